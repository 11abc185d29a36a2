"""The trainer daemon over a real store: group policy, consumption, crash safety, two daemons.

Rollouts are real: a wrapped openai client against the deterministic test server
(its token IDs are UTF-8 bytes, so a tiny random Qwen2 with a 260-token vocab can
train on them). The engine is the real TorchEngine.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lightning_middleware import TraceStore, rollout, wrap  # noqa: E402
from lightning_middleware.records import STEP_METRICS  # noqa: E402
from lightning_middleware.testing import LLMTestServer  # noqa: E402
from trainer_backend.daemon.config import GroupPolicy, TrainerConfig  # noqa: E402
from trainer_backend.daemon.trainer_daemon import TrainerDaemon  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tiny_bytes_model")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                   tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    return d


def run_rollouts(server: LLMTestServer, store: TraceStore, tasks: dict[str, list[float]], *,
                 policy_version: int | None = None, status_fail: set[tuple[str, int]] = frozenset()) -> None:
    """One 2-turn rollout per reward listed for each task."""
    client = wrap(openai.OpenAI(base_url=server.base_url, api_key="x"), store=store)
    for task, rewards in tasks.items():
        for i, reward in enumerate(rewards):
            try:
                with rollout(task, store=store, policy_version=policy_version) as r:
                    msgs = [{"role": "user", "content": f"{task} try {i}"}]
                    out = client.chat.completions.create(model="m", messages=msgs, max_tokens=12)
                    msgs += [{"role": "assistant", "content": out.choices[0].message.content},
                             {"role": "user", "content": "again"}]
                    client.chat.completions.create(model="m", messages=msgs, max_tokens=12)
                    r.reward(reward)
                    if (task, i) in status_fail:
                        raise RuntimeError("agent crashed after its reward")
            except RuntimeError:
                pass


# Every daemon make_daemon built, and every store a test opened with `own_store`, closed after its
# test by the root conftest (tests/conftest.py), the daemons first.
OPEN_DAEMONS: list[TrainerDaemon] = []
OPEN_STORES: list[TraceStore] = []


def own_store(url: str) -> TraceStore:
    """A store of the test's own (a daemon's connection, a second view of one database)."""
    store = TraceStore(url)
    OPEN_STORES.append(store)
    return store


def make_daemon(store: TraceStore, model_dir: Path, tmp_path: Path, **kw) -> TrainerDaemon:
    group = kw.pop("group", GroupPolicy(group_size=4, groups_per_step=2, min_group_size=2))
    trainer_id = kw.pop("trainer_id", "trainer-0")
    start, version = TrainerDaemon.resume_point(store, model_dir, trainer_id)
    version = kw.pop("policy_version", version)  # as if that many steps had been trained
    engine = TorchEngine(start, TorchEngineConfig(lr=1e-3, precision="fp32"), policy_version=version)
    config = TrainerConfig(checkpoint_dir=str(tmp_path / f"ckpt-{trainer_id}"), trainer_id=trainer_id,
                           group=group, poll_interval_s=0.05, **kw)
    daemon = TrainerDaemon(store, engine, config)
    OPEN_DAEMONS.append(daemon)
    return daemon


def test_step_consumes_groups_and_commits_version(llm_server, store, model_dir, tmp_path) -> None:
    run_rollouts(llm_server, store, {"a": [1, 0, 1, 0], "b": [0, 0, 1, 1], "c": [1, 1, 1, 1]})
    daemon = make_daemon(store, model_dir, tmp_path)
    [result] = daemon.run(max_steps=1)
    assert result.step == 1 and result.policy_version == 1
    m = result.metrics
    assert m["n_rollouts"] == 8 and m["n_groups"] == 2 and m["reward_mean"] == 0.5
    assert (m["reward_p25"], m["reward_median"], m["reward_p75"]) == (0.0, 0.5, 1.0)  # numpy's percentiles
    assert m["rows_merges"] == 8 and m["rows_prefix_breaks"] == 0  # 2-turn chats merge into one row each
    assert m["skipped_uniform_reward"] == 4  # group c: all rewards equal, no signal
    assert m["loss"] == m["loss"] and m["grad_norm"] > 0
    consumed = store.query_rollouts(consumed=True)
    assert len(consumed) == 12
    assert {r.task_id for r in consumed if r.consumed_step == -1} == {"c"}
    assert store.latest_policy_version() == 1
    ckpt = store.get_policy_version(1).path
    assert (Path(ckpt) / "model.safetensors").exists()
    [step] = store.train_steps()
    assert len(step.rollout_ids) == 8 and step.metrics["reward_mean"] == 0.5
    missing = set(STEP_METRICS) - set(step.metrics)
    assert not missing, f"the daemon no longer writes {sorted(missing)} (records.STEP_METRICS, notebooks)"
    assert daemon.step_once() is None  # nothing left


def test_the_step_breakdown_adds_up_to_the_time_between_steps(llm_server, store, model_dir, tmp_path) -> None:
    """analysis.step_breakdown over the daemon's real metrics: the trainer's phases sum to the
    interval between two steps, the wait for late groups lands in waiting_s, and the rollout side
    is the store's own call latencies and times."""
    from lightning_middleware import analysis as A

    run_rollouts(llm_server, store, {"a": [1, 0, 1, 0], "b": [0, 0, 1, 1]})
    daemon = make_daemon(store, model_dir, tmp_path)
    assert daemon.step_once() is not None
    time.sleep(0.5)  # the second step's groups come later: the trainer waits for them
    t0 = time.monotonic()
    run_rollouts(llm_server, store, {"c": [1, 0, 0, 0], "d": [0, 1, 1, 1]})
    late = time.monotonic() - t0
    assert daemon.step_once() is not None
    df = A.step_breakdown(store)
    assert list(df.index) == [("trainer-0", 1), ("trainer-0", 2)]
    first, second = df.iloc[0], df.iloc[1]
    assert math.isnan(first.interval_s) and math.isnan(first.waiting_s)
    assert second[list(A.STEP_PHASES)].sum() == pytest.approx(second.interval_s)
    assert second.waiting_s >= 0.5 + late
    for row in df.itertuples():
        assert row.rollouts == 8 and row.build_s > 0 and row.forward_backward_s > 0 and row.save_s > 0
        assert row.publish_s == row.drain_s == 0 and row.other_s >= 0  # no publisher here
        assert row.step_s == pytest.approx(row.build_s + row.forward_backward_s + row.save_s + row.other_s)
    ids = store.train_steps()[1].rollout_ids
    calls = store.calls_for(list(ids))
    rollouts = [store.get_rollout(i) for i in ids]
    generation = [sum(c.latency_s for c in calls[i]) for i in ids]
    durations = [r.ended_at - r.created_at for r in rollouts]
    assert second.generation_s == pytest.approx(sum(generation) / 8) and second.generation_s > 0
    assert second.rollout_s == pytest.approx(sum(durations) / 8)
    assert second.agent_s == pytest.approx(second.rollout_s - second.generation_s)
    assert 0 <= second.scoring_s < 1.0  # the agent reported its reward itself


