"""The torch engine's configuration and its learning-rate schedule (no model code here)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer_backend.algorithms.advantages import CriticConfig
from trainer_backend.algorithms.losses import DPOConfig, LossConfig
from trainer_backend.engines.lora import AdapterConfig


@dataclass(frozen=True)
class TorchEngineConfig:
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    loss: LossConfig = LossConfig()
    micro_batch_tokens: int = 8192  # padded tokens (rows x longest row) per micro-batch
    # Lowers micro_batch_tokens so that the activations kept for backward stay within this many MB
    # (batching.activation_bytes_per_token's estimate; SmolLM2-135M in fp32: ~1.8 MB a token, so
    # 8,192 tokens would keep ~15 GB). None: micro_batch_tokens alone.
    activation_budget_mb: float | None = 4096
    # The output layer and log-softmax run on chunks of positions whose fp32 logits fit in this many
    # MB, recomputed in backward (algorithms/logprobs.py); one chunk, no recompute, when all fit. None:
    # the model's own forward computes all kept positions' logits at once.
    logits_budget_mb: float | None = 256
    # Decode a prefix that several rows of a step share (a group's prompt, a rollout's first turns)
    # once for them all (engines/batching.py); the same log-probs and gradients up to rounding.
    # A BFCL-shaped step of SmolLM2 decodes 2.9x fewer tokens and runs 2.3x faster
    # (docs/benchmarks.md). Off under gradient_checkpointing and compile.
    share_prefixes: bool = True
    old_logprobs: str = "behaviour"  # "behaviour" (vLLM's) | "recompute" (current weights, before the update)
    freeze_embeddings: bool = False  # with tied embeddings this also freezes the LM head
    # "fp32"; "bf16-autocast": fp32 weights, matmuls in bf16 under torch.autocast (a cast per weight
    # per micro-batch); "bf16": weights, activations and gradients in bf16, with fp32 master weights
    # and AdamW state that the optimizer updates and copies back (no per-op casts; the fastest on
    # CPUs with AVX512-BF16, see docs/benchmarks.md); "auto": "bf16" where the device computes bf16
    # natively and faster than fp32 (trainer_backend.engines.precision's probe), else "fp32".
    precision: str = "auto"
    gradient_checkpointing: bool = False
    # torch.compile each decoder layer (inductor fuses norms, rotary, SiLU and residual adds): ~8-10%
    # faster steps on CPU once compiled. The first steps pay the compilation (15-60 s on 2 cores;
    # a new batch shape recompiles once more, then torch marks the dimensions dynamic).
    compile: bool = False
    reference_model: bool = False  # keep a frozen copy of the start weights for KL; implied by loss.kl_coef > 0
    # The frozen reference's weights (KL): None means the model the engine starts from. A resumed
    # run starts from its last checkpoint, so the daemon passes the base model here.
    reference_dir: str | None = None
    # Learning-rate schedule over optimizer steps: a linear warm-up over `warmup_steps`, then
    # "constant", or a "linear" / "cosine" decay to lr * min_lr_ratio at `total_steps`.
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    # PPO: a critic (the base model with a value head) and GAE advantages (algorithms/advantages.py);
    # the rows' `reward` is then used and their `advantage` ignored.
    critic: CriticConfig | None = None
    # DPO instead of a policy gradient (algorithms/losses.py): rows labelled +1/-1 as their advantage,
    # paired by task id, against the frozen reference (reference_dir, else the start weights).
    dpo: DPOConfig | None = None
    # Train a LoRA adapter on the frozen base instead of every weight (engines/lora.py); checkpoints
    # are then adapter folders that the publisher hot-loads into vLLM by name.
    lora: AdapterConfig | None = None


PRECISIONS = ("auto", "fp32", "bf16-autocast", "bf16")
LR_SCHEDULES = ("constant", "linear", "cosine")
# Optimizer and schedule state saved beside the weights, so a resumed run continues exactly.
STATE_FILE = "trainer_state.pt"


def lr_factor(config: TorchEngineConfig, step: int) -> float:
    """The multiplier of the peak lr at optimizer step `step` (0-based)."""
    return schedule_factor(step, config.lr_schedule, config.warmup_steps, config.total_steps, config.min_lr_ratio)


def schedule_factor(step: int, schedule: str = "constant", warmup_steps: int = 0, total_steps: int | None = None,
                    min_lr_ratio: float = 0.0) -> float:
    """The multiplier of the peak lr at step `step` (0-based): a linear warm-up over `warmup_steps`,
    then `schedule` ("constant", or a "linear" / "cosine" decay to `min_lr_ratio` at `total_steps`).
    The RL engine's schedule (`lr_factor`) and the demo warm starts' SFT."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or not total_steps:
        return 1.0
    span = max(1, total_steps - warmup_steps)
    done = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - done)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * done))
