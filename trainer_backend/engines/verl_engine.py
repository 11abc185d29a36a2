"""The verl engine: our rows as a verl `DataProto`, updated by verl's FSDP actor on Ray.

Pinned: verl 0.9.1 (`VERL_VERSION`). verl 0.9.1 no longer ships `dp_actor.DataParallelPPOActor`
/ `fsdp_workers`; the actor is `verl.workers.engine_workers.ActorRolloutRefWorker` (role
"actor": no rollout, no ref) over the model engine `workers/engine/fsdp` (FSDP/FSDP2), with
the loss `verl.workers.utils.losses.ppo_loss`. This module targets that path.

Shared with the torch engine: the rows (`rows.build_rows`), the step-normalised per-token
weights (`grpo.loss_weights`) and the loss (`grpo.policy_loss`, registered below as a verl
policy loss). See docs/trainer.md, "verl engine".

Mapping of a row (one whole multi-turn sequence, interleaved loss mask) to verl's split:
  prompt   = the row's tokens before its first trained token (at least one token: a token
             with no left context cannot be predicted, by either engine),
  response = everything after, observations included, `response_mask` 0 on them.
Left-padded prompts, right-padded responses, as verl's rollout produces them.

Weighting (why verl's own `loss_agg_mode` is not used): verl aggregates per micro-batch with
`agg_loss`, normalising `token-mean` by the global mini-batch token count and `seq-mean-*`
by the global number of sequences; none of them is the rollout-level token mean (a rollout
is several sequences). Its policy-loss hook receives exactly one extra per-token tensor,
`rollout_is_weights` (multiplied into the per-token loss by verl's own losses). We put our
weights `w_t` (computed once over the whole step, before any split) there and register the
policy loss `lightning_rollout` that returns `policy_loss(...) * dp_size` = `dp_size * sum_t
w_t l_t` over the micro-batch. The FSDP engine calls `backward()` on each micro-batch loss
unscaled and FSDP averages gradients over the dp ranks, so the update's gradient is
`sum over all tokens of the step of w_t grad l_t`: exact under any mini/micro/dp split, as
long as one update = one mini-batch (`ppo_mini_batch_size` = the whole step, 1 epoch).
`loss_agg_mode` is set to `token-sum`; verl's separate entropy/KL terms would be aggregated
unweighted, so this engine requires `kl_coef == entropy_coef == 0` (the defaults).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_middleware.rows import Row
from trainer_backend.algorithms.grpo import LossConfig, loss_weights, policy_loss

log = logging.getLogger(__name__)

VERL_VERSION = "0.9.1"
LOSS_MODE = "lightning_rollout"  # registered verl policy loss; `_dual` variant applies clip_ratio_c
LOSS_MODE_DUAL = "lightning_rollout_dual"
WEIGHTS_KEY = "rollout_is_weights"  # verl's per-token multiplier channel into the policy loss


def check_verl_version() -> str:
    import verl

    version = getattr(verl, "__version__", "?")
    if version != VERL_VERSION:
        raise RuntimeError(f"the verl engine is written against verl {VERL_VERSION}; found {version}")
    return version


# ---------------------------------------------------------------- the policy loss, registered in verl


def _lightning_policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                           response_mask: torch.Tensor, loss_agg_mode: str = "token-sum", config: Any = None,
                           rollout_is_weights: torch.Tensor | None = None, *, dual: bool = False):
    """verl policy-loss signature over our `grpo.policy_loss`: dp_size * sum_t w_t l_t (w in rollout_is_weights)."""
    if rollout_is_weights is None:
        raise ValueError(f"policy loss {LOSS_MODE!r} needs the step-normalised weights in {WEIGHTS_KEY!r} "
                         "(see rows_to_dataproto)")
    cfg = LossConfig(clip_low=config.clip_ratio_low, clip_high=config.clip_ratio_high,
                     dual_clip_c=config.clip_ratio_c if dual else None)
    weights = rollout_is_weights * response_mask.to(rollout_is_weights.dtype)
    loss, sums = policy_loss(log_prob.float(), old_log_prob.float(), advantages.float(), weights.float(), cfg)
    dp_size = (getattr(config, "global_batch_info", None) or {}).get("dp_size", 1) or 1
    n = torch.clamp(sums["response_tokens"], min=1.0)
    metrics = {  # verl averages these over micro-batches (like its own vanilla loss)
        "actor/pg_clipfrac": float(sums["clipped_tokens"] / n),
        "actor/ppo_kl": float(sums["neg_log_ratio_sum"] / n),
        "actor/pg_clipfrac_lower": float(sums["clipped_lower_tokens"] / n),
    }
    return loss * dp_size, metrics


def register_policy_loss() -> None:
    """Register `lightning_rollout` (+ `_dual`) in verl's policy-loss registry (idempotent; runs on import)."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    def plain(*args, **kwargs):
        return _lightning_policy_loss(*args, **kwargs, dual=False)

    def dual(*args, **kwargs):
        return _lightning_policy_loss(*args, **kwargs, dual=True)

    POLICY_LOSS_REGISTRY.setdefault(LOSS_MODE, plain)
    POLICY_LOSS_REGISTRY.setdefault(LOSS_MODE_DUAL, dual)


