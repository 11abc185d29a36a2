"""What a test leaves running (a pytest plugin module: the root conftest loads it).

A test that leaves a thread, a child process or a listening socket behind slows every test
after it and can fail one far away (a trainer's lease heartbeat logging against a database
dropped minutes ago). Each test's new threads and child processes are attributed to it as it
ends; once the session is done (its fixtures torn down), whatever is still running fails the
run, named with the test that started it:

- a non-daemon thread (it would keep the interpreter alive),
- a daemon thread of ours (the names in OUR_THREADS: a trainer's lease, a store writer, a gateway...),
- a child process, or a socket this process still listens on.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import pytest

# Daemon threads our own code starts; any other library's daemon threads (asyncio's executor,
# urllib3's pool) may outlive their test without harm.
OUR_THREADS = ("lease-", "lightning-", "k8s-", "demo-", "rollout-")
# Threads, children and sockets get this long to end after the last teardown.
GRACE_S = 5.0


@dataclass
class _Ledger:
    """Which test started each thread and child process still running."""

    threads: dict[int, str] = field(default_factory=dict)
    children: dict[int, str] = field(default_factory=dict)


_ledger = _Ledger()
_me = psutil.Process(os.getpid())


def _children() -> dict[int, psutil.Process]:
    out = {}
    for p in _me.children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = p
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    threads = {t.ident for t in threading.enumerate()}
    children = set(_children())
    yield
    for t in threading.enumerate():
        if t.ident not in threads and t.ident is not None:
            _ledger.threads.setdefault(t.ident, item.nodeid)
    for pid in set(_children()) - children:
        _ledger.children.setdefault(pid, item.nodeid)


def _leftovers() -> list[str]:
    main = threading.main_thread()
    found = []
    for t in threading.enumerate():
        if t is main or not t.is_alive():
            continue
        if not t.daemon or t.name.startswith(OUR_THREADS):
            kind = "daemon thread" if t.daemon else "non-daemon thread"
            found.append(f"{kind} {t.name!r} (started by {_ledger.threads.get(t.ident or 0, 'the session')})")
    for pid, p in _children().items():
        try:
            cmd = " ".join(p.cmdline())[:160]
        except psutil.Error:
            cmd = "?"
        found.append(f"child process {pid} `{cmd}` (started by {_ledger.children.get(pid, 'the session')})")
    for c in _me.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN:
            found.append(f"socket listening on {c.laddr.ip}:{c.laddr.port}")
    return found


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if session.config.option.collectonly or os.environ.get("LIGHTNING_TEST_LEAKS") == "off":
        return
    deadline = time.monotonic() + GRACE_S
    found = _leftovers()
    while found and time.monotonic() < deadline:
        time.sleep(0.2)
        found = _leftovers()
    if not found:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = ["tests left these running after the session's teardown:", *(f"  {f}" for f in found)]
    if reporter is not None:
        reporter.section("left running", sep="=", red=True)
        for line in lines:
            reporter.write_line(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
