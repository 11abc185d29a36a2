"""What the trainer takes from the rewards table beyond `rollouts.final_reward`: which reward
version to train on, which components to wait for, and the per-step hacking rate.

- `version`: a reward configuration's hash (`lightning-mw rewards check`, `rescore`). The daemon
  trains on the latest final reward stored under it (a rescore's new version), not on
  `final_reward`; a rollout without one is skipped, counted as `no_reward_version`.
- `wait_for`: component -> seconds after the rollout ended. A group with a member that lacks
  one of them (a human label, a judge's late score) is left in the pool until the component
  arrives (it is then used: the late reward is combined into the final one) or its deadline
  passes; then `on_deadline` trains without it ("train_without", counted per step as
  `rewards_trained_without_<name>`) or skips the rollout ("skip", counted as
  `skipped_late_<name>`). `rewards_waiting` is how many rollouts were waiting at the step. A
  per-call component (its rewards carry a call index) is in when every trained call it applies
  to has one (the calls of the agents its rewards name, else all), not at the first call's.
- `config`: a reward configuration (a `RewardConfig` or its file): a ready group with a member
  that has no final reward (nor ranking) under it is scored by the daemon just before it
  trains, a ranking judge (`[rank_judge]`) ranking the group once (rollouts scored as they end
  have no group yet: their final reward waits for this). The daemon trains on that
  configuration's version. Per step: `rank_judge_groups` (ranked), `rank_judge_failed` (no
  ranking: the judge failed or its answers were never readable; with on_error "drop" those
  rollouts are skipped, counted as `rank_judge_failed`), `rank_judge_groups_of_one`,
  `rank_judge_groups_told_apart` (not asked: `rank_judge.scope = "uniform"`),
  `rank_judge_unparseable` (answers that could not be read, retried or not), `reward_judge_s`
  (seconds spent scoring groups since the last step: the ready groups of a collect are ranked
  together, `rank_judge.concurrency` at a time, each within `rank_judge.deadline_s`).
- Ranking ahead (`rank_ahead`, on by default): a thread of the daemon (`RankAhead`) ranks the
  oldest ready groups while the trainer trains, so a collect finds them ranked and the judge is off
  the step's critical path. A group is ranked once, by whichever thread claims it first; a collect
  that meets a group whose ranking is under way leaves it in the pool for the next collect. Per
  step: `reward_judge_ahead_s` (seconds the thread spent ranking since the last step) and
  `rank_judge_ahead_groups` (groups it ranked); `reward_judge_s` is then what a collect waited.
  With a judge that ranks only tied groups (`rank_judge.scope = "uniform"`) a collect asks the
  judge nothing (`review_groups(defer_ranking=True)`): it scores the groups the other components
  tell apart, and a tied group waits for the thread, which scores its told-apart groups before
  ranking the tied ones, so neither thread holds a group with signal for the judge's latency. The
  thread ranks tied groups on demand, newest first, while fewer than two steps' groups with signal
  wait: a tied group left unranked goes stale, as it would without the judge.
- Without `config`, a rollout whose ranking is pending under a configuration (a
  `reward_pending` reward: scored as it ended, e.g. by wrap() or the gateway) cannot be ranked
  here: its group is held (not skipped as `no_reward`, which would consume it), one warning and
  one `rewards_pending` event per configuration name the fix, and `rewards_pending_rank_judge`
  counts the rollouts held at the step. A rescore (or a restart with `config`) releases them.
- Guards: every stored guard verdict (a component whose source is "guard") of the batch gives
  `guard_<name>_rate` (rollouts where it fired) and `hacking_rate` (any guard fired).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from lightning_middleware import Reward, RewardConfig, Rollout, TraceStore
from lightning_middleware.records import Event, LLMCall
from lightning_middleware.rewards import GroupRanking, Scored, Scorer
from lightning_middleware.rewards.combine import ERRORS, PENDING
from lightning_middleware.rewards.config import RANK_JUDGE
from lightning_middleware.rewards.trajectory import load_trajectories

log = logging.getLogger(__name__)

ON_DEADLINE = ("train_without", "skip")
FINAL = "final"  # the combined reward's name (lightning_middleware.rewards.combine)


@dataclass(frozen=True)
class RewardPolicy:
    version: str | None = None
    wait_for: Mapping[str, float] = field(default_factory=dict)
    on_deadline: str = "train_without"
    config: RewardConfig | str | Path | None = None  # scores ready groups (its ranking judge) before training
    rank_ahead: bool = True  # a ranking judge ranks the oldest ready groups in a thread while the trainer trains

    def __post_init__(self) -> None:
        if self.on_deadline not in ON_DEADLINE:
            raise ValueError(f"on_deadline must be one of {', '.join(ON_DEADLINE)}, got {self.on_deadline!r}")
        bad = {k: v for k, v in self.wait_for.items() if not isinstance(v, (int, float)) or v < 0}
        if bad:
            raise ValueError(f"wait_for deadlines must be seconds >= 0, got {bad}")

    @property
    def reads_rewards(self) -> bool:
        return self.version is not None or bool(self.wait_for) or self.config is not None


class RewardGate:
    """Applies a `RewardPolicy` to the daemon's ready groups (one rewards query per collect)."""

    def __init__(self, store: TraceStore, policy: RewardPolicy, source: str | None = None) -> None:
        self.store = store
        self.source = source  # the trainer id, on the events it records
        self.scorer = _group_scorer(policy)
        if self.scorer is not None:  # train on the version the daemon scores
            if policy.version not in (None, self.scorer.hash):
                raise ValueError(f"rewards.version {policy.version} is not the hash of rewards.config "
                                 f"({self.scorer.hash}): give one of them")
            policy = replace(policy, version=self.scorer.hash)
        self.policy = policy
        self._ranking: Counter[str] = Counter()  # the ranking judge's counts since the last step
        self._judge_s = 0.0  # seconds spent scoring groups (the judge asked) since the last step
        self.reasons: dict[str, str] = {}  # rollout id -> why it has no reward to train on
        self._without: dict[str, list[str]] = {}  # rollout id -> components it trains without
        self._waiting: set[str] = set()
        self._held: dict[str, tuple[str, ...]] = {}  # rollout id -> (config hash, components pending here)
        self._warned: set[str] = set()  # configuration hashes whose pending rankings were reported
        # Ranking ahead (RankAhead's thread) and a collect may meet the same group: the one that
        # adds its members here first ranks it. The lock also guards the judge's counters.
        self._lock = threading.Lock()
        self._ranking_now: set[str] = set()
        self._ahead_s = 0.0
        self._ahead_groups = 0

    def _counts(self, r: Reward) -> bool:
        """Whether a stored reward is of the version trained on (a person's or the agent's always are)."""
        return self.policy.version is None or r.config_hash in (None, self.policy.version)

    @property
    def review_chunk(self) -> int | None:
        """The ranking judge's concurrency, the least the daemon reviews at once (None: no ranking
        judge, so reviewing every ready group costs no judge time)."""
        judge = self.scorer.config.rank_judge if self.scorer is not None else None
        return judge.concurrency if judge is not None else None

    @property
    def ranks_groups(self) -> bool:
        """Whether this gate's configuration has a ranking judge (it scores whole groups)."""
        return self.scorer is not None and self.scorer.config.rank_judge is not None

    @property
    def ranks_ties_only(self) -> bool:
        """Whether the ranking judge ranks only the groups the other components leave tied
        (`rank_judge.scope = "uniform"`): the rest train without it."""
        judge = self.scorer.config.rank_judge if self.scorer is not None else None
        return judge is not None and judge.scope == "uniform"

    def rank_ahead(self, groups: Sequence[Sequence[Rollout]], limit: int | None = None, *,
                   newest_first: bool = True) -> int:
        """Score `groups` (oldest first) that lack the configuration's scoring and that no other
        thread is ranking (RankAhead's thread calls this); the number scored.

        Every group the judge must rank (scope "all"): the first `limit` of the unscored ones.
        Ties only (scope "uniform"): every group the other components tell apart first (no judge
        call, so none is held while the judge ranks), then the judge ranks tied groups on demand,
        while fewer than `limit` groups with signal wait in `groups`, newest first where old groups
        go stale (`newest_first`; the daemon's stale rollouts are dropped). A tied group trains only
        once ranked and only while fresh: ranked oldest first and beyond what the trainer takes,
        most of the judge's work went to groups that went stale before a step took them
        (docs/benchmarks.md). Where nothing goes stale, oldest first: none waits for ever."""
        if self.scorer is None or not groups:
            return 0
        stored: dict[str, Sequence[Reward]] = dict(self.store.rewards_for([r.id for g in groups for r in g]))
        unscored = [g for g in groups if self._unscored(g, stored)]
        if not self.ranks_ties_only:
            return self._rank_unscored(unscored[:limit], stored, ahead=True)[0]
        told, tied, _, stored = self._rank_unscored(unscored, stored, ahead=True, defer=True)
        wanted = len(tied) if limit is None else limit - sum(self._told_apart(g, stored) for g in groups)
        if wanted <= 0 or not tied:
            return told
        order = tied[::-1] if newest_first else tied
        return told + self._rank_unscored(order[:wanted], stored, ahead=True)[0]

    def _told_apart(self, members: Sequence[Rollout], stored: Mapping[str, Sequence[Reward]]) -> bool:
        """Every member has the configuration's final reward, and they differ: the group trains."""
        assert self.scorer is not None
        values = set()
        for r in members:
            finals = [x.value for x in stored.get(r.id, []) if x.name == FINAL and x.config_hash == self.scorer.hash]
            if not finals:
                return False
            values.add(finals[-1])
        return len(values) > 1

    def _rank_unscored(self, groups: Sequence[Sequence[Rollout]], stored: dict[str, Sequence[Reward]], *,
                       ahead: bool = False, defer: bool = False
                       ) -> tuple[int, list[Sequence[Rollout]], dict[str, Rollout], dict[str, Sequence[Reward]]]:
        """Rank the groups that lack the configuration's scoring and that no other thread is ranking:
        (groups scored, groups left waiting: another thread is ranking them or `defer` left them,
        the scored members as stored now, `stored` updated). A group is claimed (its members in
        `_ranking_now`) before the judge is asked, and its rewards are read again after the claim: a
        ranking another thread finished in between has stored them, so no group is ranked twice.
        `defer`: score only the groups that need no judge call (`Scorer.score_told_apart`)."""
        with self._lock:
            unscored = [g for g in groups if self._unscored(g, stored)]
            busy = [g for g in unscored if any(r.id in self._ranking_now for r in g)]
            mine = [g for g in unscored if not any(g is b for b in busy)]
            self._ranking_now.update(r.id for g in mine for r in g)
        fresh: dict[str, Rollout] = {}
        todo: list[Sequence[Rollout]] = []
        try:
            if mine:
                stored = {**stored, **self.store.rewards_for([r.id for g in mine for r in g])}
                todo = [g for g in mine if self._unscored(g, stored)]
            deferred: list[Sequence[Rollout]] = []
            if todo:
                fresh, stored, deferred = self._rank(todo, stored, ahead=ahead, defer=defer)
        finally:
            self._release(mine)
        return len(todo) - len(deferred), [*busy, *deferred], fresh, stored

    def _release(self, groups: Sequence[Sequence[Rollout]]) -> None:
        with self._lock:
            self._ranking_now.difference_update(r.id for g in groups for r in g)

    def review(self, members: Sequence[Rollout], now: float | None = None) -> list[Rollout] | None:
        """`review_groups` of one group."""
        return self.review_groups([members], now)[0]

    def review_groups(self, groups: Sequence[Sequence[Rollout]], now: float | None = None, *,
                      defer_ranking: bool = False) -> list[list[Rollout] | None]:
        """Each group as the trainer should see it (final rewards of the version; rollouts skipped
        at a deadline have none, their reason in `reasons`), or None while it waits. The groups
        that need the configuration's scoring are scored together (the judge ranks them at once).
        `defer_ranking` (a rank-ahead thread runs): a group the judge must rank waits for that
        thread, so a collect asks the judge nothing and the groups that need no judge call (at
        `rank_judge.scope = "uniform"`: the other components tell them apart) train at once."""
        now = time.time() if now is None else now
        self._held = {}  # a gauge: the rollouts held at this collect
        stored = self._read(groups)
        calls = self._calls_of_step_components(groups, stored)
        late = [None if self._held_for_ranking(g, stored) else self._deadlines(g, stored, calls, now) for g in groups]
        if self._held:
            self._report_held()
        fresh: dict[str, Rollout] = {}
        busy: list[Sequence[Rollout]] = []
        if self.scorer is not None:
            _, busy, fresh, stored = self._rank_unscored([g for g, lt in zip(groups, late) if lt is not None], stored,
                                                         defer=defer_ranking)
        out: list[list[Rollout] | None] = []
        for members, late_by_id in zip(groups, late):
            if late_by_id is None or any(members is g for g in busy):  # waits (for a ranking under way)
                out.append(None)
            elif not self.policy.reads_rewards:
                out.append(list(members))
            else:
                out.append([self._reviewed(fresh.get(r.id, r), stored, late_by_id[r.id]) for r in members])
        return out

    def _read(self, groups: Sequence[Sequence[Rollout]]) -> dict[str, Sequence[Reward]]:
        """The stored rewards of the members the policy reads (without one: those lacking a final
        reward, to tell a pending ranking from no reward)."""
        reads = self.policy.reads_rewards
        ids = [r.id for g in groups for r in g if reads or r.final_reward is None]
        return dict(self.store.rewards_for(ids)) if ids else {}

    def _deadlines(self, members: Sequence[Rollout], stored: Mapping[str, Sequence[Reward]],
                   calls: Mapping[str | None, Sequence[LLMCall]], now: float) -> dict[str, list[str]] | None:
        """Per member the awaited components past their deadline, or None while one is still to come."""
        late_by_id: dict[str, list[str]] = {}
        for r in members:
            rewards = [x for x in stored.get(r.id, []) if self._counts(x)]
            missing = [n for n in self.policy.wait_for if not _arrived(n, rewards, calls.get(r.id, ()))]
            late = [n for n in missing if now - (r.ended_at or r.created_at) > self.policy.wait_for[n]]
            if len(late) < len(missing):
                self._waiting.add(r.id)
            else:
                self._waiting.discard(r.id)
                late_by_id[r.id] = late
        return late_by_id if len(late_by_id) == len(members) else None

    def _calls_of_step_components(self, groups: Sequence[Sequence[Rollout]], stored: Mapping[str, Sequence[Reward]]
                                  ) -> Mapping[str | None, Sequence[LLMCall]]:
        """The trained calls of the members with a per-call reward of an awaited component (one query)."""
        ids = [r.id for g in groups for r in g
               if any(x.call_index is not None and x.name in self.policy.wait_for for x in stored.get(r.id, []))]
        return self.store.calls_for(ids, training_only=True) if ids else {}

    def _held_for_ranking(self, members: Sequence[Rollout], stored: Mapping[str, Sequence[Reward]]) -> bool:
        """Whether a member waits for its group's ranking under a configuration this trainer was not
        given (scored as it ended, e.g. by wrap() or the gateway): the group then waits, kept for a
        trainer with `--reward-config` or `rewards rescore`, instead of being skipped as unrewarded."""
        if self.scorer is not None:  # this trainer scores every group itself
            return False
        held = False
        for r in members:
            pending = _pending(stored.get(r.id, []), self.policy.version) if self._lacks_final(r, stored) else None
            if pending is not None:
                self._held[r.id] = pending
                held = True
        return held

    def _lacks_final(self, r: Rollout, stored: Mapping[str, Sequence[Reward]]) -> bool:
        if self.policy.version is None:
            return r.final_reward is None
        return not any(x.name == FINAL and x.config_hash == self.policy.version for x in stored.get(r.id, []))

    def _report_held(self) -> None:
        """Once per configuration: a warning naming the fix, and an event in the store."""
        by_hash: dict[str, list[str]] = {}
        for rid, (h, *_names) in self._held.items():
            by_hash.setdefault(h, []).append(rid)
        for h, ids in by_hash.items():
            if h in self._warned:
                continue
            self._warned.add(h)
            names = sorted({n for rid in ids for n in self._held[rid][1:]})
            msg = (f"{len(ids)} rollouts were scored as they ended under reward configuration {h}, whose "
                   f"{', '.join(names)} ranks a group and is computed only where groups exist; this trainer was "
                   f"started without that configuration, so they wait (held, not trained nor skipped). Fix: "
                   f"restart the trainer with --reward-config FILE (the configuration of hash {h}; it ranks "
                   f"each ready group), or run `lightning-mw rewards rescore --store URL --config FILE`")
            log.warning("%s", msg)
            self.store.add_event(Event(kind="rewards_pending", message=msg, source=self.source,
                                       data={"config_hash": h, "pending": names, "rollouts": len(ids)}))

    def _reviewed(self, r: Rollout, stored: Mapping[str, Sequence[Reward]], late: list[str]) -> Rollout:
        r = self._versioned(r, [x for x in stored.get(r.id, []) if self._counts(x)])
        if late and self.policy.on_deadline == "skip":
            self.reasons[r.id] = f"late_{late[0]}"
            return replace(r, final_reward=None)
        self._without[r.id] = late
        return r

    def _unscored(self, members: Sequence[Rollout], stored: Mapping[str, Sequence[Reward]]) -> bool:
        """A member has neither a final reward of the configuration, nor its ranking judge's value,
        nor the judge's error (a ranking that failed is not asked again: its rollouts are skipped)."""
        if self.scorer is None:
            return False
        h = self.scorer.hash

        def scored(x: Reward) -> bool:
            return x.config_hash == h and (x.name in (RANK_JUDGE, FINAL)
                                           or (x.name == ERRORS and RANK_JUDGE in (x.metadata or {}).get("errors", {})))

        return any(not any(scored(x) for x in stored.get(r.id, [])) for r in members)

    def _rank(self, groups: Sequence[Sequence[Rollout]], stored: Mapping[str, Sequence[Reward]], *,
              ahead: bool = False, defer: bool = False
              ) -> tuple[dict[str, Rollout], dict[str, Sequence[Reward]], list[Sequence[Rollout]]]:
        """Score the groups under the configuration (a ranking judge ranks each once, the groups
        concurrently); the members and their rewards as stored now, and the groups `defer` left
        unscored (those the judge must rank). `ahead`: on RankAhead's thread."""
        assert self.scorer is not None
        t0 = time.perf_counter()
        trajectories = [load_trajectories(self.store, g) for g in groups]
        results: Sequence[tuple[list[Scored], GroupRanking | None] | None] = (
            self.scorer.score_told_apart(trajectories) if defer else self.scorer.score_groups(trajectories))
        done: list[Sequence[Rollout]] = []
        deferred: list[Sequence[Rollout]] = []
        for members, group, result in zip(groups, trajectories, results):
            if result is None:
                deferred.append(members)
                continue
            done.append(members)
            scored, ranking = result
            for t, one in zip(group, scored):
                self.scorer.store_scored(self.store, t, apply="unconsumed", scored=one)
            if ranking is not None:
                with self._lock:
                    self._ranking.update(ranking.counts())
                if ranking.error is not None:
                    self.reasons.update({r.id: "rank_judge_failed" for r in members})
        with self._lock:
            if ahead:
                self._ahead_s += time.perf_counter() - t0
                self._ahead_groups += len(groups) - len(deferred)
            else:
                self._judge_s += time.perf_counter() - t0
        ids = [r.id for g in done for r in g]
        fresh = {r.id: self.store.get_rollout(r.id) or r for g in done for r in g}
        return fresh, {**stored, **self.store.rewards_for(ids)}, deferred

    def _versioned(self, r: Rollout, rewards: Sequence[Reward]) -> Rollout:
        if self.policy.version is None:
            return r
        finals = [x for x in rewards if x.name == FINAL and x.config_hash == self.policy.version]
        if not finals:
            self.reasons.setdefault(r.id, "no_reward_version")  # unless the ranking judge failed on it
            return replace(r, final_reward=None)
        return replace(r, final_reward=finals[-1].value)

    def step_metrics(self, rollouts: Sequence[Rollout]) -> dict[str, float]:
        """The batch's guard rates, the components trained without, the rollouts waiting."""
        stored = self.store.rewards_for([r.id for r in rollouts])
        fired: Counter[str] = Counter()
        names: set[str] = set()
        hacked = 0
        for r in rollouts:
            latest: dict[str, float] = {}
            for x in stored.get(r.id, []):
                if x.config_hash is not None and self._counts(x) and (x.metadata or {}).get("source") == "guard":
                    latest[str(x.name)] = x.value
            names.update(latest)
            hits = [n for n, v in latest.items() if v > 0]
            fired.update(hits)
            hacked += bool(hits)
        out: dict[str, float] = {}
        if names:
            out["hacking_rate"] = hacked / len(rollouts)
            out.update({f"guard_{n}_rate": fired[n] / len(rollouts) for n in sorted(names)})
        without = Counter(n for r in rollouts for n in self._without.pop(r.id, []))
        out.update({f"rewards_trained_without_{n}": float(k) for n, k in without.items()})
        if self.policy.wait_for:
            out["rewards_waiting"] = float(len(self._waiting))
        if self._warned:  # rollouts held for a ranking this trainer cannot do (zero once recovered)
            pending = Counter(n for _h, *names in self._held.values() for n in names)
            out.update({f"rewards_pending_{n}": float(pending[n]) for n in sorted(set(pending) | {RANK_JUDGE})})
        with self._lock:
            if self.scorer is not None:
                out["reward_judge_s"] = self._judge_s
                self._judge_s = 0.0
            if self.ranks_groups:
                out.update({f"rank_judge_{k}": float(self._ranking[k])
                            for k in ("groups", "failed", "groups_of_one", "groups_told_apart", "unparseable")})
                self._ranking.clear()
                if self.policy.rank_ahead:
                    out["reward_judge_ahead_s"] = self._ahead_s
                    out["rank_judge_ahead_groups"] = float(self._ahead_groups)
                    self._ahead_s, self._ahead_groups = 0.0, 0
        for r in rollouts:
            self.reasons.pop(r.id, None)
        return out


