"""Where the SQLite writer's time goes: the writer loop as the store runs it (build the rows,
`executemany`, commit) on bench_store.py's spans, with WAL checkpoints inline (SQLite's own
autocheckpoint at its default 1000 pages, the store before the background checkpointer) or on a
background thread (what store/checkpoint.py does). Prints wall spans/s and the writer thread's
CPU per span (its critical path), each variant interleaved, best of the rounds; each run ends
with a full checkpoint inside the wall time, so deferring checkpoints is no gain.

    python bench/bench_store_parts.py [--spans 50000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_store import _spans  # noqa: E402

from lightning_middleware import LLMCall, TraceStore  # noqa: E402
from lightning_middleware.store import mapping as M  # noqa: E402

BATCH = 5000  # the writer's max_batch


def _background(path: str, stop: threading.Event, kick: threading.Event) -> None:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    while not stop.is_set():
        kick.wait(0.05)
        kick.clear()
        conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    conn.close()


def run(spans: list[LLMCall], background: bool) -> tuple[float, float]:
    """(spans/s, writer-thread CPU us a span)."""
    path = f"{tempfile.mkdtemp()}/parts.db"
    TraceStore(f"sqlite:///{path}").close()  # the schema and page size, as the store makes them
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(f"PRAGMA wal_autocheckpoint={8192 if background else 1000}")
    stop, kick = threading.Event(), threading.Event()
    thread = threading.Thread(target=_background, args=(path, stop, kick), daemon=True)
    if background:
        thread.start()
    t0, c0 = time.perf_counter(), time.thread_time()
    for i in range(0, len(spans), BATCH):
        rows = [M.call_tuple(c) for c in spans[i:i + BATCH]]
        conn.execute("BEGIN")
        conn.executemany(M.INSERT_CALLS_QMARK, rows)
        conn.execute("COMMIT")
        kick.set()
    cpu = time.thread_time() - c0
    stop.set()
    kick.set()
    if background:
        thread.join()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    wall = time.perf_counter() - t0
    conn.close()
    return len(spans) / wall, cpu / len(spans) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    spans = _spans(args.spans)
    t = time.perf_counter()
    for c in spans:
        M.call_tuple(c)
    print(f"building rows: {(time.perf_counter() - t) / len(spans) * 1e6:.1f} us a span")
    results: dict[str, list[tuple[float, float]]] = {"inline checkpoints": [], "background checkpoints": []}
    for _ in range(args.rounds):
        for name, background in (("inline checkpoints", False), ("background checkpoints", True)):
            results[name].append(run(spans, background))
    for name, runs in results.items():
        print(f"{name:24s} spans/s best {max(r for r, _ in runs):8.0f}   writer-thread CPU us a span, best "
              f"{min(c for _, c in runs):5.1f}   all " + " ".join(f"{r:.0f}/{c:.1f}" for r, c in runs))


if __name__ == "__main__":
    main()
