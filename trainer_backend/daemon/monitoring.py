"""Watching a training run: health checks from the troubleshooting checklist (each a warning that
names its remedy, and a store event), and step metrics to TensorBoard and Weights & Biases.

The checks look at each step's metrics against the run's own history:

    entropy_collapse   entropy below `entropy_floor`, or below `entropy_drop` x the first steps'
    kl_explosion       approx_kl (to the behaviour policy) or kl_ref (to the base model) above `kl_limit`
    negative_rewards   every reward of the step's rollouts below 0
    grad_norm_spike    grad_norm above `grad_spike` x the median of the last `window` steps
    prefix_breaks      an agent's prefix_break_rate above `prefix_break_limit` (drift.py)
    retokenize_mismatch  an agent's share of calls whose stored prompt IDs differ from the trainer's
                       rendering above `retokenize_limit` (drift.py)

The two drift checks need `min_chances` calls of the agent in the step, so one odd call of a
rarely-called agent does not warn.
"""

from __future__ import annotations

import logging
import netrc
import os
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlparse

log = logging.getLogger(__name__)

REMEDIES = {
    "entropy_collapse": "the policy is turning deterministic and stops exploring: raise loss.entropy_coef "
                        "(1e-3 to 1e-2), lower optim.lr, or let the agent sample at a higher temperature",
    "kl_explosion": "the policy moves away fast: lower optim.lr, tighten loss.clip_high, raise loss.kl_coef, "
                    "or lower run.max_staleness (stale rollouts drift the most)",
    "negative_rewards": "every reward of the batch is negative: relative advantages still train, but check "
                        "the reward function's sign and scale (a success must score higher than a failure)",
    "grad_norm_spike": "one step's gradient is far above the recent ones: lower optim.lr or optim.max_grad_norm; "
                       "stale tokens with large ratios are the usual cause (loss.dual_clip, loss.tis_threshold)",
    "prefix_breaks": "the agent's next prompt does not extend what the model saw before, so its turns train as "
                     "separate rows: a chat template that re-renders history (dropped reasoning, re-serialised "
                     "tool calls) or an agent that edits its history; `lightning-mw inspect --drift` lists "
                     "where, and the agent's framework may have an option to keep history verbatim",
    "retokenize_mismatch": "the trainer's tokenizer renders the stored requests differently from the IDs the "
                           "server sampled: serve the trainer's tokenizer and chat template (vLLM's "
                           "--chat-template, --tokenizer); the rows still train on the server's IDs",
}


@dataclass(frozen=True)
class HealthConfig:
    entropy_floor: float = 0.02
    entropy_drop: float = 0.1  # of the mean entropy of the first `window` steps
    kl_limit: float = 1.0
    grad_spike: float = 10.0
    window: int = 20
    prefix_break_limit: float = 0.1
    retokenize_limit: float = 0.05
    min_chances: int = 5
    enabled: bool = True


@dataclass(frozen=True)
class Finding:
    kind: str
    message: str
    data: dict[str, Any]

    @property
    def remedy(self) -> str:
        return REMEDIES[self.kind]


