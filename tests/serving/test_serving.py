"""Serving against a real vLLM CPU server: token IDs, hot weight swaps, launcher.

Run: ``pytest -p tests.fixtures_vllm tests/serving/test_serving.py`` (the root conftest
loads the plugin when present). Needs the vLLM env, see tests/fixtures_vllm.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from tests.gateway.test_keep_alive import HTTPX_KEEPALIVE_EXPIRY_S, idle_then_ask
from trainer_backend.serving.publisher import LM_HEAD_TOLERANCE, PublishError, WeightPublisher
from trainer_backend.serving.server import VLLMServer, VLLMServerError, free_port

T = TypeVar("T")

pytestmark = [pytest.mark.vllm]

MODEL = "tiny"  # served name, see fixtures_vllm.SERVED_NAME
ATOL = 1e-4

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Weather in paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "paris"})}},
        ],
    },  # fmt: skip
    {"role": "tool", "tool_call_id": "call_1", "content": "12 celsius"},
]
SHORT = [{"role": "user", "content": "the agent calls a tool"}]


def chat(server: VLLMServer, messages: list[dict[str, Any]], **body: Any) -> dict[str, Any]:
    payload = {"model": MODEL, "messages": messages, "return_token_ids": True, **body}
    resp = httpx.post(f"{server.base_url}/chat/completions", json=payload, timeout=120)
    resp.raise_for_status()
    return resp.json()


def greedy(server: VLLMServer, messages: list[dict[str, Any]], n: int = 12) -> dict[str, Any]:
    return chat(server, messages, max_tokens=n, temperature=0.0, logprobs=True, ignore_eos=True)


def vllm_logprobs(out: dict[str, Any]) -> list[float]:
    return [t["logprob"] for t in out["choices"][0]["logprobs"]["content"]]


@lru_cache(maxsize=8)
def _hf_model(path: str):  # noqa: ANN202 - torch types stay out of the signature
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(ckpt: Path, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Log-probs of the completion tokens under an HF fp32 forward pass of ``ckpt``."""
    import torch

    model = _hf_model(str(ckpt))
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


def max_diff_to_hf(ckpt: Path, out: dict[str, Any]) -> float:
    got = vllm_logprobs(out)
    want = hf_logprobs(ckpt, out["prompt_token_ids"], out["choices"][0]["token_ids"])
    return max(abs(a - b) for a, b in zip(got, want, strict=True))


# ------------------------------------------------------------------- token IDs


def test_prompt_token_ids_equal_tokenize(vllm_server: VLLMServer, tied_checkpoints) -> None:
    from transformers import AutoTokenizer

    body = {"model": MODEL, "messages": TOOL_MESSAGES, "tools": TOOLS, "add_generation_prompt": True}
    tokens = httpx.post(f"{vllm_server.url}/tokenize", json=body, timeout=60).json()["tokens"]
    out = chat(vllm_server, TOOL_MESSAGES, tools=TOOLS, max_tokens=4, temperature=0.0)
    assert out["prompt_token_ids"] == tokens
    # The trainer env's transformers renders the template to the same IDs.
    tok = AutoTokenizer.from_pretrained(tied_checkpoints.base)
    hf_ids = tok.apply_chat_template(TOOL_MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert list(hf_ids) == tokens
    assert tok.convert_tokens_to_ids("<tool_call>") in tokens


def test_streamed_token_ids_equal_non_streamed(vllm_server: VLLMServer) -> None:
    body = {"model": MODEL, "messages": SHORT, "return_token_ids": True, "max_tokens": 24,
            "temperature": 1.0, "seed": 1234, "ignore_eos": True}  # fmt: skip
    plain = chat(vllm_server, SHORT, **{k: v for k, v in body.items() if k not in ("model", "messages")})
    prompt_ids: list[int] | None = None
    streamed: list[int] = []
    with httpx.stream("POST", f"{vllm_server.base_url}/chat/completions",
                      json={**body, "stream": True}, timeout=120) as resp:  # fmt: skip
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            prompt_ids = prompt_ids or chunk.get("prompt_token_ids")
            for choice in chunk.get("choices", []):
                streamed.extend(choice.get("token_ids") or [])
    assert prompt_ids == plain["prompt_token_ids"]
    assert streamed == plain["choices"][0]["token_ids"]
    assert len(streamed) == 24


# ------------------------------------------------------------------ weight swap


def test_swap_tied_changes_output_and_matches_hf(vllm_server: VLLMServer, tied_checkpoints) -> None:
    pub = WeightPublisher(vllm_server.base_url)
    v1, v2, _ = tied_checkpoints.variants
    r1 = pub.publish(v1, "tied-v1")
    assert r1.verified, r1.problems
    assert pub.weight_version() == "tied-v1"
    out1 = greedy(vllm_server, SHORT)
    assert max_diff_to_hf(v1, out1) < ATOL

    r2 = pub.publish(v2, "tied-v2")
    assert r2.verified, r2.problems
    assert r2.weights_changed and r2.checksum_after != r1.checksum_after
    out2 = greedy(vllm_server, SHORT)
    assert out2["choices"][0]["token_ids"] != out1["choices"][0]["token_ids"]
    assert max_diff_to_hf(v2, out2) < ATOL


def test_plain_reload_leaves_tied_output_layer_stale(vllm_server: VLLMServer, tied_checkpoints) -> None:
    """Control for the worker extension: vLLM's own reload_weights on CPU keeps the
    pre-packed output layer of a tied model, which the probe detects."""
    pub = WeightPublisher(vllm_server.base_url)
    v1, v2, _ = tied_checkpoints.variants
    assert pub.publish(v1, "ctl-v1").verified
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(v2)}}
    httpx.post(f"{vllm_server.url}/pause", params={"mode": "wait"}, timeout=60).raise_for_status()
    try:
        httpx.post(f"{vllm_server.url}/collective_rpc", json=rpc, timeout=120).raise_for_status()
    finally:
        httpx.post(f"{vllm_server.url}/resume", timeout=60).raise_for_status()
    assert pub.checksum()["lm_head_max_err"] > LM_HEAD_TOLERANCE
    result = pub.publish(v2, "ctl-v2")  # the extension re-packs
    assert result.lm_head_max_err is not None and result.lm_head_max_err < LM_HEAD_TOLERANCE