try:  # registration must also happen in every Ray worker: they import this module to unpickle the worker class
    register_policy_loss()
except ImportError:  # verl absent: the conversion helpers below still import
    pass


# ---------------------------------------------------------------- rows -> DataProto


def split_point(row: Row) -> int:
    """Prompt length of a row in verl's split: index of its first trained token, at least 1."""
    for i, m in enumerate(row.loss_mask):
        if m:
            return max(i, 1)
    return max(len(row) - 1, 1)


def rows_to_tensors(rows: Sequence[Row], *, agg: str = "rollout-token-mean", pad_id: int = 0,
                    pad_to_multiple: int = 1) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """The tensors and non-tensors of `rows_to_dataproto` (see there)."""
    if not rows:
        raise ValueError("no rows")
    # weights over the whole step, from the full masks, as the torch engine does
    w_full = loss_weights([torch.tensor(r.loss_mask) for r in rows], [r.rollout_id for r in rows], agg)
    cuts = [split_point(r) for r in rows]
    n_real = len(rows)
    n = -(-n_real // pad_to_multiple) * pad_to_multiple
    P = max(cuts)
    R = max(max(len(r) - c for r, c in zip(rows, cuts)), 1)
    prompts = torch.full((n, P), pad_id, dtype=torch.long)
    responses = torch.full((n, R), pad_id, dtype=torch.long)
    attn = torch.zeros(n, P + R, dtype=torch.long)
    resp_mask = torch.zeros(n, R, dtype=torch.long)
    old = torch.zeros(n, R, dtype=torch.float32)
    adv = torch.zeros(n, R, dtype=torch.float32)
    weights = torch.zeros(n, R, dtype=torch.float32)
    has_old = np.zeros(n, dtype=bool)
    for b, (row, c) in enumerate(zip(rows, cuts)):
        ids = torch.tensor(row.input_ids, dtype=torch.long)
        k = len(row) - c
        prompts[b, P - c:] = ids[:c]
        responses[b, :k] = ids[c:]
        attn[b, P - c:P + k] = 1
        m = torch.tensor(row.loss_mask[c:], dtype=torch.long)
        resp_mask[b, :k] = m
        weights[b, :k] = w_full[b][c:]
        per_token = (torch.tensor(row.token_advantages[c:], dtype=torch.float32) if row.token_advantages is not None
                     else row.advantage)
        adv[b, :k] = per_token * m.float()
        if row.behaviour_logprobs is not None:
            old[b, :k] = torch.tensor(row.behaviour_logprobs[c:], dtype=torch.float32) * m.float()
            has_old[b] = True
    for b in range(n_real, n):  # dp padding: one prompt token, one response token, weight 0, mask 0
        attn[b, P - 1:P + 1] = 1
        has_old[b] = True
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = torch.clamp(torch.cumsum(attn, dim=1) - 1, min=0)
    tensors = dict(prompts=prompts, responses=responses, input_ids=input_ids, attention_mask=attn,
                   position_ids=position_ids, response_mask=resp_mask, old_log_probs=old, advantages=adv)
    tensors[WEIGHTS_KEY] = weights
    pad = ["__pad__"] * (n - n_real)
    non_tensors = dict(
        uid=np.array([r.task_id if r.task_id is not None else r.rollout_id for r in rows] + pad, dtype=object),
        rollout_id=np.array([r.rollout_id for r in rows] + pad, dtype=object),
        has_old_log_probs=has_old,
        is_pad=np.array([False] * n_real + [True] * (n - n_real), dtype=bool),
    )
    return tensors, non_tensors


def rows_to_dataproto(rows: Sequence[Row], *, agg: str = "rollout-token-mean", pad_id: int = 0,
                      pad_to_multiple: int = 1, temperature: float = 1.0):
    """A verl `DataProto` for one update over `rows` (advantages already set on them).

    batch (B = rows, padded up to a multiple of `pad_to_multiple` with weight-0 rows; P, R =
    longest prompt / response): prompts (B,P) left-padded, responses (B,R) right-padded,
    input_ids = [prompts|responses], attention_mask, position_ids, response_mask (1 = trained
    token), old_log_probs (vLLM's behaviour log-probs, 0 where none), advantages (the rollout's
    A on trained tokens), rollout_is_weights (our step-normalised weights `grpo.loss_weights`).
    non_tensor_batch: uid (task id = GRPO group), rollout_id, has_old_log_probs, is_pad.
    meta_info: temperature, loss aggregation, counts.
    """
    from verl import DataProto

    tensors, non_tensors = rows_to_tensors(rows, agg=agg, pad_id=pad_id, pad_to_multiple=pad_to_multiple)
    meta = dict(temperature=temperature, lightning_agg=agg, n_rows=len(rows),
                n_rollouts=len({r.rollout_id for r in rows}))
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)


