"""`lightning-mw demo --rewards examples/rewards/hybrid-judge.toml --judge smollm2`: the
rule-plus-judge hybrid on the demo, with a real LLM judge served beside the policy.

The configuration's `[rank_judge]` (or `[reward_model]`) names the judge's address and model
name. `--judge smollm2` serves SmolLM2-135M-Instruct (PyPI's GGUF, converted once by
`prepare_smollm2`) on a second vLLM CPU server at that address's port, under that name, so the
configuration and its hash are the same whoever serves the judge; without `--judge` the
configured judge must already answer there. The trainer ranks each ready group
(`DemoRun.reward_policy`); the evaluation stays the task's own success. What the judge costs and how
often it agrees with the task's own outcome: docs/rewards.md, "Proof".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from lightning_middleware import Reward, TraceStore
from lightning_middleware.rewards import RewardConfig
from lightning_middleware.rewards.config import RANK_JUDGE
from trainer_backend.demo.outcomes import task_outcomes
from trainer_backend.demo.run import DemoRun, say
from trainer_backend.serving.server import VLLMServer

LOCAL_HOSTS = ("127.0.0.1", "localhost")
# A group of 8 guess-game transcripts cut to the example's 3,000 characters is ~1,000 tokens
# (a configuration may allow more); the answer is one short line.
JUDGE_MAX_LEN = 4096


class JudgeConfigError(ValueError):
    """The reward configuration names no judge this demo can serve; the message says why."""


def judge_address(config: RewardConfig | None) -> tuple[str, int, str]:
    """(host, port, served model name) of the configuration's judge, on this machine."""
    judges = [] if config is None else [j for j in (config.rank_judge, config.reward_model) if j is not None]
    urls = {(j.url, j.model) for j in judges if j.url}
    if not urls:
        raise JudgeConfigError("--judge serves the judge of a reward configuration: give --rewards FILE with a "
                               "[rank_judge] (or [reward_model]) url and model, e.g. "
                               "examples/rewards/hybrid-judge.toml")
    if len(urls) > 1:
        raise JudgeConfigError(f"--judge serves one judge, but the configuration names {len(urls)}: "
                               + ", ".join(f"{m} at {u}" for u, m in sorted(urls, key=str)))
    url, model = urls.pop()
    parts = urlsplit(url)
    if parts.hostname not in LOCAL_HOSTS or parts.port is None:
        raise JudgeConfigError(f"--judge serves the judge on this machine: its url must be "
                               f"http://127.0.0.1:PORT/v1, got {url!r}")
    return parts.hostname, parts.port, str(model)


def judge_line(totals: dict[str, float], agreement: dict[str, Any]) -> str:
    """The report's line on the judge: what it ranked, the time it took, and whether it agreed with
    success where a ranked group had both solved and unsolved attempts."""
    line = (f"judge: {totals['rank_judge_groups']:.0f} groups ranked ({totals['rank_judge_failed']:.0f} failed, "
            f"{totals['rank_judge_unparseable']:.0f} unreadable answers")
    if totals.get("rank_judge_groups_told_apart"):
        line += f"; {totals['rank_judge_groups_told_apart']:.0f} told apart by the rules, not asked"
    line += (f"), {(totals['reward_judge_s'] + totals.get('reward_judge_ahead_s', 0.0)) / 60:.1f} min of ranking "
             f"({totals['reward_judge_s'] / 60:.1f} of them waited for by the trainer); ")
    if not agreement["pairs"]:
        return line + "no ranked group had both a solved and an unsolved attempt to check it against"
    return line + (f"it put the solved attempt first in {agreement['agreement']:.1%} of {agreement['pairs']} (solved, "
                   f"unsolved) pairs (chance: 50%); {agreement['in_shown_order']:.0%} of its rankings were the order "
                   "shown")


def judge_agreement(store: TraceStore, rollout_ids: Sequence[str]) -> dict[str, Any]:
    """How the ranking judge's verdicts on these rollouts relate to the task's own outcome:
    `agreement`, over every (solved, unsolved) pair of one ranked group, the share the judge
    put the solved one first (a tie counts half; 0.5 is chance, 1.0 a perfect judge), and
    `in_shown_order`, the share of groups ranked exactly in the order the judge was shown them
    (A > B > C ...: a judge that reads no transcript)."""
    solved = {o.rollout_id: o.success for o in task_outcomes(store, rollout_ids)}
    groups: dict[tuple[str, ...], dict[str, float]] = {}
    for rid, rewards in store.rewards_for(rollout_ids).items():
        ranked = [d for d in (_detail(r) for r in rewards if r.name == RANK_JUDGE) if "candidates" in d]
        if ranked and rid in solved:  # the latest ranking of the rollout's group (a group re-ranked keeps the last)
            meta = ranked[-1]
            groups.setdefault(tuple(meta["candidates"]), {})[rid] = float(meta["rank"])
    pairs, agree, shown = 0, 0.0, 0
    for candidates, ranks in groups.items():
        shown += all(ranks.get(c) == i + 1 for i, c in enumerate(candidates))
        good = [r for c, r in ranks.items() if solved[c]]
        bad = [r for c, r in ranks.items() if not solved[c]]
        for g in good:
            for b in bad:
                pairs += 1
                agree += 1.0 if g < b else 0.5 if g == b else 0.0
    return {"groups": len(groups), "pairs": pairs, "agreement": agree / pairs if pairs else float("nan"),
            "in_shown_order": shown / len(groups) if groups else float("nan")}


def _detail(reward: Reward) -> dict[str, Any]:
    """What the judge said of this rollout (the component's metadata keeps it under "detail")."""
    return dict((reward.metadata or {}).get("detail") or {})


class JudgedDemoRun(DemoRun):
    """The guess demo with its reward configuration's judge served on this machine."""

    judge: VLLMServer | None = None

    def serve(self) -> None:
        host, port, name = judge_address(self.reward_config)  # before anything starts: a bad file fails fast
        super().serve()
        from trainer_backend.models import prepare_smollm2

        say(f"      judge: SmolLM2-135M-Instruct as {name!r} on its own vLLM CPU server ({host}:{port})")
        t0 = time.perf_counter()
        self.judge = VLLMServer(prepare_smollm2(), host=host, port=port, served_model_name=name, dtype="float32",
                                max_model_len=JUDGE_MAX_LEN, log_path=self.out / "judge-vllm.log",
                                extra_args=["--max-num-seqs", "8"]).start()
        self.timings["judge_start_s"] = time.perf_counter() - t0
        self.results["judge"] = {"model": "smollm2-135m-instruct", "served_name": name, "url": self.judge.base_url}

    def report(self) -> dict[str, Any]:
        assert self.store is not None
        self.store.flush()
        agreement = judge_agreement(self.store, [r.id for r in self.store.query_rollouts()])
        curve = self.results.get("curve", [])
        totals = {k: sum(float(c.get(k) or 0.0) for c in curve) for k in
                  ("rank_judge_groups", "rank_judge_failed", "rank_judge_unparseable", "rank_judge_groups_told_apart",
                   "reward_judge_s", "reward_judge_ahead_s")}
        self.results["judge_summary"] = {**agreement, **totals}
        res = super().report()
        say(judge_line(totals, agreement))
        return res

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.judge is not None:
                self.judge.stop()
