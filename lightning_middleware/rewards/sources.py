"""The reward sources beyond rules: a reward model (an OpenAI-compatible judge endpoint or a
local scorer) and human feedback (labels stored by the labelling page), with the calibration
of the one against the other.

The judge is sent the task, the transcript (cut to `max_chars`, keeping its end) and the final
output, and asked for "Score: N" on a 0..max_score scale; the component's value is
N / max_score * scale + offset. A person's labels are rewards named "human": a score in [0, 1],
or a comparison (the preferred rollout 1.0, the other 0.0, a tie 0.5 each); the component's
value is their mean.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from lightning_middleware.rewards.config import RewardModelConfig
from lightning_middleware.rewards.rules import Score, as_score, import_function
from lightning_middleware.rewards.trajectory import Trajectory

log = logging.getLogger(__name__)

DEFAULT_JUDGE_PROMPT = (
    "You grade an AI agent's work. Read the task, the agent's transcript and its final answer. "
    "Judge whether the task was solved, correctly and without shortcuts. Reply with one line "
    "'Score: N', N from 0 (useless) to {max_score} (perfect), then one sentence of reason."
)
_SCORE = re.compile(r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class RewardModelError(RuntimeError):
    """The reward model gave no usable score (unreachable, an HTTP error, no number)."""


def render_for_judge(t: Trajectory, max_chars: int) -> str:
    """The task, the conversation and the final output as one text, cut from the front."""
    task = json.dumps(t.rollout.input, ensure_ascii=False, default=str) if t.rollout.input is not None else "-"
    return f"Task:\n{task}\n\n{render_transcript(t, max_chars - len(task))}"


def render_transcript(t: Trajectory, max_chars: int) -> str:
    """The conversation and the final output, the conversation cut from the front (its end,
    where the answer is, matters most) so the whole fits in about `max_chars`."""
    lines = [f"[{m.get('role', m.get('type', '?'))}] {_content(m)}" for m in t.messages]
    transcript = "\n".join(lines)
    final = t.final_output or "-"
    if len(final) > max_chars // 2:  # a huge final answer must not push the whole transcript out
        final = final[: max_chars // 2] + "[...]"
    budget = max(0, max_chars - len(final) - 100)
    if len(transcript) > budget:
        transcript = "[...]" + transcript[len(transcript) - budget:]
    return f"Transcript:\n{transcript}\n\nFinal answer:\n{final}"


def _content(m: dict[str, Any]) -> str:
    content = m.get("content", m.get("output", ""))
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    calls = [f"{(tc.get('function') or {}).get('name')}({(tc.get('function') or {}).get('arguments')})"
             for tc in m.get("tool_calls") or [] if isinstance(tc, dict)]
    return (str(content or "") + (" calls " + ", ".join(calls) if calls else "")).strip()


def parse_score(text: str, max_score: float) -> float:
    """The judge's N of "Score: N" (else its first number), checked to lie in 0..max_score."""
    m = _SCORE.search(text) or _NUMBER.search(text)
    if m is None:
        raise RewardModelError(f"the judge's reply has no score: {text[:200]!r}")
    n = float(m.group(1) if m.re is _SCORE else m.group(0))
    if not 0 <= n <= max_score:
        raise RewardModelError(f"the judge's score {n:g} is outside 0..{max_score:g}")
    return n


def _ask_judge(cfg: RewardModelConfig, text: str) -> str:
    prompt = (cfg.prompt or DEFAULT_JUDGE_PROMPT).replace("{max_score}", f"{cfg.max_score:g}")
    messages = [{"role": "system", "content": prompt}, {"role": "user", "content": text}]
    return chat_reply(str(cfg.url), str(cfg.model), messages, timeout_s=cfg.timeout_s, retries=cfg.retries,
                      api_key_env=cfg.api_key_env, max_tokens=64)


def chat_reply(url: str, model: str, messages: list[dict[str, str]], *, timeout_s: float, retries: int,
               api_key_env: str | None, max_tokens: int, deadline: float | None = None) -> str:
    """The text of an OpenAI-compatible judge's reply (temperature 0), an HTTP failure retried
    `retries` times with backoff; RewardModelError after that, or once `deadline` (a
    `time.monotonic()` instant) has passed: no attempt nor backoff runs beyond it."""
    headers = {}
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise RewardModelError(f"the judge's api_key_env names {api_key_env}, which is not set")
        headers["authorization"] = f"Bearer {key}"
    body = {"model": model, "temperature": 0, "max_tokens": max_tokens, "messages": messages}
    endpoint = url.rstrip("/") + "/chat/completions"
    last: Exception | None = None
    for attempt in range(retries + 1):
        left = math.inf if deadline is None else deadline - time.monotonic()
        if left <= 0:
            raise RewardModelError(f"the judge at {url} gave no answer before its deadline"
                                   + (f" (last failure: {type(last).__name__}: {last})" if last else ""))
        try:
            resp = httpx.post(endpoint, json=body, headers=headers, timeout=min(timeout_s, left))
            resp.raise_for_status()
            return str(resp.json()["choices"][0]["message"]["content"] or "")
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
            last = exc
            if attempt < retries:
                time.sleep(min(0.2 * 2 ** attempt, max(0.0, left - 0.01)))
    raise RewardModelError(f"the judge at {url} failed: {type(last).__name__}: {last}")


