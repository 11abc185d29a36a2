"""The trainer's whole configuration, from a TOML file and command-line flags, validated.

    lightning-mw trainer --config trainer.toml --lr 5e-5      # a flag overrides the file
    lightning-mw trainer --config trainer.toml --print-config # the resolved configuration

Every section is a pydantic model: an unknown key or a bad value is an error that names the
field (`loss.clip_low: Input should be greater than 0`). `TrainerSettings.engine_config()`,
`.trainer_config()` and `.loss_config()` turn it into what the engine and the daemon take.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from lightning_middleware.errors import UsageError
from trainer_backend.algorithms import registry
from trainer_backend.algorithms.registry import OUTCOME, get, trains_uniform_groups
from trainer_backend.serving.publisher import PauseMode

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

class SettingsError(UsageError, ValueError):
    """The configuration is invalid; the message names each bad field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSettings(_Section):
    store: str | None = None
    model: str | None = None  # the base model directory (HF format)
    serve: str | None = None  # vLLM server to publish weights to
    gateway: str | None = None  # gateway to pause during swaps
    gateway_token: str | None = None  # default: $LIGHTNING_GATEWAY_TOKEN
    # what requests in flight do during a swap: finish on the old weights first, or continue on the
    # new ones (serving/publisher.py)
    publish_pause: PauseMode = "wait"
    engine: Literal["torch", "verl"] = "torch"
    mode: Literal["async", "sync"] = "async"
    checkpoints: str = "runs/checkpoints"
    keep_checkpoints: int = Field(3, ge=1)
    trainer_id: str = "trainer-0"
    max_steps: int | None = Field(None, ge=1)
    max_staleness: int = Field(1, ge=0)
    stale: Literal["drop", "keep"] = "drop"
    max_len: int | None = Field(None, ge=2)
    success_threshold: float = 1.0
    # train though the served model tokenises differently from the trainer's (serving/parity.py)
    allow_template_mismatch: bool = False


class GroupSettings(_Section):
    size: int = Field(8, ge=1)  # rollouts per task that make a full group
    per_step: int = Field(16, ge=1)  # groups a step waits for
    min_size: int = Field(2, ge=1)
    timeout_s: float = Field(300.0, gt=0)


class AlgorithmSettings(_Section):
    name: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "ppo", "dpo"] = "grpo"
    # "rollout": one advantage per rollout, every row of it shares it (the default); "sample":
    # each row is its own sample in its group (verl's view: a rollout split in k rows counts k times)
    advantage_level: Literal["rollout", "sample"] = "rollout"
    loss_agg: Literal["rollout-token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = (
        "rollout-token-mean")
    # "rollout": the rollout's reward decides every token (the default); "per-turn": each call's
    # return (its own and later calls' per-step rewards + the final reward), algorithms/advantages.py
    credit: Literal["rollout", "per-turn"] = "rollout"
    credit_gamma: float = Field(1.0, gt=0, le=1)  # per-turn: the discount per call


class OptimSettings(_Section):
    lr: float = Field(1e-4, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int | None = Field(None, ge=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)  # 0 (or None): no clipping
    adam_eps: float = Field(1e-8, gt=0)

    @field_validator("max_grad_norm", mode="before")
    @classmethod
    def _no_clip(cls, v: Any) -> Any:
        return None if v == 0 else v


class LossSettings(_Section):
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.2, gt=0)
    dual_clip: float | None = Field(3.0, gt=1)  # 0 (or None): off
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    # where the KL to the frozen base model goes: a loss term, or a per-token penalty in the reward
    kl_in: Literal["loss", "reward"] = "loss"
    entropy_coef: float = Field(0.0, ge=0)
    # truncated importance sampling for stale rollouts: min(pi/pi_behaviour, tis_threshold) per token
    tis_threshold: float | None = Field(None, gt=1)

    @field_validator("dual_clip", mode="before")
    @classmethod
    def _off(cls, v: Any) -> Any:
        return None if v == 0 else v


class CriticSettings(_Section):  # algorithm.name = "ppo"
    lr: float = Field(1e-5, gt=0)
    gamma: float = Field(1.0, gt=0, le=1)
    lam: float = Field(1.0, ge=0, le=1)
    cliprange_value: float = Field(0.5, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)  # steps in which only the critic learns


