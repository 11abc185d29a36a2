"""Added latency per call for each framework: wrapped versus unwrapped, interleaved, in one run.

Each framework makes the same single chat call against the deterministic loopback
server, once through an unwrapped object and once through a wrap()ed one, calls
alternating so machine noise hits both alike. Prints p50 per side, the added
microseconds and the ratio.

    python bench/bench_adapters.py [--calls 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import openai  # noqa: E402

from lightning_middleware import TraceStore, rollout, wrap  # noqa: E402
from lightning_middleware.testing import LLMTestServer  # noqa: E402

MSGS = [{"role": "user", "content": "Find the answer to question 42."}]


def _pairs(url: str, store: TraceStore) -> dict[str, tuple[Callable, Callable]]:
    """framework -> (unwrapped call, wrapped call), each an async zero-argument callable."""
    from autogen_core.models import UserMessage
    from autogen_ext.models.openai import OpenAIChatCompletionClient
    from langchain_openai import ChatOpenAI

    pairs: dict[str, tuple[Callable, Callable]] = {}

    def oa(wrapped: bool):
        c = openai.AsyncOpenAI(base_url=url, api_key="k")
        c = wrap(c, store=store) if wrapped else c
        return lambda: c.chat.completions.create(model="m", messages=MSGS)
    pairs["openai"] = (oa(False), oa(True))

    def lc(wrapped: bool):
        m = ChatOpenAI(model="m", base_url=url, api_key="k", timeout=60 + wrapped)  # two distinct cached clients
        m = wrap(m, store=store) if wrapped else m
        return lambda: m.ainvoke(MSGS)
    pairs["langchain"] = (lc(False), lc(True))

    info = {"vision": False, "function_calling": True, "json_output": False, "family": "unknown",
            "structured_output": False}

    def ag(wrapped: bool):
        c = OpenAIChatCompletionClient(model="m", base_url=url, api_key="k", model_info=info)
        c = wrap(c, store=store) if wrapped else c
        return lambda: c.create([UserMessage(content=MSGS[0]["content"], source="user")])
    pairs["autogen"] = (ag(False), ag(True))

    from agents import ModelSettings, OpenAIChatCompletionsModel, set_tracing_disabled
    from agents.models.interface import ModelTracing

    set_tracing_disabled(True)

    def sdk(wrapped: bool):
        m = OpenAIChatCompletionsModel(model="m", openai_client=openai.AsyncOpenAI(base_url=url, api_key="k"))
        m = wrap(m, store=store) if wrapped else m
        return lambda: m.get_response(None, MSGS[0]["content"], ModelSettings(), [], None, [],
                                      ModelTracing.DISABLED, previous_response_id=None, conversation_id=None,
                                      prompt=None)
    pairs["openai-agents"] = (sdk(False), sdk(True))
    return pairs


async def _litellm_pair(url: str, store: TraceStore) -> tuple[Callable, Callable]:
    """LiteLLM is wrapped module-wide: unwrapped calls are timed first, then wrap(litellm)."""
    import litellm

    call = lambda: litellm.acompletion(model="hosted_vllm/m", api_base=url, messages=MSGS)  # noqa: E731
    return call, call


async def _time(fn: Callable) -> float:
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def main_async(calls: int) -> None:
    tmp = tempfile.mkdtemp()
    store = TraceStore(f"sqlite:///{tmp}/bench.db")
    results: dict[str, tuple[float, float]] = {}
    with LLMTestServer() as srv:
        pairs = _pairs(srv.base_url, store)
        async with rollout("bench", store=store):
            for name, (bare, wrapped) in pairs.items():
                for _ in range(30):
                    await bare(), await wrapped()
                tb, tw = [], []
                for i in range(calls):
                    if i % 2:
                        tb.append(await _time(bare)); tw.append(await _time(wrapped))  # noqa: E702
                    else:
                        tw.append(await _time(wrapped)); tb.append(await _time(bare))  # noqa: E702
                results[name] = (statistics.median(tb), statistics.median(tw))
            # LiteLLM: the wrap is process-wide, so unwrapped then wrapped blocks, alternating by re-wrapping
            # is impossible; time blocks back to back instead (noisier).
            import litellm

            bare, _ = await _litellm_pair(srv.base_url, store)
            for _ in range(30):
                await bare()
            tb = [await _time(bare) for _ in range(calls)]
            wrap(litellm, store=store)
            for _ in range(30):
                await bare()
            tw = [await _time(bare) for _ in range(calls)]
            results["litellm (blocks)"] = (statistics.median(tb), statistics.median(tw))
    store.flush(60)
    print(f"per-framework capture overhead, {calls} calls each side, loopback test server, p50")
    print(f"{'framework':18s} {'bare ms':>9s} {'wrapped ms':>11s} {'added us':>9s} {'ratio':>7s}")
    for name, (b, w) in results.items():
        print(f"{name:18s} {b * 1e3:9.3f} {w * 1e3:11.3f} {(w - b) * 1e6:+9.0f} {w / b:7.3f}")
    print(f"recorded spans: {store.count('llm_calls')}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    asyncio.run(main_async(ap.parse_args().calls))


if __name__ == "__main__":
    main()
