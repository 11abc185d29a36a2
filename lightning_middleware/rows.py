"""Training rows from one rollout's LLM calls. Pure Python: no torch here.

A row is one token sequence the model is trained on. The rule (docs/trainer.md):

1. Keep only calls the store marked `is_training` that are complete and carry prompt
   token IDs. Everything else is skipped and counted (partial, non-training, no IDs).
   Retries: the store marks at most one attempt of a call as training; if two training
   attempts share a call_index the later attempt wins and the duplicate is counted.
2. Calls are taken in (call_index, attempt) order and split into threads by
   (`agent_name`, `model`); each thread has at most one open row. The model is the served name
   the call went to: with separate policies per agent, its policy; a row never mixes two.
3. A call extends its thread's open row when its prompt token IDs start with the row's
   full token IDs (earlier prompts + completions + observations). The new prompt tail
   (tool results, new user turns, template tokens) gets loss-mask 0; the completion
   gets loss-mask 1 and carries its behaviour logprobs. Otherwise the open row is
   closed and a new row starts with this call (a prefix break).
4. Rows longer than `max_len` keep their first `max_len` tokens (right truncation).
   Cutting on the right is the only cut that keeps every kept token's left context,
   so the behaviour logprobs of the kept completion tokens stay valid. A row left
   with no completion token after the cut is dropped. Both are counted.
5. Rows without any completion token (e.g. only empty completions) are dropped, counted.
6. Each completion token keeps the sampling parameters of its call (temperature, top_p, top_k
   from the request as stored; absent: the API defaults 1, 1, off), so the trainer computes
   log-probs of the distribution that was sampled (`sampling_of`; docs/trainer.md).
7. A call with several choices (`n` > 1) contributes one of them, the one the agent continued
   (`continued_choice`): the choice k for which the next call of the same thread has a prompt
   starting with this call's prompt + choice k's token IDs. Several such: the longest, then the
   lowest index. None (the thread's last call, or a next call that extends no choice): choice 0.
   The completion's token IDs, logprobs and the choice's index in `Row.choices` are that
   choice's own, so every behaviour logprob belongs to the token it is trained with.

Advantages are not computed here: `Row.advantage` is 0.0 until `with_advantages` (per-turn
credit sets `token_advantages` too: trainer_backend/algorithms/advantages.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware.records import Choice, LLMCall, Rollout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Row:
    """One training sequence. All per-token tuples have len(input_ids) entries.

    loss_mask[i] == 1 means input_ids[i] was sampled by the policy (a completion token).
    behaviour_logprobs[i] is vLLM's logprob of input_ids[i] where loss_mask[i] == 1 and
    0.0 elsewhere; the whole tuple is None when any merged call lacked logprobs (the
    engine then recomputes old logprobs for this row).
    """

    rollout_id: str
    task_id: str | None
    agent: str | None
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    behaviour_logprobs: tuple[float, ...] | None
    policy_version: int | None = None  # oldest policy version among the merged calls
    call_ids: tuple[str, ...] = ()
    choices: tuple[int, ...] = ()  # per call in call_ids, the index of the choice trained (0 unless n > 1)
    truncated: bool = False
    advantage: float = 0.0
    # The rollout's final reward, for algorithms whose advantages need the model (PPO's critic, a
    # KL penalty in the reward); set by `with_advantages(..., rewards=...)`.
    reward: float | None = None
    # Per token, the sampling parameters the token was drawn with (None: 1.0 / 1.0 / 0 for every
    # token, the common case); prompt and observation tokens carry the defaults.
    temperature: tuple[float, ...] | None = None
    top_p: tuple[float, ...] | None = None
    top_k: tuple[int, ...] | None = None
    # The served model name its calls went to: with separate policies per agent, the policy
    # (a row never mixes two; calls of one agent under two models start separate rows).
    policy: str | None = None
    # Per-turn credit (trainer_backend/algorithms/advantages.py): per token, the advantage of the call
    # whose completion holds it (0.0 off the completions); None: `advantage` on every token.
    token_advantages: tuple[float, ...] | None = None
    # Per token, the per-step reward of the call whose completion ends there (PPO's GAE with
    # per-turn credit); None: only the rollout's reward, at the last response token.
    token_rewards: tuple[float, ...] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def n_response_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass(frozen=True)
class RowStats:
    """Counters from row building; add them up across rollouts with `+`."""

    calls_in: int = 0
    calls_used: int = 0
    skipped_partial: int = 0
    skipped_non_training: int = 0
    skipped_no_token_ids: int = 0
    duplicate_attempts: int = 0
    calls_without_logprobs: int = 0
    other_choices: int = 0  # calls with n > 1 whose continued choice (the one trained) was not choice 0
    merges: int = 0
    prefix_breaks: int = 0
    rows: int = 0
    truncated_rows: int = 0
    truncated_response_tokens: int = 0
    dropped_too_long: int = 0
    dropped_empty: int = 0
    response_tokens: int = 0
    total_tokens: int = 0
    # per agent name ("" for calls without one): the merges and breaks above, for the drift check
    agent_merges: Mapping[str, int] = field(default_factory=dict)
    agent_breaks: Mapping[str, int] = field(default_factory=dict)

    def __add__(self, other: RowStats) -> RowStats:
        return RowStats(**{f.name: _plus(getattr(self, f.name), getattr(other, f.name))
                           for f in dataclasses.fields(self)})

    @property
    def prefix_break_rate(self) -> float:
        """Breaks over chances to merge (every call that followed one of its own agent)."""
        chances = self.merges + self.prefix_breaks
        return self.prefix_breaks / chances if chances else 0.0

    def agent_prefix_breaks(self) -> dict[str, tuple[int, int]]:
        """Per agent: (breaks, chances to merge)."""
        agents = set(self.agent_merges) | set(self.agent_breaks)
        return {a: (self.agent_breaks.get(a, 0), self.agent_breaks.get(a, 0) + self.agent_merges.get(a, 0))
                for a in sorted(agents)}

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                               if not f.name.startswith("agent_")}
        d["prefix_break_rate"] = self.prefix_break_rate
        return d


def _plus(a: Any, b: Any) -> Any:
    if isinstance(a, Mapping):
        total = Counter(a)
        total.update(b)
        return dict(total)
    return a + b


# ---------------------------------------------------------------- selecting calls


def counted_attempts(calls: Sequence[LLMCall]) -> list[LLMCall]:
    """The one rule for which attempt of a call counts, shared by training, metrics and export:
    per call_index, the last attempt the store marked `is_training`, else the last attempt."""
    by_index: dict[int, LLMCall] = {}
    for call in sorted(calls, key=lambda c: (c.call_index, c.attempt)):
        prev = by_index.get(call.call_index)
        if prev is None or call.is_training or not prev.is_training:
            by_index[call.call_index] = call
    return [by_index[i] for i in sorted(by_index)]


def _select_calls(calls: Sequence[LLMCall]) -> tuple[list[LLMCall], dict[str, int]]:
    """Training calls in call order, one per call_index (`counted_attempts`), plus skip counters."""
    counts = dict(skipped_partial=0, skipped_non_training=0, skipped_no_token_ids=0, duplicate_attempts=0)
    training_per_index: dict[int, int] = {}
    for call in calls:
        if call.partial:
            counts["skipped_partial"] += 1
        elif not call.is_training:
            counts["skipped_non_training"] += 1
        elif not call.prompt_token_ids:
            counts["skipped_no_token_ids"] += 1
        else:
            training_per_index[call.call_index] = training_per_index.get(call.call_index, 0) + 1
    counts["duplicate_attempts"] = sum(n - 1 for n in training_per_index.values())
    usable = [c for c in counted_attempts(calls) if c.is_training and not c.partial and c.prompt_token_ids]
    return usable, counts


def sampling_of(call: LLMCall) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) a call was sampled with, from its stored request. Absent
    values are the API defaults (1, 1, off): the server must not substitute the model's own
    (vLLM: `--generation-config vllm`, as `lightning-mw serve` starts it). Temperature 0 is
    greedy, where vLLM's log-probs are the untempered ones, so 1."""
    req = call.request or {}

    def number(key: str, default: float) -> float:
        try:
            value = req.get(key)
            return default if value is None else float(value)
        except (TypeError, ValueError):
            return default

    temperature = number("temperature", 1.0)
    top_p = number("top_p", 1.0)
    top_k = int(number("top_k", 0))
    return (temperature if temperature > 0 else 1.0), min(1.0, max(top_p, 0.0)), max(top_k, 0)


