"""A background WAL checkpointer for a SQLite store's writer.

In WAL mode every page is written twice: to the WAL at commit, then into the database by a
checkpoint. SQLite runs that checkpoint inline, in the commit that takes the WAL past
`wal_autocheckpoint` pages, so the batch writer thread copied the WAL back (~3.5 us of its
~21 us a span in bench/bench_store.py) while holding up the next batch. Here a thread of its
own, with its own connection, runs a PASSIVE checkpoint (it never blocks the writer or a
reader) after each batch; the sqlite3 module releases the GIL meanwhile, so on a second core
it overlaps the writer's next batch. SQLite's own autocheckpoint stays as the safety net
(connect.py: a batch of 5,000 spans fits under it), so a store without this thread (a process
that only reads, or writes directly) checkpoints as before.
"""

from __future__ import annotations

import logging
import sqlite3
import threading

log = logging.getLogger(__name__)


class Checkpointer:
    """Checkpoints `path` in the background each time `kick()` is called (and every `idle_s`)."""

    def __init__(self, path: str, idle_s: float = 1.0) -> None:
        self._path, self._idle_s = path, idle_s
        self._kicked = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning-wal-checkpoint", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        """A batch was committed: checkpoint it when the thread is free."""
        self._kicked.set()

    def close(self, timeout: float | None = 10.0) -> None:
        self._stop.set()
        self._kicked.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self._path, timeout=10, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:  # the writer goes on; SQLite's autocheckpoint does the work
            log.warning("background WAL checkpoints are off for %s: %s", self._path, exc)
            return
        try:
            while not self._stop.is_set():
                self._kicked.wait(self._idle_s)
                self._kicked.clear()
                self._checkpoint(conn)
        finally:
            conn.close()

    @staticmethod
    def _checkpoint(conn: sqlite3.Connection) -> None:
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:  # busy, or the file went away: the next batch tries again
            log.debug("WAL checkpoint skipped: %s", exc)
