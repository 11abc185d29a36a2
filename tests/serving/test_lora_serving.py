"""LoRA policies on the real vLLM CPU server: the torch engine's adapter, hot-loaded in place by
name, changes that adapter's greedy output and no other model's, and vLLM's log-probs of the
adapter equal the engine's (its own server: LoRA is a start-up flag)."""

from __future__ import annotations

import dataclasses
import shutil
import time
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


def test_a_policy_set_publishes_every_adapter_and_a_restart_restores_the_committed_ones(lora_server, tied_checkpoints,
                                                                                        tmp_path):
    """Two policies on one server: training the coder changes the coder's answers only; a crash that
    left a newer, uncommitted coder adapter loaded is undone by the restart's republish."""
    from trainer_backend.engines.lora import AdapterConfig
    from trainer_backend.engines.policies import PolicySet
    from trainer_backend.engines.torch_engine import TorchEngineConfig

    torch.manual_seed(0)
    policies = PolicySet(tied_checkpoints.base, ["coder", "reviewer"], TorchEngineConfig(
        lr=5e-2, precision="fp32", grad_clip=None, lora=AdapterConfig(rank=RANK)))
    publisher = WeightPublisher(lora_server.url)
    assert publisher.publish(policies.save(tmp_path / "v0"), 0).verified
    base_tokens, _ = _complete(lora_server, BASE)
    assert _complete(lora_server, "coder")[0] == _complete(lora_server, "reviewer")[0] == base_tokens

    coder_row = [dataclasses.replace(_row(list(range(300, 308))), policy="coder")]
    for _ in range(15):
        policies.step(coder_row)
    committed = policies.save(tmp_path / "v1")
    assert publisher.publish(committed, 1).verified
    coder_tokens, coder_logprobs = _complete(lora_server, "coder")
    assert coder_tokens != base_tokens and _complete(lora_server, "reviewer")[0] == base_tokens
    ours = policies.engines["coder"].token_logprobs([_row(coder_tokens)])[0][len(PROMPT):]
    assert max(abs(a - b) for a, b in zip(ours, coder_logprobs)) < 1e-4

    for _ in range(10):  # a step that saved and began to publish, then the trainer died: coder only
        policies.step([dataclasses.replace(_row(list(range(400, 408))), policy="coder")])
    uncommitted = policies.save(tmp_path / "v2")
    httpx.post(f"{lora_server.url}/v1/load_lora_adapter", timeout=60,
               json={"lora_name": "coder", "lora_path": str(uncommitted / "coder"), "load_inplace": True}
               ).raise_for_status()
    assert _complete(lora_server, "coder")[0] != coder_tokens
    publisher.publish(committed, 1)  # what the restarted trainer does with its last committed checkpoint
    assert _complete(lora_server, "coder")[0] == coder_tokens
    assert _complete(lora_server, "reviewer")[0] == base_tokens


def test_a_verl_engine_adapter_loads_in_place_too(lora_server, tmp_path):
    """The verl engine with verl's own LoRA (its real actor in one CPU process: tests/trainer/verl_cpu_lora.py)
    publishes through the same path: its new adapter is the base, its trained one changes that adapter's
    greedy output only, and vLLM serves what verl trained (the torch engine continuing verl's adapter
    computes vLLM's log-probs)."""
    pytest.importorskip("verl")
    from tests.trainer.verl_subprocess import run_verl_helper
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    base_tokens, _ = _complete(lora_server, BASE)
    rows = tmp_path / "rows.pt"
    torch.save([_row(list(range(300, 308)))], rows)  # no behaviour log-probs: verl recomputes them
    run_verl_helper("verl_cpu_lora.py", ["train", str(lora_server.model_dir), str(rows), str(tmp_path), "15", "5e-2",
                                         str(RANK)], 600)
    publisher = WeightPublisher(lora_server.url, adapter_name="coder")
    assert publisher.publish(tmp_path / "v0", 0).verified
    assert _complete(lora_server, "coder")[0] == base_tokens  # verl's new adapter (B = 0) is the base
    swap = publisher.publish(tmp_path / "v1", 1)
    assert swap.verified and swap.reported_version == "1"
    tokens, logprobs = _complete(lora_server, "coder")
    assert tokens != base_tokens and _complete(lora_server, BASE)[0] == base_tokens
    ours = TorchEngine(tmp_path / "v1", TorchEngineConfig(precision="fp32")).token_logprobs([_row(tokens)])[0]
    assert max(abs(a - b) for a, b in zip(ours[len(PROMPT):], logprobs)) < 1e-4


