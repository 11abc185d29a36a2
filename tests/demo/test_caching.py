"""trainer_backend.caching: two processes that miss one cache build it once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BUILDER = """
import sys, time
from pathlib import Path
from trainer_backend.caching import build_lock

out = Path(sys.argv[1])
if not (out / ".done").exists():
    with build_lock(out):
        if not (out / ".done").exists():
            with open(out.parent / "builds.log", "a") as log:
                log.write(sys.argv[2] + " start\\n")
            time.sleep(1.0)
            out.mkdir()
            (out / ".done").write_text("ok")
            with open(out.parent / "builds.log", "a") as log:
                log.write(sys.argv[2] + " end\\n")
print("ready", (out / ".done").read_text())
"""


def test_a_second_process_waits_for_the_first_build_and_reuses_it(tmp_path: Path) -> None:
    out = tmp_path / "cache" / "model"
    t0 = time.monotonic()  # before the launches: the first builder's sleep may start before the second's Popen returns
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(out), name], stdout=subprocess.PIPE, text=True)
             for name in ("a", "b")]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs) and outputs == ["ready ok\n"] * 2
    lines = (tmp_path / "cache" / "builds.log").read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith("start") and lines[1].endswith("end"), lines  # one build
    assert time.monotonic() - t0 >= 1.0


def test_the_lock_is_released_when_its_holder_dies(tmp_path: Path) -> None:
    out = tmp_path / "model"
    hold = ("import sys, time\nfrom trainer_backend.caching import build_lock\n"
            "with build_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        holder.kill()
        holder.wait(timeout=10)
    finally:
        if holder.poll() is None:
            holder.kill()
        if holder.stdout is not None:
            holder.stdout.close()
    from trainer_backend.caching import build_lock

    with build_lock(out):  # not left locked by a killed build
        pass
