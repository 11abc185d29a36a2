"""Run verl 0.9.1's real actor (ActorRolloutRefWorker role "actor" -> TrainingWorker -> FSDP2 engine,
optimizer step included) in ONE CPU process, for tests/trainer/test_engine_verl.py. Not for production.

verl 0.9.1 has no CPU platform and registers its FSDP engine for cuda/npu only, so this helper:
  - installs a minimal CPU platform (`set_platform`), device id "cpu", gloo backend;
  - registers FSDPEngineWithLMHead for device "cpu";
  - starts a world-size-1 gloo process group itself;
  - uses sdpa attention and no remove-padding (flash-attn is GPU-only),
and then drives the worker exactly as `VerlEngine.step` does (the same method, with the
worker object in place of the Ray worker group: `VerlEngine(start_workers=in_process_worker)`).
Run in a subprocess: it changes globals. tests/trainer/verl_cpu_lora.py uses the same set-up.

    python tests/trainer/verl_cpu_actor.py MODEL_DIR ROWS.pt OUT.pt [dual_clip_c]
Writes {"metrics": ..., "grads": {name: tensor}, "saved": [files]} to OUT.pt; the actor is built with
SGD, lr 1, no clipping, fp32 compute, so the parameter change of the step is minus its gradient;
then `VerlEngine.save` writes the HF checkpoint (verl's checkpoint manager, hf_model).
"""

from __future__ import annotations

import os
import sys
import types
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=os.environ.get("VERL_CPU_PORT", "29533"))

import torch  # noqa: E402
from verl.plugin.platform.platform_base import PlatformBase  # noqa: E402
from verl.plugin.platform.platform_manager import set_platform  # noqa: E402

_NONE = lambda *a, **k: None  # noqa: E731
_ZERO = lambda *a, **k: 0  # noqa: E731
_cpu = types.SimpleNamespace(
    current_device=lambda: "cpu", device_count=lambda: 1, is_available=lambda: True, set_device=_NONE,
    synchronize=_NONE, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, empty_cache=_NONE,
    max_memory_allocated=_ZERO, max_memory_reserved=_ZERO, memory_allocated=_ZERO, memory_reserved=_ZERO,
    reset_peak_memory_stats=_NONE, mem_get_info=lambda *a, **k: (1 << 40, 1 << 40), is_initialized=lambda: True,
    get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state, current_stream=_NONE,
    get_device_name=lambda *a, **k: "CPU",
)


class PlatformCPU(PlatformBase):
    device_name = property(lambda self: "cpu")
    vendor_name = property(lambda self: "cpu")
    device_module = property(lambda self: _cpu)

    def is_available(self): return True
    def is_platform_available(self, use_smi_check=False): return True
    def current_device(self): return "cpu"
    def device_count(self): return 1
    def set_device(self, device_index): pass
    def synchronize(self, device_index=None): pass
    def manual_seed(self, seed): torch.manual_seed(seed)
    def manual_seed_all(self, seed): torch.manual_seed(seed)
    def set_allocator_settings(self, settings): pass
    def empty_cache(self): pass
    def get_device_capability(self, device_index=0): return None, None
    def communication_backend_name(self): return "gloo"
    def visible_devices_envvar(self): return "CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self): pass
    def profiler_stop(self): pass
    def ray_resource_name(self): return "CPU"
    def ray_noset_envvars(self): return []
    def is_ipc_supported(self): return False
    def cudart(self): return None


def start_cpu_process_group() -> None:
    """The CPU platform, verl's FSDP engine registered for it, a world-size-1 gloo group (once per process)."""
    set_platform(PlatformCPU())
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    register = EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device=["cpu"])
    register(FSDPEngineWithLMHead)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)


def in_process_worker(actor_config, config):
    """`VerlEngine(start_workers=...)`: verl's actor worker, built and initialised in this process
    (it stands in for the Ray worker group: the same methods, called directly)."""
    from trainer_backend.engines.verl_engine import actor_worker_cls

    worker = actor_worker_cls()(actor_config, role="actor")
    worker.init_model()
    return worker


# the CPU test's settings: sdpa attention, padded batches (flash-attn is GPU-only), no compile
CPU_OVERRIDES = ("+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
                 "actor_rollout_ref.model.use_remove_padding=False",
                 "actor_rollout_ref.actor.use_torch_compile=False",
                 "actor_rollout_ref.actor.optim.weight_decay=0.0")


def main() -> None:
    model_dir, rows_path, out_path = sys.argv[1:4]
    dual = float(sys.argv[4]) if len(sys.argv) > 4 else None
    start_cpu_process_group()
    from pathlib import Path

    from trainer_backend.algorithms.losses import LossConfig
    from trainer_backend.engines.verl_engine import VerlEngine, VerlEngineConfig

    # SGD with lr 1 and no clipping: the parameter change is exactly minus the gradient
    cfg = VerlEngineConfig(lr=1.0, grad_clip=1e9, param_dtype="fp32", strategy="fsdp2", use_dynamic_bsz=True,
                           max_token_len_per_gpu=40, gradient_checkpointing=False,
                           loss=LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=dual),
                           overrides=(*CPU_OVERRIDES, "actor_rollout_ref.actor.optim.optimizer=SGD"))
    eng = VerlEngine(model_dir, cfg, work_dir=Path(out_path).parent / "verl_work", start_workers=in_process_worker)
    rows = torch.load(rows_path, weights_only=False)
    module = eng.wg.actor.engine.module

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    before = {n: full(p) for n, p in module.named_parameters()}
    metrics = eng.step(rows)
    grads = {n: before[n] - full(p) for n, p in module.named_parameters()}  # SGD, lr 1: delta = -grad
    saved = eng.save(Path(out_path).parent / "hf")
    torch.save({"metrics": metrics, "grads": grads, "saved": sorted(os.listdir(saved))}, out_path)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
