"""`lightning-mw example`: wrap a client, run a small tool-using agent, print the captured spans.

It starts the deterministic test LLM server (no model needed), so it shows what
`wrap()` records on any machine in a few seconds. The real training demo is
`lightning-mw demo`.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any


def add_cli(sub: Any) -> None:
    p = sub.add_parser("example", help="wrap an openai client, run a 2-turn tool agent, print the spans")
    p.add_argument("--store", default=None, help="store URL (default: a fresh SQLite file under ./runs/example)")
    p.add_argument("--rollouts", type=int, default=3)
    p.set_defaults(func=run)


def tool_agent(client: Any, question: str) -> str:
    """A plain openai tool loop: the agent code a user already has."""
    tools = [{"type": "function", "function": {"name": "lookup", "description": "look a fact up",
                                               "parameters": {"type": "object",
                                                              "properties": {"query": {"type": "string"}}}}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for _ in range(4):
        reply = client.chat.completions.create(model="test-model", messages=messages, tools=tools).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return reply.content or ""
        for call in reply.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": f"fact about {args['query']}"})
    return ""


def run(args: argparse.Namespace) -> int:
    from openai import OpenAI

    from lightning_middleware import TraceStore, rollout, wrap
    from lightning_middleware.testing import LLMTestServer

    url = args.store
    if url is None:
        os.makedirs("runs/example", exist_ok=True)
        path = os.path.abspath("runs/example/traces.db")
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(path + suffix):
                os.remove(path + suffix)
        url = f"sqlite:///{path}"
    store = TraceStore(url)
    with LLMTestServer() as server:
        client = wrap(OpenAI(base_url=server.base_url, api_key="unused"), store=store)  # the one added line
        for i in range(args.rollouts):
            with rollout(f"question-{i % 2}", input={"i": i}, store=store) as r:
                answer = tool_agent(client, f"what is fact {i}?")
                r.reward(1.0 if "fact" in answer else 0.0)
    print(f"store: {store.safe_url}")
    for ro in store.query_rollouts():
        print(f"rollout {ro.id[:8]} task={ro.task_id} status={ro.status} reward={ro.final_reward} "
              f"duration={ro.duration_s:.3f}s")
        for c in store.calls(ro.id):
            msg = (c.response or {}).get("choices", [{}])[0].get("message") or {}
            what = msg.get("content") or json.dumps(msg.get("tool_calls"))[:70]
            print(f"  call {c.call_index}: prompt {len(c.prompt_token_ids)} tokens, completion "
                  f"{len(c.completion_token_ids)} tokens, logprobs {'yes' if c.logprobs else 'no'}, "
                  f"training={c.is_training}, {(c.latency_s or 0.0) * 1000:.1f} ms -> {what}")
    return 0
