"""tests/workers.py and tests/leaks.py under two pytest-xdist workers, as scripts/test.sh runs the
suite: grouped tests share a worker, a lost grouping stops the run, and a leak fails the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.planted import run_pytest

ROOT = Path(__file__).resolve().parent.parent

# Two tests that share the tiny vLLM server (a stand-in fixture of the same name: the grouping rule
# reads fixture names), and ten that may go anywhere; each records the worker it ran on.
GROUPED = '''
import json, os, time
from pathlib import Path

import pytest

OUT = Path(__file__).parent / "ran.jsonl"


@pytest.fixture(scope="session")
def vllm_server():
    return "stand-in"


def _record(name):
    with OUT.open("a") as f:
        f.write(json.dumps({"test": name, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                            "id": os.environ.get("PYTEST_CURRENT_TEST")}) + "\\n")


def test_server_a(vllm_server):
    _record("a")
    time.sleep(0.3)


@pytest.mark.parametrize("i", range(10))
def test_elsewhere(i):
    _record(f"x{i}")
    time.sleep(0.3)


def test_server_b(vllm_server):
    _record("b")
'''

# A module whose tests share a module-scoped fixture (each worker running one of them would build it).
MODULE_SCOPED = '''
import pytest
from test_grouped import _record


@pytest.fixture(scope="module")
def built():
    return "once"


@pytest.mark.parametrize("i", range(3))
def test_uses_it(built, i):
    _record(f"m{i}")


@pytest.fixture(scope="module")
def model_dir():  # tests/workers.py's PER_WORKER: built on each worker, its module not grouped
    return "cheap"


@pytest.mark.parametrize("i", range(6))
def test_uses_a_cheap_one(model_dir, i):
    _record(f"c{i}")
'''

# What pytest 9.2 does to xdist's group suffix (the id is kept elsewhere), planted after xdist.
LOSES_THE_GROUP = '''
import pytest


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    for item in items:
        item._nodeid = item._nodeid.partition("@")[0]
'''

LEAKS = '''
import socket, threading, time

KEPT = []


def test_leaves_a_thread_and_a_socket():
    threading.Thread(target=time.sleep, args=(4,), name="left-behind").start()  # outlives the check's grace
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    KEPT.append(s)


def test_clean():
    pass
'''

CLEAN = "def test_one():\n    pass\n\n\ndef test_two():\n    pass\n"


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_pytest(folder, "-p", "xdist", *args, env={"LIGHTNING_TEST_LEAKS_GRACE_S": "1"})


def test_tests_sharing_a_server_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_module_scoped.py").write_text(MODULE_SCOPED)
    run = _pytest(tmp_path, "-p", "tests.workers", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "ran.jsonl").read_text().splitlines()]
    ran = {r["test"]: r["worker"] for r in records}
    assert len(ran) == 21 and ran["a"] is not None
    assert ran["a"] == ran["b"], ran
    assert ran["m0"] == ran["m1"] == ran["m2"], ran
    assert len(set(ran.values())) == 2, ran  # both workers ran tests: the check above is not vacuous
    # scheduled by group where grouped (xdist's `@group` in the id), and a PER_WORKER fixture groups nothing
    grouped = {r["test"] for r in records if "@" in r["id"].split(" ")[0]}
    assert grouped == {"a", "b", "m0", "m1", "m2"}, records


def test_a_lost_grouping_stops_the_run_on_one_line(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "conftest.py").write_text(LOSES_THE_GROUP)
    run = _pytest(tmp_path, "-p", "tests.workers", "-n", "2", "--dist", "loadgroup")
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    assert "--dist loadgroup did not group 2 tests" in out and "test_server_a" in out, out[-3000:]
    ran = (tmp_path / "ran.jsonl").read_text().splitlines() if (tmp_path / "ran.jsonl").exists() else []
    assert len(ran) <= 2, ran  # each worker stops after the test it had begun, at most


def test_a_leak_fails_the_run_serially_and_under_two_workers(tmp_path: Path) -> None:
    (tmp_path / "test_leaks.py").write_text(LEAKS)
    for args in ((), ("-n", "2")):
        run = _pytest(tmp_path, "-p", "tests.leaks", *args)
        out = run.stdout
        assert run.returncode == 1, f"{args}: {out[-3000:]}"
        assert "2 passed" in out, out[-3000:]  # the tests pass: the exit code is the check's
        assert "non-daemon thread 'left-behind' (started by test_leaks.py::test_leaves_a_thread_and_a_socket)" in out
        assert "socket listening on 127.0.0.1:" in out, out[-3000:]
        if args:
            assert "[gw" in out, out[-3000:]  # named with the worker that found it


def test_a_clean_run_under_two_workers_passes_the_check(tmp_path: Path) -> None:
    (tmp_path / "test_clean.py").write_text(CLEAN)
    run = _pytest(tmp_path, "-p", "tests.leaks", "-n", "2")
    assert run.returncode == 0 and "left running" not in run.stdout, run.stdout[-3000:]


def test_the_quick_tier_leaves_out_vllm_demos_and_browsers() -> None:
    from tests.workers import DEMOS, QUICK

    # The files the assertions name, not the whole suite: the markers are added item by item, so the
    # selection of these files is theirs in any collection (and the whole suite's costs ~15 s of CPU).
    vllm_test, browser_test, test_of_this = ("tests/faults/test_vllm_kill.py::test_vllm_killed_mid_rollout",
                                             "tests/rewards/test_review_page.py::test_review_page_on_the_gateway",
                                             "tests/test_workers.py::test_the_quick_tier_leaves_out_vllm_demos_and_browsers")
    files = sorted({name.partition("::")[0] for name in (*DEMOS, vllm_test, browser_test, test_of_this)})
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", QUICK,
                          *files, "tests/store/test_store.py"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    quick = {line for line in run.stdout.splitlines() if "::" in line}
    assert test_of_this in quick
    assert not quick & set(DEMOS)
    # vllm added from the fixture (this test has no marker of its own), browser from the test's own
    assert vllm_test not in quick and browser_test not in quick
    assert "tests/store/test_store.py" in {line.partition("::")[0] for line in quick}


class _Item:
    """What the ordering hook reads of a collected test: its id, fixtures and markers."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid, self.fixturenames, self.markers = nodeid, (), []

    def add_marker(self, marker) -> None:
        self.markers.append(marker.mark if hasattr(marker, "mark") else marker)


