"""Training and serving checked for parity at run time (serving/parity.py, daemon/drift.py): against
the session's real vLLM server, and a second one served with a deliberately changed --chat-template,
which the trainer refuses."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from lightning_middleware import TraceStore
from lightning_middleware.cli import main
from lightning_middleware.records import LLMCall, Rollout
from lightning_middleware.rows import build_rows_for_rollouts
from tests.fixtures_vllm import SERVED_NAME, TinyCheckpoints
from trainer_backend.daemon.drift import DriftWatch
from trainer_backend.daemon.monitoring import HealthChecks, HealthConfig
from trainer_backend.models import CHAT_TEMPLATE
from trainer_backend.serving.parity import (
    ALLOW_FLAG,
    IDENTITY_KEYS,
    PROBES,
    TemplateMismatch,
    TemplateParity,
    model_identity,
    normalise_messages,
    render_request,
)
from trainer_backend.serving.server import VLLMServer

pytest.importorskip("transformers")
# The changed template: one newline fewer before a tool's result; every other probe renders the same.
CHANGED = CHAT_TEMPLATE.replace("'\\n<tool_response>\\n'", "'\\n<tool_response>'")


@pytest.fixture(scope="module")
def tokenizer(tied_checkpoints: TinyCheckpoints):  # noqa: ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tied_checkpoints.base)


# ------------------------------------------------------------------ the trainer's rendering (CPU)


def test_messages_are_normalised_as_vllm_does() -> None:
    msgs = normalise_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "2", "type": "function", "function": {"name": "g", "arguments": "not json"}}]},
    ])
    assert msgs[0]["content"] == "a\nb"
    assert "tool_calls" not in msgs[1]
    assert [tc["function"]["arguments"] for tc in msgs[2]["tool_calls"]] == [{"x": 1}, "not json"]


def test_render_request_follows_the_request_flags(tokenizer) -> None:  # noqa: ANN001
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}]
    prompt = render_request(tokenizer, {"messages": msgs[:1]})
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    cont = render_request(tokenizer, {"messages": msgs, "continue_final_message": True})
    assert tokenizer.decode(cont).endswith("assistant\nhe")
    assert render_request(tokenizer, {"messages": msgs[:1], "add_generation_prompt": False}) == prompt[:-3]


def _call(rid: str, i: int, agent: str, prompt: list[int], completion: list[int], request: dict) -> LLMCall:
    return LLMCall(id=f"{rid}-{i}", rollout_id=rid, call_index=i, agent_name=agent, request=request,
                   prompt_token_ids=tuple(prompt), completion_token_ids=tuple(completion), is_training=True)


def test_drift_metrics_and_their_warnings(tokenizer, tmp_path: Path,  # noqa: ANN001
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Per agent: prefix breaks from the rows, re-tokenising from the stored requests; the health
    checks warn only past the limit and with enough calls."""
    req = {"messages": [{"role": "user", "content": "What is 2 + 3?"}]}
    good = render_request(tokenizer, req)
    rollouts, calls = [], {}
    for k in range(6):
        rid = f"r{k}"
        rollouts.append(Rollout(id=rid, task_id=f"t{k % 2}"))
        # "solver" extends its prompt each turn; "critic" re-renders history (a break) and its
        # stored IDs are not what the trainer renders
        calls[rid] = [_call(rid, 0, "solver", good, [5, 6], req),
                      _call(rid, 1, "solver", good + [5, 6, 7], [8], {"messages": []}),
                      _call(rid, 2, "critic", [1, 2, 3], [4], req),
                      _call(rid, 3, "critic", [9, 9], [4], req)]
    _, stats = build_rows_for_rollouts((r, calls[r.id]) for r in rollouts)
    assert stats.agent_prefix_breaks() == {"critic": (6, 6), "solver": (0, 6)}
    store = TraceStore(f"sqlite:///{tmp_path / 't.db'}")
    try:
        drift = DriftWatch(store, tokenizer=tokenizer, source="trainer-0")
        metrics, data = drift.measure(rollouts, calls, stats)
        assert metrics["prefix_break_rate/critic"] == 1.0 and metrics["prefix_break_rate/solver"] == 0.0
        assert metrics["retokenize_checked/solver"] == 6 and metrics["retokenize_mismatch_share/solver"] == 0.0
        assert metrics["retokenize_checked/critic"] == 12 and metrics["retokenize_mismatch_share/critic"] == 1.0
        assert ["critic", "t0", 6, 6] in data["retokenize"] and data["prefix_breaks"]["critic"] == [6, 6]
        drift.record(3, data)
        (event,) = store.events(kind="drift")
        assert event.step == 3 and event.data["prefix_breaks"] == {"critic": [6, 6], "solver": [0, 6]}
        for r in rollouts:  # the same calls in the store: `inspect --drift` recomputes the breaks
            store.create_rollout(r)
            for call in calls[r.id]:
                store.record_call(call)
            store.finish_rollout(r.id)
        capsys.readouterr()
        assert main(["inspect", "--store", store.url.render_as_string(hide_password=False), "--drift"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "drift over 6 finished rollouts" and out[-1] == "template mismatches: 0"
        critic_t0 = next(line.split() for line in out if line.split()[:2] == ["critic", "t0"])
        assert critic_t0[2:] == ["3", "of", "3", "100.0%", "6", "of", "6", "100.0%"]
        solver_t1 = next(line.split() for line in out if line.split()[:2] == ["solver", "t1"])
        assert solver_t1[2:] == ["0", "of", "3", "0.0%", "0", "of", "3", "0.0%"]
    finally:
        store.close()
    found = HealthChecks(HealthConfig()).check(metrics)
    assert sorted((f.kind, f.data["agent"]) for f in found) == [("prefix_breaks", "critic"),
                                                                 ("retokenize_mismatch", "critic")]
    assert all(f.remedy for f in found)
    few = {k: v for k, v in metrics.items()} | {"prefix_chances/critic": 4.0}
    assert [f.kind for f in HealthChecks(HealthConfig(min_chances=5)).check(few)] == ["retokenize_mismatch"]
    lax = HealthChecks(HealthConfig(prefix_break_limit=1.0, retokenize_limit=1.0))
    assert lax.check(metrics) == []


# ------------------------------------------------------------------ a real vLLM server


def test_the_served_model_matches_the_trainer(vllm_server: VLLMServer, tied_checkpoints: TinyCheckpoints) -> None:
    with TemplateParity(tied_checkpoints.base, vllm_server.url) as parity:
        report = parity.require("at the trainer's start")
    assert report.ok, report.message("test")
    assert report.probes_checked == len(PROBES) and report.special_tokens_checked >= 3
    assert report.served["id"] == SERVED_NAME
    assert report.identity.endswith(f"{len(IDENTITY_KEYS)} fields compared"), report.identity


def test_another_model_behind_the_same_tokenizer_is_refused(vllm_server: VLLMServer,
                                                            tied_checkpoints: TinyCheckpoints,
                                                            untied_checkpoints: TinyCheckpoints) -> None:
    """The untied family has the tied family's tokenizer and template: every probe passes, and the
    model the trainer would train is not the one the server samples from."""
    with TemplateParity(untied_checkpoints.base, vllm_server.url) as parity:
        with pytest.raises(TemplateMismatch, match="tie_word_embeddings=True, the trainer's .* False"):
            parity.require("at the trainer's start")
        report = parity.last
    assert report is not None and not report.differences  # the tokenizer alone could not tell
    assert report.served["root"] == str(tied_checkpoints.base)


def test_model_identity_compares_configs_and_says_what_it_could_not(tmp_path: Path) -> None:
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
              "num_hidden_layers": 2, "vocab_size": 512, "torch_dtype": "float32"}
    for name, changes in (("a", {}), ("same", {"torch_dtype": "bfloat16"}), ("deeper", {"num_hidden_layers": 4})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **changes}))
    assert model_identity(str(tmp_path / "a"), tmp_path / "same") == ([], f"config of {tmp_path / 'a'}: "
                                                                           "5 fields compared")
    problems, _ = model_identity(str(tmp_path / "a"), tmp_path / "deeper")
    assert problems == [f"the server's model {tmp_path / 'a'} has num_hidden_layers=2, the trainer's "
                        f"{tmp_path / 'deeper'} 4"]
    problems, said = model_identity("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "a")
    assert problems == [] and said.startswith("not compared: the server's model 'HuggingFaceTB/")


def test_a_changed_chat_template_is_refused(vllm_python: Path, tied_checkpoints: TinyCheckpoints,
                                            tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = tmp_path / "changed.jinja"
    template.write_text(CHANGED)
    server = VLLMServer(tied_checkpoints.base, python=vllm_python, dtype="float32", served_model_name=SERVED_NAME,
                        log_path=tmp_path / "vllm.log", max_model_len=1024,
                        extra_args=["--chat-template", str(template)])
    with server:
        with TemplateParity(tied_checkpoints.base, server.url) as parity:
            with pytest.raises(TemplateMismatch) as refused:
                parity.require("at the trainer's start")
            report = parity.last
        assert report is not None and [d.probe for d in report.differences] == ["tool_history"]
        diff = report.differences[0]
        message = str(refused.value)
        with capsys.disabled():
            print(f"refused: {message}")  # the form docs/trainer.md quotes
        assert "probe 'tool_history': first difference at token" in message and ALLOW_FLAG in message
        assert repr(diff.server_text) in message and repr(diff.trainer_text) in message
        assert diff.server != diff.trainer
        with TemplateParity(tied_checkpoints.base, server.url, allow_mismatch=True) as allowed:
            assert not allowed.require("at the trainer's start").ok  # a warning, no refusal

        # The trainer's command refuses it on one line, before it publishes anything; the store
        # records why, after a publish too (DriftWatch.after_publish).
        store_url = f"sqlite:///{tmp_path / 'traces.db'}"
        args = ["trainer", "--store", store_url, "--model", str(tied_checkpoints.base), "--serve", server.url,
                "--checkpoints", str(tmp_path / "ckpt"), "--max-steps", "1"]
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("lightning-mw trainer: the served model at ")
        assert "tool_history" in err[0] and not (tmp_path / "ckpt").exists()  # nothing published
        store = TraceStore(store_url)
        try:
            with TemplateParity(tied_checkpoints.base, server.url) as parity:
                with pytest.raises(TemplateMismatch):
                    DriftWatch(store, parity=parity, source="trainer-0").after_publish(4, 2)
            (event,) = store.events(kind="template_mismatch")
            assert event.step == 2 and event.data == {"version": 4, "allowed": False}
        finally:
            store.close()
        # the server's own view of the change, for the record: the tool probe's IDs differ
        body = {"model": SERVED_NAME, "add_generation_prompt": True, **PROBES["tool_history"]}
        served = httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]
        assert served != render_request(parity.tokenizer, body)


def test_a_server_that_cannot_be_asked_is_not_checked_and_not_refused(tied_checkpoints) -> None:  # noqa: ANN001
    """No vLLM `/v1/models` or `/tokenize` (the fault tests' stand-in serves only the swap routes), or
    no server yet: a warning, no refusal, and the report says why nothing was compared."""
    from tests.faults.vllm_standin import VLLMStandIn

    with VLLMStandIn() as standin:
        for url, why in ((standin.url, "answered /v1/models with 404"), ("http://127.0.0.1:9", "did not answer")):
            with TemplateParity(tied_checkpoints.base, url, timeout_s=5) as parity:
                report = parity.require("at the trainer's start")
            assert report.ok and report.unavailable and why in report.unavailable, report
            assert report.probes_checked == 0
