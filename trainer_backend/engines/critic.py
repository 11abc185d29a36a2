"""PPO's critic for the torch engine: the base model with a scalar head (as verl's critic,
`AutoModelForTokenClassification` with one label), its own AdamW, saved beside the policy.

A separate network and not a value head on the policy: the value loss then cannot pull the
policy's weights, and the critic can be dropped or re-initialised without touching the
policy. It costs one more forward + backward per step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForTokenClassification

from trainer_backend.algorithms.advantages import CriticConfig
from trainer_backend.algorithms.losses import value_loss
from trainer_backend.engines.batching import MicroBatch

log = logging.getLogger(__name__)

CRITIC_DIR = "critic"  # inside a checkpoint: the critic's weights and optimizer state
STATE_FILE = "critic_state.pt"


class Critic:
    def __init__(self, model_dir: str | Path, config: CriticConfig, *, device: torch.device,
                 base_dir: str | Path | None = None, autocast_bf16: bool = False) -> None:
        """The critic saved in `model_dir/critic`, else a new one on `base_dir` (default `model_dir`)."""
        self.config = config
        self.device = device
        self.autocast_bf16 = autocast_bf16
        saved = Path(model_dir) / CRITIC_DIR
        source = saved if (saved / "config.json").is_file() else Path(base_dir or model_dir)
        # A policy checkpoint has no "score" head: transformers initialises it (and says so). No
        # dropout (the head's default is 0.1): old values and the update must see the same network.
        config_ = AutoConfig.from_pretrained(source, num_labels=1)
        config_.classifier_dropout = 0.0
        model: Any = AutoModelForTokenClassification.from_pretrained(source, config=config_, dtype=torch.float32)
        self.model: Any = model.to(device).train()
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=config.lr,
                                           fused=device.type in ("cpu", "cuda"))
        self.steps = 0  # critic updates so far (a resumed critic continues the count)
        self.resumed = self._load_state(saved / STATE_FILE)
        log.info("critic from %s%s", source, " (optimizer state resumed)" if self.resumed else "")

    def _load_state(self, path: Path) -> bool:
        if not path.is_file():
            return False
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        return True

    def policy_may_update(self) -> bool:
        """False during the warm-up, when only the critic learns (counted in critic updates)."""
        return self.steps > self.config.warmup_steps

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.autocast_bf16 else nullcontext()

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        """V at each position that predicts a token, (B, T-1): the value of the context before it."""
        with self._autocast():
            out = self.model(input_ids=mb.input_ids.to(self.device),
                             attention_mask=mb.attention_mask.to(self.device)).logits
        return out[:, :-1, 0].float()

    @torch.no_grad()
    def values(self, mb: MicroBatch) -> torch.Tensor:
        return self._values(mb)

    def update(self, batches: Sequence[MicroBatch], old_values: Sequence[torch.Tensor],
               returns: Sequence[torch.Tensor]) -> dict[str, float]:
        """One AdamW step on the clipped value loss, weighted like the policy loss (exact across
        micro-batches: the weights are normalised over the whole step)."""
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for mb, old, ret in zip(batches, old_values, returns):
            loss, mb_sums = value_loss(self._values(mb), old.to(self.device), ret.to(self.device),
                                       mb.weights.to(self.device), self.config.cliprange_value)
            loss.backward()
            for k, v in mb_sums.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        clip = self.config.grad_clip if self.config.grad_clip is not None else float("inf")
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        n = max(sums.get("tokens", 0.0), 1.0)
        mean_ret = sums["return_sum"] / n
        var_ret = max(sums["return_sq_sum"] / n - mean_ret**2, 0.0)
        var_err = max(sums["vf_sq_err_sum"] / n - (sums["vf_err_sum"] / n) ** 2, 0.0)
        return {"vf_loss": sums["vf_loss"], "vf_clip_frac": sums["vf_clipped_tokens"] / n,
                "vpred_mean": sums["vpred_sum"] / n,
                # 1 - Var(R - V) / Var(R), as verl's critic/vf_explained_var: 1 is a perfect critic
                "vf_explained_var": 1.0 - var_err / var_ret if var_ret > 0 else float("nan"),
                "critic_grad_norm": grad_norm}

    def save(self, checkpoint_dir: Path) -> None:
        out = checkpoint_dir / CRITIC_DIR
        self.model.save_pretrained(out)
        torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, out / STATE_FILE)
