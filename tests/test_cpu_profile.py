"""tests/cpu_profile.py: each test's CPU, its children's included, from a planted suite."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.cpu_profile import CpuRow, by_module
from tests.planted import run_pytest

PLANTED = '''
import subprocess, sys, time


def _spin(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_in_process():
    _spin(0.4)


def test_in_a_child():
    subprocess.run([sys.executable, "-c",
                    "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"],
                   check=True)


def test_waits():
    time.sleep(0.3)
'''


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_pytest(folder, "-p", "tests.cpu_profile", *args, timeout=120)


def test_each_test_gets_its_own_and_its_childrens_cpu(tmp_path: Path) -> None:
    (tmp_path / "test_planted.py").write_text(PLANTED)
    out = tmp_path / "cpu.json"
    run = _pytest(tmp_path, f"--cpu-profile={out}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["nodeid"].split("::")[1]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"test_in_process", "test_in_a_child", "test_waits"}
    own, child, waits = rows["test_in_process"], rows["test_in_a_child"], rows["test_waits"]
    assert own["own_s"] >= 0.35 and own["busy_s"] >= 0.35, own
    # the child's CPU is the machine's, not pytest's (0.6 s spun, plus its interpreter's start)
    assert child["busy_s"] >= 0.55 and child["own_s"] < 0.2, child
    assert waits["wall_s"] >= 0.3 and waits["own_s"] < 0.1, waits
    assert "CPU by module:" in run.stdout and "test_planted.py" in run.stdout, run.stdout[-2000:]


def test_it_refuses_workers(tmp_path: Path) -> None:
    (tmp_path / "test_planted.py").write_text("def test_one():\n    pass\n")
    run = _pytest(tmp_path, "-p", "xdist", "-n", "2")
    assert run.returncode != 0
    assert "run it without -n" in run.stdout + run.stderr, run.stdout[-2000:] + run.stderr[-2000:]


def test_modules_are_summed_and_the_busiest_comes_first() -> None:
    rows = [CpuRow("a.py::t1", 1.0, 0.5, 2.0), CpuRow("b.py::t1", 3.0, 0.1, 1.0), CpuRow("a.py::t2", 1.5, 0.5, 1.0)]
    assert by_module(rows) == [("b.py", 3.0, 0.1, 1.0, 1), ("a.py", 2.5, 1.0, 3.0, 2)]