class DPOSettings(_Section):  # algorithm.name = "dpo"
    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)


class LoraSettings(_Section):
    rank: int = Field(0, ge=0)  # 0: train every weight; > 0: a LoRA adapter of this rank on the frozen base
    alpha: int = Field(16, ge=1)
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    name: str = "policy"  # the adapter's served model name: what the agents call (serve with --max-lora-rank)
    # Separate policies per agent: one adapter per name (its served model name), all on one base;
    # each trains on the rows of calls served under its name (wrap(policies=...), gateway --policy).
    policies: tuple[str, ...] = ()
    default_policy: str | None = None  # trains rows of every other model (None: they are left out)


class EngineSettings(_Section):
    precision: Literal["auto", "fp32", "bf16-autocast", "bf16"] = "auto"
    micro_batch_tokens: int = Field(8192, ge=16)
    gradient_checkpointing: bool = False
    compile: bool = False
    freeze_embeddings: bool = False
    share_prefixes: bool = True  # decode a prefix that rows of a step share once (engines/batching.py)


class EvalSettings(_Section):
    every: int = Field(0, ge=0)  # evaluate after every N steps (0: never)
    agent: str | None = None  # "package.module:function"
    tasks: str | None = None  # a JSONL file of held-out tasks
    n: int = Field(1, ge=1)
    metric: str = "success_rate"
    higher_is_better: bool = True
    patience: int | None = Field(None, ge=1)  # early stopping
    concurrency: int = Field(8, ge=1)
    timeout_s: float | None = Field(None, gt=0)


class MonitorSettings(_Section):
    tensorboard: str | None = None  # a log dir
    wandb_project: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    health_checks: bool = True
    entropy_floor: float = Field(0.02, ge=0)
    kl_limit: float = Field(1.0, gt=0)
    grad_spike: float = Field(10.0, gt=1)
    prefix_break_limit: float = Field(0.1, ge=0, le=1)  # an agent's share of calls breaking their prefix
    retokenize_limit: float = Field(0.05, ge=0, le=1)  # an agent's share of calls re-tokenising differently


class RewardSettings(_Section):
    # a reward configuration's hash: train on the final reward stored under it (a rescore's version)
    version: str | None = None
    # a reward configuration file whose ranking judge the daemon runs on each ready group
    config: str | None = None
    wait_for: dict[str, float] = Field(default_factory=dict)  # component -> seconds after the rollout ended
    on_deadline: Literal["train_without", "skip"] = "train_without"
    rank_ahead: bool = True  # the configuration's ranking judge ranks ready groups while the trainer trains

    @field_validator("wait_for")
    @classmethod
    def _deadlines(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: s for k, s in v.items() if s < 0}
        if bad:
            raise ValueError(f"deadlines must be seconds >= 0, got {bad}")
        return v