def test_waits_for_enough_groups_and_skips_bad_rollouts(llm_server, store, model_dir, tmp_path) -> None:
    run_rollouts(llm_server, store, {"a": [1, 0, 1, 0]}, status_fail={("a", 0)})
    daemon = make_daemon(store, model_dir, tmp_path)
    assert daemon.step_once() is None  # one ready group, the step wants two
    assert store.query_rollouts(claimed=True) == []  # nothing held while waiting
    run_rollouts(llm_server, store, {"b": [0, 1, 1, 0]})
    result = daemon.step_once()
    assert result is not None
    assert result.metrics["skipped_status_failed"] == 1 and result.metrics["n_rollouts"] == 7


def test_staleness_async_and_sync(llm_server, store, model_dir, tmp_path) -> None:
    run_rollouts(llm_server, store, {"old": [1, 0, 1, 0]}, policy_version=0)
    run_rollouts(llm_server, store, {"new1": [1, 0, 1, 0], "new2": [0, 1, 0, 1]}, policy_version=5)
    daemon = make_daemon(store, model_dir, tmp_path, mode="async", max_staleness=2)
    daemon.engine.policy_version = 5  # as if five steps had been trained
    result = daemon.step_once()
    assert result is not None and result.metrics["skipped_stale"] == 4
    assert {r.task_id for r in store.query_rollouts(consumed=True) if r.consumed_step == -1} == {"old"}

    run_rollouts(llm_server, store, {"s1": [1, 0, 1, 0], "s2": [1, 0, 0, 1]}, policy_version=5)
    sync = make_daemon(store, model_dir, tmp_path, mode="sync", trainer_id="sync")
    sync.engine.policy_version = 6
    assert sync.step_once() is None and sync.skipped_total["stale"] == 8