class RankAhead:
    """A thread that keeps the ready groups ranked while the trainer trains: every `interval_s` (at
    once after a round that ranked something) it asks `ready()` for the ready groups, oldest first,
    and has the gate rank ahead (`RewardGate.rank_ahead`) with `groups` as its limit; `newest_first`
    where the trainer drops stale rollouts."""

    def __init__(self, gate: RewardGate, ready: Callable[[], list[list[Rollout]]], groups: int,
                 interval_s: float, name: str = "rank-ahead", *, newest_first: bool = True) -> None:
        self.gate, self.ready, self.groups, self.interval_s = gate, ready, groups, interval_s
        self.newest_first = newest_first
        self.rounds = 0  # rounds finished: what a caller counts to know the thread has looked again
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def _run(self) -> None:
        ranked = 0
        while not self._stop.wait(0 if ranked else self.interval_s):
            try:
                ranked = self.gate.rank_ahead(self.ready(), self.groups, newest_first=self.newest_first)
            except Exception:  # the store or the judge failed: the collect ranks what is left itself
                log.exception("ranking ahead failed; retrying in %.1f s", self.interval_s)
                ranked = 0
            self.rounds += 1

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop after the round under way (a judge call is bounded by its deadline)."""
        self._stop.set()
        self._thread.join(timeout=timeout_s)


def _arrived(name: str, rewards: Sequence[Reward], calls: Sequence[LLMCall]) -> bool:
    """Whether an awaited component is in: a reward of that name; for a per-call component (its
    rewards carry a call index) one for every trained call it applies to (the calls of the agents
    its rewards name, else all of them): a per-step judge has then scored the whole rollout."""
    mine = [x for x in rewards if x.name == name]
    steps = [x for x in mine if x.call_index is not None]
    if not steps:
        return bool(mine)
    agents = {x.agent for x in steps}
    wanted = {c.call_index for c in calls if None in agents or c.agent_name in agents}
    return wanted <= {x.call_index for x in steps}


def _pending(rewards: Sequence[Reward], version: str | None) -> tuple[str, ...] | None:
    """(configuration hash, components...) of a ranking still pending (the latest of its marker,
    final reward and errors under that hash is the marker), under `version` if given; else None."""
    latest: dict[str, Reward] = {}
    for x in rewards:
        if x.config_hash is not None and x.name in (PENDING, FINAL, ERRORS) and version in (None, x.config_hash):
            latest[x.config_hash] = x
    for h, x in latest.items():
        if x.name == PENDING:
            return (h, *[str(n) for n in (x.metadata.get("pending") or [RANK_JUDGE])])
    return None


def _group_scorer(policy: RewardPolicy) -> Scorer | None:
    if policy.config is None:
        return None
    config = policy.config if isinstance(policy.config, RewardConfig) else RewardConfig.load(policy.config)
    return Scorer(config)