class HealthChecks:
    """Findings for each step, from its metrics and the run's history."""

    def __init__(self, config: HealthConfig = HealthConfig()) -> None:
        self.config = config
        self._first_entropy: list[float] = []
        self._grad_norms: deque[float] = deque(maxlen=config.window)

    def check(self, metrics: dict[str, Any]) -> list[Finding]:
        if not self.config.enabled:
            return []
        c, found = self.config, []
        entropy = _number(metrics, "entropy")
        if entropy is not None:
            start = statistics.fmean(self._first_entropy) if self._first_entropy else None
            if len(self._first_entropy) < c.window:
                self._first_entropy.append(entropy)
            dropped = start is not None and len(self._first_entropy) >= 3 and entropy < c.entropy_drop * start
            if entropy < c.entropy_floor or dropped:
                found.append(Finding("entropy_collapse", f"entropy {entropy:.4f} (first steps: "
                                     f"{start if start is not None else float('nan'):.4f})",
                                     {"entropy": entropy, "entropy_start": start or 0.0}))
        for key in ("approx_kl", "kl_ref"):
            kl = _number(metrics, key)
            if kl is not None and abs(kl) > c.kl_limit:
                found.append(Finding("kl_explosion", f"{key} {kl:.4f} above {c.kl_limit:g}", {key: kl}))
        top = _number(metrics, "reward_max")
        if top is not None and top < 0:
            found.append(Finding("negative_rewards", f"the best reward of the step is {top:g}", {"reward_max": top}))
        grad = _number(metrics, "grad_norm")
        if grad is not None:
            if len(self._grad_norms) >= 5:
                median = statistics.median(self._grad_norms)
                if median > 0 and grad > c.grad_spike * median:
                    found.append(Finding("grad_norm_spike", f"grad_norm {grad:.3g} is {grad / median:.0f}x the "
                                         f"median of the last {len(self._grad_norms)} steps",
                                         {"grad_norm": grad, "median": median}))
            self._grad_norms.append(grad)
        found += self._drift(metrics)
        return found

    def _drift(self, metrics: dict[str, Any]) -> list[Finding]:
        c, found = self.config, []
        checks = (("prefix_breaks", "prefix_break_rate/", "prefix_chances/", c.prefix_break_limit,
                   "of its calls broke the prefix of its previous one"),
                  ("retokenize_mismatch", "retokenize_mismatch_share/", "retokenize_checked/", c.retokenize_limit,
                   "of its calls re-tokenise differently from their stored prompt IDs"))
        for kind, rate_key, count_key, limit, what in checks:
            for key in sorted(k for k in metrics if k.startswith(rate_key)):
                agent = key[len(rate_key):]
                rate, count = _number(metrics, key), _number(metrics, count_key + agent)
                if rate is not None and count is not None and count >= c.min_chances and rate > limit:
                    found.append(Finding(kind, f"agent {agent}: {rate:.0%} {what} ({count:.0f} checked; "
                                         f"limit {limit:.0%})", {"agent": agent, "rate": rate, "count": count}))
        return found


def _number(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) and value == value else None


class Monitor:
    """Step metrics to TensorBoard (a log dir) and/or Weights & Biases (a project; `mode="offline"`
    writes the run under ./wandb for a later `wandb sync`). An online W&B run that cannot start
    (no API key, no network) falls back to offline with a warning: the training run goes on."""

    def __init__(self, *, tensorboard: str | None = None, wandb_project: str | None = None,
                 wandb_mode: Literal["online", "offline", "disabled"] = "online", run_name: str | None = None,
                 config: dict[str, Any] | None = None, wandb_dir: str | None = None,
                 wandb_init_timeout_s: float = 60.0) -> None:
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard)
        if wandb_project:
            self._wandb = _start_wandb(wandb_project, wandb_mode, init_timeout_s=wandb_init_timeout_s,
                                       name=run_name, config=config or {}, dir=wandb_dir)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_api_key_known() -> bool:
    """WANDB_API_KEY, or a `wandb login` entry in ~/.netrc ($NETRC) for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _start_wandb(project: str, mode: Literal["online", "offline", "disabled"], *, init_timeout_s: float,
                 **init: Any) -> Any:
    import wandb

    if mode == "online" and not _wandb_api_key_known():
        log.warning("W&B: no API key (set WANDB_API_KEY or run `wandb login`): logging offline instead; "
                    "`wandb sync` the run under %s/wandb later", init.get("dir") or ".")
        mode = "offline"
    try:
        return wandb.init(project=project, mode=mode, reinit="finish_previous",
                          settings=wandb.Settings(init_timeout=init_timeout_s), **init)
    except Exception as exc:  # noqa: BLE001 - wandb raises its own errors and the network's
        if mode != "online":
            raise
        log.warning("W&B: the online run did not start (%s: %s): logging offline instead; `wandb sync` it later",
                    type(exc).__name__, exc)
        return wandb.init(project=project, mode="offline", reinit="finish_previous", **init)