def test_stale_keep_trains_the_rollouts_drop_would_skip(llm_server, store, model_dir, tmp_path) -> None:
    """`stale="keep"` (async): a group 5 versions behind with max_staleness 2 is trained, its lag in
    the step's metrics, where "drop" (the test above) consumes it as skipped."""
    run_rollouts(llm_server, store, {"old": [1, 0, 1, 0]}, policy_version=0)
    run_rollouts(llm_server, store, {"new": [0, 1, 0, 1]}, policy_version=5)
    daemon = make_daemon(store, model_dir, tmp_path, mode="async", max_staleness=2, stale="keep")
    daemon.engine.policy_version = 5
    result = daemon.step_once()
    assert result is not None and result.metrics.get("skipped_stale", 0) == 0
    assert result.metrics["n_rollouts"] == 8 and result.metrics["staleness_max"] == 5
    assert result.metrics["staleness_mean"] == pytest.approx(2.5)
    assert {r.task_id for r in store.query_rollouts(consumed=True) if r.consumed_step == 1} == {"old", "new"}
    # sync mode promises on-policy batches: "keep" does not apply there
    run_rollouts(llm_server, store, {"s1": [1, 0, 1, 0], "s2": [1, 0, 0, 1]}, policy_version=5)
    sync = make_daemon(store, model_dir, tmp_path, mode="sync", trainer_id="sync", stale="keep")
    sync.engine.policy_version = 6
    assert sync.step_once() is None and sync.skipped_total["stale"] == 8


@pytest.mark.slow
def test_two_daemons_never_take_the_same_rollout(llm_server, store_url, model_dir, tmp_path) -> None:
    """On PostgreSQL and on SQLite, each daemon with its own connection: a claim is one conditional
    UPDATE (TraceStore.claim_rollouts), which SQLite's single writer serializes as PostgreSQL's row
    locks do, so no `SELECT ... FOR UPDATE` (a no-op on SQLite) is needed for it."""
    store = own_store(store_url)
    run_rollouts(llm_server, store, {f"t{i}": [1, 0, 0, 1] for i in range(8)})
    daemons = [make_daemon(own_store(store_url), model_dir, tmp_path, trainer_id=f"d{i}",
                           group=GroupPolicy(group_size=4, groups_per_step=1)) for i in range(2)]
    errors: list[BaseException] = []
    # Lockstep: after each step a daemon waits for the other's, so every round both claim at once
    # (the race under test) and the work is shared whatever the machine's load; a daemon that
    # started late had let the other take 7 of the 8 groups on a loaded machine.
    barrier = threading.Barrier(2, timeout=60)
    steps_done = itertools.count(1)

    def in_lockstep(_result: object) -> None:
        if next(steps_done) >= 8:  # every group trained: both stop
            for d in daemons:
                d.stop()
            barrier.abort()
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass

    def run(daemon: TrainerDaemon) -> None:
        try:
            daemon.run(idle_timeout_s=60.0, on_step=in_lockstep)
        except BaseException as exc:  # a "database is locked" would end up here
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(d,)) for d in daemons]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    steps = store.train_steps()
    trained = [rid for s in steps for rid in s.rollout_ids]
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(trained) == len(set(trained)) == 32  # every rollout trained exactly once
    assert len(steps) == 8  # one group per step
    per_daemon = {d: sum(1 for s in steps if s.trainer_id == d) for d in ("d0", "d1")}
    assert min(per_daemon.values()) >= 2, f"the two daemons did not share the work: {per_daemon}"