def _trained_versions(base: Path, out: Path) -> tuple[Path, Path, Path]:
    """Three adapter versions of one policy: new (the base), trained toward one continuation, then another."""
    from trainer_backend.engines.lora import AdapterConfig
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    torch.manual_seed(0)
    engine = TorchEngine(base, TorchEngineConfig(lr=5e-2, precision="fp32", grad_clip=None,
                                                 lora=AdapterConfig(rank=RANK)))
    v0 = engine.save(out / "v0")
    for _ in range(15):
        engine.step([_row(list(range(300, 308)))])
    v1 = engine.save(out / "v1")
    for _ in range(10):
        engine.step([_row(list(range(400, 408)))])
    return v0, v1, engine.save(out / "v2")


def test_a_request_queued_during_the_swap_gets_the_new_adapter_and_old_folders_can_go(lora_server, tied_checkpoints,
                                                                                       tmp_path):
    """vLLM's own in-place load gets both wrong: a request that waits out the pause runs with the previous
    version (its stored request reloads the previous folder), and every step reloads the adapter from its
    folder, so deleting a published checkpoint makes the name's requests fail."""
    import threading

    v0, v1, v2 = _trained_versions(tied_checkpoints.base, tmp_path)
    publisher = WeightPublisher(lora_server.url, adapter_name="writer")
    assert publisher.publish(v0, 0).verified
    first = publisher.publish(v1, 1)
    assert first.verified and first.stage_s > 0  # the second version of a name is staged, then committed
    v1_tokens = _complete(lora_server, "writer")[0]

    httpx.post(f"{lora_server.url}/pause", params={"mode": "wait"}, timeout=60).raise_for_status()
    queued: dict[str, list[int]] = {}
    waiter = threading.Thread(target=lambda: queued.update(tokens=_complete(lora_server, "writer")[0]))
    waiter.start()
    time.sleep(0.5)  # the request is in the engine's queue, waiting for the resume
    swap = publisher.publish(v2, 2)  # pauses (already paused), commits, resumes
    waiter.join(timeout=120)
    assert swap.verified
    v2_tokens = _complete(lora_server, "writer")[0]
    assert v2_tokens != v1_tokens  # the two versions answer differently, so the next check can tell them apart
    assert queued["tokens"] == v2_tokens

    for version in (v0, v1, v2):
        shutil.rmtree(version)
    assert _complete(lora_server, "writer")[0] == v2_tokens


def test_a_kept_adapter_swap_continues_requests_in_flight_on_the_new_adapter(lora_server, tied_checkpoints,
                                                                             tmp_path):
    """`pause="keep"` on an adapter publish: the completions in flight are frozen, not drained, and
    go on with the new adapter, its context computed again (the cache reset runs in keep mode even
    where an adapter publish skips it): each token before the swap is v1's log-prob, each after it
    v2's, as the torch engine computes them over the whole context."""
    from tests.serving.test_serving import in_flight
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    _, v1, v2 = _trained_versions(tied_checkpoints.base, tmp_path)
    publisher = WeightPublisher(lora_server.url, adapter_name="keeper", pause="keep")
    assert publisher.publish(v1, 1).verified
    n_requests, n_tokens = 16, 900  # ~10 s of decoding together, against ~1 s to the publish's pause
    threads, outs, errors = in_flight(lora_server, lambda _: _complete(lora_server, "keeper", n=n_tokens), n_requests)
    swap = publisher.publish(v2, 2)
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(outs) == n_requests
    assert swap.verified and swap.reported_version == "2", swap.problems
    rows = [_row(tokens) for tokens, _ in outs]
    old_lp, new_lp = (TorchEngine(v, TorchEngineConfig(precision="fp32")).token_logprobs(rows) for v in (v1, v2))
    tol, swaps = 1e-3, []
    for (tokens, got), lp1, lp2 in zip(outs, old_lp, new_lp, strict=True):
        assert len(tokens) == len(got) == n_tokens
        at = next((i for i, (a, b) in enumerate(zip(got, lp1[len(PROMPT):])) if abs(a - b) > tol), n_tokens)
        swaps.append(at)
        assert max((abs(a - b) for a, b in zip(got[at:], lp2[len(PROMPT) + at:])), default=0.0) < tol, \
            f"tokens {at}-{n_tokens} are not v2's: stale KV or adapter"
    assert any(0 < s < n_tokens for s in swaps), swaps  # the publish waited for none of them