def test_swap_resets_prefix_cache(vllm_server: VLLMServer, tied_checkpoints) -> None:
    pub = WeightPublisher(vllm_server.base_url)
    v1, v2, v3 = tied_checkpoints.variants
    long_msgs = [{"role": "user", "content": " ".join(["the weather in paris is 12 celsius"] * 60)}]
    assert pub.publish(v1, "pc-v1").verified
    greedy(vllm_server, long_msgs, n=4)  # now cached
    # Control: a reload without /reset_prefix_cache serves the cached (stale) KV.
    _swap_without_reset(vllm_server, v2)
    stale = greedy(vllm_server, long_msgs, n=4)
    assert len(stale["prompt_token_ids"]) > 300
    assert max_diff_to_hf(v2, stale) > 1e-2, "prefix cache not in use: the control proves nothing"
    # The publisher resets it: the same cached prompt gets the new weights' answer.
    assert pub.publish(v3, "pc-v3").verified
    fresh = greedy(vllm_server, long_msgs, n=4)
    assert max_diff_to_hf(v3, fresh) < ATOL


def _swap_without_reset(server: VLLMServer, ckpt: Path) -> None:
    rpc = {"method": "lightning_reload", "kwargs": {"weights_path": str(ckpt)}}
    httpx.post(f"{server.url}/pause", params={"mode": "wait", "clear_cache": "false"}, timeout=60).raise_for_status()
    try:
        httpx.post(f"{server.url}/collective_rpc", json=rpc, timeout=120).raise_for_status()
    finally:
        httpx.post(f"{server.url}/resume", timeout=60).raise_for_status()


def test_swap_with_requests_in_flight_loses_none(vllm_server: VLLMServer, tied_checkpoints) -> None:
    pub = WeightPublisher(vllm_server.base_url)
    n_tokens = 160
    done: list[tuple[float, dict[str, Any]]] = []
    errors: list[str] = []
    swap: list[tuple[float, Any]] = []

    def worker(i: int) -> None:
        try:
            out = chat(vllm_server, [{"role": "user", "content": f"request {i}"}], max_tokens=n_tokens,
                       temperature=1.0, seed=i, ignore_eos=True)  # fmt: skip
            done.append((time.monotonic(), out))
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(exc))

    def publish() -> None:
        t0 = time.monotonic()
        swap.append((t0, pub.publish(tied_checkpoints.variants[0], "flight")))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads[:4]:  # in flight before the pause
        t.start()
    time.sleep(0.15)
    swapper = threading.Thread(target=publish)
    swapper.start()
    time.sleep(0.02)
    for t in threads[4:]:  # arrive while the engine drains / swaps
        t.start()
    for t in [*threads, swapper]:
        t.join(timeout=120)
    assert not errors
    assert len(done) == 6 and len(swap) == 1
    for _, out in done:
        assert out["choices"][0]["finish_reason"] == "length"
        assert len(out["choices"][0]["token_ids"]) == n_tokens
    swap_started, result = swap[0]
    # The swap really overlapped generation: some request finished after it began.
    assert any(t_done > swap_started for t_done, _ in done)
    assert result.verified, result.problems
    assert pub.weight_version() == "flight"


