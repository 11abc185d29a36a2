"""The preference probe's scoring (tests/demo/learning.py) on the suite's tiny vLLM server: reading
the prefix cache gives the log-probs a full computation gives, where it computed them."""

from __future__ import annotations

import random

import httpx
import pytest

from tests.demo.learning import served_logprobs
from tests.fixtures_vllm import SERVED_NAME


def openai_route_logprobs(server_url: str, ids: list[int]) -> list[float]:
    """The same log-probs through /v1/completions' prompt log-probs (which never read the cache)."""
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    per_position = httpx.post(f"{server_url}/v1/completions", json=body, timeout=120).json()["choices"][0][
        "prompt_logprobs"]
    return [0.0] + [per_position[i][str(tok)]["logprob"] for i, tok in enumerate(ids) if i > 0]


def test_reading_the_prefix_cache_gives_the_full_computations_log_probs(vllm_server) -> None:
    httpx.post(f"{vllm_server.url}/reset_prefix_cache", timeout=30).raise_for_status()  # other tests' prompts
    rng = random.Random(7)
    prompt = [rng.randrange(10, 200) for _ in range(300)]  # a group's shared prompt
    rows = [prompt + [rng.randrange(10, 200) for _ in range(12)] for _ in range(8)]
    first = served_logprobs(vllm_server.url, SERVED_NAME, rows[0])
    full = [served_logprobs(vllm_server.url, SERVED_NAME, row, read_cache=False) for row in rows]
    again = [served_logprobs(vllm_server.url, SERVED_NAME, row) for row in rows[1:]]
    assert None not in full[0] and full[0] == pytest.approx(openai_route_logprobs(vllm_server.url, rows[0]), abs=1e-5)
    assert first == pytest.approx(full[0], abs=1e-5)  # nothing cached yet: all computed
    read = 0  # rows that read the cache: a row whose cached positions the server cannot send is computed in full
    for row, got, want in zip(rows[1:], again, full[1:]):
        cached = [i for i, value in enumerate(got) if value is None]
        read += bool(cached)
        assert cached == list(range(1, len(cached) + 1)) and len(cached) < len(prompt)
        assert all(got[i] == pytest.approx(want[i], abs=1e-5) for i in range(len(cached) + 1, len(row)))
    assert read >= 1
