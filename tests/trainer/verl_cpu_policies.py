"""Two LoRA policies on verl 0.9.1's real actor (one verl LoRA engine per policy, `VerlPolicySet`), in ONE
CPU process, for tests/trainer/test_engine_verl_policies.py; the CPU set-up of verl_cpu_actor.py. Not for production.

    python tests/trainer/verl_cpu_policies.py MODEL_DIR START_DIR ROWS.pt OUT_DIR
    python tests/trainer/verl_cpu_policies.py rss MODEL_DIR N   (prints the process's RSS with N policies)

START_DIR holds the adapters `coder/` and `reviewer/`; ROWS.pt is {"mixed": rows of both policies,
"coder_only": rows of coder and of a model that is no policy}. AdamW throughout. Writes OUT_DIR/out.pt:
  run     step 1 (mixed), saved to OUT_DIR/c1, step 2 (mixed), step 3 (coder_only): each step's metrics and
          every engine's parameters (adapter and base) after each step;
  resume  a set resumed from OUT_DIR/c1: its parameters at load, then after the same step 2.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.trainer.verl_cpu_actor import CPU_OVERRIDES, in_process_worker, start_cpu_process_group  # noqa: E402
from trainer_backend.algorithms.losses import LossConfig  # noqa: E402
from trainer_backend.engines.lora import AdapterConfig  # noqa: E402
from trainer_backend.engines.verl_engine import VerlEngineConfig  # noqa: E402
from trainer_backend.engines.verl_policies import VerlPolicySet  # noqa: E402

NAMES = ("coder", "reviewer")
CONFIG = VerlEngineConfig(lr=0.01, grad_clip=1e9, param_dtype="fp32", strategy="fsdp2", use_dynamic_bsz=True,
                          max_token_len_per_gpu=40, gradient_checkpointing=False, lora=AdapterConfig(rank=4, alpha=8),
                          loss=LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=None),
                          overrides=(*CPU_OVERRIDES, "actor_rollout_ref.actor.optim.optimizer=AdamW"))


def policy_set(start: Path, out: Path, names: tuple[str, ...] = NAMES, version: int = 0) -> VerlPolicySet:
    return VerlPolicySet(start, names, CONFIG, work_dir=out / "verl_work", start_workers=in_process_worker,
                         policy_version=version)


def params(s: VerlPolicySet) -> dict[str, dict[str, torch.Tensor]]:
    """Every engine's parameters (its own base copy and its adapter), by policy."""
    out = {}
    for name, eng in s.engines.items():
        module = eng.wg.actor.engine.module
        out[name] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for n, p in module.named_parameters()}
    return out


def run(start: Path, rows: dict, out: Path) -> dict:
    s = policy_set(start, out)
    result: dict = {"at_start": params(s), "metrics": []}
    result["metrics"].append(s.step(rows["mixed"]))
    result["after_1"] = params(s)
    s.save(out / "c1")
    result["metrics"].append(s.step(rows["mixed"]))
    result["after_2"] = params(s)
    result["metrics"].append(s.step(rows["coder_only"]))
    result["after_3"] = params(s)
    result["version"] = s.policy_version
    return result


def resume(rows: dict, out: Path) -> dict:
    s = policy_set(out / "c1", out, version=1)  # the daemon passes the checkpoint's version
    at_load = params(s)
    metrics = s.step(rows["mixed"])
    return {"at_load": at_load, "after_2": params(s), "metrics": metrics,
            "resumed": {n: e.resumed for n, e in s.engines.items()}}


def rss(model_dir: Path, n: int) -> None:
    """RSS of this process holding `n` policies (one verl engine each), after one step of each."""
    from tests.trainer.test_engine_verl import multi_turn_rows

    names = tuple(f"p{i}" for i in range(n))
    s = policy_set(model_dir, Path(os.environ.get("TMPDIR", "/tmp")) / f"verl_rss_{os.getpid()}", names)
    s.step([dataclasses.replace(r, policy=name) for name in names for r in multi_turn_rows()])
    status = Path("/proc/self/status").read_text().splitlines()
    keep = [line for line in status if line.startswith(("VmRSS", "RssAnon", "RssFile"))]
    print(f"policies {n}: {' '.join(' '.join(line.split()) for line in keep)} "
          f"maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss} kB")


def main() -> None:
    start_cpu_process_group()
    if sys.argv[1] == "rss":
        rss(Path(sys.argv[2]), int(sys.argv[3]))
    else:
        start, rows_path, out = Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
        rows = torch.load(rows_path, weights_only=False)
        torch.save({"run": run(start, rows, out), "resume": resume(rows, out)}, out / "out.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
