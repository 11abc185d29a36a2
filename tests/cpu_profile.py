"""Where a test run's CPU goes, test by test (a pytest plugin module, loaded on demand).

    .venv/bin/python -m pytest -p tests.cpu_profile --cpu-profile=cpu.json -m "not vllm and not demo and not browser"

For each test (setup, call and teardown together) it records the machine's busy CPU-seconds
(`/proc/stat`: every process, so the servers, pods and compilers a test starts count with it),
pytest's own process CPU and the wall time, writes them as JSON, and prints the modules that took
the most. Run it serially on an otherwise quiet machine: the machine-wide figure counts whatever
else runs, and under xdist each worker would count the others' tests too (it refuses to run there).
The quick tier's profile on each CPU kind is in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


class CpuRow(NamedTuple):
    nodeid: str
    busy_s: float  # the whole machine's
    own_s: float  # pytest's process
    wall_s: float


def machine_busy_s() -> float:
    """CPU-seconds every core has spent running something since boot: user, nice, system, irq and
    softirq (not idle or I/O wait; not steal, the hypervisor's; guest time is in user already)."""
    with open("/proc/stat", encoding="ascii") as f:
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / _TICKS_PER_S


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-profile", metavar="FILE", default="cpu-profile.json",
                     help="where tests.cpu_profile writes each test's CPU (JSON)")


_rows: list[CpuRow] = []


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError("tests.cpu_profile counts the whole machine: run it without -n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    busy, own, wall = machine_busy_s(), time.process_time(), time.monotonic()
    yield
    _rows.append(CpuRow(item.nodeid, machine_busy_s() - busy, time.process_time() - own, time.monotonic() - wall))


def by_module(rows: list[CpuRow]) -> list[tuple[str, float, float, float, int]]:
    """(module, busy, own, wall, tests), the busiest first."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for row in rows:
        acc = sums[row.nodeid.split("::", 1)[0]]
        acc[0] += row.busy_s
        acc[1] += row.own_s
        acc[2] += row.wall_s
        acc[3] += 1
    return sorted(((m, b, o, w, int(n)) for m, (b, o, w, n) in sums.items()), key=lambda r: -r[1])


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    if not _rows:
        return
    path = Path(config.getoption("--cpu-profile"))
    path.write_text(json.dumps([row._asdict() for row in _rows], indent=0))
    busy = sum(r.busy_s for r in _rows)
    own = sum(r.own_s for r in _rows)
    tr = terminalreporter
    tr.write_sep("-", f"CPU by module: {busy:.0f} s busy in all, {own:.0f} s of it pytest's own ({path})")
    tr.write_line(f"{'module':60s} {'busy s':>8s} {'own s':>7s} {'wall s':>7s} {'tests':>5s}")
    for module, b, o, w, n in by_module(_rows)[:20]:
        tr.write_line(f"{module:60s} {b:8.1f} {o:7.1f} {w:7.1f} {n:5d}")
