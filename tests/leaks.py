"""What a test leaves running (a pytest plugin module: the root conftest loads it).

A test that leaves a thread, a child process or a listening socket behind slows every test
after it and can fail one far away (a trainer's lease heartbeat logging against a database
dropped minutes ago). Each test's new threads and child processes are attributed to it as it
ends; once the session is done (its fixtures torn down), what is still running fails the run,
named with the test that started it:

- a non-daemon thread (it would keep the interpreter alive), except a thread pool's idle workers
  (concurrent.futures joins them at exit: litellm keeps one for its logging);
- a trainer's lease thread (`lease-*`);
- a child process, except the interpreter's own helpers in EXPECTED_CHILDREN;
- a socket this process still listens on.

Under pytest-xdist each worker checks itself and sends what it found to the controller, which fails
the run (a worker's own exit status is not the run's).

The other daemon threads of ours (a store's writer and WAL checkpointer: stores the tests never
closed) are listed, not failed: a follow-up to close them (docs/benchmarks.md counts them).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
import pytest

# Daemon threads our own code starts; any other library's daemon threads (asyncio's executor,
# urllib3's pool) may outlive their test without harm. Those in FAILING fail the run.
OUR_THREADS = ("lease-", "lightning-", "k8s-", "demo-", "rollout-")
FAILING = ("lease-",)
# Children that live as long as this process by design and end with it: Python's multiprocessing
# resource tracker, and W&B's service process (it watches our pid) with its system monitor (it
# watches the service's).
EXPECTED_CHILDREN = ("multiprocessing.resource_tracker", "wandb-core", "wandb-symon")
# Threads, children and sockets get this long to end after the last teardown (tests/test_workers.py
# plants leaks with a shorter one).
GRACE_S = float(os.environ.get("LIGHTNING_TEST_LEAKS_GRACE_S", "5"))


@dataclass
class _Ledger:
    """Which test started each thread and child process still running."""

    threads: dict[int, str] = field(default_factory=dict)
    children: dict[int, str] = field(default_factory=dict)


_ledger = _Ledger()


@dataclass
class _Reported:
    """On an xdist controller: what the workers' checks found."""

    failing: list[str] = field(default_factory=list)
    listed: list[str] = field(default_factory=list)


_reported = _Reported()
WORKER_KEY = "lightning_leaks"
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


def _pool_worker(t: threading.Thread) -> bool:
    return getattr(getattr(t, "_target", None), "__module__", "") == "concurrent.futures.thread"


def _leftovers() -> tuple[list[str], list[str]]:
    """(what fails the run, what is only listed)."""
    main = threading.main_thread()
    failing, listed = [], []
    for t in threading.enumerate():
        if t is main or not t.is_alive() or _pool_worker(t):
            continue
        started = _ledger.threads.get(t.ident or 0, "the session")
        if not t.daemon:
            failing.append(f"non-daemon thread {t.name!r} (started by {started})")
        elif t.name.startswith(FAILING):
            failing.append(f"daemon thread {t.name!r} (started by {started})")
        elif t.name.startswith(OUR_THREADS):
            listed.append(f"daemon thread {t.name!r} (started by {started})")
    for pid, p in _children().items():
        try:
            cmd = " ".join(p.cmdline())[:160]
        except psutil.Error:
            cmd = "?"
        if not any(name in cmd for name in EXPECTED_CHILDREN):
            failing.append(f"child process {pid} `{cmd}` (started by {_ledger.children.get(pid, 'the session')})")
    for c in _me.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN:
            failing.append(f"socket listening on {c.laddr.ip}:{c.laddr.port}")
    return failing, listed


def _report(session: pytest.Session, failing: list[str], listed: list[str]) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    for title, found, red in (("left running", failing, True), ("left running (listed, not failed)", listed, False)):
        if found and reporter is not None:
            reporter.section(title, sep="=", red=red, yellow=not red)
            reporter.write_line("tests left these running after the session's teardown:")
            for line in found:
                reporter.write_line(f"  {line}")
    if failing:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _controller(config: pytest.Config) -> bool:
    """Whether this process hands the tests to pytest-xdist workers and runs none itself."""
    return config.pluginmanager.get_plugin("dsession") is not None


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    # On the controller, as each worker ends: what its own check found (sent by the worker below).
    found = getattr(node, "workeroutput", {}).get(WORKER_KEY)
    if found:
        worker = node.gateway.id
        _reported.failing.extend(f"[{worker}] {line}" for line in found["failing"])
        _reported.listed.extend(f"[{worker}] {line}" for line in found["listed"])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if config.option.collectonly or os.environ.get("LIGHTNING_TEST_LEAKS") == "off":
        return
    if _controller(config):
        # Every worker has ended (pytest_testnodedown) before the controller's session finishes.
        _report(session, _reported.failing, _reported.listed)
        return
    deadline = time.monotonic() + GRACE_S
    failing, listed = _leftovers()
    while (failing or listed) and time.monotonic() < deadline:
        time.sleep(0.2)
        failing, listed = _leftovers()
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        # A worker's exit status is not the run's: the controller reads this after the hook (xdist
        # sends workeroutput once every pytest_sessionfinish has run) and fails the run itself.
        workeroutput[WORKER_KEY] = {"failing": failing, "listed": listed}
        return
    _report(session, failing, listed)
