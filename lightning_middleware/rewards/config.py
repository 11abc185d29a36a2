"""One reward configuration, in Python or in a TOML/JSON file, and its hash.

    reward_type = "hybrid"            # rule | model | hybrid
    on_error = "drop"                 # drop | partial: what a component that failed does to the final
    [rules]
    tool_call_valid = 1.0             # a built-in rule, by its weight
    task_complete = 5.0
    syntax_error = -2.0
    [rules.tests_pass]                # your own: a function of the trajectory, with parameters
    function = "my_project.rewards:tests_pass"
    weight = 3.0
    min_passed = 1
    [guards]
    repeated_tool_calls = { weight = -1.0, max_repeats = 2 }
    tests_bypassed = { weight = -1.0, action = "zero" }   # fired: the final reward is 0.0
    [reward_model]
    weight = 2.0
    url = "http://127.0.0.1:8001/v1"
    model = "judge"
    [rank_judge]                      # an LLM judge that ranks the rollouts of one group (ranking.py)
    weight = 2.0
    url = "http://127.0.0.1:8001/v1"
    model = "judge"
    [human]
    weight = 3.0
    interval = 10
    agent_reward = false              # the rollout may not report its own reward (below)

The final reward is the sum of weight x value over the components (docs/rewards.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_middleware.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # a declared dependency on 3.10
    import tomli as tomllib

REWARD_TYPES = ("rule", "model", "hybrid")
RANK_JUDGE = "rank_judge"  # the ranking judge's component name
AGENT = "agent"  # the name a configured rollout's own reported reward is stored under
ON_ERROR = ("drop", "partial")
SELF_REPORTED = {"task_complete", "agent_reward", "step_reward_sum"}  # built-ins that read the rollout's own rewards
GUARD_ACTIONS = ("penalise", "zero")
_TOP_KEYS = {"reward_type", "on_error", "rules", "guards", "reward_model", "rank_judge", "human", "name",
             "agent_reward"}
_MODEL_KEYS = {"weight", "url", "model", "scorer", "path", "prompt", "max_score", "scale", "offset", "timeout_s",
               "retries", "api_key_env", "max_chars"}
_RANK_KEYS = {"weight", "url", "model", "prompt", "timeout_s", "retries", "api_key_env", "max_chars",
              "max_tokens", "shuffle", "concurrency", "deadline_s", "scope"}
RANK_SCOPES = ("all", "uniform")
_RANK_EFFORT = {"api_key_env", "timeout_s", "retries", "concurrency", "deadline_s"}  # how, not what: not hashed
_HUMAN_KEYS = {"weight", "interval"}


class ConfigError(UsageError, ValueError):
    """A reward configuration is malformed; the message names the key."""


@dataclass(frozen=True)
class Component:
    """A rule or a guard as configured: `function` is a built-in's name, "package.module:function",
    or (in Python) the function itself; `params` are passed to it as keyword arguments."""

    name: str
    weight: float
    function: str | Callable[..., Any]
    params: Mapping[str, Any] = field(default_factory=dict)
    kind: str = "rule"  # rule | guard
    # A guard's effect when it fires (value > 0): "penalise" adds weight x value like any
    # component; "zero" makes the rollout's final reward 0.0 whatever the other components say.
    action: str = "penalise"

    def __post_init__(self) -> None:
        if self.action not in GUARD_ACTIONS:
            raise ConfigError(f"{self.kind}s.{self.name}.action must be one of {', '.join(GUARD_ACTIONS)}, "
                              f"got {self.action!r}")
        if self.kind != "guard" and self.action != "penalise":
            raise ConfigError(f"rules.{self.name}: only a guard takes an action")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "weight": self.weight, "function": function_name(self.function),
                "params": dict(sorted(self.params.items())), "kind": self.kind, "action": self.action}


@dataclass(frozen=True)
class RewardModelConfig:
    """A reward model: an OpenAI-compatible judge (`url`, `model`), a local Hugging Face
    sequence-classification model run in-process with transformers (`path`), or a `scorer`
    ("package.module:function" or a function of the trajectory returning a number)."""

    weight: float = 1.0
    url: str | None = None
    model: str | None = None
    scorer: str | Callable[..., Any] | None = None
    path: str | None = None  # a local Hugging Face sequence-classification model, run in-process
    prompt: str | None = None  # None: sources.DEFAULT_JUDGE_PROMPT
    max_score: float = 10.0  # the judge's scale: its score / max_score is the value, in [0, 1]
    scale: float = 1.0  # value * scale + offset: a calibration against human labels
    offset: float = 0.0
    timeout_s: float = 30.0
    retries: int = 2
    api_key_env: str | None = None  # the judge's key is read from this variable, never stored
    max_chars: int = 8000  # the transcript shown to the judge is cut to this many characters

    def describe(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in sorted(_MODEL_KEYS - {"api_key_env", "timeout_s", "retries"})}
        out["scorer"] = function_name(self.scorer) if self.scorer is not None else None
        return out


@dataclass(frozen=True)
class RankJudgeConfig:
    """An OpenAI-compatible LLM judge that ranks the rollouts of one group (one task) against
    each other; each rollout's value is its group-relative rank mapped to [0, 1] (ranking.py)."""

    url: str
    model: str
    weight: float = 1.0
    prompt: str | None = None  # None: ranking.DEFAULT_RANK_PROMPT; "{n}" and "{letters}" are filled in
    timeout_s: float = 60.0
    retries: int = 2  # answers it could not read are asked again this many times, then an error
    api_key_env: str | None = None  # the judge's key is read from this variable, never stored
    max_chars: int = 24000  # all candidates' transcripts together are cut to this many characters
    max_tokens: int = 256
    shuffle: bool = True  # candidates in an order drawn from their ids, so no rollout is always "A"
    concurrency: int = 4  # groups ranked at once (the trainer's ready groups, a rescore's groups)
    deadline_s: float = 120.0  # one group's ranking, every answer and retry together; then it failed
    # Which groups the judge ranks: "all", or "uniform": only those whose other components give
    # every member one final reward (no signal without the judge); the rest are not asked.
    scope: str = "all"

    def __post_init__(self) -> None:
        if not (isinstance(self.url, str) and self.url and isinstance(self.model, str) and self.model):
            raise ConfigError("[rank_judge] needs the judge's url and model (text)")
        for key in ("timeout_s", "deadline_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"rank_judge.{key} must be a number of seconds > 0, got {value!r}")
        for key, least in (("retries", 0), ("max_chars", 200), ("max_tokens", 1), ("concurrency", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"rank_judge.{key} must be a whole number >= {least}, got {value!r}")
        for key in ("prompt", "api_key_env"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise ConfigError(f"rank_judge.{key} must be text, got {getattr(self, key)!r}")
        if not isinstance(self.shuffle, bool):
            raise ConfigError(f"rank_judge.shuffle must be true or false, got {self.shuffle!r}")
        if self.scope not in RANK_SCOPES:
            raise ConfigError(f"rank_judge.scope must be one of {', '.join(map(repr, RANK_SCOPES))}, "
                              f"got {self.scope!r}")

    def describe(self) -> dict[str, Any]:
        # the default scope is left out: configurations written before it existed keep their hash
        return {k: getattr(self, k) for k in sorted(_RANK_KEYS - _RANK_EFFORT) if k != "scope" or self.scope != "all"}


@dataclass(frozen=True)
class HumanConfig:
    """Human feedback: `interval` N puts every Nth rollout (chosen by its id) on the labelling
    page's queue; labels of any rollout count."""

    weight: float = 1.0
    interval: int = 0


@dataclass(frozen=True)
class RewardConfig:
    reward_type: str = "hybrid"
    rules: tuple[Component, ...] = ()
    guards: tuple[Component, ...] = ()
    reward_model: RewardModelConfig | None = None
    human: HumanConfig | None = None
    on_error: str = "drop"
    rank_judge: RankJudgeConfig | None = None
    name: str | None = None
    # False: the scorer is the benchmark, a model or the trainer, never the rollout itself. The
    # gateway refuses a reward the rollout sends (POST /rollouts/{id}/reward, or a finish carrying
    # one) with a 403 and a store event, and a sandboxed rollout's returned number is not stored.
    # Not hashed: it decides who may report, not how a reward is computed.
    agent_reward: bool = True

    def __post_init__(self) -> None:
        _check_shape(self)

    @property
    def components(self) -> tuple[Component, ...]:
        return (*self.rules, *self.guards)

    def describe(self) -> dict[str, Any]:
        """Everything that changes a reward, as plain data (what the hash is taken of)."""
        return {
            "reward_type": self.reward_type, "on_error": self.on_error,
            "components": [c.describe() for c in self.components],
            "reward_model": self.reward_model.describe() if self.reward_model else None,
            "human": {"weight": self.human.weight} if self.human else None,
            # absent when not configured, so the hashes of configurations without one do not change
            **({"rank_judge": self.rank_judge.describe()} if self.rank_judge else {}),
        }

    @property
    def hash(self) -> str:
        """16 hex digits naming this configuration (the human queue's interval and the name aside)."""
        text = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def weights(self) -> dict[str, float]:
        out = {c.name: c.weight for c in self.components}
        if self.reward_model is not None:
            out["reward_model"] = self.reward_model.weight
        if self.rank_judge is not None:
            out[RANK_JUDGE] = self.rank_judge.weight
        if self.human is not None:
            out["human"] = self.human.weight
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RewardConfig:
        return from_dict(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> RewardConfig:
        return load_config(path)


def function_name(fn: str | Callable[..., Any]) -> str:
    if isinstance(fn, str):
        return fn
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _component(name: str, spec: Any, kind: str) -> Component:
    where = f"{kind}s.{name}"
    if not isinstance(spec, Mapping):
        return Component(name, _number(spec, where), name, {}, kind)
    if "weight" not in spec:
        raise ConfigError(f"{where} needs a weight")
    params = {k: v for k, v in spec.items() if k not in ("weight", "function", "params", "action")}
    extra = spec.get("params", {})
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{where}.params must be a table")
    function = spec.get("function", name)
    if not (isinstance(function, str) or callable(function)):
        raise ConfigError(f"{where}.function must be a built-in's name or 'package.module:function'")
    return Component(name, _number(spec["weight"], f"{where}.weight"), function, {**params, **extra}, kind,
                     str(spec.get("action", "penalise")))


def _components(data: Any, kind: str) -> tuple[Component, ...]:
    if data is None:
        return ()
    if not isinstance(data, Mapping):
        raise ConfigError(f"[{kind}s] must be a table of name = weight or name = {{ weight = ..., ... }}")
    return tuple(_component(str(name), spec, kind) for name, spec in data.items())


def _model(data: Any) -> RewardModelConfig | None:
    if data is None:
        return None
    if isinstance(data, RewardModelConfig):
        return data
    data = _table(data, "reward_model", _MODEL_KEYS)
    kw = dict(data)
    for key in ("weight", "max_score", "scale", "offset", "timeout_s"):
        if key in kw:
            kw[key] = _number(kw[key], f"reward_model.{key}")
    cfg = RewardModelConfig(**kw)
    if sum(x is not None for x in (cfg.url, cfg.scorer, cfg.path)) != 1:
        raise ConfigError("[reward_model] needs exactly one of url (an OpenAI-compatible judge), path (a local "
                          "sequence-classification model) or scorer (a function)")
    if cfg.url is not None and not cfg.model:
        raise ConfigError("[reward_model] with a url needs the judge's model name (model = ...)")
    if cfg.max_score <= 0:
        raise ConfigError("reward_model.max_score must be positive")
    return cfg


def _table(data: Any, name: str, known: set[str]) -> Mapping[str, Any]:
    """A [name] section checked for its shape and its keys: a ConfigError names what is wrong."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"[{name}] must be a table")
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"[{name}] has unknown keys {sorted(unknown)} (known: {sorted(known)})")
    return data


def _rank_judge(data: Any) -> RankJudgeConfig | None:
    if data is None or isinstance(data, RankJudgeConfig):
        return data
    data = _table(data, "rank_judge", _RANK_KEYS)
    kw = dict(data)
    for key in ("weight", "timeout_s", "deadline_s"):
        if key in kw:
            kw[key] = _number(kw[key], f"rank_judge.{key}")
    if "url" not in kw or "model" not in kw:
        raise ConfigError("[rank_judge] needs the judge's url and model (an OpenAI-compatible endpoint)")
    return RankJudgeConfig(**kw)


def _human(data: Any) -> HumanConfig | None:
    if data is None or isinstance(data, HumanConfig):
        return data
    data = _table(data, "human", _HUMAN_KEYS)
    interval = data.get("interval", 0)
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
        raise ConfigError(f"human.interval must be a whole number >= 0, got {interval!r}")
    return HumanConfig(weight=_number(data.get("weight", 1.0), "human.weight"), interval=interval)


def from_dict(data: Mapping[str, Any]) -> RewardConfig:
    """A configuration from the file's shape (module docstring); ConfigError names a bad key."""
    if not isinstance(data, Mapping):
        raise ConfigError("a reward configuration is a table (a TOML file or a JSON object)")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"unknown keys {sorted(unknown)} in the reward configuration (known: {sorted(_TOP_KEYS)})")
    return RewardConfig(
        reward_type=data.get("reward_type", "hybrid"), rules=_components(data.get("rules"), "rule"),
        guards=_components(data.get("guards"), "guard"), reward_model=_model(data.get("reward_model")),
        human=_human(data.get("human")), on_error=data.get("on_error", "drop"), name=data.get("name"),
        rank_judge=_rank_judge(data.get("rank_judge")), agent_reward=data.get("agent_reward", True))


def load_config(path: str | os.PathLike[str]) -> RewardConfig:
    """A configuration from a .toml or .json file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"reward configuration {str(p)!r} does not exist")
    text = p.read_text(encoding="utf-8")
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except ValueError as exc:  # tomllib.TOMLDecodeError and json.JSONDecodeError are ValueErrors
        raise ConfigError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from exc
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from exc


def _check_shape(cfg: RewardConfig) -> None:
    if cfg.reward_type not in REWARD_TYPES:
        raise ConfigError(f"reward_type must be one of {', '.join(REWARD_TYPES)}, got {cfg.reward_type!r}")
    if cfg.on_error not in ON_ERROR:
        raise ConfigError(f"on_error must be one of {', '.join(ON_ERROR)}, got {cfg.on_error!r}")
    model = cfg.reward_model is not None or cfg.rank_judge is not None
    if cfg.reward_type == "rule" and model:
        raise ConfigError("reward_type 'rule' takes no [reward_model] or [rank_judge]: use 'hybrid' for rules "
                          "and a model")
    if cfg.reward_type == "model" and cfg.rules:
        raise ConfigError("reward_type 'model' takes no [rules]: use 'hybrid' for rules and a reward model")
    if cfg.reward_type == "model" and not model:
        raise ConfigError("reward_type 'model' needs a [reward_model] or [rank_judge] section")
    if cfg.reward_type == "hybrid" and not model and not cfg.rules:
        raise ConfigError("reward_type 'hybrid' (the default) needs [rules], a [reward_model] or a [rank_judge]; "
                          "for guards and human feedback alone use reward_type = 'rule'")
    names = [c.name for c in cfg.components] + (["reward_model"] if cfg.reward_model else []) + (
        [RANK_JUDGE] if cfg.rank_judge else []) + (["human"] if cfg.human else [])
    reserved = {"final", "reward_errors", "reward_pending", "reward_model", "human", RANK_JUDGE, AGENT}
    for c in cfg.components:
        if c.name in reserved:
            raise ConfigError(f"a {c.kind} may not be named {c.name!r} (reserved)")
    if len(set(names)) != len(names):
        raise ConfigError(f"component names must be unique, got {names}")
    if not names:
        raise ConfigError("the configuration has no component: give [rules], [guards], [reward_model] or [human]")
    if not isinstance(cfg.agent_reward, bool):
        raise ConfigError(f"agent_reward must be true or false, got {cfg.agent_reward!r}")
    reads_reports = [c.name for c in cfg.components if c.function in SELF_REPORTED]
    if not cfg.agent_reward and reads_reports:
        raise ConfigError(f"agent_reward = false refuses the rollout's own rewards, which {reads_reports} read: "
                          "score with the benchmark's rule instead")