class TrainerSettings(_Section):
    run: RunSettings = RunSettings()
    group: GroupSettings = GroupSettings()
    algorithm: AlgorithmSettings = AlgorithmSettings()
    optim: OptimSettings = OptimSettings()
    loss: LossSettings = LossSettings()
    critic: CriticSettings = CriticSettings()
    dpo: DPOSettings = DPOSettings()
    lora: LoraSettings = LoraSettings()
    engine: EngineSettings = EngineSettings()
    eval: EvalSettings = EvalSettings()
    monitor: MonitorSettings = MonitorSettings()
    rewards: RewardSettings = RewardSettings()

    @model_validator(mode="after")
    def _consistent(self) -> TrainerSettings:
        if self.eval.every and not (self.eval.agent and self.eval.tasks):
            raise ValueError("eval.every needs eval.agent and eval.tasks")
        if self.group.min_size > self.group.size:
            raise ValueError(f"group.min_size ({self.group.min_size}) is larger than group.size ({self.group.size})")
        if self.run.engine == "verl" and (self.algorithm.name in ("ppo", "dpo") or self.loss.kl_in == "reward"):
            raise ValueError(f"the verl engine runs the policy-gradient algorithms with the KL in the loss; "
                             f"algorithm {self.algorithm.name!r} / loss.kl_in {self.loss.kl_in!r} need engine 'torch'")
        a = self.algorithm
        try:
            registry.check_credit(a.credit, a.name, level=a.advantage_level, gamma=a.credit_gamma,
                         kl_in_reward=self.loss.kl_in == "reward" and self.loss.kl_coef > 0)
        except ValueError as exc:
            raise ValueError(f"algorithm.credit: {exc}") from None
        if self.lora.policies and not self.lora.rank:
            raise ValueError("lora.policies: separate policies are LoRA adapters; set lora.rank")
        if self.lora.default_policy and self.lora.default_policy not in self.lora.policies:
            raise ValueError(f"lora.default_policy {self.lora.default_policy!r} is not one of lora.policies")
        if self.optim.lr_schedule != "constant" and self.optim.total_steps is None and self.run.max_steps is None:
            raise ValueError(f"optim.lr_schedule {self.optim.lr_schedule!r} needs optim.total_steps or run.max_steps")
        return self

    # -- loading ------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainerSettings:
        """A TOML file (optional) with `overrides` ("section.key" -> value, None ignored) on top."""
        data: dict[str, Any] = {}
        if path is not None:
            try:
                data = tomllib.loads(Path(path).read_text())
            except OSError as exc:
                raise SettingsError(f"cannot read the trainer config {path}: {exc.strerror or exc}") from None
            except tomllib.TOMLDecodeError as exc:
                raise SettingsError(f"{path} is not valid TOML: {exc}") from None
        for dotted, value in (overrides or {}).items():
            if value is None:
                continue
            section, _, key = dotted.partition(".")
            section_data = data.setdefault(section, {})
            if not isinstance(section_data, dict):
                raise SettingsError(f"{section}: expected a table, got {section_data!r}")
            section_data[key] = value
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SettingsError(_describe(exc, path)) from None

    def to_toml(self) -> str:
        """The resolved configuration as TOML, loadable again, every option listed. TOML has no
        null: an option not set (None, its default) is a commented line naming its type, to
        uncomment and fill in; a None that turns a default off is written 0."""
        lines: list[str] = []
        for section, values in self.model_dump().items():
            lines.append(f"[{section}]")
            fields = type(getattr(self, section)).model_fields
            for key, value in values.items():
                if value is None and fields[key].default is None:
                    lines.append(f"# {key} = <{_type_name(fields[key].annotation)}>  (not set)")
                    continue
                lines.append(f"{key} = {_toml_value(0 if value is None else value)}")
            lines.append("")
        return "\n".join(lines)

    # -- what the engine and the daemon take -------------------------------------------
    def loss_config(self) -> Any:
        from trainer_backend.algorithms.losses import LossConfig

        algo = get(self.algorithm.name)
        agg: str = self.algorithm.loss_agg
        if algo.agg is not None and "loss_agg" not in self.algorithm.model_fields_set:
            agg = algo.agg  # GSPO's sequence-level objective
        in_reward = self.loss.kl_in == "reward"
        return LossConfig(agg=agg, clip_low=self.loss.clip_low, clip_high=self.loss.clip_high,
                          dual_clip_c=self.loss.dual_clip, kl_coef=0.0 if in_reward else self.loss.kl_coef,
                          kl_in_reward_coef=self.loss.kl_coef if in_reward else 0.0, kl_kind=self.loss.kl_estimator,
                          entropy_coef=self.loss.entropy_coef, tis_threshold=self.loss.tis_threshold,
                          ratio_level=algo.ratio_level,
                          advantage=self.algorithm.name if self.algorithm.name in OUTCOME else "grpo")

    def engine_config(self) -> Any:
        from trainer_backend.algorithms.advantages import CriticConfig
        from trainer_backend.algorithms.losses import DPOConfig
        from trainer_backend.engines.torch_engine import TorchEngineConfig

        o, e, c, name = self.optim, self.engine, self.critic, self.algorithm.name
        critic = (CriticConfig(lr=c.lr, gamma=c.gamma, lam=c.lam, cliprange_value=c.cliprange_value,
                               grad_clip=c.max_grad_norm, warmup_steps=c.warmup_steps) if name == "ppo" else None)
        dpo = DPOConfig(beta=self.dpo.beta, label_smoothing=self.dpo.label_smoothing) if name == "dpo" else None
        from trainer_backend.engines.lora import AdapterConfig

        lo = self.lora
        adapter = AdapterConfig(rank=lo.rank, alpha=lo.alpha, target_modules=lo.target_modules) if lo.rank else None
        return TorchEngineConfig(critic=critic, dpo=dpo, lora=adapter,
            lr=o.lr, adam_eps=o.adam_eps, weight_decay=o.weight_decay, grad_clip=o.max_grad_norm,
            loss=self.loss_config(), micro_batch_tokens=e.micro_batch_tokens, freeze_embeddings=e.freeze_embeddings,
            precision=e.precision, gradient_checkpointing=e.gradient_checkpointing, compile=e.compile,
            share_prefixes=e.share_prefixes, reference_dir=self.run.model, lr_schedule=o.lr_schedule,
            warmup_steps=o.warmup_steps,
            total_steps=o.total_steps or self.run.max_steps, min_lr_ratio=o.min_lr_ratio)

    def trainer_config(self) -> Any:
        from trainer_backend.daemon.config import GroupPolicy, TrainerConfig
        from trainer_backend.daemon.monitoring import HealthConfig
        from trainer_backend.daemon.reward_gate import RewardPolicy
        from trainer_backend.daemon.validation import EvalPolicy

        r, g, a, e, m = self.run, self.group, self.algorithm, self.eval, self.monitor
        policy = None
        if e.every and e.agent and e.tasks:
            policy = EvalPolicy(agent=e.agent, tasks=e.tasks, every=e.every, n=e.n, metric=e.metric,
                                higher_is_better=e.higher_is_better, patience=e.patience, concurrency=e.concurrency,
                                timeout_s=e.timeout_s)
        return TrainerConfig(
            checkpoint_dir=r.checkpoints, trainer_id=r.trainer_id, mode=r.mode, max_staleness=r.max_staleness,
            stale=r.stale, max_len=r.max_len, keep_checkpoints=r.keep_checkpoints,
            success_threshold=r.success_threshold, algorithm=a.name, advantage_level=a.advantage_level,
            credit=a.credit, credit_gamma=a.credit_gamma,
            group=GroupPolicy(group_size=g.size, groups_per_step=g.per_step, min_group_size=g.min_size,
                              group_timeout_s=g.timeout_s, skip_uniform=not trains_uniform_groups(a.name)),
            health=HealthConfig(enabled=m.health_checks, entropy_floor=m.entropy_floor, kl_limit=m.kl_limit,
                                grad_spike=m.grad_spike, prefix_break_limit=m.prefix_break_limit,
                                retokenize_limit=m.retokenize_limit),
            eval=policy, rewards=RewardPolicy(version=self.rewards.version, wait_for=dict(self.rewards.wait_for),
                                              on_deadline=self.rewards.on_deadline, config=self.rewards.config,
                                              rank_ahead=self.rewards.rank_ahead))


def _toml_value(value: Any) -> str:
    """A scalar as JSON (the same text in TOML); a table inline, `{ "key" = value }`."""
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items()) + " }"
    return json.dumps(value)


def _type_name(annotation: Any) -> str:
    """`int | None` -> "int"; `Literal["a", "b"] | None` -> "a|b"."""
    args = [a for a in get_args(annotation) if a is not type(None)] or [annotation]
    names = []
    for a in args:
        literal = get_args(a) if get_origin(a) is Literal else ()
        names.append("|".join(map(str, literal)) if literal else getattr(a, "__name__", str(a)))
    return " or ".join(names)


def _describe(exc: ValidationError, path: str | Path | None) -> str:
    where = f" in {path}" if path else ""
    problems = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(the configuration)"
        msg = err["msg"].removeprefix("Value error, ")
        problems.append(f"{field}: {msg}" + (f" (got {err['input']!r})" if err["type"] != "missing"
                                             and not isinstance(err.get("input"), dict) else ""))
    return f"invalid trainer configuration{where}:\n  " + "\n  ".join(problems)
