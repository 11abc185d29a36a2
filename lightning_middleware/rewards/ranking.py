"""The ranking judge: an LLM, through any OpenAI-compatible endpoint, that ranks the rollouts of
one group (the same task) against each other, as a ranking judge does.

The judge is sent the task once and every candidate's transcript, labelled A, B, C, ... (in an
order drawn from the rollout ids, so no rollout is always first), all of it cut to `max_chars`
(each candidate an equal share, its transcript cut from the front). It answers one line
"Ranking: B > A = C" (best first, "=" a tie, "," read as ">") or one "A: 7" line per candidate
(higher is better). A rollout's value is its group-relative rank mapped to [0, 1]:
(n - rank) / (n - 1), ties sharing their mean rank, so the best is 1.0, the worst 0.0 and an
all-tied group 0.5 each. Its raw answer is kept in every rollout's component metadata.

An answer that cannot be read (prose, a letter that is no candidate, a candidate missing or
named twice) is asked again, with what was wrong, up to `retries` times; after that every
rollout of the group gets the error (the `reward_errors` reward). Unreadable answers are
counted (`GroupRanking.unparseable`), and the counts reach `rewards rescore`'s summary and
the trainer's per-step metrics. A group's ranking has a deadline (`deadline_s`: every answer and
retry together; then it is the error), and `rank_groups` ranks several groups at once
(`concurrency` at a time), so a slow judge costs about one latency per round, not one per group.
A group of one has nothing to rank against: the component is absent, and the final reward's
metadata says why.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from lightning_middleware.rewards.config import RankJudgeConfig
from lightning_middleware.rewards.sources import RewardModelError, chat_reply, render_transcript
from lightning_middleware.rewards.trajectory import Trajectory

log = logging.getLogger(__name__)

DEFAULT_RANK_PROMPT = (
    "You compare {n} attempts by an AI agent at the same task, labelled {letters}. Read the task, then "
    "each candidate's transcript and final answer. Rank them from best to worst: a correct solution "
    "reached without shortcuts is best. Reply with one line 'Ranking: ' followed by every letter exactly "
    "once, best first, separated by '>' ('=' for a tie), for example 'Ranking: {example}', then one "
    "sentence of reason."
)
SINGLETON = "group of 1: nothing to rank against"
TOLD_APART = 'the other components already tell the group apart (rank_judge.scope = "uniform"): not ranked'
MAX_CANDIDATES = 26 * 27  # A..Z, AA..ZZ: the labels an answer can name
_MIN_SHARE = 200  # characters a candidate gets even in a very large group
_LETTER = r"(?:[Cc]andidate\s+)?[\[(*\"']*([A-Z]{1,2})[\])*\"'.]*"
_RANKING_LINE = re.compile(r"^[\W_]*ranking[\W_]*?[:=\-]\s*(.*)$", re.IGNORECASE | re.MULTILINE)
_SCORE_LINE = re.compile(r"^[\W_]*" + _LETTER + r"\s*[:=\-]\s*(-?\d+(?:\.\d+)?)\b", re.MULTILINE)
_SEPARATOR = re.compile(r"\s*(>>?|=|,)\s*")


class RankParseError(ValueError):
    """The judge's answer is no ranking of exactly the candidates; the message says what is wrong."""