def test_the_smollm2_demos_open_the_collection_and_the_tiny_models_close_it() -> None:
    from tests.workers import DEMOS, SMOL_DEMOS, TINY_DEMOS, pytest_collection_modifyitems

    assert set(SMOL_DEMOS) | set(TINY_DEMOS) == set(DEMOS) and not set(SMOL_DEMOS) & set(TINY_DEMOS)
    others = ["tests/store/test_store.py::test_a", "tests/controller/test_controller_ray.py::test_b",
              "tests/test_cli.py::test_c"]
    items = [_Item(n) for n in (others[0], DEMOS[3], others[1], DEMOS[0], DEMOS[2], others[2], DEMOS[1])]
    pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [*SMOL_DEMOS, *others, *TINY_DEMOS]

    def groups(item: _Item) -> set[str]:
        return {m.kwargs.get("name", m.args[0] if m.args else "") for m in item.markers if m.name == "xdist_group"}

    by_id = {i.nodeid: i for i in items}
    assert [groups(by_id[n]) for n in DEMOS] == [{"demo"}, {"demo"}, {"demo-tiny"}, {"demo-tiny"}]
    assert all("demo" in {m.name for m in by_id[n].markers} for n in DEMOS)
    assert groups(by_id[others[1]]) == {"ray"} and groups(by_id[others[0]]) == set()
