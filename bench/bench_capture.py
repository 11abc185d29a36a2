"""Capture overhead: the same calls with a bare openai client and a wrap()ed one, interleaved.

Both clients talk to the same deterministic loopback server (a separate
process). Calls alternate bare / wrapped so machine noise hits both alike.
Prints per-call p50 / p99 for each, the added microseconds and the ratio.

    python bench/bench_capture.py [--calls 2000] [--stream]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import openai  # noqa: E402

from lightning_middleware import TraceStore, rollout, wrap  # noqa: E402
from lightning_middleware.testing import LLMTestServer  # noqa: E402

MSGS = [{"role": "system", "content": "You are a helpful agent."},
        {"role": "user", "content": "Find the answer to question 42 and call a tool if needed."}]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    store = TraceStore(f"sqlite:///{tmp}/bench.db")
    with LLMTestServer() as srv:
        bare = openai.OpenAI(base_url=srv.base_url, api_key="x")
        wrapped = wrap(openai.OpenAI(base_url=srv.base_url, api_key="x"), store=store)
        # Recording without asking for token IDs / logprobs: separates the transport's own
        # cost from the cost of the bigger response those fields make.
        plain = wrap(openai.OpenAI(base_url=srv.base_url, api_key="x"), store=store, inject_token_ids=False)

        def one(client: openai.OpenAI) -> float:
            t0 = time.perf_counter()
            if args.stream:
                for _ in client.chat.completions.create(model="m", messages=MSGS, stream=True):
                    pass
            else:
                client.chat.completions.create(model="m", messages=MSGS)
            return time.perf_counter() - t0

        clients = {"bare": bare, "wrapped": wrapped, "wrapped-noinject": plain}
        for _ in range(100):  # warm up the connection pools and the server
            for client in clients.values():
                one(client)
        times: dict[str, list[float]] = {name: [] for name in clients}
        names = list(clients)
        with rollout("bench", store=store):
            for i in range(args.calls):
                for name in names[i % 3:] + names[:i % 3]:  # rotate who goes first
                    times[name].append(one(clients[name]))
    store.flush(60)
    recorded = store.count("llm_calls")
    mode = "streaming" if args.stream else "non-streaming"
    print(f"capture overhead, {args.calls} {mode} calls each, interleaved, loopback test server")
    print(f"{'client':18s} {'p50 ms':>8s} {'p99 ms':>8s} {'added p50 us':>13s} {'ratio p50':>10s} "
          f"{'added p99 us':>13s}")
    b50, b99 = statistics.median(times["bare"]), _pct(times["bare"], 0.99)
    for name in names:
        p50, p99 = statistics.median(times[name]), _pct(times[name], 0.99)
        print(f"{name:18s} {p50 * 1e3:8.3f} {p99 * 1e3:8.3f} {(p50 - b50) * 1e6:+13.0f} {p50 / b50:10.3f} "
              f"{(p99 - b99) * 1e6:+13.0f}")
    print(f"recorded spans: {recorded} (expected {2 * (args.calls + 100)})")
    store.close()


if __name__ == "__main__":
    main()
