"""A background batched writer: an agent's LLM call never waits on disk.

Producers (the capture transport, `rollout()`) append operations to an in-memory
buffer and return at once. One daemon thread takes whatever has accumulated,
at most every `interval_s`, and applies it in one transaction. If the database
is unavailable the batch stays at the head of the buffer and is retried with
backoff, so nothing is lost while it comes back.

Durability trade-off (documented in README): an operation is on disk once
`flush()` returns or about `interval_s` after it was submitted. If the agent
process is killed (kill -9), operations still buffered are lost: at most
`interval_s` worth, or everything since the database went away. `flush()` runs
at every rollout end and at interpreter exit. The buffer is bounded
(`max_buffer` operations); past that new operations are dropped, counted in
`stats().dropped` and logged, never silently.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

Op = tuple[str, Any]  # (kind, payload): the apply function knows what each kind carries


@dataclass(frozen=True)
class WriterStats:
    submitted: int
    written: int
    dropped: int
    rejected: int
    pending: int
    failures: int
    last_error: str | None


class BatchWriter:
    def __init__(
        self,
        apply: Callable[[Sequence[Op]], None],
        *,
        is_transient: Callable[[BaseException], bool] = lambda exc: True,
        interval_s: float = 0.05,
        max_batch: int = 5000,
        max_buffer: int = 200_000,
        name: str = "lightning-writer",
    ) -> None:
        self._apply = apply
        self._is_transient = is_transient
        self._interval_s = interval_s
        self._max_batch = max_batch
        self._max_buffer = max_buffer
        self._buffer: collections.deque[tuple[int, Op]] = collections.deque()
        self._cond = threading.Condition()
        self._seq = 0  # sequence number of the last submitted op
        self._written_seq = 0  # every op with seq <= this is on disk (or dropped)
        self._written = 0
        self._dropped = 0
        self._failures = 0
        self._rejected = 0
        self._last_error: str | None = None
        self._flush_requested = False
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _live_writers.add(self)

    # -- producer side -------------------------------------------------------
    def submit(self, kind: str, payload: Any) -> bool:
        """Queue one operation. Never blocks on I/O; returns False if it was dropped."""
        with self._cond:
            if len(self._buffer) >= self._max_buffer:
                self._dropped += 1
                if self._dropped == 1 or self._dropped % 1000 == 0:
                    log.warning(
                        "trace buffer full (%d ops, store unavailable: %s); dropped %d ops so far",
                        self._max_buffer, self._last_error, self._dropped,
                    )
                return False
            self._seq += 1
            self._buffer.append((self._seq, (kind, payload)))
            # Wake the writer when the buffer stops being empty (it then waits up to interval_s
            # for more) or fills a batch; not on every op, which would cost a wake-up per call.
            if len(self._buffer) == 1 or len(self._buffer) >= self._max_batch:
                self._cond.notify_all()
            return True

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until everything submitted so far is written. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            target = self._seq
            self._flush_requested = True
            self._cond.notify_all()
            while self._written_seq < target:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    def stats(self) -> WriterStats:
        with self._cond:
            return WriterStats(
                submitted=self._seq,
                written=self._written,
                dropped=self._dropped,
                rejected=self._rejected,
                pending=len(self._buffer),
                failures=self._failures,
                last_error=self._last_error,
            )

    def close(self, timeout: float | None = 10.0) -> bool:
        ok = self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)
        _live_writers.discard(self)
        return ok

    # -- the writer thread ---------------------------------------------------
    def _take_batch(self) -> list[tuple[int, Op]]:
        with self._cond:
            while not self._buffer and not self._stopping:
                self._flush_requested = False
                self._cond.wait()
            if not self._buffer:
                return []
            # Let a batch accumulate unless someone is waiting or it is full already.
            if not self._flush_requested and len(self._buffer) < self._max_batch and not self._stopping:
                self._cond.wait(self._interval_s)
            n = min(len(self._buffer), self._max_batch)
            return [self._buffer[i] for i in range(n)]

    def _run(self) -> None:
        backoff = 0.05
        while True:
            batch = self._take_batch()
            if not batch:
                return  # stopping and drained
            try:
                self._apply([op for _, op in batch])
            except Exception as exc:
                if not self._is_transient(exc):
                    # A bad operation (not a bad database): apply one by one so a
                    # single poisoned op can't hold back everything behind it.
                    self._apply_one_by_one(batch)
                    self._mark_written(batch)
                    continue
                if not self._retry_later(exc, backoff):
                    return
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.05
            self._mark_written(batch)

    def _apply_one_by_one(self, batch: list[tuple[int, Op]]) -> None:
        for _, op in batch:
            try:
                self._apply([op])
            except Exception as exc:
                with self._cond:
                    self._rejected += 1
                log.error("trace store rejected a %s op (%s: %s); it is not stored", op[0], type(exc).__name__, exc)

    def _retry_later(self, exc: BaseException, backoff: float) -> bool:
        with self._cond:
            self._failures += 1
            self._last_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
            stopping = self._stopping
        if stopping and self._failures > 3:
            log.error("giving up on %d buffered trace ops at shutdown (%s)", len(self._buffer), self._last_error)
            return False
        log.warning("trace store write failed (%s); retrying in %.2fs", self._last_error, backoff)
        time.sleep(backoff)
        return True

    def _mark_written(self, batch: list[tuple[int, Op]]) -> None:
        with self._cond:
            for _ in batch:
                self._buffer.popleft()
            self._written += len(batch)
            self._written_seq = batch[-1][0]
            if not self._buffer:
                self._flush_requested = False
            self._cond.notify_all()


_live_writers: weakref.WeakSet[BatchWriter] = weakref.WeakSet()


@atexit.register
def _flush_at_exit() -> None:
    for writer in list(_live_writers):
        if not writer.flush(timeout=5.0):
            st = writer.stats()
            log.error("exiting with %d trace ops unwritten (last error: %s)", st.pending, st.last_error)
