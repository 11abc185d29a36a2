"""Two reward versions side by side over real rollouts (the test LLM, a real store): the frame
per rollout, rank disagreement within each group, the summary, the figure."""

from __future__ import annotations

import io

import matplotlib
import pytest

matplotlib.use("Agg")

from lightning_middleware import RewardConfig, TraceStore, analysis, rollout  # noqa: E402
from lightning_middleware.rewards import rescore  # noqa: E402
from tests.rewards.helpers import client_for, tool_agent  # noqa: E402

SAME = RewardConfig.from_dict({"rules": {"agent_reward": 1.0}})
REVERSED = RewardConfig.from_dict({"rules": {"agent_reward": -1.0, "tool_call_valid": 1.0}})
AGENT_REWARDS = {"a": [0.1, 0.5, 0.9], "b": [0.3, 0.2, 0.7]}


def _fill(store: TraceStore) -> dict[str, float]:
    client = client_for(store)
    own = {}
    for task, values in AGENT_REWARDS.items():
        for v in values:
            with rollout(task, store=store) as r:
                tool_agent(client, f"{task}?", "ok")
                r.reward(v)
            own[r.id] = v
    return own


def test_two_versions_side_by_side(store: TraceStore) -> None:
    own = _fill(store)
    ids = list(own)
    rescore(store, SAME, apply="none")
    rescore(store, REVERSED, rollout_ids=ids[1:], apply="none")  # one rollout only under SAME
    versions = analysis.reward_versions(store)
    assert list(versions.index) == ["agent", SAME.hash, REVERSED.hash]  # newest last
    assert list(versions["n_rollouts"]) == [6, 6, 5]
    assert versions.loc[REVERSED.hash, "components"] == ["agent_reward", "tool_call_valid"]

    cmp = analysis.compare_reward_versions(store)  # the two newest
    assert (cmp.version_a, cmp.version_b) == (SAME.hash, REVERSED.hash)
    f = cmp.frame.set_index("rollout_id")
    assert len(f) == 5 and ids[0] not in f.index
    for rid in f.index:
        assert f.loc[rid, "final_a"] == pytest.approx(own[rid])
        assert f.loc[rid, "final_b"] == pytest.approx(1.0 - own[rid])
        assert f.loc[rid, "diff"] == pytest.approx(1.0 - 2 * own[rid])
        assert f.loc[rid, "rank_a"] + f.loc[rid, "rank_b"] == f.loc[rid, "group_size"] + 1  # order reversed
        assert f.loc[rid, "discordant"] == f.loc[rid, "group_size"] - 1  # against every partner
    s = cmp.summary
    assert (s["n_a"], s["n_b"], s["n_both"], s["only_a"], s["only_b"]) == (6, 5, 5, 1, 0)
    assert (s["groups"], s["pairs"], s["discordant_pairs"], s["discordant_rate"]) == (2, 1 + 3, 4, 1.0)
    assert s["spearman"] == pytest.approx(-1.0) and s["groups_best_changed"] == 2
    assert cmp.disagreements(2)["discordant"].tolist() == [2, 2]

    fig = cmp.figure()
    assert len(fig.axes) == 2 and len(fig.axes[1].collections) == 2
    flipped = fig.axes[1].collections[1].get_offsets()
    assert len(flipped) == 5  # every rollout's order flipped
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue().startswith(b"\x89PNG")


def test_against_the_agents_own_reward_and_one_version_given(store: TraceStore) -> None:
    _fill(store)
    rescore(store, SAME, apply="none")
    cmp = analysis.compare_reward_versions(store, "agent", SAME.hash)
    assert cmp.summary["mean_abs_diff"] == 0.0 and cmp.summary["discordant_pairs"] == 0
    assert cmp.summary["spearman"] == pytest.approx(1.0) and cmp.summary["groups_best_changed"] == 0
    assert analysis.compare_reward_versions(store, version_b=SAME.hash).version_a == "agent"
    with pytest.raises(ValueError, match=r"no final rewards under reward version 'nope'; stored versions: \['agent'"):
        analysis.compare_reward_versions(store, "nope", SAME.hash)


def test_an_empty_store_says_how_to_make_a_second_version(store: TraceStore) -> None:
    assert analysis.reward_versions(store).empty
    with pytest.raises(ValueError, match="comparing needs two reward versions, the store has 0.*rewards rescore"):
        analysis.compare_reward_versions(store)
