"""Store ingestion: spans/s through the background writer into SQLite and PostgreSQL, in one run.

Each span is a realistic chat call: ~1 KB of request JSON, a 400-token prompt,
a 60-token completion with logprobs. Spans are submitted as fast as one
producer thread can, then flushed; the rate counts until everything is on disk.
PostgreSQL runs durable (fsync on) from the Debian package on loopback.

    python bench/bench_store.py [--spans 50000] [--engines sqlite,postgres] [--rounds 1]

With --rounds N each engine is measured N times and the best and median are printed (on a
shared machine the best is the least disturbed run).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_middleware import LLMCall, TraceStore  # noqa: E402
from lightning_middleware.records import new_id  # noqa: E402
from lightning_middleware.testing import PostgresTestServer  # noqa: E402


def _spans(n: int) -> list[LLMCall]:
    rng = random.Random(0)
    prompt = tuple(rng.randrange(150_000) for _ in range(400))
    completion = tuple(rng.randrange(150_000) for _ in range(60))
    logprobs = tuple(-rng.random() for _ in range(60))
    request = {"model": "m", "temperature": 1.0, "messages": [
        {"role": "system", "content": "You are an agent. " * 10},
        {"role": "user", "content": "Solve the task and report the answer. " * 12}]}
    response = {"id": "chatcmpl-1", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "The answer is 42. " * 5}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 400, "completion_tokens": 60, "total_tokens": 460}}
    now = time.time()
    return [LLMCall(id=new_id(), rollout_id=f"r{i // 8}", call_index=i % 8, request=request,
                    response=response, prompt_token_ids=prompt, completion_token_ids=completion,
                    logprobs=logprobs, status_code=200, is_training=True, started_at=now, latency_s=0.01)
            for i in range(n)]


def _ingest(store: TraceStore, spans: list[LLMCall]) -> tuple[float, float, float]:
    """(spans/s, the producer's submit us/span, this process's CPU us/span: every thread)."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    for s in spans:
        store.submit_call(s)
    t_submit = time.perf_counter() - t0
    assert store.flush(600), "flush timed out"
    total = time.perf_counter() - t0
    cpu = time.process_time() - c0
    assert store.count("llm_calls") == len(spans)
    return len(spans) / total, t_submit / len(spans) * 1e6, cpu / len(spans) * 1e6


def _sqlite(spans: list[LLMCall]) -> tuple[float, float, float]:
    store = TraceStore(f"sqlite:///{tempfile.mkdtemp()}/bench.db")
    try:
        return _ingest(store, spans)
    finally:
        store.close()


def _postgres(spans: list[LLMCall]) -> tuple[float, float, float]:
    with PostgresTestServer(durable=True) as pg:
        store = TraceStore(pg.url)
        try:
            return _ingest(store, spans)
        finally:
            store.close()


ENGINES = {"sqlite": ("sqlite (WAL, synchronous=NORMAL)", _sqlite), "postgres": ("postgresql 15 (fsync on)", _postgres)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spans", type=int, default=50_000)
    ap.add_argument("--engines", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    ap.add_argument("--rounds", type=int, default=1, help="measure each engine this many times")
    args = ap.parse_args()
    spans = _spans(args.spans)
    results: dict[str, list[tuple[float, float, float]]] = {}
    for _ in range(args.rounds):
        for key in args.engines.split(","):
            name, run = ENGINES[key.strip()]
            results.setdefault(name, []).append(run(spans))
    print(f"store ingestion, {args.spans} spans (400+60 tokens, logprobs, ~1.3 KB JSON each), one producer")
    print(f"{'engine':36s} {'spans/s':>10s} {'median':>10s} {'submit us/span':>15s} {'cpu us/span':>12s}  all runs")
    for name, runs in results.items():
        best = max(runs)
        print(f"{name:36s} {best[0]:10.0f} {statistics.median(r[0] for r in runs):10.0f} {best[1]:15.1f} "
              f"{min(r[2] for r in runs):12.1f}  " + " ".join(f"{r[0]:.0f}" for r in runs))
    if len(results) == 2:
        (a, ra), (b, rb) = results.items()
        print(f"ratio {a.split()[0]}/{b.split()[0]}: {max(ra)[0] / max(rb)[0]:.2f}")


if __name__ == "__main__":
    main()
