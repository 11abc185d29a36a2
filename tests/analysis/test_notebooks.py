"""The notebooks run top to bottom in a real Jupyter kernel on a store built from real rollouts."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from lightning_middleware import RewardConfig, TraceStore
from lightning_middleware.rewards import rescore
from lightning_middleware.testing import LLMTestServer

from . import analysis_data as D

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ("analysis.ipynb", "training_run.ipynb")


def _execute(name: str, store_url: str, fig_dir: Path, monkeypatch: pytest.MonkeyPatch) -> nbformat.NotebookNode:
    monkeypatch.setenv("LIGHTNING_STORE_URL", store_url)
    monkeypatch.setenv("LIGHTNING_FIG_DIR", str(fig_dir))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    # a cell that raises fails the test (CellExecutionError)
    NotebookClient(nb, timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(fig_dir.parent)}}).execute()
    return nb


def _outputs_text(nb: nbformat.NotebookNode) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            parts.extend(str(v) for k, v in out.get("data", {}).items() if k.startswith("text/"))
    return "\n".join(parts)


@pytest.fixture(scope="module")
def filled_url(llm_server: LLMTestServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    url = f"sqlite:///{tmp_path_factory.mktemp('nb') / 'traces.db'}"
    store = TraceStore(url)
    made = D.build(store, llm_server.base_url)
    # two reward versions beside the agents' own (final_reward untouched), for the side-by-side cells
    rescore(store, RewardConfig.from_dict({"rules": {"agent_reward": 1.0, "succeeded": 0.5}}), apply="none")
    rescore(store, RewardConfig.from_dict({"rules": {"agent_reward": -1.0, "tool_call_valid": 1.0}}), apply="none")
    store.close()
    return url, made


def test_analysis_notebook(filled_url: tuple[str, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url, made = filled_url
    nb = _execute("analysis.ipynb", url, tmp_path / "figs", monkeypatch)
    figs = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert [f.split("-", 1)[1] for f in figs] == ["reward-curve.png", "success-by-task.png", "distributions.png",
                                                  "reward-versions.png"]
    text = _outputs_text(nb)
    assert "prefix-break rate:" in text and '<mark class="trained"' in text
    assert "discordant pairs within groups:" in text and "groups whose best rollout changed:" in text
    images = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert images == 4


def test_training_run_notebook(filled_url: tuple[str, dict], tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    url, _made = filled_url
    nb = _execute("training_run.ipynb", url, tmp_path / "figs", monkeypatch)
    figs = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "figs").iterdir())
    assert figs == ["evaluation.png", "reward-by-step.png", "step-metrics.png"]
    text = _outputs_text(nb)
    assert "3 training steps, 3 policy versions" in text and "not reported" not in text
    assert "/ckpt/v3" in text


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_run_on_an_empty_store(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    TraceStore(url).close()
    _execute(name, url, tmp_path / "figs", monkeypatch)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebooks_are_stored_without_outputs(name: str) -> None:
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "strip outputs before committing"
    assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells)