def running_requests(server: VLLMServer) -> float:
    """vLLM's own count of the requests it is decoding (its Prometheus `/metrics`)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def in_flight(server: VLLMServer, ask: Callable[[int], T], n: int) -> tuple[list[threading.Thread], list[T], list[str]]:
    """Send `ask(0)` .. `ask(n - 1)` from threads and return once vLLM decodes all n at once (or
    one has ended, or after 120 s): the threads to join, their answers and errors as they come."""
    outs: list[T] = []
    errors: list[str] = []

    def run(i: int) -> None:
        try:
            outs.append(ask(i))
        except Exception as exc:  # noqa: BLE001 - the caller asserts there are none
            errors.append(repr(exc))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while running_requests(server) < n and time.monotonic() < deadline and not outs:
        time.sleep(0.01)
    return threads, outs, errors


@pytest.mark.parametrize("pause", ["keep", "wait"])
def test_a_kept_swap_continues_requests_in_flight_on_the_new_weights(vllm_server: VLLMServer, tied_checkpoints,
                                                                     pause: str) -> None:
    """`pause="keep"`: the publish waits for no completion in flight. Each completion's tokens
    before the swap carry v1's log-probs and the rest v2's, each equal to an HF forward pass of its
    checkpoint over the whole context: a kept request's KV was computed again with the new
    weights, not served stale from the old. The control, `wait`: no completion mixes the two."""
    v1, v2, _ = tied_checkpoints.variants
    assert WeightPublisher(vllm_server.base_url).publish(v1, f"{pause}-v1").verified
    publisher = WeightPublisher(vllm_server.base_url, pause=pause)  # type: ignore[arg-type]
    # The engine decodes them together for ~10 s here (24 x 900: 16 s), the publish reaches its pause
    # within ~1 s (it reads a checksum first): 8 x 400 (~3 s) lost that race under load in a run.
    n_requests, n_tokens = 16, 900
    threads, outs, errors = in_flight(
        vllm_server, lambda i: greedy(vllm_server, [{"role": "user", "content": f"request {i}"}], n=n_tokens),
        n_requests)
    result = publisher.publish(v2, f"{pause}-v2")
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(outs) == n_requests
    assert result.verified, result.problems
    # Over hundreds of tokens vLLM and HF drift apart by up to ~1e-4 in fp32 on CPU; v1 and v2 differ by nats.
    tol = 1e-3
    swaps = []
    for out in outs:
        prompt, ids, got = out["prompt_token_ids"], out["choices"][0]["token_ids"], vllm_logprobs(out)
        assert len(ids) == len(got) == n_tokens
        d1 = [abs(a - b) for a, b in zip(got, hf_logprobs(v1, prompt, ids), strict=True)]
        swap = next((i for i, d in enumerate(d1) if d > tol), n_tokens)
        swaps.append(swap)
        if swap < n_tokens:  # the rest came from v2, its context computed again with v2
            d2 = [abs(a - b) for a, b in zip(got[swap:], hf_logprobs(v2, prompt, ids)[swap:], strict=True)]
            assert max(d2) < tol, f"tokens {swap}-{n_tokens} are not v2's: stale KV or weights"
    if pause == "wait":  # the swap waited for those running: each completion is one checkpoint's (a request
        # still queued at the pause runs on v2 from its first token, swap 0)
        assert all(s in (0, n_tokens) for s in swaps) and n_tokens in swaps, swaps
    else:  # the publish waited for none: completions went on with v2
        assert any(0 < s < n_tokens for s in swaps), swaps
        assert publisher.weight_version() == "keep-v2"


def test_failed_swap_resumes_and_keeps_serving(vllm_server: VLLMServer, tied_checkpoints, tmp_path: Path) -> None:
    """A broken checkpoint must not leave the engine paused or the weights mixed."""
    pub = WeightPublisher(vllm_server.base_url)
    v1 = tied_checkpoints.variants[0]
    assert pub.publish(v1, "ok-v1").verified
    before = greedy(vllm_server, SHORT)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((v1 / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    for ckpt in (tmp_path / "missing", broken):
        with pytest.raises(PublishError):
            pub.publish(ckpt, "broken")
        assert httpx.get(f"{vllm_server.url}/is_paused", timeout=10).json()["is_paused"] is False
    assert pub.weight_version() == "ok-v1"
    after = greedy(vllm_server, SHORT)  # previous weights restored
    assert after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    assert max_diff_to_hf(v1, after) < ATOL


@pytest.mark.parametrize("sampling", [{"temperature": 0.7}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20}])
def test_trainer_log_probs_at_step_0_equal_what_vllm_sampled(vllm_server: VLLMServer, tied_checkpoints,
                                                              tmp_path: Path, sampling: dict[str, float]) -> None:
    """A completion sampled at temperature 0.7 (and with top-p / top-k), recorded by wrap(): the
    engine's log-probs of its tokens before any update equal vLLM's (the server runs with
    --logprobs-mode processed_logprobs) within fp32 rounding; at temperature 1 they would not."""
    import dataclasses

    import openai

    from lightning_middleware import TraceStore, rollout, wrap
    from lightning_middleware.rows import build_rows
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    ckpt = tied_checkpoints.variants[2]
    assert WeightPublisher(vllm_server.base_url).publish(ckpt, "sampling").verified
    store = TraceStore(f"sqlite:///{tmp_path / 'sampling.db'}")
    client = wrap(openai.OpenAI(base_url=vllm_server.base_url, api_key="-"), store=store)
    with rollout("sampled", store=store) as r:
        for _ in range(3):
            client.chat.completions.create(model=MODEL, messages=SHORT, max_tokens=16, extra_body=sampling)
    calls = store.calls(r.id)
    rows = [row for c in calls for row in build_rows([c], rollout_id=r.id)[0]]
    assert len(rows) == 3 and all(row.temperature is not None for row in rows)
    engine = TorchEngine(ckpt, TorchEngineConfig(precision="fp32"))
    ours = engine.token_logprobs(rows)
    plain = engine.token_logprobs([dataclasses.replace(row, temperature=None, top_p=None, top_k=None)
                                   for row in rows])
    worst = worst_plain = 0.0
    for row, mine, untempered in zip(rows, ours, plain):
        for t, m in enumerate(row.loss_mask):
            if m:
                worst = max(worst, abs(mine[t] - row.behaviour_logprobs[t]))
                worst_plain = max(worst_plain, abs(untempered[t] - row.behaviour_logprobs[t]))
    assert worst < ATOL, worst
    assert worst_plain > 1e-2  # temperature 1 (or no truncation) would bias every ratio
    store.close()


def test_publish_through_a_gateway_with_a_token_resumes_it_with_the_new_version(
        vllm_server: VLLMServer, tied_checkpoints, tmp_path: Path) -> None:
    """The publisher pauses and resumes the gateway with its bearer token, and resumes it with the
    published policy version: the calls after the swap are stamped with it (an async trainer
    would otherwise drop them as stale); a failed swap resumes with the version unchanged."""
    from lightning_middleware import TraceStore
    from lightning_middleware.gateway import Gateway

    store = TraceStore(f"sqlite:///{tmp_path / 'gw.db'}")
    v1 = tied_checkpoints.variants[0]
    with Gateway(vllm_server.base_url, store, token="s3cret", health_interval_s=0, policy_version=3) as gw:
        assert WeightPublisher(vllm_server.base_url, gateway_url=gw.url, gateway_token="s3cret").publish(v1, 4).verified
        assert gw.state()["policy_version"] == 4 and not gw.state()["paused"]
        auth = {"authorization": "Bearer s3cret"}
        r = httpx.post(gw.base_url + "/chat/completions", headers=auth, timeout=60,
                       json={"model": MODEL, "messages": SHORT, "max_tokens": 4})
        assert r.status_code == 200 and r.headers["x-lightning-policy-version"] == "4"
        broken = tmp_path / "broken"  # fails inside the pause: the reload itself
        broken.mkdir()
        (broken / "config.json").write_text((v1 / "config.json").read_text())
        (broken / "model.safetensors").write_bytes(b"not a safetensors file")
        with pytest.raises(PublishError):
            WeightPublisher(vllm_server.base_url, gateway_url=gw.url, gateway_token="s3cret").publish(broken, 5)
        assert gw.state()["policy_version"] == 4 and not gw.state()["paused"]
        with pytest.raises(Exception, match="401"):  # a wrong token is refused before anything is paused
            WeightPublisher(vllm_server.base_url, gateway_url=gw.url, gateway_token="wrong").publish(v1, 6)
        assert not gw.state()["paused"] and gw.state()["policy_version"] == 4
        assert httpx.get(f"{vllm_server.url}/is_paused", timeout=10).json()["is_paused"] is False
        # keep: the gateway stops admitting without draining (vLLM freezes what is in flight)
        kept = WeightPublisher(vllm_server.base_url, gateway_url=gw.url, gateway_token="s3cret", pause="keep")
        assert kept.publish(v1, 7).verified
        assert gw.state()["policy_version"] == 7 and not gw.state()["paused"]
    store.close()


@pytest.mark.slow
def test_swap_untied_matches_hf(vllm_python: Path, untied_checkpoints, tmp_path: Path) -> None:
    with VLLMServer(untied_checkpoints.base, python=vllm_python, dtype="float32",
                    served_model_name=MODEL, log_path=tmp_path / "untied.log") as server:  # fmt: skip
        pub = WeightPublisher(server.url)
        before = greedy(server, SHORT)
        result = pub.publish(untied_checkpoints.variants[0], "untied-v1")
        assert result.verified, result.problems
        after = greedy(server, SHORT)
        assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
        assert max_diff_to_hf(untied_checkpoints.variants[0], after) < ATOL


# --------------------------------------------------------------------- launcher


def test_idle_connections_outlive_the_clients_pool_expiry(vllm_server: VLLMServer) -> None:
    """vLLM's own default (5 s) closes an idle connection just as httpx may reuse it; the
    launcher sets 75 s (serving/env.py), so a connection idle past httpx's 5 s still answers."""
    first, after_idle = idle_then_ask(vllm_server.port, HTTPX_KEEPALIVE_EXPIRY_S + 1.0)
    assert first.startswith(b"HTTP/1.1 200"), first
    assert after_idle.startswith(b"HTTP/1.1 200"), after_idle


