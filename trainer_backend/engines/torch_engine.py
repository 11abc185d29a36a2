"""An in-process PyTorch training engine (one machine, CPU or one GPU) over transformers.

One `step(rows)` is one optimizer update:
  1. per-token loss weights over all rows of the step (grpo.loss_weights),
  2. old log-probs: vLLM's behaviour log-probs, or recomputed by a no-grad forward
     (config `old_logprobs="recompute"`, and always for rows that lack them),
  3. micro-batches of padded rows: forward, PPO loss, backward (gradients accumulate;
     the step-normalised weights make the sum exact, so no rescaling happens here),
  4. grad-norm clip, AdamW step, policy_version += 1.

The `Engine` protocol is what the trainer daemon uses, so a verl engine can sit behind it.
"""

from __future__ import annotations

import copy
import logging
import math
import shutil
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from lightning_middleware.rows import Row
from trainer_backend.algorithms.advantages import pairs_from_rows
from trainer_backend.algorithms.logprobs import (
    chunk_positions,
    head_logprobs,
    sampled_logits,
    split_head,
    token_logprobs_entropy,
)
from trainer_backend.algorithms.losses import loss_weights, policy_loss, rollout_coefficients
from trainer_backend.engines import lora, model_advantages
from trainer_backend.engines.batching import (
    MicroBatch,
    SharedPrefix,
    decoded_tokens,
    make_micro_batch,
    plan_micro_batches,
    token_budget,
)
from trainer_backend.engines.critic import Critic
from trainer_backend.engines.precision import resolve_precision
from trainer_backend.engines.torch_config import LR_SCHEDULES, PRECISIONS, STATE_FILE, TorchEngineConfig, lr_factor

log = logging.getLogger(__name__)

# Files a serving engine needs besides config + weights; copied from the source dir by save().
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)


# ---------------------------------------------------------------- the engine


