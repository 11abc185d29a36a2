"""How many cores the CPU vLLM server computes on, measured on the BFCL demo's evaluation.

    python bench/bench_vllm_threads.py [--rounds 2] [--eval-tasks 32] [--modes pinned,all]

vLLM's CPU backend, left to itself (`VLLM_CPU_OMP_THREADS_BIND=auto`), reserves one core per rank for
its scheduler process and pins the model's OpenMP threads to the rest: on a 2-core machine, one
thread on core 0. Each mode serves the BFCL demo's warm-started SmolLM2 (fp32, the demo's own
server settings; the warm start is the demo's cache, built first if missing) and runs the demo's
evaluation: `--eval-tasks` held-out items at T=1 through its LangChain agent, scored by BFCL's
checker. Modes, alternated round by round so that the machine's drift falls on both:
- `pinned`: vLLM's default;
- `all`: `VLLM_CPU_OMP_THREADS_BIND=<every core this process may use>`, one thread per core;
- `nobind`: no binding and no thread count (torch's default, one per core, unpinned).
Prints one line per run (the evaluation's seconds, generated tokens/s, BFCL accuracy) and each mode's
median against `pinned`'s.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning_middleware.cli import build_parser  # noqa: E402
from trainer_backend.demo.cli import config_from  # noqa: E402
from trainer_backend.demo.smol_bfcl import BfclDemoRun  # noqa: E402
from trainer_backend.serving.server import CPU_BIND  # noqa: E402


def bind_value(mode: str) -> str | None:
    if mode == "pinned":
        return None
    if mode == "nobind":
        return "nobind"
    cores = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cores))


def one(mode: str, eval_tasks: int, out: str) -> dict[str, float]:
    value = bind_value(mode)
    if value is None:
        os.environ.pop(CPU_BIND, None)
    else:
        os.environ[CPU_BIND] = value
    args = build_parser().parse_args(["demo", "--task", "bfcl", "--seed", "0", "--no-greedy",
                                      "--eval-tasks", str(eval_tasks), "--out", out])
    run = BfclDemoRun(replace(config_from(args), progress=False))
    try:
        run.warm_start()
        run.serve()
        res = run.evaluate("before")["sampled"]
        return {"seconds": res["seconds"], "gen_tokens_per_s": res["gen_tokens_per_s"], "success": res["success"],
                "server_start_s": run.timings["server_start_s"]}
    finally:
        run.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--eval-tasks", type=int, default=32)
    ap.add_argument("--modes", default="pinned,all")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    modes = a.modes.split(",")
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                res = one(mode, a.eval_tasks, os.path.join(tmp, f"{mode}-{r}"))
                runs[mode].append(res)
                print(f"round {r} {mode:>7}: evaluation {res['seconds']:.1f} s, {res['gen_tokens_per_s']:.1f} "
                      f"generated tokens/s, BFCL {res['success']:.1%}, server start {res['server_start_s']:.1f} s",
                      flush=True)
    base = statistics.median(x["seconds"] for x in runs[modes[0]])
    for mode in modes:
        med = statistics.median(x["seconds"] for x in runs[mode])
        print(f"{mode:>7}: median {med:.1f} s over {len(runs[mode])} runs, {base / med:.2f}x {modes[0]}'s speed")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