def test_a_bad_adapter_fails_before_the_pause_and_changes_nothing(lora_server, tied_checkpoints, tmp_path):
    import json

    v0, v1, _ = _trained_versions(tied_checkpoints.base, tmp_path)
    publisher = WeightPublisher(lora_server.url, adapter_name="editor")
    publisher.publish(v0, 0)
    assert publisher.publish(v1, 1).verified
    served = _complete(lora_server, "editor")[0]
    config = json.loads((v1 / "adapter_config.json").read_text())
    bad = tmp_path / "too-big"
    shutil.copytree(v1, bad)
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": RANK * 4}))  # over --max-lora-rank
    with pytest.raises(PublishError, match="lightning_stage_adapter"):
        publisher.publish(bad, 2)
    assert publisher.weight_version() == "1"
    assert _complete(lora_server, "editor")[0] == served


def _worker_adapter_ids(server: VLLMServer) -> set[int]:
    body = {"method": "lightning_adapter_ids", "kwargs": {}, "timeout": 60}
    resp = httpx.post(f"{server.url}/collective_rpc", json=body, timeout=60).raise_for_status()
    return set(resp.json()["results"][0]["ids"])


def test_a_new_publisher_commits_under_the_ids_the_server_has_while_requests_wait(lora_server, tied_checkpoints,
                                                                                  tmp_path):
    """The team demo's case: one publisher registered two adapters (at the run's start), then another
    (the trainer) publishes their next versions while requests for both wait out its pause. It must
    commit under the ids the server gave the names: registering them again gives new ids while the
    waiting requests carry the old ones, more adapters than the server's two slots (vLLM's engine died
    of it in the team demo)."""
    import json
    import threading

    v0, v1, v2 = _trained_versions(tied_checkpoints.base, tmp_path / "versions")
    for step, (scout, closer) in enumerate([(v0, v0), (v1, v2)]):
        for name, version in (("scout", scout), ("closer", closer)):
            shutil.copytree(version, tmp_path / f"c{step}" / name)
    assert WeightPublisher(lora_server.url).publish(tmp_path / "c0", 0).verified
    ids = _worker_adapter_ids(lora_server)

    httpx.post(f"{lora_server.url}/pause", params={"mode": "wait"}, timeout=60).raise_for_status()
    answers: dict[str, list[list[int]]] = {"scout": [], "closer": []}
    waiters = [threading.Thread(target=lambda name=name: answers[name].append(_complete(lora_server, name)[0]))
               for name in ("scout", "closer", "scout", "closer")]
    for waiter in waiters:
        waiter.start()
    time.sleep(0.5)  # the requests are in the engine's queue, waiting for the resume
    swap = WeightPublisher(lora_server.url).publish(tmp_path / "c1", 1)  # a new publisher: the trainer
    late = [threading.Thread(target=lambda name=name: _complete(lora_server, name, 32))  # batched with the waiting
            for name in ("closer", "scout", "closer", "scout")]
    for thread in late:
        thread.start()
    for thread in waiters + late:
        thread.join(timeout=120)
    assert swap.verified
    for name in ("scout", "closer"):
        served = _complete(lora_server, name)[0]
        assert answers[name] == [served, served]  # both waiting requests got the new version
    assert _complete(lora_server, "scout")[0] != _complete(lora_server, "closer")[0]  # v1 and v2 answer apart
    assert _worker_adapter_ids(lora_server) <= ids  # the names kept their ids: none was registered again

    record = tmp_path / "served-adapters" / "ids.json"  # where the names' ids are kept for the next publisher
    record.write_text("{not json")  # unreadable: the next publisher registers the names again, and says so
    assert WeightPublisher(lora_server.url).publish(tmp_path / "c0", 2).verified
    assert _complete(lora_server, "scout")[0] == _complete(lora_server, "closer")[0] == _complete(lora_server, BASE)[0]
    assert set(json.loads(record.read_text())["ids"]) == {"scout", "closer"}