def letters(n: int) -> list[str]:
    """A, B, ..., Z, AA, AB, ...: one label per candidate."""
    out = []
    for i in range(n):
        out.append(chr(65 + i) if i < 26 else chr(64 + i // 26) + chr(65 + i % 26))
    return out


def parse_ranking(text: str, candidates: Sequence[str]) -> dict[str, float]:
    """Candidate letter -> its rank (1 = best, ties share their mean rank), read from a
    "Ranking: ..." line (the last one) or else from one "X: score" line per candidate."""
    lines = _RANKING_LINE.findall(text)
    tiers = _order(lines[-1], candidates) if lines else _scores(text, candidates)
    seen = [c for tier in tiers for c in tier]
    unknown = sorted(set(seen) - set(candidates))
    if unknown:
        raise RankParseError(f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} no candidate "
                             f"(the candidates are {', '.join(candidates)})")
    twice = sorted({c for c in seen if seen.count(c) > 1})
    if twice:
        raise RankParseError(f"{', '.join(twice)} named more than once")
    missing = [c for c in candidates if c not in seen]
    if missing:
        raise RankParseError(f"{', '.join(missing)} missing from the ranking")
    ranks, position = {}, 1
    for tier in tiers:
        for c in tier:
            ranks[c] = position + (len(tier) - 1) / 2
        position += len(tier)
    return ranks


def _order(line: str, candidates: Sequence[str]) -> list[list[str]]:
    """The tiers of "B > A = C" (its trailing sentence of reason ignored)."""
    line = line.strip().lstrip("*_ ")  # "**Ranking:** B > A": the bold's closing marks
    m = re.match(_LETTER + r"((?:" + _SEPARATOR.pattern + _LETTER + r")*)", line)
    if m is None:
        raise RankParseError(f"the ranking line names no candidate letter: {line[:120]!r}")
    rest = line[m.end():]
    if re.match(r"\s*(>|=|,)", rest):
        raise RankParseError(f"the ranking line has something that is no candidate letter: {line[:120]!r}")
    tokens = _SEPARATOR.split(m.group(0))
    tiers: list[list[str]] = [[_strip(tokens[0])]]
    for sep, token in zip(tokens[1::2], tokens[2::2]):
        if sep == "=":
            tiers[-1].append(_strip(token))
        else:
            tiers.append([_strip(token)])
    return tiers


def _strip(token: str) -> str:
    m = re.fullmatch(_LETTER, token.strip())
    return m.group(1) if m else token.strip()


def _scores(text: str, candidates: Sequence[str]) -> list[list[str]]:
    """Tiers from "A: 7" lines, best score first."""
    found = [(m.group(1), float(m.group(2))) for m in _SCORE_LINE.finditer(text)]
    if not found:
        raise RankParseError(f"no 'Ranking:' line and no 'X: score' lines in the answer: {text[:120]!r}")
    names = [c for c, _ in found]
    twice = sorted({c for c in names if names.count(c) > 1})
    if twice:
        raise RankParseError(f"{', '.join(twice)} scored more than once")
    by_score: dict[float, list[str]] = {}
    for c, s in found:
        by_score.setdefault(s, []).append(c)
    return [by_score[s] for s in sorted(by_score, reverse=True)]


def rank_values(ranks: Mapping[str, float]) -> dict[str, float]:
    """Rank -> value in [0, 1]: (n - rank) / (n - 1); the best 1.0, the worst 0.0."""
    n = len(ranks)
    return {c: (n - r) / (n - 1) for c, r in ranks.items()} if n > 1 else {}


@dataclass(frozen=True)
class GroupRanking:
    """The judge's verdict on one group: each rollout's value and metadata, or the error."""

    values: Mapping[str, float] = field(default_factory=dict)  # rollout id -> value in [0, 1]
    detail: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # rollout id -> its metadata
    error: str | None = None  # the judge failed or its answers were never readable
    note: str | None = None  # why there is no ranking although nothing failed (a group of one)
    unparseable: int = 0  # answers that could not be read (a retry may have read the next)
    asked: int = 0  # answers requested

    def counts(self) -> dict[str, int]:
        """What this verdict adds to the judge's tallies (the trainer's per-step metrics, a rescore's report)."""
        return {"groups": int(bool(self.values)), "failed": int(self.error is not None),
                "groups_of_one": int(self.note == SINGLETON), "groups_told_apart": int(self.note == TOLD_APART),
                "unparseable": self.unparseable}


def candidate_order(group: Sequence[Trajectory], shuffle: bool) -> list[Trajectory]:
    """The order the judge sees: drawn from the rollout ids (stable across re-scorings)."""
    if not shuffle:
        return list(group)
    return sorted(group, key=lambda t: hashlib.sha256(t.rollout.id.encode()).hexdigest())


def render_group(group: Sequence[Trajectory], labels: Sequence[str], max_chars: int) -> str:
    """The task once, then each candidate under its letter, all cut to about `max_chars`."""
    first = group[0].rollout.input
    task = "-" if first is None else json.dumps(first, ensure_ascii=False, default=str)
    task = task[: max_chars // 4]
    share = max(_MIN_SHARE, (max_chars - len(task) - 40 * len(group)) // len(group))
    parts = [f"Task:\n{task}"]
    parts += [f"=== Candidate {c} ===\n{render_transcript(t, share)}" for c, t in zip(labels, group)]
    return "\n\n".join(parts)


def _prompt(cfg: RankJudgeConfig, labels: Sequence[str]) -> str:
    example = " > ".join(labels[:3]) if len(labels) < 3 else f"{labels[1]} > {labels[0]} = {labels[2]}" + "".join(
        f" > {c}" for c in labels[3:])
    return ((cfg.prompt or DEFAULT_RANK_PROMPT).replace("{n}", str(len(labels)))
            .replace("{letters}", ", ".join(labels)).replace("{example}", example))


def _normal(ranks: Mapping[str, float]) -> str:
    """The ranking as "B > A = C"."""
    tiers: dict[float, list[str]] = {}
    for c, r in ranks.items():
        tiers.setdefault(r, []).append(c)
    return " > ".join(" = ".join(sorted(tiers[r])) for r in sorted(tiers))


def rank_group(group: Sequence[Trajectory], cfg: RankJudgeConfig) -> GroupRanking:
    """Ask the judge to rank `group`; never raises for the judge's failures (they are the error)."""
    if len(group) < 2:
        return GroupRanking(note=SINGLETON)
    if len(group) > MAX_CANDIDATES:
        return GroupRanking(error=f"a group of {len(group)} is too large to rank in one answer (at most "
                                  f"{MAX_CANDIDATES}); use smaller groups")
    ordered = candidate_order(group, cfg.shuffle)
    labels = letters(len(ordered))
    messages = [{"role": "system", "content": _prompt(cfg, labels)},
                {"role": "user", "content": render_group(ordered, labels, cfg.max_chars)}]
    bad, why = 0, ""
    replies: list[str] = []
    deadline = time.monotonic() + cfg.deadline_s
    for _ in range(cfg.retries + 1):
        try:
            reply = chat_reply(cfg.url, cfg.model, messages, timeout_s=cfg.timeout_s, retries=cfg.retries,
                               api_key_env=cfg.api_key_env, max_tokens=cfg.max_tokens, deadline=deadline)
        except RewardModelError as exc:
            late = f" (rank_judge.deadline_s = {cfg.deadline_s:g} s)" if time.monotonic() >= deadline else ""
            return GroupRanking(error=f"{exc}{late}", unparseable=bad, asked=len(replies) + 1)
        replies.append(reply)
        try:
            ranks = parse_ranking(reply, labels)
        except RankParseError as exc:
            bad, why = bad + 1, str(exc)
            log.warning("the ranking judge's answer %d could not be read: %s", len(replies), exc)
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"Your answer could not be read: {exc}. Reply with one line "
                                                     f"'Ranking: ' naming each of {', '.join(labels)} exactly once, "
                                                     "best first, separated by '>' or '='."}]
            continue
        return _ranked(ordered, labels, ranks, reply, bad, len(replies))
    return GroupRanking(error=f"the ranking judge's answer could not be read after {len(replies)} tries: {why}; "
                              f"last answer: {replies[-1][:300]!r}", unparseable=bad, asked=len(replies))


def rank_groups(groups: Sequence[Sequence[Trajectory]], cfg: RankJudgeConfig) -> list[GroupRanking]:
    """`rank_group` for each group, `cfg.concurrency` of them at once (threads: the judge is
    I/O), in the order given. Only HTTP runs in the threads; the caller stores the results."""
    if len(groups) < 2 or cfg.concurrency == 1:
        return [rank_group(g, cfg) for g in groups]
    with ThreadPoolExecutor(max_workers=min(cfg.concurrency, len(groups)), thread_name_prefix="rank-judge") as pool:
        return list(pool.map(lambda g: rank_group(g, cfg), groups))


def _ranked(ordered: Sequence[Trajectory], labels: Sequence[str], ranks: Mapping[str, float], reply: str,
            bad: int, asked: int) -> GroupRanking:
    values = rank_values(ranks)
    ids = [t.rollout.id for t in ordered]
    order = _normal(ranks)
    detail = {rid: {"letter": c, "rank": ranks[c], "group_size": len(ids), "order": order, "candidates": ids,
                    "reply": reply[:2000], "answers": asked} for c, rid in zip(labels, ids)}
    return GroupRanking({rid: values[c] for c, rid in zip(labels, ids)}, detail, unparseable=bad, asked=asked)