@pytest.mark.slow
def test_kill_9_mid_run_trains_nothing_twice_and_loses_nothing(llm_server, model_dir, tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'crash.db'}"
    store = own_store(url)
    run_rollouts(llm_server, store, {f"t{i}": [1, 0, 1, 0] for i in range(12)})  # six steps of work
    cmd = [sys.executable, "-m", "lightning_middleware.cli", "trainer", "--store", url, "--model", str(model_dir),
           "--checkpoints", str(tmp_path / "ckpt"), "--group-size", "4", "--groups-per-step", "2", "--lr", "1e-3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not store.train_steps() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # most likely inside a later step; on a fast machine it may have finished all six
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = store.train_steps()
    assert done_before, proc.stdout.read().decode()[-2000:]
    # Six more steps of work arrive while it is down, so the restart always has something to train.
    run_rollouts(llm_server, store, {f"u{i}": [1, 0, 1, 0] for i in range(12)})
    # Restart: it releases what the killed run held and carries on from the committed checkpoint.
    tb = tmp_path / "tb"
    out = subprocess.run(cmd + ["--max-steps", str(12 - len(done_before)), "--tensorboard", str(tb)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "reward" in out.stdout and list(tb.glob("events.out.tfevents.*"))  # progress lines, TensorBoard
    steps = store.train_steps()
    trained = [rid for s in steps for rid in s.rollout_ids]
    assert len(trained) == len(set(trained)) == 96
    assert [s.step for s in steps] == list(range(1, 13))
    assert [s.policy_version for s in steps] == list(range(1, 13))
    assert store.query_rollouts(consumed=False) == []


def test_one_live_daemon_per_trainer_id_and_no_batch_trained_twice(llm_server, store_url, model_dir,
                                                                    tmp_path) -> None:
    """Two daemons under the default trainer id: the second is refused while the first is alive.
    If the id is taken over after the first looked dead (a frozen process, a lost network), the
    first one's step does not commit: its rollouts are trained once, by the new owner."""
    from lightning_middleware.store import LeaseLost, TrainerIdInUse

    store = own_store(store_url)
    run_rollouts(llm_server, store, {"t0": [1, 0, 0, 1], "t1": [0, 1, 1, 0]})
    one_group = GroupPolicy(group_size=4, groups_per_step=1)
    first = make_daemon(own_store(store_url), model_dir, tmp_path, group=one_group)
    with pytest.raises(TrainerIdInUse, match="in use by a running daemon"):
        make_daemon(own_store(store_url), model_dir, tmp_path / "b", group=one_group)
    batch = first.collect()
    assert batch is not None
    # The first daemon goes silent for longer than its lease; a run elsewhere takes the id over.
    with store.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE trainer_leases SET heartbeat_at = heartbeat_at - 1000")
    store.acquire_trainer("trainer-0", run_id="elsewhere:1:takeover")
    with pytest.raises(LeaseLost):
        first.train(batch)
    assert store.train_steps() == [] and store.latest_policy_version() is None  # nothing committed
    store.release_trainer("trainer-0", "elsewhere:1:takeover")
    first.close()
    second = make_daemon(own_store(store_url), model_dir, tmp_path / "c", group=one_group)  # released: it starts
    results = second.run(max_steps=2, idle_timeout_s=1.0)
    trained = [rid for s in store.train_steps() for rid in s.rollout_ids]
    assert len(results) == 2 and len(trained) == len(set(trained)) == 8
    second.close()


def test_two_runs_taking_over_one_dead_lease_at_once_on_sqlite(tmp_path) -> None:
    """SQLite ignores SELECT ... FOR UPDATE: a run that read the dead lease could overwrite a takeover
    that happened after its read, and both would think they own the id. The takeover is a
    compare-and-set on what was read; here a second run takes the lease between the first run's
    read and its write (an SQLAlchemy hook before that UPDATE), and the first is then refused."""
    import sqlalchemy as sa

    from lightning_middleware.store import TrainerIdInUse

    url = f"sqlite:///{tmp_path / 'lease.db'}"
    a, b = TraceStore(url), TraceStore(url)
    a.acquire_trainer("t", run_id="elsewhere:1:old")
    with a.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE trainer_leases SET heartbeat_at = heartbeat_at - 1000")  # dead
    raced: list[str] = []

    def b_first(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.startswith("UPDATE trainer_leases SET run_id") and not raced:
            raced.append(b.acquire_trainer("t"))

    sa.event.listen(a.engine, "before_cursor_execute", b_first)
    try:
        with pytest.raises(TrainerIdInUse, match="in use by a running daemon"):
            a.acquire_trainer("t")
    finally:
        sa.event.remove(a.engine, "before_cursor_execute", b_first)
    assert raced  # the race happened
    with b.engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT run_id FROM trainer_leases").scalar_one() == raced[0]
    a.close()
    b.close()


def test_a_daemon_dropped_without_close_stops_renewing_its_lease(store, model_dir, tmp_path) -> None:
    """The lease thread holds its daemon weakly: once nobody holds the daemon it stops beating (and
    logging against a store that may be gone), so its lease expires and the id can be taken again."""
    import gc

    before = set(threading.enumerate())
    daemon = make_daemon(store, model_dir, tmp_path, lease_s=0.4)
    OPEN_DAEMONS.remove(daemon)
    [beat] = [t for t in set(threading.enumerate()) - before if t.name == "lease-trainer-0"]
    del daemon
    gc.collect()
    beat.join(timeout=5)
    assert not beat.is_alive()
    time.sleep(0.5)  # past the lease
    make_daemon(store, model_dir, tmp_path / "again", lease_s=0.4).close()  # the id is free again


def test_a_batch_without_trainable_rows_commits_no_version(llm_server, store, model_dir, tmp_path) -> None:
    client = wrap(openai.OpenAI(base_url=llm_server.base_url, api_key="x"), store=store, inject_token_ids=False)
    for reward in (1.0, 0.0, 1.0, 0.0):  # no token IDs asked for: recorded, but nothing to train on
        with rollout("blind", store=store) as r:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
            r.reward(reward)
    daemon = make_daemon(store, model_dir, tmp_path, group=GroupPolicy(group_size=4, groups_per_step=1))
    assert daemon.step_once() is None
    assert store.latest_policy_version() is None and store.train_steps() == []
    assert daemon.skipped_total["no_trainable_rows"] == 4 and daemon.engine.policy_version == 0
    assert {r.consumed_step for r in store.query_rollouts()} == {-1}  # consumed as skipped, never polled again
    daemon.close()


def test_success_uses_the_threshold_and_sync_drops_unversioned(llm_server, store, model_dir, tmp_path) -> None:
    run_rollouts(llm_server, store, {"half": [0.5, 0.0, 1.0, 0.5]}, policy_version=0)
    daemon = make_daemon(store, model_dir, tmp_path, group=GroupPolicy(group_size=4, groups_per_step=1))
    result = daemon.step_once()
    assert result is not None and result.metrics["success_rate"] == 0.25  # reward >= 1, not > 0
    daemon.close()
    run_rollouts(llm_server, store, {"nover": [1, 0, 1, 0]})  # no policy version: sync can't check it
    sync = make_daemon(store, model_dir, tmp_path, mode="sync", trainer_id="sync",
                       group=GroupPolicy(group_size=4, groups_per_step=1))
    sync.engine.policy_version = 0
    assert sync.step_once() is None and sync.skipped_total["stale"] == 4
    sync.close()


def test_evaluation_every_n_steps_keeps_the_best_and_stops_early(llm_server, store, model_dir, tmp_path) -> None:
    from trainer_backend.daemon.validation import EvalPolicy

    url = store.url.render_as_string(hide_password=False)
    tasks = tmp_path / "val.jsonl"
    # the held-out success changes with the policy version serving it: 1, 2, 1, 1 of 3 tasks after
    # steps 2, 4, 6, 8, so the best is step 4's, not the first
    solved = {2: 1, 4: 2, 6: 1, 8: 1}
    tasks.write_text("".join(json.dumps({"task_id": f"val-{i}", "question": f"held out {i}",
                                         "reward_by_version": {str(v): float(i < n) for v, n in solved.items()},
                                         "base_url": llm_server.base_url, "store": url}) + "\n" for i in range(3)))
    run_rollouts(llm_server, store, {f"t{i}": [1, 0, 1, 0] for i in range(10)})  # work for 10 steps
    ckpts = tmp_path / "ckpt-trainer-0"
    daemon = make_daemon(store, model_dir, tmp_path, group=GroupPolicy(group_size=4, groups_per_step=1),
                         keep_checkpoints=1, eval=EvalPolicy(agent="tests.controller.controller_agents:tool_agent",
                                                            tasks=str(tasks), every=2, patience=2, concurrency=3))
    results = daemon.run(idle_timeout_s=2.0)
    daemon.close()
    # evaluations after steps 2, 4, 6, 8: the best is step 4's, then two without improvement: early stop
    # after step 8, though two more groups wait
    assert [r.step for r in results] == [1, 2, 3, 4, 5, 6, 7, 8]
    evals = store.eval_results("val")
    assert [e.step for e in evals] == [2, 4, 6, 8] and all(e.metrics["rollouts"] == 3 for e in evals)
    assert [e.policy_version for e in evals] == [2, 4, 6, 8]  # tagged with the version that served them
    best = json.loads((ckpts / "best.json").read_text())
    assert best["step"] == 4 and best["value"] == pytest.approx(2 / 3)
    assert sorted(p.name for p in ckpts.glob("v*")) == ["v000004", "v000008"]  # the best survives keep=1
    [stop] = store.events(kind="early_stop")
    assert stop.step == 8 and "v000004" in stop.message
    assert {r.mode for r in store.query_rollouts(mode="val")} == {"val"} and len(store.query_rollouts(mode="val")) == 12


def test_health_checks_warn_with_the_remedy_and_record_events(llm_server, store, model_dir, tmp_path, caplog) -> None:
    from trainer_backend.daemon.monitoring import HealthConfig

    run_rollouts(llm_server, store, {"a": [1, 0, 1, 0]})
    daemon = make_daemon(store, model_dir, tmp_path, group=GroupPolicy(group_size=4, groups_per_step=1),
                         health=HealthConfig(entropy_floor=1e6))  # any entropy is "collapsed" for this test
    import logging

    with caplog.at_level(logging.WARNING, logger="trainer_backend.daemon.trainer_daemon"):
        result = daemon.step_once()
    daemon.close()
    assert result is not None and result.metrics["health_entropy_collapse"] == 1.0
    [event] = store.events(kind="entropy_collapse")
    assert event.source == "trainer-0" and event.step == 1 and "entropy_coef" in event.data["remedy"]
    assert "Remedy: the policy is turning deterministic" in caplog.text
    assert store.train_steps()[0].metrics["health_entropy_collapse"] == 1.0


def test_ppo_and_dpo_from_the_settings_through_the_daemon(llm_server, store, model_dir, tmp_path) -> None:
    """PPO trains a group whose rewards are all equal (its critic, not the group, is the baseline) and
    saves its critic; DPO trains the best and the worst rollout of each group and nothing else."""
    from trainer_backend.daemon.settings import TrainerSettings

    def daemon_for(algo: str, **extra: object) -> TrainerDaemon:
        s = TrainerSettings.load(None, {"algorithm.name": algo, "group.size": 4, "group.per_step": 2,
                                        "run.model": str(model_dir), "run.checkpoints": str(tmp_path / algo),
                                        "run.trainer_id": algo, "engine.precision": "fp32", "optim.lr": 1e-3, **extra})
        return TrainerDaemon(store, TorchEngine(model_dir, s.engine_config()), s.trainer_config())

    run_rollouts(llm_server, store, {"a": [1, 0, 0.5, 0], "c": [1, 1, 1, 1]})
    with daemon_for("ppo", **{"critic.lr": 1e-3}) as ppo:
        [result] = ppo.run(max_steps=1)
    m = result.metrics
    assert m["n_groups"] == 2 and m["n_rollouts"] == 8 and "skipped_uniform_reward" not in m
    assert m["vf_loss"] > 0 and m["critic_grad_norm"] > 0
    assert (Path(store.get_policy_version(1, "ppo").path) / "critic" / "model.safetensors").is_file()

    run_rollouts(llm_server, store, {"d": [1, 0.5, 0, 0.2], "e": [0, 1, 1, 0], "f": [1, 1, 1, 1]})
    with daemon_for("dpo", **{"dpo.beta": 0.2}) as dpo:
        [result] = dpo.run(max_steps=1)
    m = result.metrics
    assert m["skipped_uniform_reward"] == 4  # group f: no pair
    assert m["pairs"] == 2 and m["n_rows"] == 4 and m["n_rollouts"] == 8  # the middle rollouts are consumed, untrained
    assert m["dpo_loss"] == pytest.approx(0.6931, abs=1e-3)  # the first step: policy == reference
