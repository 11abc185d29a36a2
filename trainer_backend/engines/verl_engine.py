"""The verl engine: our rows as a verl `DataProto`, updated by verl's FSDP actor on Ray.

Pinned: verl 0.9.1 (`VERL_VERSION`). verl 0.9.1 no longer ships `dp_actor.DataParallelPPOActor`
/ `fsdp_workers`; the actor is `verl.workers.engine_workers.ActorRolloutRefWorker` (role
"actor": no rollout, no ref) over the model engine `workers/engine/fsdp` (FSDP/FSDP2), with
the loss `verl.workers.utils.losses.ppo_loss`. This module targets that path.

Shared with the torch engine: the rows (`rows.build_rows`), the step-normalised per-token
weights (`grpo.loss_weights`) and the loss (`grpo.policy_loss`, registered as a verl policy
loss). The parts: `verl_rows` (rows -> `DataProto`), `verl_loss` (the registered loss and why
its weighting is exact under any split), `verl_lora` (LoRA through verl's own support), this
module (verl's config, the worker, the engine). See docs/trainer.md, "verl engine".
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_middleware.rows import Row
from trainer_backend.algorithms.losses import LossConfig
from trainer_backend.engines import lora, verl_lora
from trainer_backend.engines.verl_loss import LOSS_MODE, LOSS_MODE_DUAL, register_policy_loss
from trainer_backend.engines.verl_rows import rows_to_dataproto

log = logging.getLogger(__name__)

VERL_VERSION = "0.9.1"


def check_verl_version() -> str:
    import verl

    version = getattr(verl, "__version__", "?")
    if version != VERL_VERSION:
        raise RuntimeError(f"the verl engine is written against verl {VERL_VERSION}; found {version}")
    return version


# ---------------------------------------------------------------- the engine (GPU, Ray)


@dataclass(frozen=True)
class VerlEngineConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    loss: LossConfig = LossConfig()
    old_logprobs: str = "behaviour"  # or "recompute" (verl's compute_log_prob before the update)
    n_gpus: int = 1
    nnodes: int = 1
    strategy: str = "fsdp2"
    micro_batch_size_per_gpu: int = 4  # rows; or use_dynamic_bsz with max_token_len_per_gpu
    use_dynamic_bsz: bool = True
    max_token_len_per_gpu: int = 16384
    param_dtype: str = "bf16"  # FSDP compute dtype, "bf16" | "fp32" (master weights stay fp32)
    gradient_checkpointing: bool = True
    freeze_embeddings: bool = False
    overrides: tuple[str, ...] = ()  # extra hydra overrides of verl's ppo_trainer config
    ray_init: dict = field(default_factory=dict)
    lora: lora.AdapterConfig | None = None  # a LoRA adapter on the frozen base, by verl's own LoRA (verl_lora)


_DTYPES = {"bf16": "bf16", "fp32": "fp32", "bfloat16": "bf16", "float32": "fp32"}


def build_actor_config(model_dir: str | Path, cfg: VerlEngineConfig):
    """verl's `actor_rollout_ref` config (hydra, from verl's own ppo_trainer.yaml) for our actor-only worker.
    With `cfg.lora`, or a LoRA adapter folder as `model_dir`: verl's LoRA on its base (verl_lora)."""
    import verl
    from hydra import compose, initialize_config_dir

    if cfg.loss.kl_coef or cfg.loss.entropy_coef:
        raise ValueError("the verl engine supports kl_coef = entropy_coef = 0 only (verl aggregates those terms "
                         "unweighted; see verl_loss)")
    if cfg.freeze_embeddings:
        raise ValueError("freeze_embeddings is not supported by the verl engine")
    if cfg.loss.agg not in ("rollout-token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        raise ValueError(f"unknown aggregation {cfg.loss.agg!r}")
    a = "actor_rollout_ref"
    dual = cfg.loss.dual_clip_c is not None
    base, lora_overrides = Path(model_dir).resolve(), []  # type: tuple[Path, list[str]]
    if cfg.lora is not None or lora.is_adapter_dir(model_dir):
        base, lora_overrides = verl_lora.actor_overrides(model_dir, cfg.lora)
    overrides = [
        f"{a}.model.path={base}",
        f"{a}.model.enable_gradient_checkpointing={cfg.gradient_checkpointing}",
        f"{a}.model.use_remove_padding=True",
        f"{a}.actor.strategy={cfg.strategy}",
        f"{a}.actor.optim.lr={cfg.lr}",
        f"{a}.actor.optim.weight_decay={cfg.weight_decay}",
        f"{a}.actor.grad_clip={cfg.grad_clip}",
        f"{a}.actor.optim.clip_grad={cfg.grad_clip}",
        f"{a}.actor.fsdp_config.strategy={cfg.strategy}",
        f"{a}.actor.fsdp_config.model_dtype=fp32",
        f"{a}.actor.policy_loss.loss_mode={LOSS_MODE_DUAL if dual else LOSS_MODE}",
        f"{a}.actor.loss_agg_mode=token-sum",
        f"{a}.actor.clip_ratio={cfg.loss.clip_low}",
        f"{a}.actor.clip_ratio_low={cfg.loss.clip_low}",
        f"{a}.actor.clip_ratio_high={cfg.loss.clip_high}",
        f"{a}.actor.entropy_coeff=0",
        f"{a}.actor.use_kl_loss=False",
        f"{a}.actor.ppo_epochs=1",
        f"{a}.actor.shuffle=False",
        f"{a}.actor.use_dynamic_bsz={cfg.use_dynamic_bsz}",
        f"{a}.actor.ppo_max_token_len_per_gpu={cfg.max_token_len_per_gpu}",
        f"{a}.actor.ppo_micro_batch_size_per_gpu={cfg.micro_batch_size_per_gpu}",
        f"{a}.actor.checkpoint.save_contents=[hf_model]",
        f"{a}.rollout.n=1",
        f"{a}.rollout.log_prob_micro_batch_size_per_gpu={cfg.micro_batch_size_per_gpu}",
        f"{a}.rollout.log_prob_use_dynamic_bsz={cfg.use_dynamic_bsz}",
        f"{a}.rollout.log_prob_max_token_len_per_gpu={cfg.max_token_len_per_gpu}",
        f"trainer.n_gpus_per_node={cfg.n_gpus}",
        f"trainer.nnodes={cfg.nnodes}",
    ]
    if dual:
        overrides.append(f"{a}.actor.clip_ratio_c={cfg.loss.dual_clip_c}")
    # FSDP compute dtype (autocast and FSDP MixedPrecision param_dtype; master weights fp32).
    # Not fsdp_config.dtype: verl 0.9.1's FSDP engine reads mixed_precision.param_dtype (default bf16).
    overrides.append(f"+{a}.actor.fsdp_config.mixed_precision.param_dtype={_DTYPES[cfg.param_dtype]}")
    overrides += lora_overrides  # after save_contents=[hf_model]: a LoRA checkpoint is the adapter's state
    overrides += list(cfg.overrides)
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        full = compose(config_name="ppo_trainer", overrides=overrides)
    return full


def actor_worker_cls():
    """Our subclass of verl's ActorRolloutRefWorker, made on first use (importing verl's workers pulls in ray)
    and reachable as `trainer_backend.engines.verl_engine.LightningActorWorker` (module __getattr__), so a Ray worker
    that unpickles it by reference imports this module, which registers our policy loss; __init__
    registers it again in case the class travelled by value."""
    cls = globals().get("LightningActorWorker")
    if cls is not None:
        return cls
    from verl.single_controller.base.decorator import Dispatch, register
    from verl.workers.engine_workers import ActorRolloutRefWorker

    class LightningActorWorker(ActorRolloutRefWorker):
        """verl's actor worker (role "actor": FSDP actor, no rollout, no ref) with our policy loss registered."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            register_policy_loss()
            super().__init__(*args, **kwargs)

        @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]  # Dispatch's members are dynamic
        def export_adapter(self, out_dir: str) -> None:
            """The LoRA adapter as a peft folder, by verl's own adapter sync (verl_lora.export_adapter)."""
            assert self.actor is not None, "export_adapter needs role 'actor'"
            verl_lora.export_adapter(self.actor.engine, out_dir, rank=torch.distributed.get_rank())

    LightningActorWorker.__module__ = __name__
    LightningActorWorker.__qualname__ = "LightningActorWorker"
    globals()["LightningActorWorker"] = LightningActorWorker
    return LightningActorWorker


def __getattr__(name: str) -> Any:  # PEP 562: the lazily made worker class, for unpickling by reference
    if name == "LightningActorWorker":
        return actor_worker_cls()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def ray_workers(actor_config: Any, config: VerlEngineConfig, pool: Any = None) -> Any:
    """verl's actor worker group on Ray's GPUs, initialised (the model and, for training, its optimizer).
    `pool`: a `RayResourcePool` other worker groups share (verl_policies), else one of its own."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    if not torch.cuda.is_available():
        raise RuntimeError("the verl engine needs GPUs (verl 0.9.1's FSDP engine is registered for cuda/npu "
                           "only); use --engine torch on CPU")
    if not ray.is_initialized():
        repo = str(Path(__file__).resolve().parent.parent)
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
               "TOKENIZERS_PARALLELISM": "false"}
        ray.init(runtime_env={"env_vars": env}, **config.ray_init)
    if pool is None:
        pool = RayResourcePool(process_on_nodes=[config.n_gpus] * config.nnodes, use_gpu=True, max_colocate_count=1)
    cls = RayClassWithInitArgs(cls=ray.remote(actor_worker_cls()), config=actor_config, role="actor")
    # Any: the worker group gets its methods (init_model, update_actor, ...) from the worker class at run time
    wg: Any = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cuda")
    wg.init_model()
    return wg


class VerlEngine:
    """verl's FSDP actor on Ray behind our `Engine` protocol (GPU machines).

    `model_dir`: a model folder, or a LoRA adapter folder this engine saved (continued on its
    base, with its optimizer state). `start_workers(actor_config, config)` makes the initialised
    worker group: `ray_workers` by default; the CPU tests build verl's worker in their process."""

    def __init__(self, model_dir: str | Path, config: VerlEngineConfig = VerlEngineConfig(), *,
                 policy_version: int = 0, work_dir: str | Path | None = None,
                 start_workers: Callable[[Any, VerlEngineConfig], Any] = ray_workers) -> None:
        check_verl_version()
        self.source_dir = Path(model_dir)
        self.config = config
        self.policy_version = policy_version
        self.is_lora = config.lora is not None or lora.is_adapter_dir(model_dir)
        self.base_dir = lora.base_of(model_dir) if lora.is_adapter_dir(model_dir) else self.source_dir
        self.work_dir = Path(work_dir) if work_dir else Path("runs/verl_work")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.full_config = build_actor_config(self.source_dir, config)
        self.world_size = config.n_gpus * config.nnodes
        self.wg = start_workers(self.full_config.actor_rollout_ref, config)
        state = verl_lora.resumable_state(self.source_dir, self.world_size) if self.is_lora else None
        if state is not None:  # the adapter came from lora_adapter_path; its optimizer and schedule from here
            self.wg.load_checkpoint(str(state), None, False)
        self.resumed = state is not None
        from transformers import AutoConfig

        pad = AutoConfig.from_pretrained(self.base_dir).pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        log.info("VerlEngine: %s%s on %d GPU(s), version %d", self.source_dir, " (LoRA)" if self.is_lora else "",
                 self.world_size, policy_version)

    def _to_tensordict(self, data, *, compute_loss: bool):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        td = left_right_2_no_padding(data.to_tensordict())
        n = len(data)
        tu.assign_non_tensor(td, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
                             global_batch_size=n, mini_batch_size=n, epochs=1, seed=42,
                             dataloader_kwargs={"shuffle": False}, compute_loss=compute_loss,
                             temperature=1.0, multi_turn=True)
        return td

    def step(self, rows: Sequence[Row]) -> dict[str, float]:
        """One optimizer update: one verl mini-batch holding the whole step."""
        if not rows:
            raise ValueError("step() needs at least one row")
        from verl.utils import tensordict_utils as tu

        t0 = time.perf_counter()
        data = rows_to_dataproto(rows, agg=self.config.loss.agg, pad_id=self.pad_id, pad_to_multiple=self.world_size)
        has = data.non_tensor_batch["has_old_log_probs"]
        if self.config.old_logprobs == "recompute" or not has.all():
            # as ray_trainer._compute_old_log_prob: no-padding in, nested log_probs out, back to (B, R)
            from verl.workers.utils.padding import no_padding_2_padding

            td = self._to_tensordict(data, compute_loss=False)
            out = self.wg.compute_log_prob(td)
            recomputed = no_padding_2_padding(tu.get(out, "log_probs"), td).float().cpu()
            keep = torch.from_numpy(has if self.config.old_logprobs == "behaviour" else np.zeros_like(has))
            data.batch["old_log_probs"] = torch.where(keep.unsqueeze(-1), data.batch["old_log_probs"],
                                                      recomputed.float() * data.batch["response_mask"])
        out = self.wg.update_actor(self._to_tensordict(data, compute_loss=True))
        from verl.utils.metric import reduce_metrics

        raw = reduce_metrics(dict(tu.get(out, "metrics")))  # as ray_trainer: Metric.aggregate / mean
        self.policy_version += 1
        elapsed = time.perf_counter() - t0
        metrics = {f"verl/{k}": float(v) for k, v in raw.items() if np.ndim(v) == 0}
        tokens = sum(len(r) for r in rows)
        nan = float("nan")
        metrics.update(loss=float(raw.get("loss", nan)),  # sum of micro-batch losses = the step loss
                       pg_loss=float(raw.get("actor/pg_loss", nan)),
                       clip_frac=float(raw.get("actor/pg_clipfrac", nan)),  # micro-batch means, averaged
                       clip_frac_lower=float(raw.get("actor/pg_clipfrac_lower", nan)),
                       approx_kl=float(raw.get("actor/ppo_kl", nan)),
                       grad_norm=float(raw.get("grad_norm", nan)),
                       rows=float(len(rows)), rollouts=float(len({r.rollout_id for r in rows})),
                       tokens=float(tokens), response_tokens=float(sum(r.n_response_tokens for r in rows)),
                       time_s=elapsed, tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
                       policy_version=float(self.policy_version))
        return metrics

    def save(self, out_dir: str | Path) -> Path:
        """Full weights: HF safetensors + config via verl's checkpoint manager (save_contents=[hf_model]),
        plus tokenizer files. LoRA: the adapter folder (what vLLM loads in place) and verl's state."""
        from trainer_backend.engines.torch_engine import TOKENIZER_FILES

        out = Path(out_dir)
        ckpt = self.work_dir / f"v{self.policy_version}"
        self.wg.save_checkpoint(str(ckpt), None, self.policy_version, 1)
        out.mkdir(parents=True, exist_ok=True)
        if self.is_lora:
            self.wg.export_adapter(str(out))
            verl_lora.keep_state(ckpt, out)
            log.info("saved LoRA policy version %d to %s", self.policy_version, out)
            return out
        hf = ckpt / "huggingface"
        for p in hf.iterdir():
            if p.is_file():
                shutil.copy2(p, out / p.name)
        for name in TOKENIZER_FILES:
            src = self.source_dir / name
            if src.is_file() and not (out / name).exists():
                shutil.copy2(src, out / name)
        shutil.rmtree(ckpt, ignore_errors=True)
        log.info("saved policy version %d to %s", self.policy_version, out)
        return out
