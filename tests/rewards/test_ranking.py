"""The ranking judge: its answers parsed (every shape, exhaustively with hypothesis), a group of
real rollouts on the test LLM ranked by a real HTTP judge (scripted per test), unreadable
answers retried then recorded and counted, a group of one, a large group cut to max_chars."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_middleware import RewardConfig, TraceStore, rollout
from lightning_middleware.rewards import ConfigError, RankParseError, Scorer, parse_ranking, rescore
from lightning_middleware.rewards.ranking import SINGLETON, TOLD_APART, letters, rank_values
from lightning_middleware.rewards.trajectory import load_trajectories
from tests.rewards.helpers import client_for, tool_agent
from tests.rewards.ranking_judge import by_errors, candidates, ranking_judge

# -- parsing ---------------------------------------------------------------------------------


@st.composite
def rankings(draw: st.DrawFn) -> tuple[list[str], list[list[str]]]:
    """Candidates A.. and a ranking of them into tiers (ties), best first."""
    n = draw(st.integers(2, 30))
    labels = letters(n)
    order = draw(st.permutations(labels))
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)))
    tiers = [list(order[a:b]) for a, b in zip([0, *cuts], [*cuts, n])]
    return labels, tiers


def _expected(tiers: list[list[str]]) -> dict[str, float]:
    out, position = {}, 1
    for tier in tiers:
        out.update({c: position + (len(tier) - 1) / 2 for c in tier})
        position += len(tier)
    return out


WRAPS = ["{}", "[{}]", "({})", "**{}**", "Candidate {}"]
HEADS = ["Ranking: ", "ranking:", "**Ranking:** ", "RANKING = ", "- Ranking: "]


@settings(max_examples=300, deadline=None)
@given(rankings(), st.sampled_from(WRAPS), st.sampled_from(HEADS), st.sampled_from([" > ", ">", " >> ", ", "]),
       st.sampled_from([" = ", "="]), st.sampled_from(["", ". B was best.", "\nReason: fine", " because"]),
       st.sampled_from(["", "I compared them.\n", "Ranking: A > B (a draft)\n"]))
def test_every_written_ranking_reads_back(r: tuple[list[str], list[list[str]]], wrap: str, head: str, sep: str,
                                          tie: str, tail: str, preface: str) -> None:
    labels, tiers = r
    line = head + sep.join(tie.join(wrap.format(c) for c in tier) for tier in tiers) + tail
    assert parse_ranking(preface + line, labels) == _expected(tiers)  # the last ranking line counts


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 12).flatmap(lambda n: st.lists(st.integers(0, 10), min_size=n, max_size=n)),
       st.sampled_from(["{c}: {s}", "Candidate {c}: {s}/10", "- **{c}** = {s}", "[{c}] - {s}"]))
def test_per_candidate_scores_read_as_a_ranking(scores: list[int], fmt: str) -> None:
    labels = letters(len(scores))
    text = "Scores:\n" + "\n".join(fmt.format(c=c, s=s) for c, s in zip(labels, scores)) + "\nDone."
    tiers = [[c for c, s in zip(labels, scores) if s == v] for v in sorted(set(scores), reverse=True)]
    assert parse_ranking(text, labels) == _expected(tiers)


@settings(max_examples=300, deadline=None)
@given(rankings(), st.sampled_from(["drop", "twice", "unknown", "garbage"]), st.data())
def test_a_ranking_that_is_not_one_of_exactly_the_candidates_fails(r: tuple[list[str], list[list[str]]],
                                                                    fault: str, data: st.DataObject) -> None:
    labels, tiers = r
    flat = [c for tier in tiers for c in tier]
    i = data.draw(st.integers(0, len(flat) - 1))
    if fault == "drop":
        flat.pop(i)
    elif fault == "twice":
        flat.insert(i, flat[data.draw(st.integers(0, len(flat) - 1))])
    elif fault == "unknown":
        flat.insert(i, letters(len(labels) + 1)[-1])
    else:
        flat.insert(i, "?")
    with pytest.raises(RankParseError):
        parse_ranking("Ranking: " + " > ".join(flat), labels)


@settings(max_examples=500, deadline=None)
@given(st.one_of(st.text(), st.text(alphabet="ABCD >=,:.*[]()\n0123456789Ranking")))
def test_any_answer_is_a_full_ranking_or_a_parse_error(text: str) -> None:
    try:
        ranks = parse_ranking(text, ["A", "B", "C"])
    except RankParseError:
        return
    assert sorted(ranks) == ["A", "B", "C"] and sum(ranks.values()) == 6  # ranks 1..3, ties averaged


@pytest.mark.parametrize("text, why", [
    ("They are all quite good, hard to say.", "no 'Ranking:' line"),
    ("", "no 'Ranking:' line"),
    ("Ranking: none of them", "no candidate"),
    ("Ranking: B > A", "C missing"),
    ("Ranking: B > A > C > D", "D is no candidate"),
    ("Ranking: B > B > A > C", "B named more than once"),
    ("A: 3\nB: 4\nA: 5\nC: 1", "A scored more than once"),
    ("A: 3\nB: 4", "C missing"),
])
def test_unreadable_answers_say_what_is_wrong(text: str, why: str) -> None:
    with pytest.raises(RankParseError, match=why):
        parse_ranking(text, ["A", "B", "C"])


@given(rankings())
def test_values_are_group_relative_in_0_1(r: tuple[list[str], list[list[str]]]) -> None:
    labels, tiers = r
    values = rank_values(_expected(tiers))
    assert all(0.0 <= v <= 1.0 for v in values.values())
    assert sum(values.values()) == pytest.approx(len(labels) / 2)  # the mean is always 0.5
    if len(tiers[0]) == 1:
        assert values[tiers[0][0]] == 1.0
    if len(tiers[-1]) == 1:
        assert values[tiers[-1][0]] == 0.0


# -- a real judge over real rollouts ---------------------------------------------------------


def _config(url: str, **judge: object) -> RewardConfig:
    return RewardConfig.from_dict({"rules": {"tool_call_valid": 1.0},
                                   "rank_judge": {"url": url, "model": "judge", "weight": 4.0, **judge}})


def _rollouts(store: TraceStore, results: list[str], *, task: str = "t", config: RewardConfig | None = None,
              question: str = "fix it") -> list[str]:
    client = client_for(store)
    ids = []
    for result in results:
        with rollout(task, store=store, input={"question": question}, rewards=config) as r:
            tool_agent(client, question, result)
        ids.append(r.id)
    return ids


def _mine(store: TraceStore, rid: str, h: str) -> dict[str, object]:
    return {x.name: x for x in store.rewards(rid) if x.config_hash == h}


def test_a_group_is_ranked_by_the_judge_and_its_answer_kept(store: TraceStore) -> None:
    with ranking_judge(by_errors) as judge:
        cfg = _config(judge.url, prompt="Rank these {n} ({letters}). Reply 'Ranking: {example}'.")
        ids = _rollouts(store, ["ok", "Error: boom", "ok", "Error: bad"], config=cfg)
        # scored as they ended, alone: the rule is in, the ranking is pending, no final reward yet
        assert judge.seen == []
        for rid in ids:
            mine = _mine(store, rid, cfg.hash)
            assert "tool_call_valid" in mine and "rank_judge" not in mine and "final" not in mine
            assert store.get_rollout(rid).final_reward is None
        report = rescore(store, cfg)
        assert (report.groups_ranked, report.groups_failed, report.unparseable_answers) == (1, 0, 0)
        assert "1 groups ranked, 0 failed, 0 of one (not ranked), 0 unparseable answers" in report.summary()
        [body] = judge.seen
    assert body["messages"][0]["content"].startswith("Rank these 4 (A, B, C, D). Reply 'Ranking: B > A = C > D'")
    assert sorted(candidates(body)) == ["A", "B", "C", "D"] and body["messages"][1]["content"].count("fix it") >= 4
    values = {rid: _mine(store, rid, cfg.hash)["rank_judge"].value for rid in ids}
    assert [values[i] for i in ids] == pytest.approx([5 / 6, 1 / 6, 5 / 6, 1 / 6])  # ranks 1.5 and 3.5 of 4
    for rid in ids:
        mine = _mine(store, rid, cfg.hash)
        detail = mine["rank_judge"].metadata["detail"]
        assert detail["reply"].startswith("Ranking: ") and detail["group_size"] == 4 and detail["answers"] == 1
        assert detail["candidates"][ord(detail["letter"]) - 65] == rid
        assert mine["final"].value == pytest.approx(1.0 + 4.0 * values[rid])
        assert store.get_rollout(rid).final_reward == pytest.approx(mine["final"].value)
    # scored alone again (a late label, the review page): the group's value is reused, not asked again
    again = Scorer(cfg).score_rollout(store, ids[1])
    assert again.scored.values["rank_judge"] == pytest.approx(1 / 6) and len(judge.seen) == 1


def test_the_judges_settings_are_in_the_hash_and_checked() -> None:
    base = _config("http://127.0.0.1:1/v1")
    assert len({base.hash, _config("http://127.0.0.1:1/v1", prompt="other {n}").hash,
                _config("http://127.0.0.1:1/v1", weight=2.0).hash, _config("http://127.0.0.1:1/v1", shuffle=False).hash,
                _config("http://127.0.0.1:1/v1", max_chars=500).hash}) == 5
    assert _config("http://127.0.0.1:1/v1", retries=5).hash == base.hash  # how hard it tries is no reward change
    with pytest.raises(ConfigError, match="rank_judge. has unknown keys"):
        RewardConfig.from_dict({"rank_judge": {"url": "u", "model": "m", "temperature": 1}})
    with pytest.raises(ConfigError, match="needs the judge's url and model"):
        RewardConfig.from_dict({"rank_judge": {"url": "u"}})
    for bad, why in (({"retries": -1}, "retries must be a whole number >= 0"),
                     ({"max_chars": 10}, "max_chars must be a whole number >= 200"),
                     ({"max_tokens": 1.5}, "max_tokens must be a whole number"),
                     ({"shuffle": "yes"}, "shuffle must be true or false"), ({"prompt": 3}, "prompt must be text"),
                     ({"url": 1}, "needs the judge's url and model"), ({"weight": "x"}, "weight must be a finite")):
        with pytest.raises(ConfigError, match=why):
            RewardConfig.from_dict({"rank_judge": {"url": "u", "model": "m", **bad}})
    with pytest.raises(ConfigError, match="takes no .reward_model. or .rank_judge."):
        RewardConfig.from_dict({"reward_type": "rule", "rules": {"succeeded": 1},
                                "rank_judge": {"url": "u", "model": "m"}})
    assert RewardConfig.from_dict({"reward_type": "model", "rank_judge": {"url": "u", "model": "m"}}).weights == {
        "rank_judge": 1.0}


def test_an_unreadable_answer_is_asked_again_with_what_was_wrong(store: TraceStore) -> None:
    script = ["They are all fine.", "Ranking: B > A > D", "Ranking: B > A > C"]
    with ranking_judge(script) as judge:
        cfg = _config(judge.url, retries=2, shuffle=False)
        ids = _rollouts(store, ["ok", "ok", "ok"])
        report = rescore(store, cfg)
        assert (report.groups_ranked, report.groups_failed, report.unparseable_answers) == (1, 0, 2)
    third = judge.seen[2]["messages"]
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert "no 'Ranking:' line" in third[3]["content"] and "D is no candidate" in third[5]["content"]
    values = [_mine(store, rid, cfg.hash)["rank_judge"].value for rid in ids]
    assert values == [0.5, 1.0, 0.0]  # shuffle off: A, B, C in the order given
    assert _mine(store, ids[0], cfg.hash)["rank_judge"].metadata["detail"]["answers"] == 3


@pytest.mark.parametrize("on_error", ["drop", "partial"])
def test_answers_never_readable_are_an_error_on_every_rollout_and_counted(store: TraceStore, store_url: str,
                                                                          tmp_path: Path, on_error: str) -> None:
    with ranking_judge(["Ranking: A > A"]) as judge:
        config = tmp_path / "rewards.toml"
        config.write_text(f'on_error = "{on_error}"\n[rules]\ntool_call_valid = 1.0\n'
                          f'[rank_judge]\nurl = "{judge.url}"\nmodel = "judge"\nretries = 1\n')
        cfg = RewardConfig.load(config)
        ids = _rollouts(store, ["ok", "ok"], task="x") + _rollouts(store, ["ok"], task="solo")
        done = subprocess.run([sys.executable, "-m", "lightning_middleware.cli", "rewards", "rescore", "--store",
                               store_url, "--config", str(config)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert len(judge.seen) == 2  # the group of two, asked twice; the group of one not at all
    assert "ranking judge: 0 groups ranked, 1 failed, 1 of one (not ranked), 2 unparseable answers" in done.stdout
    for rid in ids[:2]:
        mine = _mine(store, rid, cfg.hash)
        error = mine["reward_errors"].metadata["errors"]["rank_judge"]
        assert "could not be read after 2 tries" in error and "A named more than once" in error
        assert "'Ranking: A > A'" in error  # the raw answer is kept with the error
        assert ("final" in mine) == (on_error == "partial")
    solo = _mine(store, ids[2], cfg.hash)
    assert solo["final"].value == 1.0 and solo["final"].metadata["notes"] == {"rank_judge": SINGLETON}


def test_a_group_of_one_is_not_ranked_and_stays_so(store: TraceStore) -> None:
    with ranking_judge(by_errors) as judge:
        cfg = _config(judge.url)
        [rid] = _rollouts(store, ["ok"], config=cfg)
        report = rescore(store, cfg)
        assert (report.groups_of_one, report.groups_ranked, judge.seen) == (1, 0, [])
        again = Scorer(cfg).score_rollout(store, rid)  # scored alone later: absent, not pending again
    assert again.scored.final == 1.0 and again.scored.pending == ()
    final = _mine(store, rid, cfg.hash)["final"]
    assert final.metadata["absent"] == ["rank_judge"] and final.metadata["notes"]["rank_judge"] == SINGLETON


def test_scope_uniform_asks_the_judge_only_for_groups_the_rules_leave_tied(store: TraceStore) -> None:
    with ranking_judge(["Ranking: A > B > C"]) as judge:
        cfg = RewardConfig.from_dict({"rules": {"tool_error": -1.0}, "rank_judge": {
            "url": judge.url, "model": "judge", "weight": 0.5, "shuffle": False, "scope": "uniform"}})
        apart = _rollouts(store, ["ok", "Error: boom"], task="apart", config=cfg)
        tied = _rollouts(store, ["Error: a", "Error: b", "Error: c"], task="tied", config=cfg)
        for rid in apart + tied:  # as they end, every rollout waits for its group, as with scope "all"
            assert store.get_rollout(rid).final_reward is None
        report = rescore(store, cfg)
        assert (report.groups_ranked, report.groups_told_apart, report.groups_of_one) == (1, 1, 0)
        assert "1 told apart by the other components (not ranked)" in report.summary()
        [body] = judge.seen  # the tied group only
        assert sorted(candidates(body)) == ["A", "B", "C"]
        again = Scorer(cfg).score_rollout(store, apart[0])  # scored alone later: absent, not pending again
        assert again.scored.pending == () and again.scored.final == 0.0 and len(judge.seen) == 1
    for rid, rule in zip(apart, (0.0, -1.0)):  # the rules alone, in every member of the group
        mine = _mine(store, rid, cfg.hash)
        assert "rank_judge" not in mine and mine["final"].value == rule == store.get_rollout(rid).final_reward
        assert mine["final"].metadata["notes"] == {"rank_judge": TOLD_APART}
    finals = [store.get_rollout(rid).final_reward for rid in tied]
    assert finals == pytest.approx([-1.0 + 0.5 * v for v in (1.0, 0.5, 0.0)])  # the judge breaks the tie
    assert _config("u").hash == _config("u", scope="all").hash != _config("u", scope="uniform").hash
    # the default is not hashed at all: a configuration written before the key existed keeps its hash
    assert "scope" not in _config("u").describe()["rank_judge"] and "scope" in _config(
        "u", scope="uniform").describe()["rank_judge"]
    with pytest.raises(ConfigError, match="rank_judge.scope must be one of 'all', 'uniform', got 'ties'"):
        _config("u", scope="ties")


def test_score_told_apart_scores_without_the_judge_and_leaves_the_tied_groups(store: TraceStore) -> None:
    """What a trainer's collect scores while its rank-ahead thread ranks: the groups the rules tell
    apart, as `score_groups` scores them; a tied group (or, at scope "all", every group) is None."""
    with ranking_judge(["Ranking: A > B"]) as judge:
        uniform = RewardConfig.from_dict({"rules": {"tool_error": -1.0}, "rank_judge": {
            "url": judge.url, "model": "judge", "weight": 0.5, "shuffle": False, "scope": "uniform"}})
        apart = load_trajectories(store, [store.get_rollout(i) for i in _rollouts(store, ["ok", "Error: x"], task="p")])
        tied = load_trajectories(store, [store.get_rollout(i) for i in _rollouts(store, ["ok", "fine"], task="q")])
        deferred = Scorer(uniform).score_told_apart([tied, apart])
        assert deferred[0] is None and deferred[1] is not None and judge.seen == []
        scored, ranking = deferred[1]
        assert [s.final for s in scored] == [0.0, -1.0] and ranking is not None and ranking.note == TOLD_APART
        assert [s.final for s in scored] == [s.final for s in Scorer(uniform).score_groups([apart])[0][0]]
        every = RewardConfig.from_dict({"rules": {"tool_error": -1.0}, "rank_judge": {
            "url": judge.url, "model": "judge", "weight": 0.5}})
        assert Scorer(every).score_told_apart([tied, apart]) == [None, None] and judge.seen == []


def test_a_large_group_is_cut_to_max_chars(store: TraceStore) -> None:
    results = [("Error: " if i % 3 == 0 else "fine ") + "x" * 3000 + f" #{i}" for i in range(12)]
    with ranking_judge(by_errors) as judge:
        cfg = _config(judge.url, max_chars=6000)
        ids = _rollouts(store, results, question="q" * 5000)
        report = rescore(store, cfg)
        [body] = judge.seen
    assert report.groups_ranked == 1
    user = body["messages"][1]["content"]
    assert len(user) <= 6000 + 500, len(user)
    cands = candidates(body)
    assert sorted(cands) == letters(12) and all("Final answer:" in text for text in cands.values())
    assert all(f"#{i}" in user for i in range(12))  # each transcript keeps its end
    values = {rid: _mine(store, rid, cfg.hash)["rank_judge"].value for rid in ids}
    assert {round(values[ids[i]], 6) for i in range(12) if i % 3 == 0} == {round((12 - 10.5) / 11, 6)}
    assert {round(values[ids[i]], 6) for i in range(12) if i % 3} == {round((12 - 4.5) / 11, 6)}
