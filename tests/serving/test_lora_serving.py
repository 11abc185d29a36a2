"""LoRA policies on the real vLLM CPU server: the torch engine's adapter, hot-loaded in place by
name, changes that adapter's greedy output and no other model's, and vLLM's log-probs of the
adapter equal the engine's (its own server: LoRA is a start-up flag)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from trainer_backend.serving.publisher import PublishError, WeightPublisher
from trainer_backend.serving.server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
torch = pytest.importorskip("torch")
pytest.importorskip("peft")

BASE, RANK = "tiny", 8
PROMPT = [5, 17, 42, 99, 7]  # token IDs: no tokenizer round trip in the comparison


@pytest.fixture(scope="module")
def lora_server(vllm_python: Path, tied_checkpoints, tmp_path_factory) -> Iterator[VLLMServer]:
    server = VLLMServer(tied_checkpoints.base, python=vllm_python, dtype="float32", served_model_name=BASE,
                        log_path=tmp_path_factory.mktemp("vllm-lora") / "server.log", max_lora_rank=RANK,
                        max_loras=2)
    with server:
        yield server


def _complete(server: VLLMServer, model: str, n: int = 8) -> tuple[list[int], list[float]]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "logprobs": 0,
            "return_token_ids": True}
    resp = httpx.post(f"{server.base_url}/completions", json=body, timeout=120).raise_for_status()
    choice = resp.json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _row(completion: list[int]):
    from lightning_middleware.rows import Row

    ids = (*PROMPT, *completion)
    return Row(rollout_id="r", task_id="t", agent=None, input_ids=ids,
               loss_mask=(0,) * len(PROMPT) + (1,) * len(completion), behaviour_logprobs=None, advantage=1.0)


def test_an_adapter_swap_changes_that_adapter_only(lora_server, tied_checkpoints, tmp_path):
    from trainer_backend.engines.lora import AdapterConfig
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    torch.manual_seed(0)
    engine = TorchEngine(tied_checkpoints.base, TorchEngineConfig(lr=5e-2, precision="fp32", grad_clip=None,
                                                                  lora=AdapterConfig(rank=RANK)))
    publisher = WeightPublisher(lora_server.url, adapter_name="coder")
    first = publisher.publish(engine.save(tmp_path / "v0"), 0)
    assert first.verified and first.reported_version == "0"
    base_tokens, _ = _complete(lora_server, BASE)
    assert _complete(lora_server, "coder")[0] == base_tokens  # a new adapter (B = 0) is the base

    target = [t for t in range(300, 308)]  # teach the adapter a continuation the base does not produce
    for _ in range(15):
        engine.step([_row(target)])
    swap = publisher.publish(engine.save(tmp_path / "v1"), 1)
    assert swap.verified and swap.reported_version == "1"
    tokens, logprobs = _complete(lora_server, "coder")
    assert tokens != base_tokens  # the adapter moved (toward the target; exactly what it learned is checked below)
    assert _complete(lora_server, BASE)[0] == base_tokens  # the base and other policies are untouched
    ours = engine.token_logprobs([_row(tokens)])[0][len(PROMPT):]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-4  # vLLM serves exactly what was trained


def test_an_adapter_checkpoint_needs_the_adapters_name(lora_server, tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(PublishError, match="adapter_name"):
        WeightPublisher(lora_server.url).publish(tmp_path, 3)
