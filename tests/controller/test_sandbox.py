"""The sandbox enforced (issue 34): rollouts under bubblewrap, through the real gateway, the real
test LLM and a SQLite store; an attacking agent tries each forbidden thing from inside a rollout,
and a well-behaved coding agent completes its rollouts in the same sandbox.

Network targets are loopback only (the test's own servers), every attack loop is bounded, and the
sandbox's limits are set low so the limit attacks end in seconds."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from lightning_middleware import RewardConfig, TraceStore
from lightning_middleware.controller import RolloutController
from lightning_middleware.controller.backends.sandboxed import SandboxedBackend
from lightning_middleware.controller.jobs import RetryPolicy
from lightning_middleware.controller.sandbox import Sandbox, SandboxUnavailable, check_host
from lightning_middleware.gateway import Gateway
from lightning_middleware.records import SANDBOX_BREACH
from lightning_middleware.testing import LLMTestServer

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is installed by scripts/setup.sh (Debian package 'bubblewrap')")

TOKEN = "sandbox-test-token"
SECRET = "postgresql://lightning:hunter2@127.0.0.1/secret"
REWARDS = {"rules": {"succeeded": 1.0, "tool_call_valid": 0.0}, "agent_reward": False}
CODER = "tests.controller.sandbox_agents:coder"
ATTACKER = "tests.controller.sandbox_agents:attacker"
LIMITS = Sandbox(memory_bytes=2 * 2**30, cpu_s=3, max_procs=48)
# A deadline no attack but `overrun` should meet: reaching it is a failure the test names.
UNREACHED_DEADLINE_S = 240.0


@dataclass
class Setup:
    store: TraceStore
    store_path: str
    gateway: Gateway


@pytest.fixture
def setup(llm_server: LLMTestServer, tmp_path, monkeypatch) -> Iterator[Setup]:
    monkeypatch.setenv("LIGHTNING_TEST_SECRET", SECRET)  # in the controller's environment, not the rollout's
    path = str(tmp_path / "store.db")
    store = TraceStore(f"sqlite:///{path}")
    with Gateway([llm_server.base_url], store, rewards=RewardConfig.from_dict(REWARDS), token=TOKEN,
                 health_interval_s=0) as gw:
        yield Setup(store, path, gw)
    store.close()


def _controller(s: Setup, agent: str, root: str | None = None) -> RolloutController:
    backend = SandboxedBackend(s.gateway.url, token=TOKEN, sandbox=LIMITS, workers=2, root=root)
    return RolloutController(agent, store=s.store, backend=backend, concurrency=2, timeout_s=60.0,
                             retry=RetryPolicy(max_attempts=3, retry_on=("ConnectionError", "OSError", "MemoryError",
                                                                         "httpx.HTTPError")))


def test_a_coding_agent_completes_its_rollouts_in_the_sandbox(setup: Setup, tmp_path) -> None:
    tasks = [{"task_id": f"add-{i}", "prompt": f"add {i} and 2", "a": i, "b": 2} for i in range(4)]
    root = str(tmp_path / "sandboxes")  # its own: another worker's sandboxed test may be running
    with _controller(setup, CODER, root) as c:
        results = c.run(tasks, n=1)
        work = [os.path.join(root, p, "work") for p in os.listdir(root)]
        assert work and not any(os.listdir(w) for w in work), work  # each workspace removed at its rollout's end
    assert os.listdir(root) == []  # and the backend's own directory at close
    assert [r.status for r in results] == ["succeeded"] * 4, [r.error for r in results]
    for r in results:
        calls = setup.store.calls(r.rollout_id)
        assert len(calls) == 1 and calls[0].prompt_token_ids and calls[0].completion_token_ids
        rewards = {w.name: w.value for w in setup.store.rewards(r.rollout_id)}
        assert "agent" not in rewards  # agent_reward = false: its returned 1.0 was not stored
        assert r.reward == pytest.approx(1.0)  # `succeeded`, scored by the gateway
    assert not setup.store.events(kind=SANDBOX_BREACH)


def _port_of(url: str) -> int:
    port = httpx.URL(url).port
    assert port is not None
    return port


def test_every_attack_fails_and_ends_its_rollout_with_its_class(setup: Setup, llm_server: LLMTestServer,
                                                                pg_server, tmp_path, monkeypatch) -> None:
    # A directory the sandbox binds (it is on the agent's import path), holding a checkpoint that a
    # hidden path masks and a second store file, which is masked because the backend's store is there.
    shared = tmp_path / "shared"
    (shared / "ckpt").mkdir(parents=True)
    (shared / "ckpt" / "model.safetensors").write_bytes(b"weights")
    pg_port = _port_of(pg_server if isinstance(pg_server, str) else pg_server.url)
    with socket.socket() as free:  # nothing listens here on the host either: refused inside, not just absent
        free.bind(("127.0.0.1", 0))
        idle_port = free.getsockname()[1]
    other_root = tmp_path / "rollouts"
    monkeypatch.setenv("LIGHTNING_TEST_ALLOWED", "a-variable-env_allow-names")
    sandbox = Sandbox(memory_bytes=2 * 2**30, cpu_s=3, max_procs=48, hidden_paths=(str(shared / "ckpt"),),
                      env_allow=("PATH", "LIGHTNING_TEST_ALLOWED"))
    import sys

    backend = SandboxedBackend(setup.gateway.url, token=TOKEN, sandbox=sandbox, workers=2, root=str(other_root),
                               python_path=[*[p for p in sys.path if p], str(shared)])
    attacks = {
        "read_store": ({"path": setup.store_path}, "failed", "sandbox_fs"),
        "read_checkpoint": ({"attack": "read_store", "path": str(shared / "ckpt" / "model.safetensors")},
                            "failed", "sandbox_fs"),
        "read_secret": ({"var": "LIGHTNING_TEST_SECRET"}, "failed", None),  # KeyError: it is not there
        "read_allowed": ({"attack": "read_secret", "var": "LIGHTNING_TEST_ALLOWED"}, "succeeded", None),
        "connect_postgres": ({"attack": "connect", "port": pg_port}, "failed", "sandbox_network"),
        "connect_gateway": ({"attack": "connect", "port": _port_of(setup.gateway.url)}, "failed", "sandbox_network"),
        "connect_llm": ({"attack": "connect", "port": _port_of(llm_server.base_url)}, "failed", "sandbox_network"),
        "connect_idle": ({"attack": "connect", "port": idle_port}, "failed", "sandbox_network"),
        "gateway_admin": ({}, "failed", "sandbox_network"),
        "other_rollout": ({"other": "someone-else"}, "failed", "sandbox_network"),
        "write_usr": ({"attack": "write_outside", "path": "/usr/lib/pwned"}, "failed", "sandbox_fs"),
        "write_root": ({"attack": "write_outside", "path": "/pwned"}, "failed", "sandbox_fs"),
        "write_host_tmp": ({"attack": "write_outside", "path": str(tmp_path / "pwned")}, "failed", "sandbox_fs"),
        "read_other_workdir": ({"path": str(other_root)}, "failed", "sandbox_fs"),
        "fork_bomb": ({}, "failed", "sandbox_limit"),
        "allocate": ({}, "failed", "sandbox_limit"),
        "burn_cpu": ({}, "failed", "sandbox_limit"),
        "overrun": ({}, "timeout", "sandbox_limit"),
        "self_reward": ({}, "failed", "sandbox_reward"),
    }
    tasks = [{"attack": name, **extra, "task_id": name} for name, (extra, _, _) in attacks.items()]
    retry = RetryPolicy(max_attempts=3, retry_on=("ConnectionError", "OSError", "MemoryError", "TimeoutError",
                                                  "httpx.HTTPError"))
    # Only `overrun` needs a deadline; every other attack ends by itself (a sandbox limit, an error or
    # its answer). A deadline they shared ended the fork bomb first on a loaded machine twice (8 s fixed,
    # then 9.1 s scaled, with the whole suite beside it on CI's 2 cores), so they run under a deadline
    # far above their own ends, and `overrun` alone under one scaled from a harmless rollout timed here.
    t0 = time.monotonic()
    with RolloutController(ATTACKER, store=setup.store, backend=backend, concurrency=1, timeout_s=60.0) as c:
        [baseline] = c.run([{"attack": "read_secret", "var": "LIGHTNING_TEST_ALLOWED", "task_id": "baseline"}], n=1)
    assert baseline.status == "succeeded", baseline.error
    deadline = min(60.0, max(8.0, 4 * (time.monotonic() - t0)))
    results = {}
    for batch, timeout_s in (([t for t in tasks if t["attack"] != "overrun"], UNREACHED_DEADLINE_S),
                             ([t for t in tasks if t["attack"] == "overrun"], deadline)):
        with RolloutController(ATTACKER, store=setup.store, backend=backend, concurrency=2, timeout_s=timeout_s,
                               retry=retry) as c:
            results.update({r.task_id: r for r in c.run(batch, n=1)})
    events = {e.data["rollout_id"]: e.data["class"] for e in setup.store.events(kind=SANDBOX_BREACH)}
    got = {name: (r.status, events.get(r.rollout_id), r.attempts) for name, r in results.items()}
    want = {name: (status, kind, 1) for name, (_, status, kind) in attacks.items()}
    assert got == want, {name: results[name].error for name in got if got[name] != want[name]}
    for name, (_, _, kind) in attacks.items():
        stored = setup.store.get_rollout(results[name].rollout_id)
        assert stored is not None and stored.status.value == results[name].status
        if kind is not None:
            assert stored.error is not None and stored.error.startswith(kind + ":"), (name, stored.error)
    assert not (tmp_path / "pwned").exists()
    assert (shared / "ckpt" / "model.safetensors").read_bytes() == b"weights"
    assert not setup.gateway.gate.paused  # the admin route was never reached
    refused = setup.store.events(kind="reward_refused")
    assert [e.data["rollout_id"] for e in refused] == [results["self_reward"].rollout_id]
    everything = repr([setup.store.get_rollout(r.rollout_id) for r in results.values()])
    assert SECRET not in everything and "hunter2" not in everything


def test_a_missing_sandbox_tool_is_one_line_naming_the_package(monkeypatch) -> None:
    check_host.cache_clear()
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        with pytest.raises(SandboxUnavailable, match=r"Debian package 'bubblewrap'"):
            check_host()
    finally:
        check_host.cache_clear()


def test_masked_paths_inside_a_bound_directory_cannot_be_read(tmp_path) -> None:
    """A store file or checkpoint under a directory the sandbox binds (a source tree on the import
    path) shows as an unreadable file; a masked directory as an empty one."""
    import subprocess
    import sys

    from lightning_middleware.controller.sandbox import bwrap_command

    tree = tmp_path / "tree"
    (tree / "ckpt").mkdir(parents=True)
    (tree / "ckpt" / "w.bin").write_bytes(b"weights")
    (tree / "traces.db").write_bytes(b"SQLite format 3")
    (tree / "ok.txt").write_text("visible")
    blind = tmp_path / "blind"
    blind.touch()
    blind.chmod(0)
    work, door = tmp_path / "work", tmp_path / "door.sock"
    work.mkdir()
    door.touch()
    probe = ("import os\n"
             "print(open('ok.txt').read())\n"
             "print(os.listdir('ckpt'))\n"
             "try:\n    open('traces.db', 'rb').read()\nexcept PermissionError as e:\n    print('refused', e.errno)\n")
    cmd = bwrap_command(Sandbox(), bwrap=check_host(), workspace_dir=str(work), door_socket=str(door),
                        python=sys.executable, python_path=[str(tree)], env={"PATH": "/usr/bin"},
                        masked=[str(tree / "ckpt"), str(tree / "traces.db")], blind_file=str(blind),
                        argv=["-c", f"import os; os.chdir({str(tree)!r}); exec({probe!r})"])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["visible", "[]", "refused 13"]


def test_the_cli_runs_rollouts_in_the_sandbox(setup: Setup, tmp_path, monkeypatch, capsys) -> None:
    import json

    from lightning_middleware.cli import main

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"task_id": f"c{i}", "prompt": "hi", "a": i, "b": 1}) + "\n"
                             for i in range(2)))
    settings = tmp_path / "sandbox.toml"
    settings.write_text("[sandbox]\nmax_procs = 40\ncpu_s = 20\nenv_allow = ['PATH']\n")
    url = f"sqlite:///{setup.store_path}"
    base = ["rollouts", "run", "--agent", CODER, "--tasks", str(tasks), "--store", url, "--backend", "sandbox"]
    monkeypatch.setenv("LIGHTNING_GATEWAY_TOKEN", TOKEN)
    assert main([*base, "--gateway", setup.gateway.url, "--sandbox", str(settings), "--concurrency", "2"]) == 0
    assert "2 rollouts" in capsys.readouterr().out
    done = [r for r in setup.store.query_rollouts() if r.task_id.startswith("c")]
    assert [r.status.value for r in done] == ["succeeded"] * 2

    assert main(base) == 2
    assert "--backend sandbox needs --gateway URL" in capsys.readouterr().err
    settings.write_text("[sandbox]\nmax_proc = 4\n")
    assert main([*base, "--gateway", setup.gateway.url, "--sandbox", str(settings)]) == 2
    assert "unknown sandbox keys ['max_proc']" in capsys.readouterr().err


def test_a_kernel_without_the_namespaces_is_refused(tmp_path, monkeypatch) -> None:
    """Where bwrap cannot make its namespaces (a fake bwrap here fails as one does on such a kernel),
    the backend refuses to start: never a rollout without the sandbox."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    check_host.cache_clear()
    try:
        backend = SandboxedBackend("http://127.0.0.1:1")
        with pytest.raises(SandboxUnavailable, match="No permissions to create new namespace"):
            backend.start(CODER, None)  # type: ignore[arg-type]
    finally:
        check_host.cache_clear()


def test_the_breach_kinds_inside_and_outside_agree() -> None:
    from lightning_middleware.controller import sandbox_entry
    from lightning_middleware.controller.jobs import BREACHES

    assert set(sandbox_entry.BREACH_KINDS) == set(BREACHES)
    ws = "/workspace"
    assert sandbox_entry.classify(FileNotFoundError(2, "gone", "/workspace/x.py"), ws) is None  # its own file
    assert sandbox_entry.classify(FileNotFoundError(2, "gone", "relative.py"), ws) is None
    assert sandbox_entry.classify(KeyError("SECRET"), ws) is None
    try:
        try:
            raise ConnectionRefusedError(111, "refused")
        except ConnectionRefusedError as inner:
            raise RuntimeError("the SDK's wrapper") from inner
    except RuntimeError as outer:
        assert sandbox_entry.classify(outer, ws) == "sandbox_network"
