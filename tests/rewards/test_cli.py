"""`lightning-mw rewards` as a user runs it (a subprocess): check, rescore and calibrate on a
store (SQLite and PostgreSQL), and bad input answered with one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lightning_middleware import Reward, RewardConfig, TraceStore, rollout
from tests.rewards.helpers import client_for, tool_agent

ROOT = Path(__file__).resolve().parent.parent.parent


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    # The module's own main: the `rewards` entry point exists once the package is (re)installed.
    return subprocess.run([sys.executable, "-m", "lightning_middleware.rewards.cli", *argv], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def _one_line(proc: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-2000:])
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1 and fragment in err, err


def test_rescore_and_calibrate_from_the_command_line(store: TraceStore, store_url: str, tmp_path: Path) -> None:
    client = client_for(store)
    ids = []
    for v in (0.2, 0.6, 1.0):
        with rollout("t", store=store) as r:
            tool_agent(client, "q", "ok")
            r.reward(v)
        ids.append(r.id)
    config = tmp_path / "rewards.toml"
    config.write_text('reward_type = "hybrid"\n[rules]\nagent_reward = 2.0\ntool_call_valid = 1.0\n'
                      '[reward_model]\nweight = 1.0\nscorer = "tests.rewards.test_cli:judge"\n')
    checked = _run("check", str(config))
    assert checked.returncode == 0 and RewardConfig.load(config).hash in checked.stdout, checked.stderr

    done = _run("rescore", "--store", store_url, "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert "re-scored 3 rollouts" in done.stdout and "3 applied" in done.stdout
    assert [store.get_rollout(i).final_reward for i in ids] == pytest.approx([2 * v + 1 + v / 2 for v in (0.2, 0.6,
                                                                                                       1.0)])
    assert all(len([r for r in store.rewards(i) if r.config_hash is None]) == 1 for i in ids)  # the old one stays

    for rid, v in zip(ids, (0.2, 0.6, 1.0)):
        store.add_reward(Reward(rid, v, name="human", final=False))
    cal = _run("calibrate", "--store", store_url, "--config", str(config))
    assert cal.returncode == 0, cal.stderr
    assert "3 rollouts with both" in cal.stdout and "scale = 2" in cal.stdout and "offset = 0" in cal.stdout


def judge(t) -> float:
    """A local scorer for the test: half the agent's own reward."""
    return (t.reported_reward or 0.0) / 2


def test_bad_input_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[rules]\nnope = 1.0\n")
    _one_line(_run("check", str(bad)), "no built-in rule 'nope'")
    _one_line(_run("check", str(tmp_path / "missing.toml")), "does not exist")
    good = tmp_path / "good.toml"
    good.write_text("[rules]\nsucceeded = 1.0\n")
    _one_line(_run("rescore", "--store", f"sqlite:///{tmp_path}/none.db", "--config", str(good)), "does not exist")
    store = f"sqlite:///{tmp_path}/empty.db"
    TraceStore(store).close()
    _one_line(_run("rescore", "--store", store, "--config", str(good), "--rollout", "nope"), "no rollouts")
    _one_line(_run("calibrate", "--store", store), "at least 2")
    _one_line(_run("label", "--store", store, "--host", "0.0.0.0"), "without a token")