def _choice_logprobs(choice: Choice) -> tuple[float, ...] | None:
    lp = choice.logprobs
    if lp is None or len(lp) != len(choice.completion_token_ids):
        return None
    return tuple(float(x) for x in lp)


def continued_choice(call: LLMCall, next_prompt: Sequence[int] | None) -> Choice:
    """The choice of `call` the agent continued: the one `next_prompt` (the prompt of the next
    call of the same thread) extends, i.e. starts with call's prompt + the choice's token IDs.

    Several match (identical choices, or one a prefix of another): the longest, then the lowest
    index. None matches, or no next call: choice 0. A call with one choice: that choice.
    """
    choices = call.choices
    if len(choices) == 1 or next_prompt is None:
        return choices[0]
    prompt = tuple(call.prompt_token_ids)
    start = len(prompt)
    if tuple(next_prompt[:start]) != prompt:
        return choices[0]
    matching = [c for c in choices
                if tuple(next_prompt[start:start + len(c.completion_token_ids)]) == tuple(c.completion_token_ids)]
    if not matching:
        return choices[0]
    return max(matching, key=lambda c: (len(c.completion_token_ids), -c.index))


def _thread(call: LLMCall) -> tuple[str | None, str | None]:
    """A call's thread: its agent and the model that served it (with separate policies, the
    policy), so that one row never holds tokens of two policies."""
    return call.agent_name, call.model


