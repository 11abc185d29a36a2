"""An agent process for the kill -9 cells: `python -m tests.faults.agent_proc MODE STORE_URL BASE_URL`.

It records through `wrap()` like any agent, holds a lease on its rollout as a controller's worker
would, prints `READY <rollout id> <calls answered>` when it reaches the moment MODE names, then
waits there to be killed:

    nonstream  two calls answered, the third in flight (the engine hangs on it; tagged with the
               rollout's id: the test waits until the engine has it)
    stream     one call answered, then a stream read half-way
    between    one rollout finished (two calls, a reward), the next not begun
"""

from __future__ import annotations

import sys
import time

import openai

from lightning_middleware import TraceStore, rollout, wrap


def main(mode: str, store_url: str, base_url: str) -> None:
    store = TraceStore(store_url, writer_interval_s=0.05)
    client = wrap(openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120), store=store)

    def ask(r: object, text: str, **kw: object) -> object:
        return client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                              max_tokens=16, **kw)  # type: ignore[call-overload]

    with rollout(f"kill-{mode}", store=store) as r:
        store.flush()
        store.heartbeat([r.id], owner="agent-proc")  # one beat, then silence: the reaper sees it go stale
        ask(r, "first")
        if mode == "between":
            ask(r, "second")
            r.reward(1.0)
    if mode == "between":
        print(f"READY {r.id} 2", flush=True)
        time.sleep(600)
        return
    with rollout(f"kill-{mode}-2", store=store, rollout_id=f"{r.id}-b") as r2:
        store.flush()
        store.heartbeat([r2.id], owner="agent-proc")
        ask(r2, "one more")
        if mode == "nonstream":
            print(f"READY {r2.id} 1", flush=True)
            ask(r2, "in flight", extra_headers={"x-test-hang": "600", "x-test-tag": r2.id})
        else:
            stream = ask(r2, "half read " * 4, stream=True, extra_headers={"x-test-delay": "0.1"})
            for i, _chunk in enumerate(stream):  # type: ignore[attr-defined]
                if i == 3:
                    print(f"READY {r2.id} 1", flush=True)
                    time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:4])
