"""reasoning-gym's procedural datasets as tasks, scored by the dataset's own `score_answer`.

    rg:basic_arithmetic?size=500&seed=1&max_terms=3

names the dataset, its size and seed (the same address gives the same items everywhere: the
tasks are rebuilt, not stored), and any of the dataset's own config keys (values read as JSON
where they parse: numbers, booleans, lists). A task is `{"task_id", "question", "rg": {"address",
"index"}}`; the agent answers the question, and `rg_score` scores the rollout's final output:
the text inside `<answer>` tags when there are some (`reasoning_gym.utils.extract_answer`), else
the whole output. reasoning-gym gives partial credit (a near miss in format scores between 0 and
1): the score is the component's value, and `solved` (score 1.0) is kept beside it.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from lightning_middleware.errors import UsageError
from lightning_middleware.rewards.rules import Score
from lightning_middleware.rewards.trajectory import Trajectory

SCHEME = "rg"
DEFAULT_SIZE = 500


class BenchmarkError(UsageError, ValueError):
    """A task address or a task that can't be read: a bad address, an unknown dataset, a missing extra."""


@dataclass(frozen=True)
class Address:
    name: str
    size: int
    seed: int
    config: tuple[tuple[str, Any], ...] = ()  # the dataset's own keys, sorted

    def __str__(self) -> str:
        extra = "".join(f"&{k}={v if isinstance(v, str) else json.dumps(v, separators=(',', ':'))}"
                        for k, v in self.config)
        return f"{SCHEME}:{self.name}?size={self.size}&seed={self.seed}{extra}"


def parse(address: str) -> Address:
    """`rg:NAME?size=N&seed=S&KEY=VALUE...` as an Address; BenchmarkError naming what is wrong."""
    parts = urlsplit(address)
    if parts.scheme != SCHEME or not parts.path:
        raise BenchmarkError(f"a reasoning-gym task address is rg:NAME?size=N&seed=S, got {address!r}")
    # "+" is itself here (an operator, a sign), not the form encoding's space
    query = dict(parse_qsl(parts.query.replace("+", "%2B"), keep_blank_values=True))
    try:
        size, seed = int(query.pop("size", DEFAULT_SIZE)), int(query.pop("seed", 0))
    except ValueError:
        raise BenchmarkError(f"{address!r}: size and seed are integers") from None
    if size <= 0:
        raise BenchmarkError(f"{address!r}: size must be positive")
    return Address(parts.path, size, seed, tuple(sorted((k, _value(v)) for k, v in query.items())))


def _value(text: str) -> Any:
    """A query value as JSON where it parses; lists as tuples, so an Address stays hashable (the
    datasets are cached by it) and reasoning-gym takes them as its own tuple defaults are."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return _frozen(value)


def _frozen(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        raise BenchmarkError(f"a task address's config values are numbers, strings, booleans or lists, not {value}")
    return value


@functools.lru_cache(maxsize=64)
def dataset(address: Address) -> Any:
    """The reasoning-gym dataset an address names (built once per process: they are procedural)."""
    try:
        import reasoning_gym
    except ImportError:
        raise BenchmarkError("rg: task addresses need reasoning-gym: pip install 'lightning-middleware[benchmarks]'"
                             ) from None
    from reasoning_gym.factory import DATASETS

    if address.name not in DATASETS:
        raise BenchmarkError(f"{address}: reasoning-gym has no dataset {address.name!r}; it has "
                             f"{', '.join(sorted(DATASETS))}")
    try:
        return reasoning_gym.create_dataset(address.name, size=address.size, seed=address.seed,
                                            **dict(address.config))
    except Exception as exc:  # noqa: BLE001 - its own errors for an unknown name or a bad config
        raise BenchmarkError(f"{address}: reasoning-gym refused it: {type(exc).__name__}: {exc}") from None


def tasks(address: str) -> list[dict[str, Any]]:
    """Every item of the dataset as a task."""
    a = parse(address)
    ds = dataset(a)
    return [{"task_id": f"rg:{a.name}:{a.seed}:{i}", "question": ds[i]["question"],
             "rg": {"address": str(a), "index": i}} for i in range(a.size)]


def score(answer: str, task: Mapping[str, Any]) -> float:
    """The dataset's own score of `answer` to `task` (one built by `tasks`), in [0, 1]."""
    ref = task.get("rg") if isinstance(task, Mapping) else None
    if not isinstance(ref, Mapping) or "address" not in ref or "index" not in ref:
        raise BenchmarkError("not a reasoning-gym task: it has no 'rg' address and index")
    ds = dataset(parse(str(ref["address"])))
    return float(ds.score_answer(answer=answer, entry=ds[int(ref["index"])]))


def final_answer(output: str) -> str:
    """The text inside the last `<answer>` tags, else the whole output, stripped."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(output) if "<answer>" in output else None
    return (tagged if tagged is not None else output).strip()


def rg_score(t: Trajectory) -> Score | None:
    """Reward rule: the dataset's score of the rollout's final output (absent when the rollout's
    task is not a reasoning-gym one)."""
    task = t.rollout.input
    if not isinstance(task, Mapping) or "rg" not in task:
        return None
    answer = final_answer(t.final_output or "")
    value = score(answer, task)
    return Score(value, {"answer": answer[:200], "solved": value >= 1.0})