def dataproto_to_rows(data) -> list[Row]:
    """Inverse of `rows_to_dataproto` for the fields it carries (tests, debugging); pad rows dropped.

    Not carried: agent, policy_version, call_ids, truncated. A trained first token (no left
    context) comes back with loss-mask 0 (neither engine can train it).
    """
    b = data.batch
    P = b["prompts"].shape[1]
    out = []
    for i in range(len(data)):
        if data.non_tensor_batch["is_pad"][i]:
            continue
        attn = b["attention_mask"][i].bool()
        ids = b["input_ids"][i][attn].tolist()
        c = int(attn[:P].sum())
        k = len(ids) - c
        mask = [0] * c + b["response_mask"][i, :k].tolist()
        lps = None
        if data.non_tensor_batch["has_old_log_probs"][i]:
            lps = tuple([0.0] * c + b["old_log_probs"][i, :k].tolist())
        trained = b["response_mask"][i, :k].bool()
        on_trained = b["advantages"][i, :k][trained]
        adv = float(on_trained[0]) if bool(trained.any()) else 0.0
        per_turn = bool((on_trained != adv).any())  # per-turn credit: advantages differ by call
        token_adv = tuple([0.0] * c + b["advantages"][i, :k].tolist()) if per_turn else None
        rid = data.non_tensor_batch["rollout_id"][i]
        uid = data.non_tensor_batch["uid"][i]
        out.append(Row(rollout_id=rid, task_id=uid, agent=None, input_ids=tuple(ids), loss_mask=tuple(mask),
                       behaviour_logprobs=lps, advantage=adv, token_advantages=token_adv))
    return out


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


_DTYPES = {"bf16": "bf16", "fp32": "fp32", "bfloat16": "bf16", "float32": "fp32"}


