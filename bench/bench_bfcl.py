"""A served model on BFCL: its accuracy by BFCL's own checker, greedy and at T=1, and how often it
makes a well-formed call, through the BFCL agent (LangChain, `wrap()`ed) and the rollout controller.

    python bench/bench_bfcl.py [--tasks bfcl:simple_python?split=test] [--tasks ...] [--warm-start STEPS]

Serves SmolLM2-135M-Instruct with its tool-call template (the demo's cached conversion; vLLM's xlam
parser) unless `--base-url` names a server; every task address is run at temperature 0 and 1, each
rollout scored by `bfcl_score` (docs/controller.md, "Tasks from a benchmark"). Prints one line per
address and temperature: BFCL accuracy, the share of answers with a call at all, and of calls
BFCL could check (no `malformed_arguments`), and the commonest checker error types.

`--warm-start STEPS` serves SmolLM2 after the BFCL demo's LoRA SFT (trainer_backend/demo/smol_bfcl.py,
merged; the same cache) on STEPS x 4 demonstrations from the train split of simple_python and
multiple: each item's question answered with the calls of its possible answer
(`bfcl.reference_calls`), shuffled by `--seed`. The test split is never shown.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_middleware import RewardConfig, TraceStore  # noqa: E402
from lightning_middleware.benchmarks import bfcl  # noqa: E402
from lightning_middleware.controller import RolloutController  # noqa: E402
from trainer_backend.demo.smol_bfcl import RULES, demonstrations, outcomes, warm_start_name  # noqa: E402


def evaluate(base_url: str, model: str, store: TraceStore, address: str, temperature: float,
             concurrency: int, system: str | None = None) -> str:
    tasks = [dict(t, temperature=temperature) for t in bfcl.tasks(address)]
    agent = bfcl.make_agent(base_url, model=model, store=store, system=system)
    t0 = time.perf_counter()
    with RolloutController(agent, store=store, concurrency=concurrency, timeout_s=600,
                           rewards=RewardConfig.from_dict(RULES)) as c:
        results = c.run(tasks, mode="val")
    seconds = time.perf_counter() - t0
    o = outcomes(store, results)
    common = ", ".join(f"{k} {v}" for k, v in list(o["error_types"].items())[:4])
    return (f"{address} T={temperature:g}: accuracy {o['success']:.1%} "
            f"({round(o['success'] * o['n'])}/{o['n']}), a call {o['a_call']:.1%}, "
            f"checkable {o['valid_tool_call']:.1%}; {common}; {seconds:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", action="append", default=None)
    ap.add_argument("--base-url", default=None, help="an OpenAI-compatible server (default: serve SmolLM2 here)")
    ap.add_argument("--model", default="policy")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--system", default=None, help="a system message before each question (BFCL sends none)")
    ap.add_argument("--temperatures", default="0,1", help="comma-separated (default 0,1)")
    ap.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                    help="SFT SmolLM2 on STEPS x 4 train-split demonstrations first (default 0: untouched)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    addresses = args.tasks or ["bfcl:simple_python?split=test", "bfcl:multiple?split=test",
                               "bfcl:live_simple?split=test"]
    store = TraceStore(f"sqlite:///{tempfile.mkdtemp(prefix='bench-bfcl-')}/store.db")
    server = None
    base_url = args.base_url
    if base_url is None:
        from trainer_backend.caching import lightning_home
        from trainer_backend.demo.arith import TOOL_PARSER
        from trainer_backend.demo.smol_warm import tools_model
        from trainer_backend.models import prepare_smollm2
        from trainer_backend.serving.env import ensure_vllm_env, vllm_python
        from trainer_backend.serving.server import VLLMServer

        ensure_vllm_env()
        model_dir = tools_model(prepare_smollm2(python=vllm_python()),
                                lightning_home() / "models" / "smollm2-135m-instruct-tools")
        if args.warm_start:
            from trainer_backend.demo.smol_warm import SmolWarmStart, warm_start

            ws = SmolWarmStart(steps=args.warm_start, seed=args.seed)
            t0 = time.perf_counter()
            model_dir = warm_start(model_dir, lightning_home() / "demo" / f"{warm_start_name()}-{ws.key()}", ws,
                                   demonstrations=demonstrations)
            print(f"warm start: {ws.key()} ({time.perf_counter() - t0:.0f} s, cached after the first run)",
                  flush=True)
        server = VLLMServer(model_dir, dtype="float32", served_model_name=args.model, max_model_len=4096,
                            extra_args=["--max-num-seqs", "64"], tool_parser=TOOL_PARSER)
        server.start()
        base_url = server.url + "/v1"
    try:
        for address in addresses:
            for temperature in (float(x) for x in args.temperatures.split(",")):
                print(evaluate(base_url, args.model, store, address, temperature, args.concurrency, args.system),
                      flush=True)
    finally:
        if server is not None:
            server.stop()
        store.close()


if __name__ == "__main__":
    main()
