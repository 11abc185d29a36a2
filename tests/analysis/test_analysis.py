"""Analysis API over a store filled by real wrapped rollouts (SQLite and PostgreSQL)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_middleware import TraceStore, TrainStep
from lightning_middleware import analysis as A
from lightning_middleware.records import STEP_METRICS
from lightning_middleware.testing import LLMTestServer

from . import analysis_data as D


@pytest.fixture
def filled(llm_server: LLMTestServer, store: TraceStore) -> tuple[TraceStore, dict]:
    return store, D.build(store, llm_server.base_url)


def test_importing_the_package_does_not_import_pandas() -> None:
    code = ("import sys, lightning_middleware, lightning_middleware.analysis.frames, "
            "lightning_middleware.analysis.export, "
            "lightning_middleware.cli; lightning_middleware.cli.build_parser(); "
            "assert 'pandas' not in sys.modules and 'datasets' not in sys.modules and 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_frames_and_summaries(filled: tuple[TraceStore, dict]) -> None:
    store, made = filled
    ro = A.load_rollouts(store.safe_url if store.dialect == "sqlite" else store)
    n_train = len(D.TASKS) * D.GROUP * len(D.VERSIONS)
    assert len(ro) == n_train + len(made["val"]) + 4
    by_id = ro.set_index("rollout_id")
    # tokens and turns: the tool-loop agent makes 2 calls; token counts equal the stored IDs
    first = by_id.loc[made["train"][0]]
    calls = store.calls(made["train"][0])
    assert first.n_turns == 2 and first.n_attempts == 2
    assert first.prompt_tokens == sum(len(c.prompt_token_ids) for c in calls)
    assert first.completion_tokens == sum(len(c.completion_token_ids) for c in calls)
    assert by_id.loc[made["retry"]].n_retries == 1 and by_id.loc[made["retry"]].n_failed == 1
    assert by_id.loc[made["retry"]].n_turns == 1
    assert by_id.loc[made["failed"]].status == "failed" and not by_id.loc[made["failed"]].success
    assert by_id.loc[made["multi"]].n_agents == 2 and by_id.loc[made["multi"]].n_rewards == 2

    pv = A.reward_by_policy_version(ro, mode="train")
    for v in D.VERSIONS:
        expect = [D.reward_for(ti, s, v) for ti in range(len(D.TASKS)) for s in range(D.GROUP)]
        assert pv.loc[v, "n"] == len(expect)
        assert pv.loc[v, "mean_reward"] == pytest.approx(sum(expect) / len(expect))
        assert pv.loc[v, "success_rate"] == pytest.approx(sum(x >= 1.0 for x in expect) / len(expect))
    steps = A.load_train_steps(store)
    assert list(steps["step"]) == [1, 2, 3] and set(STEP_METRICS) <= set(steps)  # the daemon's own names
    by_step = A.reward_by_train_step(ro, steps)
    assert list(by_step.index) == [1, 2, 3] and list(by_step["policy_version"]) == [1, 2, 3]
    assert by_step.loc[3, "mean_reward"] == pytest.approx(pv.loc[2, "mean_reward"])

    tasks = A.success_by_task(ro, mode="train")
    assert tasks.loc["retry", "success_rate"] == 1.0 and tasks.loc["crash", "n"] == 1
    assert tasks["success_rate"].is_monotonic_increasing

    calls_df = A.load_calls(store)
    assert len(calls_df) == store.count("llm_calls")
    lat = A.latency_summary(calls_df)
    assert lat.loc["all", "n"] == int(calls_df["ok"].sum()) and lat.loc["all", "p50"] > 0
    assert set(A.latency_summary(calls_df, by="agent_name").index.dropna()) == {"planner", "writer"}
    rt = A.retries(calls_df)
    assert rt.loc["500", "failed"] == 1 and rt.loc["total", "retries"] == 1
    agents = A.per_agent(calls_df, ro)
    assert agents.loc["planner", "n_training_calls"] == 2 and agents.loc["writer", "n_training_calls"] == 1
    assert agents.loc["writer", "mean_reward"] == 0.75

    best, worst = A.best_and_worst(ro, 2)
    assert list(best["final_reward"]) == [1.0, 1.0] and list(worst["final_reward"]) == [0.0, 0.0]
    assert len(A.load_policy_versions(store)) == 3 and len(A.load_rewards(store)) == store.count("rewards")


def test_prefix_breaks_match_the_trainer(filled: tuple[TraceStore, dict]) -> None:
    store, made = filled
    stats = A.row_stats(store).set_index("rollout_id")
    assert stats.loc[made["broken"], "prefix_breaks"] == 1 and stats.loc[made["broken"], "rows"] == 2
    assert stats.loc[made["multi"], "prefix_breaks"] == 0 and stats.loc[made["multi"], "rows"] == 2
    assert stats.loc[made["train"][0], "merges"] == 1
    merges = int(stats["merges"].sum())
    assert A.prefix_break_rate(stats.reset_index()) == pytest.approx(1 / (merges + 1))


def test_transcript_marks_trained_replies(filled: tuple[TraceStore, dict]) -> None:
    store, made = filled
    text = A.transcript(store, made["train"][0]).text()
    assert "[user] please do add sample 0" in text and "call lookup(" in text and "[tool]" in text
    assert text.count("<<trained>>") == 2 and "*** reward" in text
    retry = A.transcript(store, made["retry"])
    assert "FAILED status=500" in retry.text() and retry.text().count("<<trained>>") == 1
    broken = A.transcript(store, made["broken"]).text()
    assert "context rewritten" in broken
    team = A.transcript(store, made["multi"])
    assert "context rewritten" not in team.text() and "agent=writer" in team.text()
    assert 'name=format' in team.text()
    html = team._repr_html_()
    assert html.count('<mark class="trained"') == 3 and "&quot;" in html
    # a truncated row: the first call's completion is cut, the second is not trained at all
    calls = store.calls(made["train"][0])
    cut = len(calls[0].prompt_token_ids) + 5
    spans = A.trained_spans(calls, max_len=cut)
    assert spans[calls[0].id] == (5, len(calls[0].completion_token_ids))
    assert spans[calls[1].id] == (0, len(calls[1].completion_token_ids))
    assert "trained 5/" in A.transcript(store, made["train"][0], max_len=cut).text()
    with pytest.raises(KeyError):
        A.transcript(store, "nope")


def test_empty_store(store: TraceStore) -> None:
    ro = A.load_rollouts(store)
    assert ro.empty and "success" in ro and "n_turns" in ro
    assert A.load_calls(store).empty and A.load_train_steps(store).empty
    assert A.row_stats(store).empty and A.prefix_break_rate(A.row_stats(store)) == 0.0


def test_open_store_errors(tmp_path) -> None:
    from lightning_middleware import StoreError

    with pytest.raises(StoreError, match="does not exist"):
        A.open_store(f"sqlite:///{tmp_path / 'missing.db'}")
    assert not (tmp_path / "missing.db").exists()
    import sqlite3

    sqlite3.connect(tmp_path / "other.db").execute("create table x (y int)").connection.commit()
    with pytest.raises(StoreError, match="no trace tables"):
        A.open_store(f"sqlite:///{tmp_path / 'other.db'}")


def test_transcript_shows_and_marks_the_choice_trained(store: TraceStore) -> None:
    """A call with n = 2 whose choice 1 the agent continued: the transcript shows choice 1's reply,
    and its trained counts are choice 1's tokens, not choice 0's."""
    from lightning_middleware.records import Choice, LLMCall, Rollout

    store.create_rollout(Rollout(id="rc", task_id="t", status="succeeded"))
    resp = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "zero"}},
                        {"index": 1, "message": {"role": "assistant", "content": "one!"}}]}
    first = LLMCall(id="c0", rollout_id="rc", call_index=0, request={"messages": [{"role": "user", "content": "q"}]},
                    response=resp, prompt_token_ids=(1, 2), completion_token_ids=(10,), logprobs=(-0.1,),
                    status_code=200, is_training=True, extra_choices=(Choice(1, (20, 21, 22), (-0.2,) * 3, "stop"),))
    second = LLMCall(id="c1", rollout_id="rc", call_index=1, response={"choices": [{"message": {"content": "ok"}}]},
                     request={"messages": [{"role": "user", "content": "q"}]}, prompt_token_ids=(1, 2, 20, 21, 22, 5),
                     completion_token_ids=(6,), logprobs=(-0.3,), status_code=200, is_training=True)
    for c in (first, second):
        store.record_call(c)
    assert A.trained_spans(store.calls("rc")) == {"c0": (3, 3), "c1": (1, 1)}
    text = A.transcript(store, "rc").text()
    assert "one!" in text and "zero" not in text and "choices=2 trained=1" in text


def test_the_step_breakdown_shows_the_publishs_drain_apart(store: TraceStore) -> None:
    """A publish that waited for completions in flight (its pause calls, server and gateway) shows
    as `drain_s`, the rest of the publish as `publish_s`; the phases still sum to the interval.
    A step published without a gateway, or not published, drains nothing."""
    timings = {"step_time_s": 20.0, "batch_build_s": 1.0, "time_s": 10.0, "save_s": 2.0}
    published = {"publish_total_s": 6.5, "publish_engine_pause_s": 4.0, "publish_gateway_pause_s": 1.5}
    for step, at, extra in ((1, 100.0, {}), (2, 130.0, published), (3, 160.0, {"publish_total_s": 1.0,
                                                                               "publish_engine_pause_s": 0.25})):
        store.commit_train_step(TrainStep(step=step, policy_version=step, created_at=at, trainer_id="t",
                                          metrics={**timings, **extra}))
    df = A.step_breakdown(store)
    assert list(df.drain_s) == [0.0, 5.5, 0.25] and list(df.publish_s) == [0.0, 1.0, 0.75]
    assert list(df.other_s) == [7.0, 0.5, 6.0]  # the step less build, forward/backward, save, publish
    for _, row in df.iloc[1:].iterrows():
        assert row.interval_s == 30.0 and row.waiting_s == 10.0
        assert row[list(A.STEP_PHASES)].sum() == pytest.approx(30.0)
