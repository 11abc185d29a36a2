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
from typing import NamedTuple

import pytest

from lightning_middleware import TraceStore
from lightning_middleware.testing import LLMTestServer, free_port
from tests.controller import controller_agents as A

ray = pytest.importorskip("ray")
ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
# A driver's limit, times the slowness probe: each took 16-24 s in the whole suite on 2
# AVX2 cores; the 300 s they had before held a worker 600 s when they could not reach the GCS.
DRIVER_S = 100.0


class RayHead(NamedTuple):
    address: str
    temp_dir: Path  # its session logs: what a failed driver's message shows

    def logs(self, chars: int = 1500) -> str:
        """The tail of the head's GCS and raylet logs."""
        parts = []
        for name in ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err"):
            for path in sorted(self.temp_dir.glob(f"session_*/logs/{name}")):
                text = path.read_text(errors="replace").strip()
                if text:
                    parts.append(f"--- {path.relative_to(self.temp_dir)} ---\n{text[-chars:]}")
        return "\n".join(parts) or f"(no head logs under {self.temp_dir})"


def _run(cmd: list[str], head: RayHead, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """A driver in its own process; if it fails or hangs, the failure shows its output and the head's logs
    (a driver once failed for 300 s to reach a head's GCS, and said nothing else)."""
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=_ray_env(), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        err = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        pytest.fail(f"{cmd[2:4]} ran past {timeout_s:g}s:\n{out[-1500:]}\n{err[-3000:]}\n{head.logs()}")
    assert proc.returncode == 0, f"{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}\n{head.logs()}"
    return proc


@pytest.fixture(scope="module")
def ray_head() -> Iterator[RayHead]:
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
        yield RayHead(address, Path(tmp))
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


def test_rollouts_run_on_an_existing_ray_cluster(ray_head: RayHead, llm_server: LLMTestServer, sq: TraceStore,
                                                slowness: float) -> None:
    url = sq.url.render_as_string(hide_password=False)
    proc = _run([sys.executable, "-m", "tests.controller.ray_cluster_driver", ray_head.address, url,
                 llm_server.base_url, str(2.0 * slowness)], ray_head, DRIVER_S * slowness)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    results = out["results"]
    assert all(status == "succeeded" and reward == 1.0 for tid, status, reward, *_ in results if tid != "t2"), results
    assert [status for tid, status, *_ in results if tid == "t2"] == ["timeout", "timeout"], results
    assert all(len(sq.calls(rid)) >= 1 for _, _, _, rid, *_ in results)
    assert out["nodes"] == [True]  # the head we started, not a fresh local runtime
    assert out["driver"] not in out["pids"] and len(set(out["pids"])) == 2


def test_the_cli_joins_the_cluster_by_address(ray_head: RayHead, llm_server: LLMTestServer, sq: TraceStore,
                                              tmp_path: Path, slowness: float) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in A.make_tasks(llm_server, sq, 2)))
    proc = _run([sys.executable, "-m", "lightning_middleware.cli", "rollouts", "run", "--agent",
                 "tests.controller.controller_agents:tool_agent", "--tasks", str(tasks), "-n", "2",
                 "--store", sq.url.render_as_string(hide_password=False), "--backend", "ray",
                 "--ray-address", ray_head.address, "--workers", "2"], ray_head, DRIVER_S * slowness)
    assert "4 rollouts" in proc.stdout and "succeeded=4" in proc.stdout
    assert len(sq.query_rollouts(status="succeeded")) == 4
