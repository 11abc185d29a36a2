"""Session fixtures for tests against a real vLLM CPU server (a pytest plugin module:
the root conftest loads it with ``pytest_plugins``; by hand: ``-p tests.fixtures_vllm``).

The server runs from the project's vLLM venv (``trainer_backend.serving.server.vllm_python()``:
``$LIGHTNING_VLLM_PYTHON`` or ``$LIGHTNING_HOME/vllm-env``). Tests that need it are
skipped with a message when it does not exist, unless ``LIGHTNING_TEST_INSTALL_VLLM=1``
asks to create it (minutes, ~3.4 GB). One server per test session, on a tiny
tied-embedding model built in seconds in a temp dir.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from trainer_backend.serving.server import VLLMServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SERVED_NAME = "tiny"


@dataclass(frozen=True)
class TinyCheckpoints:
    """A base model and weight variants with the same config and tokenizer."""

    base: Path
    variants: tuple[Path, ...]


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    from trainer_backend.serving import env as serving

    python = serving.vllm_python()
    if not python.exists():
        if os.environ.get("LIGHTNING_TEST_INSTALL_VLLM") == "1":
            return serving.ensure_vllm_env()
        pytest.skip(
            f"no vLLM environment at {python}: run `lightning-mw vllm-env` "
            "(or set LIGHTNING_VLLM_PYTHON / LIGHTNING_TEST_INSTALL_VLLM=1)"
        )
    return python


def _build_family(root: Path, *, tied: bool, n_variants: int) -> TinyCheckpoints:
    pytest.importorskip("torch", reason="building the tiny model needs the train extra")
    pytest.importorskip("transformers", reason="building the tiny model needs the train extra")
    from trainer_backend.models import build_tiny_model, reinit_weights

    base = build_tiny_model(root / "base", tie_word_embeddings=tied, seed=0)
    variants = tuple(reinit_weights(base, root / f"v{i}", seed=100 + i) for i in range(1, n_variants + 1))
    return TinyCheckpoints(base=base, variants=variants)


@pytest.fixture(scope="session")
def tied_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    return _build_family(tmp_path_factory.mktemp("tiny-tied"), tied=True, n_variants=3)


@pytest.fixture(scope="session")
def untied_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    return _build_family(tmp_path_factory.mktemp("tiny-untied"), tied=False, n_variants=1)


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: Path, tied_checkpoints: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    from trainer_backend.serving.server import VLLMServer

    log_path = tmp_path_factory.mktemp("vllm-log") / "server.log"
    server = VLLMServer(
        tied_checkpoints.base, python=vllm_python, dtype="float32",
        served_model_name=SERVED_NAME, log_path=log_path, max_model_len=1024,
    )  # fmt: skip
    with server:
        yield server
