"""The translation against the real vLLM CPU server: the token IDs recorded for a translated call
are vLLM's own tokenization of the translated prompt (0 drift), for Anthropic Messages through
the gateway (streamed) and the Responses API through wrap() (whole), two turns each."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from lightning_middleware import LLMCall, TraceStore, rollout, wrap
from lightning_middleware.gateway import Gateway

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# anthropic 2.x has no sampling parameters of its own: extra_body sends them, and they pass to vLLM as they are.
SAMPLING = {"max_tokens": 6, "extra_body": {"temperature": 1.0}}


def _tokenize(server, messages: list[dict]) -> tuple[int, ...]:
    out = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": messages,
                                                     "add_generation_prompt": True}, timeout=60).json()
    return tuple(out["tokens"])


def _no_drift(server, calls: list[LLMCall], source_format: str) -> None:
    assert [c.call_index for c in calls] == [0, 1]
    for c in calls:
        assert c.is_training and c.endpoint == "chat.completions" and c.source_format == source_format
        assert c.prompt_token_ids == _tokenize(server, c.request["messages"])
        assert c.completion_token_ids and c.logprobs is not None
        assert len(c.logprobs) == len(c.completion_token_ids)


def test_translated_calls_carry_vllms_own_token_ids(vllm_server, tied_checkpoints, tmp_path) -> None:
    from trainer_backend.serving.publisher import WeightPublisher

    # Other tests swap weights into the shared server: serve the base weights the tokenizer belongs to.
    WeightPublisher(vllm_server.url).publish(tied_checkpoints.base, "formats")
    store = TraceStore(f"sqlite:///{tmp_path / 'vllm-fmt.db'}")
    with Gateway([vllm_server.base_url], store, health_interval_s=0) as gw:
        rid = httpx.post(gw.url + "/rollouts", json={"task_id": "fmt-vllm"}).json()["id"]
        claude = anthropic.Anthropic(base_url=f"{gw.url}/rollouts/{rid}", api_key="-")
        messages: list[dict] = [{"role": "user", "content": [{"type": "text", "text": "hello there,"},
                                                             {"type": "text", "text": "how are you?"}]}]
        for turn in range(2):
            with claude.messages.stream(model="tiny", system="be brief", messages=messages, **SAMPLING) as s:
                reply = s.get_final_message()
            assert reply.stop_reason in ("max_tokens", "end_turn") and reply.usage.output_tokens > 0
            messages += [{"role": "assistant", "content": reply.content or "..."},
                         {"role": "user", "content": f"and then? ({turn})"}]
        assert httpx.post(f"{gw.url}/rollouts/{rid}/finish", json={"reward": 1.0}, timeout=60).status_code == 200
    _no_drift(vllm_server, store.calls(rid), "anthropic.messages")

    client = wrap(openai.OpenAI(base_url=vllm_server.base_url, api_key="-"), store=store)
    with rollout("fmt-vllm-responses", store=store) as r:
        first = client.responses.create(model="tiny", instructions="be brief", input="hello there, how are you?",
                                        max_output_tokens=6, temperature=1.0)
        client.responses.create(model="tiny", instructions="be brief", max_output_tokens=6, temperature=1.0, input=[
            {"role": "user", "content": "hello there, how are you?"},
            *(item.model_dump(exclude_none=True) for item in first.output),
            {"role": "user", "content": "and then?"}])
    _no_drift(vllm_server, store.calls(r.id), "responses")
    store.close()