class TorchEngine:
    """Trains a transformers causal LM in this process. Satisfies `Engine`."""

    def __init__(
        self,
        model_dir: str | Path,
        config: TorchEngineConfig = TorchEngineConfig(),
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        policy_version: int = 0,
        shared: lora.SharedAdapter | None = None,
    ) -> None:
        """`shared`: train that adapter of a peft model other engines hold too (a `PolicySet`);
        `model_dir` is then where this adapter's optimizer state may be (its checkpoint folder)."""
        if config.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, not {config.precision!r}")
        if config.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, not {config.lr_schedule!r}")
        config = replace(config, precision=resolve_precision(config.precision, device=torch.device(device).type))
        if config.precision == "bf16" and dtype != torch.float32:
            raise ValueError("precision='bf16' keeps fp32 master weights: load the model with dtype=torch.float32")
        self.source_dir = Path(model_dir)
        self.config = config
        self.device = torch.device(device)
        self.policy_version = policy_version
        self.base_dir = self.source_dir  # the full model a LoRA adapter sits on; the model itself otherwise
        self.is_lora = shared is not None or config.lora is not None or lora.is_adapter_dir(self.source_dir)
        self.adapter = shared.name if shared is not None else "default"
        if shared is not None:
            model, self.base_dir = shared.model, shared.base_dir
        elif self.is_lora:
            model, self.base_dir = lora.load(self.source_dir, config.lora or lora.AdapterConfig(), dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(self.source_dir, dtype=dtype)
        self.model: Any = model.to(self.device)
        self._activate()
        self.model.train()
        if config.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.model.config.use_cache = False
        if config.freeze_embeddings:
            self.model.get_input_embeddings().weight.requires_grad_(False)
        self.ref_model = None
        self.needs_reference = bool(config.reference_model or config.loss.kl_coef > 0
                                    or config.loss.kl_in_reward_coef > 0 or config.dpo)
        if self.needs_reference and not self.is_lora:  # LoRA: the base with the adapter off is the reference
            loaded: Any = None if config.reference_dir is None else AutoModelForCausalLM.from_pretrained(
                config.reference_dir, dtype=dtype)
            ref = copy.deepcopy(self.model) if loaded is None else loaded.to(self.device)
            self.ref_model = ref.eval().requires_grad_(False)
        self.params = (lora.adapter_parameters(self.model, self.adapter) if self.is_lora
                       else [p for p in self.model.parameters() if p.requires_grad])
        # The optimizer's parameters: the model's own, or fp32 masters of the bf16 model's.
        self.master = self.params
        if config.precision == "bf16":
            self.master = [p.detach().clone() for p in self.params]
            self.model.to(torch.bfloat16)
            if self.ref_model is not None:
                self.ref_model.to(torch.bfloat16)
        if config.compile:  # after the reference copy, which stays eager
            self._compile_layers()
        self.critic = None if config.critic is None else Critic(
            self.source_dir, config.critic, device=self.device, base_dir=self.base_dir,
            autocast_bf16=config.precision in ("bf16", "bf16-autocast"))
        # fused: one kernel for all parameters instead of a loop of small ops per tensor
        self.optimizer = torch.optim.AdamW(self.master, lr=config.lr, betas=config.betas, eps=config.adam_eps,
                                           weight_decay=config.weight_decay,
                                           fused=self.device.type in ("cpu", "cuda"))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda k: lr_factor(self.config, k))
        self.resumed = self._load_state(self.source_dir / STATE_FILE)
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.micro_batch_tokens = token_budget(self.model.config, config.micro_batch_tokens,
                                               config.activation_budget_mb, dtype_bytes=2 if config.precision == "bf16"
                                               else 4, checkpointed=config.gradient_checkpointing)
        log.info("TorchEngine: %s, %.2fM trainable params, %s, version %d", self.source_dir,
                 sum(p.numel() for p in self.params) / 1e6, config.precision, policy_version)

    def _activate(self) -> None:
        """Make this engine's adapter the active (and only trainable) one of a shared model."""
        if self.is_lora and self.model.active_adapter != self.adapter:
            self.model.set_adapter(self.adapter)

    def _compile_layers(self) -> None:
        """Compile the repeated decoder layers (one graph serves them all), not the whole model:
        the embedding, output layer and our log-prob function stay eager and shape-agnostic."""
        decoder = self.model.get_base_model() if self.is_lora else self.model
        layers = getattr(getattr(decoder, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"compile=True needs a decoder with .model.layers; {type(self.model).__name__} has none")
        for layer in layers:
            layer.compile()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        """Peak learning rate for the following steps (the configured schedule scales it; a caller
        with its own schedule, like the demo, keeps the default "constant" and sets it each step)."""
        if not lr > 0:
            raise ValueError(f"learning rate must be positive, got {lr}")
        self.scheduler.base_lrs = [lr for _ in self.optimizer.param_groups]
        factor = lr_factor(self.config, self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * factor

    def _load_state(self, path: Path) -> bool:
        """Continue from a checkpoint's optimizer and schedule state, if it has one."""
        if not path.is_file():
            return False
        state = torch.load(path, map_location=self.device, weights_only=True)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (KeyError, ValueError) as exc:  # other trainable parameters (e.g. freeze_embeddings changed)
            log.warning("optimizer state in %s does not fit this engine (%s): starting it fresh", path, exc)
            return False
        log.info("resumed the optimizer and lr schedule from %s (step %d)", path, self.scheduler.last_epoch)
        return True

    # -- forward helpers

    def _micro_batches(self, rows: Sequence[Row], weights: Sequence[torch.Tensor]) -> list[MicroBatch]:
        """The step's rows in micro-batches within the token budget; rows that start alike share
        their prefix's decoding where the engine runs the decoder itself (the chunked head), and
        neither gradient checkpointing (it drops a layer's keys and values) nor compiled layers
        (the prefix, the rows on it and lone rows are three graphs per layer: past dynamo's
        recompile limit) are on."""
        share = (self.config.share_prefixes and self.config.logits_budget_mb is not None
                 and not self.config.gradient_checkpointing and not self.config.compile
                 and split_head(self.model) is not None)
        plans = plan_micro_batches([r.input_ids for r in rows], self.micro_batch_tokens, share=share)
        return [make_micro_batch(rows, p.index, weights, self.pad_id, p.shared) for p in plans]

    def _autocast(self):
        if self.config.precision == "bf16-autocast":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _forward(self, model: torch.nn.Module, mb: MicroBatch, with_entropy: bool):
        """Per-token log-probs of the targets (B, T-1) and, optionally, entropies.

        Only positions that predict a trained token (weight != 0 in some row) get
        logits: prompts and tool results are most of an agent's tokens, and the
        output layer plus the vocabulary softmax are a large share of a small
        model's step. Other positions read 0 and carry weight 0 everywhere.
        The output layer runs in chunks of positions (algorithms/logprobs.py) so that only
        `logits_budget_mb` of logits live at once; the vocabulary-wide work (log-softmax,
        entropy, their backward) runs in cache-sized chunks on the logits in their own
        dtype (grpo.token_logprobs_entropy).
        """
        keep = (mb.weights != 0).any(0).nonzero().squeeze(-1).to(self.device)
        targets = mb.targets.to(self.device)[:, keep]
        sampling = tuple(None if t is None else t.to(self.device)[:, keep]
                         for t in (mb.temperature, mb.top_p, mb.top_k))
        ids, attn = mb.input_ids.to(self.device), mb.attention_mask.to(self.device)
        split = split_head(model) if self.config.logits_budget_mb is not None else None
        with self._autocast():
            if split is not None:
                decoder, out = split
                if mb.shared:
                    hidden = decode_shared_prefixes(decoder, ids, attn, mb.shared)[:, keep]
                else:
                    hidden = decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state[:, keep]
                chunk = chunk_positions(out.out_features, self.config.logits_budget_mb or 0.0)
                logp_k, ent_k = head_logprobs(hidden, out, targets, sampling, with_entropy, chunk)
            else:
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False, logits_to_keep=keep).logits
                if any(t is not None for t in sampling):  # the distribution each token was sampled from
                    logits = sampled_logits(logits, *sampling)
                logp_k, ent_k = token_logprobs_entropy(logits, targets, with_entropy)
        logp = logp_k.new_zeros(mb.targets.shape).index_copy(1, keep, logp_k)
        entropy = None
        if ent_k is not None:
            if not self.config.loss.entropy_coef:
                ent_k = ent_k.detach()  # a metric only: no backward through it
            entropy = ent_k.new_zeros(mb.targets.shape).index_copy(1, keep, ent_k)
        return logp, entropy

    @torch.no_grad()
    def _old_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Behaviour log-probs where the row has them and the config uses them, else recomputed."""
        use_behaviour = (mb.has_behaviour if self.config.old_logprobs == "behaviour"
                         else torch.zeros_like(mb.has_behaviour))
        if bool(use_behaviour.all()):
            return mb.behaviour_logp.to(self.device)
        recomputed, _ = self._forward(self.model, mb, with_entropy=False)
        keep = use_behaviour.to(self.device).unsqueeze(-1)
        return torch.where(keep, mb.behaviour_logp.to(self.device), recomputed)

    @torch.no_grad()
    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """The frozen reference's log-probs: its own copy, or (LoRA) the base with the adapter off."""
        if self.ref_model is not None:
            return self._forward(self.ref_model, mb, with_entropy=False)[0]
        with self.model.disable_adapter():
            return self._forward(self.model, mb, with_entropy=False)[0]

    def _model_advantages(self, rows: Sequence[Row], batches: list[MicroBatch],
                          old: Sequence[torch.Tensor | None]) -> model_advantages.ModelAdvantages:
        """PPO's GAE and a KL penalty in the reward: advantages from a no-grad pass of the models."""
        def current(mb: MicroBatch) -> torch.Tensor:  # TIS: the old policy is the current one
            with torch.no_grad():
                return self._forward(self.model, mb, with_entropy=False)[0]

        olds = [o if o is not None else current(mb) for mb, o in zip(batches, old)]
        return model_advantages.compute(
            rows, batches, olds, self.config.loss, critic=self.config.critic,
            values=self.critic.values if self.critic is not None else None,
            ref_logprobs=self._reference_logprobs if self.needs_reference else None)

    # -- the update

    def step(self, rows: Sequence[Row]) -> dict[str, float]:
        """One optimizer update on all rows (advantages already set on them). Returns metrics."""
        if not rows:
            raise ValueError("step() needs at least one row")
        if self.config.old_logprobs not in ("behaviour", "recompute"):
            raise ValueError(f"old_logprobs must be 'behaviour' or 'recompute', not {self.config.old_logprobs!r}")
        self._activate()
        if self.config.dpo is not None:
            return self._dpo_step(rows)
        t0 = time.perf_counter()
        cfg = self.config.loss
        weights = loss_weights([torch.tensor(r.loss_mask) for r in rows], [r.rollout_id for r in rows], cfg.agg)
        batches = self._micro_batches(rows, weights)
        # Old log-probs first, for every micro-batch, so that all are taken before any update. With
        # truncated importance sampling the old policy is the current one: every forward below
        # runs before the update, so its detached log-probs are it (no extra forward).
        tis = cfg.tis_threshold is not None
        old = [None if tis else self._old_logprobs(mb) for mb in batches]
        adv_pass = None
        if model_advantages.needs_model(cfg, self.config.critic):
            adv_pass = self._model_advantages(rows, batches, old)
            batches = adv_pass.batches

        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for mb, old_logp in zip(batches, old):
            logp, entropy = self._forward(self.model, mb, with_entropy=True)
            ref_logp = self._reference_logprobs(mb) if self.needs_reference else None
            behaviour = None
            if old_logp is None:  # TIS: weigh each token by min(pi_current / pi_behaviour, threshold)
                old_logp = logp.detach()
                has = mb.has_behaviour.to(self.device).unsqueeze(-1)
                behaviour = torch.where(has, mb.behaviour_logp.to(self.device), old_logp)
            loss, mb_sums = policy_loss(logp, old_logp, mb.advantages.to(self.device), mb.weights.to(self.device),
                                        cfg, ref_logp=ref_logp, entropy=entropy, behaviour_logp=behaviour)
            loss.backward()
            mb_sums.update(_behaviour_gap(logp, mb, self.device))
            for k, v in mb_sums.items():
                sums[k] = max(sums.get(k, -math.inf), float(v)) if k.endswith("_max") else sums.get(k, 0.0) + float(v)

        lr_used = self.lr
        critic_metrics: dict[str, float] = {}
        if self.critic is not None and adv_pass is not None:
            assert adv_pass.old_values is not None and adv_pass.returns is not None
            critic_metrics = self.critic.update(batches, adv_pass.old_values, adv_pass.returns)
        grad_norm = self._optimizer_step(update=self.critic is None or self.critic.policy_may_update())
        self.policy_version += 1
        metrics = self._metrics(rows, batches, sums, grad_norm, time.perf_counter() - t0)
        metrics["lr"] = lr_used
        metrics.update(critic_metrics)
        if adv_pass is not None:
            metrics.update(adv_pass.metrics)
        if tis:
            n_resp = max(sums["response_tokens"], 1.0)
            metrics["tis_weight_mean"] = sums["tis_weight_sum"] / n_resp
            metrics["tis_truncated_frac"] = sums["tis_truncated_tokens"] / n_resp
        if sums.get("gap_tokens"):  # |vLLM's log-prob - ours| before the update: 0 up to rounding if they agree
            metrics["behaviour_logprob_gap"] = sums["gap_abs_sum"] / sums["gap_tokens"]
        return metrics

    def _optimizer_step(self, update: bool = True) -> float:
        """Clip the accumulated gradients and step AdamW and the lr schedule (not during a critic
        warm-up: `update=False`); returns the gradient norm before clipping."""
        if self.master is not self.params:  # bf16: the fp32 masters take the gradients and the update
            for m, p in zip(self.master, self.params):
                m.grad = p.grad.float() if p.grad is not None else None
                p.grad = None
        clip = self.config.grad_clip if self.config.grad_clip is not None else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.master, clip))
        if update:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.master is not self.params:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
        return grad_norm

    def _dpo_step(self, rows: Sequence[Row]) -> dict[str, float]:
        """One DPO update, exact across micro-batches (the two passes of algorithms/losses.py)."""
        assert self.config.dpo is not None
        t0 = time.perf_counter()
        pairs = pairs_from_rows([r.task_id for r in rows], [r.rollout_id for r in rows], [r.advantage for r in rows])
        weights = [torch.tensor(r.loss_mask, dtype=torch.float32) for r in rows]  # a plain sum over response tokens
        batches = self._micro_batches(rows, weights)
        logp: dict[str, float] = dict.fromkeys((r.rollout_id for r in rows), 0.0)
        ref_logp = dict(logp)
        with torch.no_grad():
            for mb in batches:
                policy = self._forward(self.model, mb, with_entropy=False)[0]
                for per_token, sums in ((policy, logp), (self._reference_logprobs(mb), ref_logp)):
                    per_row = (per_token * mb.weights.to(self.device)).sum(-1)
                    for i, v in zip(mb.index, per_row.tolist()):
                        sums[rows[i].rollout_id] += v
        coef, metrics = rollout_coefficients(pairs, logp, ref_logp, self.config.dpo)
        self.optimizer.zero_grad(set_to_none=True)
        for mb in batches:
            c = torch.tensor([coef[rows[i].rollout_id] for i in mb.index], dtype=torch.float32, device=self.device)
            logp_t, _ = self._forward(self.model, mb, with_entropy=False)
            (c.unsqueeze(-1) * logp_t * mb.weights.to(self.device)).sum().backward()
        grad_norm = self._optimizer_step()
        self.policy_version += 1
        elapsed = time.perf_counter() - t0
        tokens = sum(len(r) for r in rows)
        return {**metrics, "loss": metrics["dpo_loss"], "grad_norm": grad_norm, "pairs": float(len(pairs)),
                "rows": float(len(rows)), "micro_batches": float(len(batches)), "tokens": float(tokens),
                "time_s": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
                "policy_version": float(self.policy_version)}

    def _metrics(self, rows: Sequence[Row], batches: Sequence[MicroBatch], sums: dict[str, float],
                 grad_norm: float, elapsed: float) -> dict[str, float]:
        n_resp = max(sums["response_tokens"], 1.0)
        tokens = sum(len(r) for r in rows)
        metrics = {
            "loss": sums["loss"],
            "pg_loss": sums["pg_loss"],
            "clip_frac": sums["clipped_tokens"] / n_resp,
            "clip_frac_lower": sums["clipped_lower_tokens"] / n_resp,
            "approx_kl": sums["neg_log_ratio_sum"] / n_resp,  # mean(old - new) over response tokens, verl's ppo_kl
            "ratio_max": math.exp(min(sums.get("log_ratio_max", -math.inf), 700.0)),
            "entropy": sums.get("entropy", float("nan")),  # aggregated like the loss
            "grad_norm": grad_norm,
            "rows": float(len(rows)),
            "rollouts": float(len({r.rollout_id for r in rows})),
            "micro_batches": float(len(batches)),
            "tokens": float(tokens),
            "padded_tokens": float(sum(mb.input_ids.numel() for mb in batches)),
            "decoded_tokens": float(sum(decoded_tokens(mb) for mb in batches)),
            "response_tokens": sums["response_tokens"],
            "time_s": elapsed,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "policy_version": float(self.policy_version),
        }
        if "kl_ref" in sums:
            metrics["kl_ref"] = sums["kl_ref"]
        return metrics

    @torch.no_grad()
    def token_logprobs(self, rows: Sequence[Row]) -> list[tuple[float, ...]]:
        """The current policy's log-prob of every token of each row as the trainer computes it
        (at the row's sampling parameters); 0.0 at positions that are not response tokens."""
        self._activate()
        weights = loss_weights([torch.tensor(r.loss_mask) for r in rows], [r.rollout_id for r in rows], "token-mean")
        out: list[tuple[float, ...]] = [()] * len(rows)
        for mb in self._micro_batches(rows, weights):
            logp, _ = self._forward(self.model, mb, with_entropy=False)
            for b, i in enumerate(mb.index):
                masked = (logp[b] * (mb.weights[b] != 0)).tolist()[: len(rows[i]) - 1]
                out[i] = (0.0, *masked)
        return out

    # -- weights out

    def _fp32_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The weights to save: the model's own, or in bf16 mode the fp32 masters (not their bf16 rounding)."""
        if self.master is self.params:
            return None
        masters = {id(p): m for p, m in zip(self.params, self.master)}
        state = self.model.state_dict(keep_vars=True)
        return {name: masters.get(id(t), t).detach().float() for name, t in state.items()}

    def save(self, out_dir: str | Path) -> Path:
        """HF safetensors + config (+ generation config) and the source dir's tokenizer files."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if self.is_lora:  # the adapter alone, in the folder itself (what vLLM loads by name)
            lora.save_adapter(self.model, self.adapter, out, self._fp32_state_dict())
        else:
            self.model.save_pretrained(out, state_dict=self._fp32_state_dict())  # safetensors only in transformers 5
        # vLLM loads only the safetensors; the optimizer's moments (2x the trainable weights in
        # fp32) let a restarted trainer continue the same AdamW and lr schedule.
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                    "policy_version": self.policy_version}, out / STATE_FILE)
        if self.critic is not None:
            self.critic.save(out)
        for name in () if self.is_lora else TOKENIZER_FILES:  # an adapter is served on the base's tokenizer
            src = self.source_dir / name
            if src.is_file() and not (out / name).exists():
                shutil.copy2(src, out / name)
        log.info("saved policy version %d to %s", self.policy_version, out)
        return out


def decode_shared_prefixes(decoder: Any, ids: torch.Tensor, attn: torch.Tensor,
                           shared: Sequence[SharedPrefix]) -> torch.Tensor:
    """The decoder's last hidden states (B, T, H) of a right-padded batch, each shared prefix
    decoded once: its keys and values, repeated for its rows, are the past of the rows' own tokens
    (a transformers `DynamicCache`; the rows' gradients flow back into the prefix through them).
    Rows in no shared prefix are decoded together as usual."""
    from transformers import DynamicCache

    B, T = ids.shape
    parts: list[tuple[list[int], torch.Tensor]] = []
    for group in shared:
        rows = list(group.rows)
        end = int(attn[rows].sum(-1).max())  # the longest row of the group: less padding
        cache = DynamicCache(config=decoder.config)
        prefix = decoder(input_ids=ids[rows[:1], :group.length], past_key_values=cache,
                         use_cache=True).last_hidden_state
        cache.batch_repeat_interleave(len(rows))
        own = decoder(input_ids=ids[rows, group.length:end], attention_mask=attn[rows, :end], past_key_values=cache,
                      use_cache=True).last_hidden_state
        parts.append((rows, torch.cat([prefix.expand(len(rows), -1, -1), own], dim=1)))
    in_groups = {b for group in shared for b in group.rows}
    lone = [b for b in range(B) if b not in in_groups]
    if lone:
        end = int(attn[lone].sum(-1).max())
        parts.append((lone, decoder(input_ids=ids[lone, :end], attention_mask=attn[lone, :end],
                                    use_cache=False).last_hidden_state))
    hidden = torch.cat([torch.nn.functional.pad(h, (0, 0, 0, T - h.shape[1])) for _, h in parts])
    order = torch.tensor([b for rows, _ in parts for b in rows], device=ids.device)
    return hidden[torch.argsort(order)]


def _behaviour_gap(logp: torch.Tensor, mb: MicroBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """Sum of |behaviour - current| log-prob over the response tokens that have vLLM's log-prob."""
    mask = (mb.weights != 0) & mb.has_behaviour.unsqueeze(-1)
    mask = mask.to(device)
    gap = (mb.behaviour_logp.to(device) - logp.detach()).abs()
    return {"gap_abs_sum": (gap * mask).sum(), "gap_tokens": mask.sum().float()}
