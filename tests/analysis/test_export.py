"""Dataset export: round trip of token IDs, filters, preference pairs, CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_middleware import TraceStore
from lightning_middleware.analysis.export import (
    ExportError,
    ExportFilter,
    conversation,
    export_dataset,
    select_rollouts,
)
from lightning_middleware.cli import main
from lightning_middleware.testing import LLMTestServer

from . import analysis_data as D


@pytest.fixture
def filled(llm_server: LLMTestServer, store: TraceStore) -> tuple[TraceStore, dict]:
    return store, D.build(store, llm_server.base_url)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sft_jsonl_round_trip(filled: tuple[TraceStore, dict], tmp_path: Path) -> None:
    store, made = filled
    out = tmp_path / "sft.jsonl"
    res = export_dataset(store, str(out), filter=ExportFilter(mode="train", status=("succeeded",)))
    recs = _read(out)
    assert res.records == len(recs) > 0
    ids = {r["rollout_id"] for r in recs}
    assert made["failed"] not in ids and not ids & set(made["val"])
    by_rollout: dict[str, list[dict]] = {}
    for r in recs:
        by_rollout.setdefault(r["rollout_id"], []).append(r)
    # a 2-call tool loop merges into one row: last prompt + last completion, the completions masked 1
    [rec] = by_rollout[made["train"][0]]
    c0, c1 = store.calls(made["train"][0])
    assert rec["input_ids"] == list(c1.prompt_token_ids) + list(c1.completion_token_ids)
    assert rec["input_ids"][:len(c0.prompt_token_ids) + len(c0.completion_token_ids)] == \
        list(c0.prompt_token_ids) + list(c0.completion_token_ids)
    trained = [t for t, m in zip(rec["input_ids"], rec["loss_mask"]) if m]
    assert trained == list(c0.completion_token_ids) + list(c1.completion_token_ids)
    assert [x for x, m in zip(rec["logprobs"], rec["loss_mask"]) if m] == \
        pytest.approx(list(c0.logprobs) + list(c1.logprobs))
    assert [m["role"] for m in rec["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert rec["messages"][1]["tool_calls"][0]["function"]["name"] == "lookup"
    assert json.loads(rec["tools"])[0]["function"]["name"] == "lookup"
    assert rec["reward"] == store.get_rollout(made["train"][0]).final_reward
    # two agents: one row each; a prefix break: two rows
    assert [r["agent"] for r in by_rollout[made["multi"]]] == ["planner", "writer"]
    assert len(by_rollout[made["broken"]]) == 2
    # the retried call: only the successful attempt is exported
    [retry] = by_rollout[made["retry"]]
    ok = [c for c in store.calls(made["retry"]) if c.is_training]
    assert retry["input_ids"] == list(ok[0].prompt_token_ids) + list(ok[0].completion_token_ids)


def test_filters(filled: tuple[TraceStore, dict], tmp_path: Path) -> None:
    store, made = filled
    def ids(**kw) -> set[str]:
        return {r.id for r in select_rollouts(store, ExportFilter(**kw))}
    good = ids(min_reward=1.0, mode="train")
    assert good and all(store.get_rollout(i).final_reward == 1.0 for i in good)
    assert ids(status=("failed",)) == {made["failed"]}
    assert ids(mode="val") == set(made["val"])
    assert ids(status=None, min_policy_version=3, mode="train") == {
        made[k] for k in ("failed", "retry", "multi", "broken")}
    assert all(store.get_rollout(i).policy_version == 1 for i in ids(min_policy_version=1, max_policy_version=1))
    assert ids(task_ids=("retry",)) == {made["retry"]}
    assert ids(max_reward=0.0, mode="train") and all(store.get_rollout(i).final_reward == 0.0
                                                     for i in ids(max_reward=0.0))
    with pytest.raises(ExportError, match="unknown status 'done'"):
        ExportFilter(status=("done",))
    with pytest.raises(ExportError, match="min_reward must be a number"):
        ExportFilter(min_reward="abc")  # type: ignore[arg-type]
    with pytest.raises(ExportError, match="unknown mode"):
        ExportFilter(mode="eval")
    with pytest.raises(ExportError, match="above"):
        ExportFilter(min_reward=1, max_reward=0)
    with pytest.raises(ExportError, match="exists"):
        out = tmp_path / "x.jsonl"
        out.write_text("")
        export_dataset(store, str(out))
    with pytest.raises(ExportError, match="unknown kind"):
        export_dataset(store, str(tmp_path / "y.jsonl"), kind="rlhf")


def test_preference_pairs(filled: tuple[TraceStore, dict], tmp_path: Path) -> None:
    store, _made = filled
    out = tmp_path / "pairs.jsonl"
    export_dataset(store, str(out), kind="preferences", filter=ExportFilter(mode="train", max_policy_version=0))
    pairs = _read(out)
    # policy version 0: every task's group has rewards 1.0 / 0.5 / 0.0 in some order
    assert sorted(p["task_id"] for p in pairs) == sorted(D.TASKS)
    for p in pairs:
        assert p["chosen_reward"] == 1.0 and p["rejected_reward"] == 0.0 and p["margin"] == 1.0
        for side in ("chosen", "rejected"):
            calls = [c for c in store.calls(p[f"{side}_rollout_id"]) if c.is_training]
            assert p[f"{side}_input_ids"] == list(calls[-1].prompt_token_ids) + list(calls[-1].completion_token_ids)
            assert p["prompt"] + p[side] == conversation(calls[-1])  # prompt: the common head of both
            assert p[side][-1]["role"] == "assistant"
    # a margin larger than any difference leaves nothing
    export_dataset(store, str(out), kind="preferences", min_margin=1.0, overwrite=True)
    assert _read(out) == []


def test_hf_dataset_folder(filled: tuple[TraceStore, dict], tmp_path: Path) -> None:
    import datasets

    store, made = filled
    out = tmp_path / "sft_hf"
    res = export_dataset(store, str(out), format="hf", filter=ExportFilter(min_reward=0.5))
    ds = datasets.load_from_disk(str(out))
    assert len(ds) == res.records > 0
    row = next(r for r in ds if r["rollout_id"] == made["retry"])
    ok = [c for c in store.calls(made["retry"]) if c.is_training][0]
    assert row["input_ids"] == list(ok.prompt_token_ids) + list(ok.completion_token_ids)
    assert row["messages"][-1]["role"] == "assistant" and row["messages"][-1]["content"] == "echo: " + \
        row["messages"][0]["content"]
    pairs = tmp_path / "pairs_hf"
    export_dataset(store, str(pairs), format="hf", kind="preferences")
    assert {"prompt", "chosen", "rejected", "chosen_input_ids"} <= set(datasets.load_from_disk(str(pairs)).column_names)


def test_cli(filled: tuple[TraceStore, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store, made = filled
    url = store.url.render_as_string(hide_password=False)
    out = tmp_path / "cli.jsonl"
    assert main(["export", "--store", url, "-o", str(out), "--status", "succeeded,failed", "--mode", "train",
                 "--policy-version", "3"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert {r["rollout_id"] for r in _read(out)} == {made[k] for k in ("failed", "retry", "multi", "broken")}
    for argv, message in [
        (["--min-reward", "abc"], "argument --min-reward: must be a number, got 'abc'"),
        (["--status", "done"], "unknown status 'done'"),
        (["--mode", "eval"], "unknown mode 'eval'"),
        (["--min-policy-version", "x"], "must be an integer"),
        (["--max-len", "0"], "must be a positive integer"),
        (["--min-reward", "2", "--max-reward", "1"], "min_reward 2.0 is above max_reward 1.0"),
        (["--policy-version", "1", "--min-policy-version", "0"], "can't be combined"),
    ]:
        try:  # a value argparse rejects exits with its usage; a filter the export rejects is one line
            code = main(["export", "--store", url, "-o", str(tmp_path / "bad.jsonl"), *argv])
        except SystemExit as exc:
            code = exc.code
        assert code == 2, argv
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad.jsonl").exists()
