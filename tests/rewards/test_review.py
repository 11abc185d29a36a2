"""The labelling page: a person scores a rollout and compares two in a real headless Chromium,
the labels land in the store as "human" rewards and the final rewards are combined again; the
API's errors and its token. The store is SQLite here (the page reads it through the same
TraceStore as everything else, which the store tests run on PostgreSQL too)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from lightning_middleware import RewardConfig, TraceStore, rollout
from lightning_middleware.rewards import Scorer
from lightning_middleware.rewards.review import build_app
from tests.rewards.browser import browser, serve
from tests.rewards.helpers import client_for, tool_agent

CONFIG = RewardConfig.from_dict({"rules": {"agent_reward": 1.0}, "human": {"weight": 2.0, "interval": 1}})


@pytest.fixture
def labelled_store(tmp_path: Path) -> TraceStore:
    store = TraceStore(f"sqlite:///{tmp_path / 'labels.db'}")
    client = client_for(store)
    for task, question, reported in (("sort", "sort [3,1,2]", 0.5), ("sort", "sort [9,8]", 0.25),
                                     ("sum", "add 2 and 2", 1.0)):
        with rollout(task, store=store, rewards=CONFIG, input={"q": question}) as r:
            tool_agent(client, question, "done")
            r.reward(reported)
    yield store
    store.close()


def _human(store: TraceStore, rid: str) -> list[tuple[float, dict]]:
    """A rollout's human labels: (value, metadata without its label_id)."""
    return [(r.value, {k: v for k, v in r.metadata.items() if k != "label_id"}) for r in store.rewards(rid)
            if r.name == "human" and r.config_hash is None]


@pytest.mark.browser
def test_a_person_scores_and_compares_rollouts_in_a_browser(labelled_store: TraceStore, tmp_path: Path) -> None:
    store = labelled_store
    with serve(build_app(store, scorer=Scorer(CONFIG))) as url, browser(tmp_path / "profile") as page:
        page.goto(url + "/")
        first = page.wait_for("document.querySelector('.pane') && document.querySelector('.pane').dataset.rolloutId")
        shown = store.get_rollout(first)
        assert page.evaluate("document.querySelector('.final-output').textContent").startswith("echo:")
        assert shown.input["q"] in page.evaluate("document.querySelector('.pane').textContent")
        assert "agent_reward" in page.evaluate("document.querySelector('table.components').textContent")
        page.wait_for("document.getElementById('stats').textContent.includes('0 of 3 labelled')")
        visible = "((id) => getComputedStyle(document.getElementById(id)).display !== 'none')"
        assert page.evaluate(f"[{visible}('score-actions'), {visible}('compare-actions')]") == [True, False]
        assert page.evaluate("document.querySelectorAll('.msg')[1].textContent").endswith('-> run_python({"query": '
                                                                                       f'"{shown.input["q"]}"}})')

        page.click("#save")  # no score chosen yet: refused on the page, nothing stored
        assert page.wait_for("document.getElementById('status').className === 'error'")
        assert _human(store, first) == []
        page.type("#labeler", "ana")
        page.click("button.score-btn[data-value='7']")
        page.type("#note", "right answer, slow")
        # a double click: the second arrives while the first is on its way, and one label is stored
        page.evaluate("document.getElementById('save').click(), document.getElementById('save').click()")
        page.wait_for("document.getElementById('status').textContent.startsWith('saved')")
        assert _human(store, first) == [(0.7, {"kind": "score", "labeler": "ana", "note": "right answer, slow"})]
        assert [len(r.metadata["label_id"]) for r in store.rewards(first) if r.name == "human" and r.config_hash is None
                ] == [32]  # the id the page gave the rollout it showed
        reported = [r.value for r in store.rewards(first) if r.name == "agent"][0]
        assert store.get_rollout(first).final_reward == pytest.approx(reported + 2 * 0.7)
        # The page moved on to a rollout not labelled yet.
        page.wait_for(f"document.querySelector('.pane').dataset.rolloutId !== {first!r}")
        page.wait_for("document.getElementById('stats').textContent.includes('1 of 3 labelled')")

        page.click("#mode-compare")
        page.wait_for("document.querySelectorAll('.pane').length === 2")
        assert page.evaluate(f"[{visible}('score-actions'), {visible}('compare-actions')]") == [False, True]
        a, b = page.evaluate("[...document.querySelectorAll('.pane')].map(p => p.dataset.rolloutId)")
        assert store.get_rollout(a).task_id == store.get_rollout(b).task_id
        page.screenshot(tmp_path / "compare.png")
        page.click("#prefer-b")
        page.wait_for("document.getElementById('empty').hidden === false")  # no unlabelled pair is left
    [(va, ma)], [(vb, mb)] = _human(store, a), _human(store, b)
    assert (va, vb) == (0.0, 1.0) and ma["vs"] == b and mb["vs"] == a and ma["pair"] == mb["pair"]
    assert ma["labeler"] == "ana" and ma["kind"] == "compare"
    assert (tmp_path / "compare.png").stat().st_size > 10_000