def build_actor_config(model_dir: str | Path, cfg: VerlEngineConfig, checkpoint_dir: str | Path | None = None):
    """verl's `actor_rollout_ref` config (hydra, from verl's own ppo_trainer.yaml) for our actor-only worker."""
    import verl
    from hydra import compose, initialize_config_dir

    if cfg.loss.kl_coef or cfg.loss.entropy_coef:
        raise ValueError("the verl engine supports kl_coef = entropy_coef = 0 only (verl aggregates those terms "
                         "unweighted; see the module docstring)")
    if cfg.freeze_embeddings:
        raise ValueError("freeze_embeddings is not supported by the verl engine")
    if cfg.loss.agg not in ("rollout-token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        raise ValueError(f"unknown aggregation {cfg.loss.agg!r}")
    a = "actor_rollout_ref"
    dual = cfg.loss.dual_clip_c is not None
    overrides = [
        f"{a}.model.path={Path(model_dir).resolve()}",
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
    from verl.workers.engine_workers import ActorRolloutRefWorker

    class LightningActorWorker(ActorRolloutRefWorker):
        """verl's actor worker (role "actor": FSDP actor, no rollout, no ref) with our policy loss registered."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            register_policy_loss()
            super().__init__(*args, **kwargs)

    LightningActorWorker.__module__ = __name__
    LightningActorWorker.__qualname__ = "LightningActorWorker"
    globals()["LightningActorWorker"] = LightningActorWorker
    return LightningActorWorker


def __getattr__(name: str) -> Any:  # PEP 562: the lazily made worker class, for unpickling by reference
    if name == "LightningActorWorker":
        return actor_worker_cls()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class VerlEngine:
    """verl's FSDP actor on Ray behind our `Engine` protocol (GPU machines)."""

    def __init__(self, model_dir: str | Path, config: VerlEngineConfig = VerlEngineConfig(), *,
                 policy_version: int = 0, work_dir: str | Path | None = None) -> None:
        check_verl_version()
        import ray
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

        if not torch.cuda.is_available():
            raise RuntimeError("the verl engine needs GPUs (verl 0.9.1's FSDP engine is registered for cuda/npu "
                               "only); use --engine torch on CPU")
        self.source_dir = Path(model_dir)
        self.config = config
        self.policy_version = policy_version
        self.work_dir = Path(work_dir) if work_dir else Path("runs/verl_work")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.full_config = build_actor_config(self.source_dir, config)
        if not ray.is_initialized():
            repo = str(Path(__file__).resolve().parent.parent)
            env = {"PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])),
                   "TOKENIZERS_PARALLELISM": "false"}
            ray.init(runtime_env={"env_vars": env}, **config.ray_init)
        pool = RayResourcePool(process_on_nodes=[config.n_gpus] * config.nnodes, use_gpu=True, max_colocate_count=1)
        cls = RayClassWithInitArgs(cls=ray.remote(actor_worker_cls()),
                                   config=self.full_config.actor_rollout_ref, role="actor")
        self.world_size = config.n_gpus * config.nnodes
        # Any: the worker group gets its methods (init_model, update_actor, ...) from the worker class at run time
        wg: Any = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cuda")
        wg.init_model()
        self.wg = wg
        from transformers import AutoConfig

        pad = AutoConfig.from_pretrained(self.source_dir).pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        log.info("VerlEngine: %s on %d GPU(s), version %d", self.source_dir, self.world_size, policy_version)

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
        """HF safetensors + config via verl's checkpoint manager (save_contents=[hf_model]), plus tokenizer files."""
        from trainer_backend.engines.torch_engine import TOKENIZER_FILES

        out = Path(out_dir)
        ckpt = self.work_dir / f"v{self.policy_version}"
        self.wg.save_checkpoint(str(ckpt), None, self.policy_version, 1)
        hf = ckpt / "huggingface"
        out.mkdir(parents=True, exist_ok=True)
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
