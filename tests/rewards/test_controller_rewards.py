"""The rollout controller with a reward configuration: every rollout scored as it ends, in this
process (thread backend) and in worker processes (the configuration file travels with the job);
`RolloutResult.reward` is the combined final reward. On SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_middleware import RewardConfig, TraceStore
from lightning_middleware.controller import RolloutController
from lightning_middleware.testing import LLMTestServer
from tests.controller import controller_agents as A

TOML = '[rules]\ntask_complete = 5.0\ntool_call_valid = 1.0\n[guards]\nrepeated_tool_calls = -1.0\n'


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_the_controller_scores_every_rollout(llm_server: LLMTestServer, store: TraceStore, tmp_path: Path,
                                              backend: str) -> None:
    config = tmp_path / "rewards.toml"
    config.write_text(TOML)
    tasks = A.make_tasks(llm_server, store, 2)
    tasks[1]["reward"] = 0.0  # the agent says it failed: task_complete is 0
    with RolloutController(A.tool_agent, store=store, backend=backend, concurrency=2, workers=2,
                           rewards=str(config)) as c:
        results = c.run(tasks)
    h = RewardConfig.load(config).hash
    assert sorted(r.reward for r in results) == [1.0, 6.0]
    for r in results:
        got = {x.name: x.value for x in store.rewards(r.rollout_id) if x.config_hash == h}
        assert got["final"] == r.reward == store.get_rollout(r.rollout_id).final_reward
        assert set(got) == {"task_complete", "tool_call_valid", "repeated_tool_calls", "final"}


def test_a_bad_configuration_fails_at_construction(tmp_path: Path) -> None:
    bad = tmp_path / "rewards.toml"
    bad.write_text("[rules]\nsucceeded = 1.0\n[guards]\nnope = -1.0\n")
    with pytest.raises(ValueError, match="no built-in guard 'nope'"):
        RolloutController(A.sync_noop_agent, store=f"sqlite:///{tmp_path / 'x.db'}", rewards=str(bad))