def _next_prompts(calls: Sequence[LLMCall]) -> list[tuple[int, ...] | None]:
    """Per call, the prompt of the next call of its thread; None for the last."""
    out: list[tuple[int, ...] | None] = [None] * len(calls)
    last: dict[tuple[str | None, str | None], int] = {}
    for i, call in enumerate(calls):
        prev = last.get(_thread(call))
        if prev is not None:
            out[prev] = tuple(call.prompt_token_ids)
        last[_thread(call)] = i
    return out


# ---------------------------------------------------------------- growing rows


@dataclass
class _OpenRow:
    """A row being built; mutable, private."""

    agent: str | None
    policy: str | None = None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    call_ids: list[str] = field(default_factory=list)
    choices: list[int] = field(default_factory=list)
    sampling: list[tuple[float, float, int]] = field(default_factory=list)  # per token

    def extends(self, prompt: Sequence[int]) -> bool:
        n = len(self.ids)
        return len(prompt) >= n and tuple(prompt[:n]) == tuple(self.ids)

    def add(self, call: LLMCall, choice: Choice) -> None:
        """Append the call's new prompt tail (mask 0) and the choice's completion (mask 1)."""
        tail = call.prompt_token_ids[len(self.ids):]
        completion = choice.completion_token_ids
        self.ids += list(tail) + list(completion)
        self.mask += [0] * len(tail) + [1] * len(completion)
        self.sampling += [_DEFAULT_SAMPLING] * len(tail) + [sampling_of(call)] * len(completion)
        lp = _choice_logprobs(choice)
        if self.logprobs is not None and lp is not None:
            self.logprobs += [0.0] * len(tail) + list(lp)
        else:
            self.logprobs = None
        if call.policy_version is not None:
            self.versions.append(call.policy_version)
        self.call_ids.append(call.id)
        self.choices.append(choice.index)


def _finish(row: _OpenRow, rollout_id: str, task_id: str | None, max_len: int | None) -> tuple[Row | None, str, int]:
    """Freeze an open row, applying the truncation rule. Returns (row, outcome, lost response tokens)."""
    ids, mask, lps, sampling = row.ids, row.mask, row.logprobs, row.sampling
    truncated = max_len is not None and len(ids) > max_len
    lost = 0
    if truncated:
        lost = sum(mask[max_len:])
        ids, mask, sampling = ids[:max_len], mask[:max_len], sampling[:max_len]
        lps = lps[:max_len] if lps is not None else None
    if sum(mask) == 0:
        return None, ("dropped_too_long" if truncated else "dropped_empty"), lost
    frozen = Row(
        rollout_id=rollout_id,
        task_id=task_id,
        agent=row.agent,
        policy=row.policy,
        input_ids=tuple(ids),
        loss_mask=tuple(mask),
        behaviour_logprobs=tuple(lps) if lps is not None else None,
        policy_version=min(row.versions) if row.versions else None,
        call_ids=tuple(row.call_ids),
        choices=tuple(row.choices),
        truncated=truncated,
        temperature=_per_token(sampling, 0, 1.0),
        top_p=_per_token(sampling, 1, 1.0),
        top_k=_per_token(sampling, 2, 0),
    )
    return frozen, ("truncated" if truncated else "ok"), lost


