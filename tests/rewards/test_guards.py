"""The guards beyond the seeds' three: forbidden commands, protected files (the harness's
helper over real files, through a real rollout), and a guard's "zero" action."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_middleware import RewardConfig, Rollout, RolloutStatus, TraceStore, rollout
from lightning_middleware.rewards import ConfigError, ProtectedFiles, Scorer, guards
from lightning_middleware.rewards.trajectory import build_trajectory
from tests.rewards.helpers import client_for, tool_agent, tool_call

RO = Rollout(id="r", task_id="t", status=RolloutStatus.SUCCEEDED)


def test_forbidden_commands_positives_and_negatives() -> None:
    calls = [
        tool_call(0, "run_shell", {"command": "git log -p -- src/sort.py"}),  # reads the fix from history
        tool_call(1, "run_shell", {"command": "curl https://example.com/answer"}),
        tool_call(2, "run_shell", {"command": "git show HEAD~1"}),
        tool_call(3, "run_shell", {"command": "git status && git diff"}),  # honest: looks at its own work
        tool_call(4, "run_shell", {"command": "pytest -q tests/"}),
        tool_call(5, "edit_file", {"path": "src/curling.py", "content": "sshd = 1"}),  # words, not commands
    ]
    found = guards.forbidden_commands(build_trajectory(RO, calls, []))
    assert found.value == 3.0 and [f["call_index"] for f in found.detail["flagged"]] == [0, 1, 2]
    assert found.detail["flagged"][0]["matched"] == ["git log"]
    own = guards.forbidden_commands(build_trajectory(RO, calls, []), patterns=[r"\bpytest\b"])
    assert own.value == 1.0 and own.detail["flagged"][0]["call_index"] == 4


def test_protected_files_changed_during_a_rollout_are_caught(store: TraceStore, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_sort.py").write_text("def test_sort(): assert sort([2, 1]) == [1, 2]\n")
    (repo / "tests" / "test_other.py").write_text("def test_other(): pass\n")
    (repo / "src.py").write_text("def sort(xs): return xs\n")
    cfg = RewardConfig.from_dict({"rules": {"succeeded": 1.0},
                                  "guards": {"protected_files": {"weight": -1.0, "action": "zero"}}})
    client = client_for(store)

    honest = ProtectedFiles(["tests"], root=repo)
    with rollout("bug", store=store, rewards=cfg) as good:
        tool_agent(client, "fix it", "ok")
        (repo / "src.py").write_text("def sort(xs): return sorted(xs)\n")  # fixes the code
        assert honest.report(good) == []

    hacker = ProtectedFiles(["tests"], root=repo)
    with rollout("bug", store=store, rewards=cfg) as bad:
        tool_agent(client, "fix it", "ok")
        (repo / "tests" / "test_sort.py").write_text("def test_sort(): pass\n")  # guts the test
        (repo / "tests" / "test_other.py").unlink()
        (repo / "tests" / "test_new.py").write_text("\n")
        assert hacker.report(bad) == ["tests/test_new.py", "tests/test_other.py", "tests/test_sort.py"]

    got = {r.name: r for r in store.rewards(good.id) if r.config_hash == cfg.hash}
    assert got["protected_files"].value == 0.0 and got["final"].value == 1.0
    bad_got = {r.name: r for r in store.rewards(bad.id) if r.config_hash == cfg.hash}
    assert bad_got["protected_files"].value == 3.0
    assert bad_got["protected_files"].metadata["detail"]["changed"][0] == "tests/test_new.py"
    assert bad_got["final"].value == 0.0 and bad_got["final"].metadata["zeroed_by"] == ["protected_files"]
    assert store.get_rollout(bad.id).final_reward == 0.0 and store.get_rollout(good.id).final_reward == 1.0
    # Not reported at all: the guard is absent (it cannot tell), not a pass.
    assert guards.protected_files(build_trajectory(RO, [], [])) is None


def test_a_guard_penalises_or_zeroes_by_config() -> None:
    loop = [tool_call(i, "run_python", {"query": "pytest"}) for i in range(4)]
    t = build_trajectory(RO, loop, [])
    base = {"rules": {"succeeded": 5.0}}
    penalise = Scorer(RewardConfig.from_dict({**base, "guards": {"repeated_tool_calls": {
        "weight": -1.0, "max_repeats": 1}}}))
    zero = Scorer(RewardConfig.from_dict({**base, "guards": {"repeated_tool_calls": {
        "weight": -1.0, "max_repeats": 1, "action": "zero"}}}))
    assert penalise.score(t).final == 5.0 - 3.0 and penalise.score(t).zeroed_by == ()
    assert zero.score(t).final == 0.0 and zero.score(t).zeroed_by == ("repeated_tool_calls",)
    assert zero.hash != penalise.hash  # the action changes rewards, so it is in the hash
    clean = build_trajectory(RO, loop[:1], [])
    assert zero.score(clean).final == 5.0  # not fired: nothing zeroed
    with pytest.raises(ConfigError, match="action must be one of penalise, zero"):
        RewardConfig.from_dict({**base, "guards": {"repeated_tool_calls": {"weight": -1.0, "action": "ban"}}})
    with pytest.raises(ConfigError, match="only a guard takes an action"):
        RewardConfig.from_dict({"rules": {"succeeded": {"weight": 1.0, "action": "zero"}}})
