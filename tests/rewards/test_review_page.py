"""The labelling page served by the gateway at /review: its API behind the gateway's bearer
token, a person's score in a real headless Chromium stored as a `human` reward and combined
into the final reward under the gateway's configuration, and the model-vs-human agreement
(rank correlation) the page reports."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from lightning_middleware import RewardConfig, TraceStore
from lightning_middleware.gateway import Gateway
from lightning_middleware.testing import LLMTestServer
from tests.rewards.browser import browser
from tests.rewards.test_gateway_rewards import gateway_turns

TOKEN = "review-Tok-4c1d"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _quality(t) -> float:
    """A stand-in reward model: the quality the test wrote into the rollout's input."""
    return float(t.rollout.input["quality"])


CONFIG = RewardConfig.from_dict({"rules": {"succeeded": 1.0}, "human": {"weight": 2.0, "interval": 1},
                                 "reward_model": {"scorer": "tests.rewards.test_review_page:_quality", "weight": 1.0}})


def _human(store: TraceStore, rid: str) -> list[float]:
    return [r.value for r in store.rewards(rid) if r.name == "human" and r.config_hash is None]


@pytest.mark.browser
def test_review_page_on_the_gateway(llm_server: LLMTestServer, tmp_path: Path) -> None:
    store = TraceStore(f"sqlite:///{tmp_path / 'review.db'}")
    quality = {"r-1": 0.9, "r-2": 0.1, "r-3": 0.5}
    with Gateway([llm_server.base_url], store, rewards=CONFIG, token=TOKEN, health_interval_s=0.5) as gw:
        for rid, q in quality.items():
            ro = httpx.post(gw.url + "/rollouts", json={"id": rid, "task_id": "t", "input": {"quality": q}},
                            headers=AUTH, timeout=30).json()
            gateway_turns(ro["base_url"], token=TOKEN)
            httpx.post(gw.url + f"/rollouts/{rid}/finish", json={}, headers=AUTH, timeout=30).raise_for_status()
        assert store.get_rollout("r-1").final_reward == pytest.approx(1.0 + 0.9)  # no label yet

        # The API: the gateway's token, like its other admin routes; bad input loses nothing.
        assert httpx.get(gw.url + "/review", timeout=30).status_code == 200  # the page itself holds no data
        assert httpx.get(gw.url + "/review/api/next", timeout=30).status_code == 401
        assert httpx.post(gw.url + "/review/api/rollouts/r-1/score", json={"score": 1}, timeout=30).status_code == 401
        bad = httpx.post(gw.url + "/review/api/rollouts/r-1/score", json={"score": 3}, headers=AUTH, timeout=30)
        assert bad.status_code == 400 and _human(store, "r-1") == []
        for rid, score in (("r-1", 0.8), ("r-2", 0.3)):
            ok = httpx.post(gw.url + f"/review/api/rollouts/{rid}/score", json={"score": score}, headers=AUTH,
                            timeout=30).json()
            assert ok["final_rewards"] == {rid: pytest.approx(1.0 + quality[rid] + 2.0 * score)}
        assert store.get_rollout("r-1").final_reward == pytest.approx(1.0 + 0.9 + 1.6)

        # The page, in a real browser: the token in the address's fragment (never sent to the server).
        with browser(tmp_path / "profile") as page:
            page.goto(f"{gw.url}/review#token={TOKEN}")
            pane = "document.querySelector('.pane')"
            shown = page.wait_for(f"{pane} && {pane}.dataset.rolloutId")
            assert shown == "r-3"  # the one not labelled yet
            page.wait_for("document.getElementById('stats').textContent.includes('2 of 3 labelled')")
            page.click("button.score-btn[data-value='4']")
            page.type("#note", "half right")
            page.click("#save")
            page.wait_for("document.getElementById('status').textContent.startsWith('saved')")
            stats = page.wait_for("document.getElementById('stats').textContent.includes('3 of 3 labelled') && "
                                  "document.getElementById('stats').textContent")
        assert _human(store, "r-3") == [0.4]
        assert store.get_rollout("r-3").final_reward == pytest.approx(1.0 + 0.5 + 2.0 * 0.4)

        agreement = httpx.get(gw.url + "/review/api/stats", headers=AUTH, timeout=30).json()["agreement"]
        # model 0.9 > 0.5 > 0.1 and people 0.8 > 0.4 > 0.3: the same order, rank correlation 1
        assert agreement["n"] == 3 and agreement["rank_correlation"] == pytest.approx(1.0)
        assert "rank correlation 1.00" in stats
    store.close()