def test_the_api_refuses_bad_labels_and_loses_nothing(labelled_store: TraceStore) -> None:
    store = labelled_store
    rid = store.query_rollouts()[0].id
    with serve(build_app(store, scorer=Scorer(CONFIG), token="label-test-token")) as url:
        assert httpx.get(url + "/", timeout=30).status_code == 200  # the page itself holds no data
        assert httpx.get(url + "/api/next", timeout=30).status_code == 401
        auth = {"authorization": "Bearer label-test-token"}

        def err(path: str, body: dict, status: int, code: str) -> None:
            resp = httpx.post(url + path, json=body, headers=auth, timeout=30)
            assert resp.status_code == status and resp.json()["error"]["code"] == code, resp.text

        err(f"/api/rollouts/{rid}/score", {"score": 7}, 400, "bad_score")
        err(f"/api/rollouts/{rid}/score", {"score": True}, 400, "bad_score")
        err("/api/rollouts/nope/score", {"score": 0.5}, 404, "rollout_not_found")
        err(f"/api/rollouts/{rid}/score", {"score": 0.5, "note": "x" * 5000}, 400, "bad_note")
        err("/api/compare", {"a": rid, "b": rid, "winner": "a"}, 400, "bad_pair")
        other = store.query_rollouts()[1].id
        err("/api/compare", {"a": rid, "b": other, "winner": "both"}, 400, "bad_winner")
        bad_json = httpx.post(url + f"/api/rollouts/{rid}/score", content=b"{nope", headers=auth, timeout=30)
        assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
        assert all(_human(store, r.id) == [] for r in store.query_rollouts())
        ok = httpx.post(url + "/api/compare", json={"a": rid, "b": other, "winner": "tie"}, headers=auth,
                        timeout=30).json()
        assert ok["stored"] == 2 and set(ok["final_rewards"]) == {rid, other}
        assert [v for v, _ in _human(store, rid)] == [0.5]
        assert httpx.get(url + f"/api/rollouts/{rid}", headers=auth,
                         timeout=30).json()["rollout"]["labels"][0]["kind"] == "compare"
        stats = httpx.get(url + "/api/stats", headers=auth, timeout=30).json()
        assert (stats["rollouts"], stats["labelled"], stats["config_hash"]) == (3, 2, CONFIG.hash)


def test_a_repeated_label_id_stores_one_label(labelled_store: TraceStore) -> None:
    """A double click or a retried POST: its label_id stores the label once, also when the repeats race."""
    from concurrent.futures import ThreadPoolExecutor

    store = labelled_store
    first, second, third = (r.id for r in store.query_rollouts())
    with serve(build_app(store, scorer=Scorer(CONFIG))) as url:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(url + path, json=body, timeout=30)

        body = {"score": 0.3, "label_id": "click-1"}
        with ThreadPoolExecutor(8) as pool:
            answers = [r.json() for r in pool.map(lambda _: post(f"/api/rollouts/{first}/score", body), range(8))]
        assert sorted(a["stored"] for a in answers) == [0] * 7 + [1]
        assert sum(bool(a.get("replayed")) for a in answers) == 7
        assert [v for v, _ in _human(store, first)] == [0.3]
        clash = post(f"/api/rollouts/{first}/score", {"score": 0.9, "label_id": "click-1"})
        assert clash.status_code == 409 and clash.json()["error"]["code"] == "label_id_conflict"
        assert post(f"/api/rollouts/{first}/score", {"score": 0.9, "label_id": "click-2"}).json()["stored"] == 1
        for bad in ("", " ", "x" * 129, 7):
            resp = post(f"/api/rollouts/{first}/score", {"score": 0.5, "label_id": bad})
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "bad_label_id"
        pair = {"a": second, "b": third, "winner": "a", "label_id": "pair-1"}
        assert [post("/api/compare", pair).json()["stored"] for _ in range(2)] == [2, 0]
        assert [v for v, _ in _human(store, first)] == [0.3, 0.9]
        assert [v for v, _ in _human(store, second)] == [1.0] and [v for v, _ in _human(store, third)] == [0.0]