def test_launcher_picks_free_ports(vllm_server: VLLMServer) -> None:
    assert httpx.get(f"{vllm_server.url}/health", timeout=10).status_code == 200
    assert vllm_server.base_url.endswith("/v1")
    port = free_port()
    assert port != vllm_server.port and 0 < port < 65536


@pytest.mark.slow
def test_launcher_reports_crash_with_log_tail(vllm_python: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "no-such-model"
    bogus.mkdir()
    server = VLLMServer(bogus, python=vllm_python, log_path=tmp_path / "crash.log", startup_timeout=240)
    t0 = time.monotonic()
    with pytest.raises(VLLMServerError) as err:
        server.start()
    assert "exited with code" in str(err.value)
    assert "log tail" in str(err.value) and str(bogus) in str(err.value)
    assert time.monotonic() - t0 < 240
    assert not server.is_running()


def test_all_cores_binds_the_models_threads_to_every_core_this_process_may_use(tmp_path: Path) -> None:
    from trainer_backend.serving.server import CPU_BIND

    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert VLLMServer(tmp_path, device="cpu", all_cores=True).environment(tmp_path)[CPU_BIND] == cores
    mine = VLLMServer(tmp_path, device="cpu", all_cores=True, env={CPU_BIND: "0"})
    assert mine.environment(tmp_path)[CPU_BIND] == "0"  # the caller's own binding wins
    assert VLLMServer(tmp_path, device="cpu").environment(tmp_path).get(CPU_BIND) == os.environ.get(CPU_BIND)
    gone = VLLMServer(tmp_path, device="cpu", port=free_port())
    with pytest.raises(VLLMServerError, match="^could not set the server's threads to 2: "):
        gone.set_threads(2, timeout=5)


def test_the_models_threads_are_set_while_it_serves(vllm_server: VLLMServer) -> None:
    own = vllm_server.set_threads(0)  # vLLM's own count (one on 2 cores): asked, not changed
    assert own >= 1
    try:
        assert vllm_server.set_threads(own + 1) == own + 1
        assert vllm_server.set_threads(0) == own + 1
        assert greedy(vllm_server, SHORT)  # still answers
    finally:
        assert vllm_server.set_threads(own) == own  # the other tests see the server as it started


_ORPHAN_LAUNCHER = """
import sys, time
from trainer_backend.serving.server import VLLMServer
server = VLLMServer(sys.argv[1], python=sys.argv[2], dtype="float32", log_path=sys.argv[3]).start()
print(server.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_server_dies_with_its_launcher(vllm_python: Path, tied_checkpoints, tmp_path: Path) -> None:
    """A launcher killed without stop() must not leave the server running."""
    import os
    import signal
    import subprocess
    import sys

    launcher = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_LAUNCHER, str(tied_checkpoints.base), str(vllm_python),
         str(tmp_path / "orphan.log")],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    try:
        server_pid = int(launcher.stdout.readline())
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        try:
            os.killpg(server_pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(server_pid, signal.SIGKILL)
    pytest.fail("the vLLM server outlived its launcher by 40 s")