def model_score(t: Trajectory, cfg: RewardModelConfig, scorer: Callable[..., Any] | None = None) -> Score:
    """The reward model's component for one trajectory; RewardModelError if it has none."""
    if scorer is not None:
        score = as_score(scorer(t), "reward_model.scorer")
        if score is None:
            raise RewardModelError("reward_model.scorer returned None")
        return Score(score.value * cfg.scale + cfg.offset, {**score.detail, "raw": score.value})
    reply = _ask_judge(cfg, render_for_judge(t, cfg.max_chars))
    raw = parse_score(reply, cfg.max_score)
    return Score(raw / cfg.max_score * cfg.scale + cfg.offset, {"raw": raw, "reply": reply[:300]})


def local_scorer(cfg: RewardModelConfig) -> Callable[..., Any] | None:
    if cfg.path is not None:
        return ClassifierScorer(cfg.path, cfg.max_chars)
    if cfg.scorer is None:
        return None
    return cfg.scorer if callable(cfg.scorer) else import_function(cfg.scorer, "reward_model.scorer")


class ClassifierScorer:
    """A sequence-classification reward model run in-process (transformers, on the CPU unless
    torch sees a GPU), loaded once per configuration. The value is the model's logit for a
    one-label head, else the probability of its last label ("good")."""

    def __init__(self, path: str, max_chars: int) -> None:
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as exc:
            raise RewardModelError(f"reward_model.path needs torch and transformers installed: {exc}") from exc
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        except (OSError, ValueError) as exc:
            raise RewardModelError(f"reward_model.path {path!r} is not a sequence-classification model: {exc}") from exc
        self.torch = torch
        self.max_chars = max_chars
        self._lock = threading.Lock()  # one forward at a time: rollouts may end on several threads

    def __call__(self, t: Trajectory) -> Score:
        text = render_for_judge(t, self.max_chars)
        with self._lock, self.torch.no_grad():
            enc = self.tokenizer(text, return_tensors="pt", truncation=True)
            logits = self.model(**enc).logits[0].float()
        value = float(logits[0]) if logits.numel() == 1 else float(self.torch.softmax(logits, -1)[-1])
        return Score(value, {"logits": [round(float(x), 6) for x in logits]})


def human_score(t: Trajectory) -> Score | None:
    """The mean of a person's labels of this rollout (absent if none)."""
    labels = t.human_labels
    if not labels:
        return None
    return Score(statistics.fmean(r.value for r in labels), {"labels": len(labels)})


def wants_label(rollout_id: str, interval: int) -> bool:
    """Whether a rollout is on the labelling queue: 1 in `interval`, chosen by its id."""
    if interval <= 0:
        return False
    return int(hashlib.sha256(rollout_id.encode()).hexdigest()[:8], 16) % interval == 0


@dataclass(frozen=True)
class Calibration:
    """The reward model against human labels over `n` rollouts that have both:
    human ~ slope * model + intercept; bias = mean(model - human); the agreement is the rank
    (Spearman) correlation: does the model order rollouts as people do."""

    n: int
    bias: float
    slope: float
    intercept: float
    correlation: float | None
    rank_correlation: float | None = None

    def advice(self, cfg: RewardModelConfig) -> str:
        """The [reward_model] scale / offset that map the current values onto the labels."""
        return (f"scale = {cfg.scale * self.slope:.4g}\n"
                f"offset = {cfg.offset * self.slope + self.intercept:.4g}")


def calibrate(pairs: Sequence[tuple[float, float]]) -> Calibration:
    """(model value, human value) pairs; ValueError with fewer than 2."""
    if len(pairs) < 2:
        raise ValueError(f"calibration needs at least 2 rollouts with both a reward-model value and a "
                         f"human label; found {len(pairs)}")
    xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in pairs)
    slope = sxy / sxx if sxx else 1.0
    corr = sxy / math.sqrt(sxx * syy) if sxx and syy else None
    return Calibration(len(pairs), mx - my, slope, my - slope * mx, corr, _pearson(_ranks(xs), _ranks(ys)))


def _ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, ties sharing their mean rank (what Spearman's correlation ranks by)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def _pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:  # constant input: no ordering to agree on
        return None