_DEFAULT_SAMPLING = (1.0, 1.0, 0)


def _per_token(sampling: Sequence[tuple[float, float, int]], k: int, default: Any) -> tuple[Any, ...] | None:
    """One sampling parameter per token; None where it is at its default everywhere (the common case)."""
    values = tuple(s[k] for s in sampling)
    return None if all(v == default for v in values) else values


# ---------------------------------------------------------------- public API


def build_rows(
    calls: Sequence[LLMCall],
    *,
    rollout_id: str,
    task_id: str | None = None,
    max_len: int | None = None,
) -> tuple[list[Row], RowStats]:
    """Rows of one rollout, in the order their first call was made, plus counters."""
    used, counts = _select_calls(calls)
    open_rows: dict[tuple[str | None, str | None], _OpenRow] = {}
    started: list[_OpenRow] = []
    merges = breaks = no_lp = other = 0
    agent_merges: Counter[str] = Counter()
    agent_breaks: Counter[str] = Counter()
    for call, next_prompt in zip(used, _next_prompts(used)):
        choice = continued_choice(call, next_prompt)
        other += choice.index != 0
        if _choice_logprobs(choice) is None:
            no_lp += 1
        row = open_rows.get(_thread(call))
        if row is not None and row.extends(call.prompt_token_ids):
            merges += 1
            agent_merges[call.agent_name or ""] += 1
        else:
            if row is not None:
                breaks += 1
                agent_breaks[call.agent_name or ""] += 1
                log.debug("prefix break in rollout %s at call %d", rollout_id, call.call_index)
            row = _OpenRow(agent=call.agent_name, policy=call.model)
            open_rows[_thread(call)] = row
            started.append(row)
        row.add(call, choice)

    rows: list[Row] = []
    outcome_counts = dict(truncated=0, dropped_too_long=0, dropped_empty=0)
    lost_total = 0
    for open_row in started:
        row_out, outcome, lost = _finish(open_row, rollout_id, task_id, max_len)
        lost_total += lost
        if outcome != "ok":
            outcome_counts[outcome] += 1
        if outcome == "dropped_too_long":
            outcome_counts["truncated"] += 1
        if row_out is not None:
            rows.append(row_out)

    stats = RowStats(
        calls_in=len(calls),
        calls_used=len(used),
        calls_without_logprobs=no_lp,
        other_choices=other,
        merges=merges,
        prefix_breaks=breaks,
        agent_merges=dict(agent_merges),
        agent_breaks=dict(agent_breaks),
        rows=len(rows),
        truncated_rows=outcome_counts["truncated"],
        truncated_response_tokens=lost_total,
        dropped_too_long=outcome_counts["dropped_too_long"],
        dropped_empty=outcome_counts["dropped_empty"],
        response_tokens=sum(r.n_response_tokens for r in rows),
        total_tokens=sum(len(r) for r in rows),
        **counts,
    )
    return rows, stats


def build_rows_for_rollouts(
    items: Iterable[tuple[Rollout, Sequence[LLMCall]]],
    *,
    max_len: int | None = None,
) -> tuple[list[Row], RowStats]:
    """Rows of many rollouts (each given with its calls) and their summed counters."""
    all_rows: list[Row] = []
    total = RowStats()
    for rollout, calls in items:
        rows, stats = build_rows(calls, rollout_id=rollout.id, task_id=rollout.task_id, max_len=max_len)
        all_rows += rows
        total = total + stats
    if total.prefix_breaks:
        log.info("prefix breaks: %d of %d chances (%.1f%%)", total.prefix_breaks,
                 total.merges + total.prefix_breaks, 100 * total.prefix_break_rate)
    return all_rows, total


def with_advantages(rows: Sequence[Row], advantages: Mapping[str, float] | Sequence[float],
                    rewards: Mapping[str, float] | None = None) -> list[Row]:
    """Copies of rows with `advantage` set: by rollout id (a mapping) or one value per row;
    with `rewards` (by rollout id) also `reward`."""
    if not isinstance(advantages, Mapping) and len(advantages) != len(rows):
        raise ValueError(f"{len(advantages)} advantages for {len(rows)} rows")
    values = ([advantages[r.rollout_id] for r in rows] if isinstance(advantages, Mapping) else list(advantages))
    return [dataclasses.replace(r, advantage=float(a),
                                reward=r.reward if rewards is None else float(rewards[r.rollout_id]))
            for r, a in zip(rows, values)]
