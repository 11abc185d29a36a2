"""The Ray backend on an existing cluster: a real Ray head started by `ray start --head` in its own
process (as a KubeRay head pod would be), joined by address (`--ray-address`). The drivers run in
their own processes too, with the head's auth mode: `ray.init` of a local runtime elsewhere in the
session sets RAY_AUTH_MODE in this process's environment, and Ray reads it once per process."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_middleware import TraceStore
from lightning_middleware.testing import LLMTestServer, free_port
from tests.controller import controller_agents as A

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """A Ray head (its GCS on a free port, its own temp dir); its workers import this checkout."""
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="rh", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # `ray start` turns token authentication on by default; this test's head and drivers opt out
    # (docs/kubernetes.md: a token cluster).
    env = _ray_env()
    # On loopback: with the machine's own address (here eth0's 192.0.2.2, the default route's) the
    # drivers once failed, for 300 s, to reach the GCS there ("Failed to connect to GCS at address
    # 192.0.2.2:...") in a quick-tier run that reached it on 127.0.0.1 to start.
    head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--node-ip-address=127.0.0.1", "--include-dashboard=false", f"--temp-dir={tmp}",
                             "--disable-usage-stats", f"--ray-client-server-port={free_port()}"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        _wait_for_head(head, address)
        yield address
    finally:
        # SIGINT, not SIGTERM: on SIGTERM `ray start --block` drains for up to 30 s before it stops
        # its processes (10 s of every run's teardown); on SIGINT it stops them in ~2 s.
        os.killpg(head.pid, signal.SIGINT)  # the head and the processes it started (its own session)
        try:
            head.wait(10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # the GCS and monitor may outlive a SIGTERM
        except ProcessLookupError:
            pass
        head.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def _ray_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def _wait_for_head(head: subprocess.Popen[str], address: str, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if head.poll() is not None:
            out = head.stdout.read() if head.stdout else ""
            raise RuntimeError(f"ray start --head exited {head.returncode}: {out[-2000:]}")
        probe = subprocess.run([RAY, "status", f"--address={address}"], capture_output=True, text=True, timeout=60,
                               env=_ray_env())
        if probe.returncode == 0:
            return
        time.sleep(1.0)
    raise RuntimeError(f"the Ray head at {address} did not come up in {timeout_s:g}s")


@pytest.fixture
def sq(tmp_path: Path) -> Iterator[TraceStore]:
    s = TraceStore(f"sqlite:///{tmp_path / 'traces.db'}")
    yield s
    s.close()


def test_rollouts_run_on_an_existing_ray_cluster(ray_head: str, llm_server: LLMTestServer, sq: TraceStore,
                                                slowness: float) -> None:
    url = sq.url.render_as_string(hide_password=False)
    proc = subprocess.run([sys.executable, "-m", "tests.controller.ray_cluster_driver", ray_head, url,
                           llm_server.base_url, str(2.0 * slowness)], cwd=ROOT, env=_ray_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    results = out["results"]
    assert all(status == "succeeded" and reward == 1.0 for tid, status, reward, *_ in results if tid != "t2"), results
    assert [status for tid, status, *_ in results if tid == "t2"] == ["timeout", "timeout"], results
    assert all(len(sq.calls(rid)) >= 1 for _, _, _, rid, *_ in results)
    assert out["nodes"] == [True]  # the head we started, not a fresh local runtime
    assert out["driver"] not in out["pids"] and len(set(out["pids"])) == 2


def test_the_cli_joins_the_cluster_by_address(ray_head: str, llm_server: LLMTestServer, sq: TraceStore,
                                              tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in A.make_tasks(llm_server, sq, 2)))
    proc = subprocess.run([sys.executable, "-m", "lightning_middleware.cli", "rollouts", "run", "--agent",
                           "tests.controller.controller_agents:tool_agent", "--tasks", str(tasks), "-n", "2",
                           "--store", sq.url.render_as_string(hide_password=False), "--backend", "ray",
                           "--ray-address", ray_head, "--workers", "2"],
                          cwd=ROOT, env=_ray_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "4 rollouts" in proc.stdout and "succeeded=4" in proc.stdout
    assert len(sq.query_rollouts(status="succeeded")) == 4
