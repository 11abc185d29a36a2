"""The verl engine on CPU: the DataProto conversion and verl 0.9.1's loss path.

verl 0.9.1's FSDP engine is registered for cuda/npu only, so the full actor (Ray worker,
FSDP, optimizer) cannot run here. What runs: our rows -> `DataProto` -> verl's own
`DataProto.to_tensordict` + `left_right_2_no_padding` (what ray_trainer does before
`update_actor`) -> verl's own micro-batching (`prepare_micro_batches`, fixed and dynamic
sizes) -> a tiny Qwen2's per-token log-probs in verl's no-padding layout -> verl's own
`ppo_loss` (workers/utils/losses.py) calling our registered policy loss -> backward, and
the summed loss and gradients are compared with the TorchEngine's step on the same rows.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
verl = pytest.importorskip("verl")

from lightning_middleware.rows import Row  # noqa: E402
from tests.trainer.tiny_models import save_tiny_qwen2  # noqa: E402
from tests.trainer.verl_subprocess import run_verl_helper  # noqa: E402
from trainer_backend.algorithms.losses import LossConfig, loss_weights  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402
from trainer_backend.engines.verl_engine import (  # noqa: E402
    VERL_VERSION,
    VerlEngineConfig,
    build_actor_config,
    check_verl_version,
)
from trainer_backend.engines.verl_loss import LOSS_MODE, LOSS_MODE_DUAL  # noqa: E402
from trainer_backend.engines.verl_rows import dataproto_to_rows, rows_to_dataproto, split_point  # noqa: E402

VOCAB = 48


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = save_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_verl"), vocab=VOCAB)
    return d


def multi_turn_rows() -> list[Row]:
    """Three rollouts in two groups; interleaved masks (observations inside responses), one row per call
    or merged calls, different lengths, one row without behaviour log-probs is not included here."""
    g = torch.Generator().manual_seed(3)

    def toks(n):
        return torch.randint(1, VOCAB, (n,), generator=g).tolist()

    def row(rid, task, segments, adv):
        ids, mask = [], []
        for kind, n in segments:
            ids += toks(n)
            mask += [1 if kind == "c" else 0] * n
        lps = tuple(-0.5 - 0.1 * (i % 7) if m else 0.0 for i, m in enumerate(mask))
        return Row(rollout_id=rid, task_id=task, agent=None, input_ids=tuple(ids), loss_mask=tuple(mask),
                   behaviour_logprobs=lps, advantage=adv)

    return [
        row("a", "t1", [("p", 5), ("c", 3), ("p", 4), ("c", 2), ("p", 2), ("c", 4)], 1.2),  # 3 calls merged
        row("a", "t1", [("p", 7), ("c", 5)], 1.2),  # after a prefix break
        row("b", "t1", [("p", 3), ("c", 6)], -1.2),
        row("c", "t2", [("p", 6), ("c", 2), ("p", 3), ("c", 3)], 0.7),
        row("d", "t2", [("p", 2), ("c", 1)], -0.7),
    ]


# ---------------------------------------------------------------- conversion


def test_version_pinned():
    assert check_verl_version() == VERL_VERSION == "0.9.1"


def test_dataproto_fields_and_round_trip():
    rows = multi_turn_rows()
    data = rows_to_dataproto(rows)
    b = data.batch
    B, P, R = len(rows), max(split_point(r) for r in rows), max(len(r) - split_point(r) for r in rows)
    assert b["prompts"].shape == (B, P) and b["responses"].shape == (B, R)
    assert b["input_ids"].shape == b["attention_mask"].shape == b["position_ids"].shape == (B, P + R)
    for k in ("response_mask", "old_log_probs", "advantages", "rollout_is_weights"):
        assert b[k].shape == (B, R), k
    assert list(data.non_tensor_batch["uid"]) == ["t1", "t1", "t1", "t2", "t2"]
    assert list(data.non_tensor_batch["rollout_id"]) == ["a", "a", "b", "c", "d"]
    # prompts end exactly at the first trained token; the response keeps the observation tokens with mask 0
    r0 = rows[0]
    assert b["prompts"][0, -5:].tolist() == list(r0.input_ids[:5])
    assert b["responses"][0, :len(r0) - 5].tolist() == list(r0.input_ids[5:])
    assert b["response_mask"][0, :len(r0) - 5].tolist() == list(r0.loss_mask[5:])
    # position ids count only real tokens (left padding)
    pos = b["position_ids"][0][b["attention_mask"][0].bool()]
    assert pos.tolist() == list(range(len(r0)))
    # exact round trip of ids, masks, behaviour log-probs, advantages
    back = dataproto_to_rows(data)
    for r, q in zip(rows, back):
        assert q.input_ids == r.input_ids and q.loss_mask == r.loss_mask
        # exact at float32, the dtype both engines train with
        assert list(q.behaviour_logprobs) == torch.tensor(r.behaviour_logprobs, dtype=torch.float32).tolist()
        assert q.advantage == float(torch.tensor(r.advantage, dtype=torch.float32)) and q.rollout_id == r.rollout_id
        assert q.task_id == r.task_id
    # the weights are our step-normalised weights, on the response part
    w = loss_weights([torch.tensor(r.loss_mask) for r in rows], [r.rollout_id for r in rows])
    for i, r in enumerate(rows):
        c = split_point(r)
        assert torch.equal(b["rollout_is_weights"][i, :len(r) - c], w[i][c:])
        assert float(b["rollout_is_weights"][i, len(r) - c:].abs().sum()) == 0.0
    assert float(b["rollout_is_weights"].sum()) == pytest.approx(1.0, abs=1e-6)  # mean over 4 rollouts of means


def test_padding_rows_for_data_parallel_and_missing_logprobs():
    rows = multi_turn_rows()
    rows[2] = dataclasses.replace(rows[2], behaviour_logprobs=None)
    data = rows_to_dataproto(rows, pad_to_multiple=4)
    assert len(data) == 8
    assert list(data.non_tensor_batch["is_pad"]) == [False] * 5 + [True] * 3
    assert list(data.non_tensor_batch["has_old_log_probs"]) == [True, True, False, True, True, True, True, True]
    assert float(data.batch["rollout_is_weights"][5:].abs().sum()) == 0.0
    assert int(data.batch["response_mask"][5:].sum()) == 0
    assert int(data.batch["attention_mask"][5:].sum()) == 6  # one prompt + one response token each
    back = dataproto_to_rows(data)
    assert len(back) == 5 and back[2].behaviour_logprobs is None


def test_first_token_trained_goes_to_the_prompt():
    r = Row(rollout_id="x", task_id="t", agent=None, input_ids=(5, 6, 7), loss_mask=(1, 1, 1),
            behaviour_logprobs=(-1.0, -2.0, -3.0))
    data = rows_to_dataproto([r])
    assert split_point(r) == 1
    assert data.batch["prompts"].tolist() == [[5]] and data.batch["response_mask"].tolist() == [[1, 1]]
    # weight of token 0 stays in the normaliser, as in the torch engine (it can't be predicted by either)
    assert data.batch["rollout_is_weights"].tolist() == [[pytest.approx(1 / 3), pytest.approx(1 / 3)]]


def test_actor_config_composes(model_dir):
    """verl's hydra config with our overrides composes and converts to verl's ActorConfig (no GPU needed)."""
    from verl.utils.config import omega_conf_to_dataclass

    full = build_actor_config(model_dir, VerlEngineConfig(loss=LossConfig(dual_clip_c=None)))
    actor = omega_conf_to_dataclass(full.actor_rollout_ref.actor)
    assert actor.policy_loss.loss_mode == LOSS_MODE and actor.loss_agg_mode == "token-sum"
    assert actor.ppo_epochs == 1 and actor.use_kl_loss is False and actor.entropy_coeff == 0
    dual = build_actor_config(model_dir, VerlEngineConfig())  # the dual clip is the default (c = 3)
    assert dual.actor_rollout_ref.actor.policy_loss.loss_mode == LOSS_MODE_DUAL
    assert dual.actor_rollout_ref.actor.clip_ratio_c == 3.0
    with pytest.raises(ValueError):
        build_actor_config(model_dir, VerlEngineConfig(loss=LossConfig(kl_coef=0.1)))


# ---------------------------------------------------------------- the loss path vs the torch engine


def _verl_grads(model_dir: Path, rows: list[Row], loss_cfg: LossConfig, *, dynamic: bool, micro: int = 2,
                max_tokens: int = 40):
    """verl 0.9.1's own conversion, micro-batching and ppo_loss on CPU; returns (loss sum, grads, n micro)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine.utils import prepare_micro_batches
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import left_right_2_no_padding

    actor_cfg = omega_conf_to_dataclass(build_actor_config(model_dir, VerlEngineConfig(loss=loss_cfg))
                                        .actor_rollout_ref.actor)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    data = rows_to_dataproto(rows, agg=loss_cfg.agg, pad_to_multiple=micro if not dynamic else 1)
    td = left_right_2_no_padding(data.to_tensordict())
    # what FSDPEngine.forward_backward_batch / the trainer assign (dp_size 1 here)
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=int(td["loss_mask"].sum()), global_batch_size=len(data),
                         use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=micro, sp_size=1)
    if dynamic:
        tu.assign_non_tensor(td, max_token_len_per_gpu=max_tokens)
    micro_batches, _ = prepare_micro_batches(td, dp_group=None)
    total = 0.0
    for mb in micro_batches:
        ids = mb["input_ids"]  # nested (jagged)
        offsets = ids.offsets()
        pos = mb["position_ids"]
        vals = []
        for i in range(len(offsets) - 1):
            seq = ids.values()[offsets[i]:offsets[i + 1]]
            logits = model(input_ids=seq[None], position_ids=pos[i][None], use_cache=False).logits[0].float()
            rolled = torch.roll(seq, shifts=-1)  # verl: the log-prob of the next token at each position
            vals.append(torch.log_softmax(logits, -1).gather(-1, rolled[:, None]).squeeze(-1))
        log_probs = torch.nested.nested_tensor_from_jagged(torch.cat(vals), offsets=offsets)
        loss, _metrics = ppo_loss(actor_cfg, {"log_probs": log_probs}, mb)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, grads, len(micro_batches)


def _torch_grads(model_dir: Path, rows: list[Row], loss_cfg: LossConfig, micro_batch_tokens: int = 10_000):
    """The TorchEngine's gradient of one step: SGD with lr 1 and no clipping makes delta = -grad."""
    eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", grad_clip=None, loss=loss_cfg,
                                                   micro_batch_tokens=micro_batch_tokens))
    eng.optimizer = torch.optim.SGD(eng.params, lr=1.0)
    before = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
    m = eng.step(rows)
    grads = {n: before[n] - p.detach() for n, p in eng.model.named_parameters()}
    return m["loss"], grads


def perturbed_rows(model_dir: Path, rows: list[Row]) -> list[Row]:
    """Behaviour log-probs near the model's own (ratios around 1, some clipped)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r.input_ids])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
            noise = 0.4 * torch.randn(len(lp), generator=g)
            full = [0.0] + [float(x + e) if m else 0.0 for x, e, m in zip(lp, noise, r.loss_mask[1:])]
            out.append(dataclasses.replace(r, behaviour_logprobs=tuple(full)))
    return out


@pytest.mark.parametrize("agg", ["rollout-token-mean", "token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_verl_loss_path_equals_torch_engine(model_dir, agg, dynamic):
    rows = perturbed_rows(model_dir, multi_turn_rows())
    loss_cfg = LossConfig(agg=agg, clip_low=0.2, clip_high=0.28)
    t_loss, t_grads = _torch_grads(model_dir, rows, loss_cfg)
    v_loss, v_grads, n_micro = _verl_grads(model_dir, rows, loss_cfg, dynamic=dynamic)
    assert n_micro >= 2  # the split happened inside verl
    assert v_loss == pytest.approx(t_loss, abs=1e-6)
    assert set(v_grads) == {n for n, g in t_grads.items() if g.abs().sum() > 0} | (set(v_grads) - set(t_grads))
    for n, g in t_grads.items():
        assert torch.allclose(v_grads[n], g, atol=1e-5, rtol=1e-4), n
    assert max(float(g.abs().max()) for g in t_grads.values()) > 1e-4  # the comparison is not trivially zero


def test_verl_loss_path_dual_clip(model_dir):
    rows = perturbed_rows(model_dir, multi_turn_rows())
    rows = [dataclasses.replace(r, behaviour_logprobs=tuple(
                x - 2.0 * m for x, m in zip(r.behaviour_logprobs, r.loss_mask)))
            for r in rows]  # ratios e^2 > c for negative advantages: dual clip active
    loss_cfg = LossConfig(dual_clip_c=3.0)
    t_loss, t_grads = _torch_grads(model_dir, rows, loss_cfg)
    v_loss, v_grads, _ = _verl_grads(model_dir, rows, loss_cfg, dynamic=False, micro=1)
    assert v_loss == pytest.approx(t_loss, abs=1e-6)
    for n, g in t_grads.items():
        assert torch.allclose(v_grads[n], g, atol=1e-5, rtol=1e-4), n


@pytest.mark.parametrize("dual_clip_c", [None, 3.0])
def test_verl_fsdp_actor_on_cpu_equals_torch_engine(model_dir, tmp_path, dual_clip_c):
    """verl's real actor worker (TrainingWorker -> FSDP2 engine -> micro-batches -> ppo_loss with our registered
    loss -> backward -> optimizer step -> HF checkpoint), driven by VerlEngine.step/save, in one CPU process with
    a CPU platform shim (tests/trainer/verl_cpu_actor.py); SGD lr 1 so the parameter change is the gradient."""

    rows = perturbed_rows(model_dir, multi_turn_rows())
    if dual_clip_c:
        rows = [dataclasses.replace(r, behaviour_logprobs=tuple(x - 2.0 * m for x, m in
                                                               zip(r.behaviour_logprobs, r.loss_mask))) for r in rows]
    torch.save(rows, tmp_path / "rows.pt")
    args = [str(model_dir), str(tmp_path / "rows.pt"), str(tmp_path / "out.pt")]
    run_verl_helper("verl_cpu_actor.py", [*args, str(dual_clip_c)] if dual_clip_c else args, 300)
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    loss_cfg = LossConfig(clip_low=0.2, clip_high=0.28, dual_clip_c=dual_clip_c)
    t_loss, t_grads = _torch_grads(model_dir, rows, loss_cfg)
    m = out["metrics"]
    assert m["loss"] == pytest.approx(t_loss, abs=1e-6) and m["policy_version"] == 1
    if dual_clip_c:
        assert m["clip_frac_lower"] > 0
    for n, g in t_grads.items():
        assert torch.allclose(out["grads"][n], g, atol=1e-5, rtol=1e-4), n
    grad_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in t_grads.values())))
    assert m["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert {"config.json", "model.safetensors"} <= set(out["saved"])
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    start = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for (n, p), (_, p0) in zip(saved.named_parameters(), start.named_parameters()):
        assert torch.allclose(p, p0 - t_grads[n], atol=1e-5), n  # the checkpoint holds the updated weights


def test_worker_class_pickles_by_reference_and_registers_the_loss():
    """A Ray worker gets the class by reference; unpickling it in a fresh process registers our loss."""
    import subprocess
    import sys

    import cloudpickle

    from trainer_backend.engines.verl_engine import actor_worker_cls

    blob = cloudpickle.dumps(actor_worker_cls())
    assert len(blob) < 200  # by reference, not by value
    code = ("import sys, pickle; cls = pickle.loads(sys.stdin.buffer.read()); "
            "from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; "
            "print(cls.__name__, 'lightning_rollout' in R, 'lightning_rollout_dual' in R)")
    repo = str(Path(__file__).resolve().parents[2])
    proc = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": repo})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.decode().split() == ["LightningActorWorker", "True", "True"]


def test_verl_engine_refuses_cpu(model_dir):
    from trainer_backend.engines.verl_engine import VerlEngine

    if torch.cuda.is_available():
        pytest.skip("GPU present")
    with pytest.raises(RuntimeError, match="GPU"):
        VerlEngine(model_dir)
    # the daemon's path: `lightning-mw trainer --engine verl` -> make_engine -> VerlEngine
    import argparse

    from trainer_backend.daemon.cli import add_cli, make_engine, settings_from

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["trainer", "--store", "sqlite:///x.db", "--model", str(model_dir), "--engine", "verl",
                              "--bf16", "--micro-batch-tokens", "4096"])
    with pytest.raises(RuntimeError, match="GPU"):
        make_engine(settings_from(args), model_dir, 0)
    lora_args = parser.parse_args(["trainer", "--store", "sqlite:///x.db", "--model", str(model_dir),
                                   "--engine", "verl", "--lora-rank", "8"])
    with pytest.raises(RuntimeError, match="GPU"):  # the settings accept one LoRA policy on verl
        make_engine(settings_from(lora_args), model_dir, 0)
    team_args = parser.parse_args(["trainer", "--store", "sqlite:///x.db", "--model", str(model_dir),
                                   "--engine", "verl", "--lora-rank", "8", "--policies", "coder,reviewer"])
    with pytest.raises(RuntimeError, match="GPU"):  # and several: a VerlPolicySet, one verl engine per policy
        make_engine(settings_from(team_args), model_dir, 0)


# ---------------------------------------------------------------- VerlEngine.step's driver logic, worker group faked


class _FakeWorkerGroup:
    """Stands in for the Ray worker group: compute_log_prob with a tiny model in verl's no-padding layout,
    update_actor records its input and answers with metrics shaped like TrainingWorker's."""

    def __init__(self, model_dir: Path):
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.updates = []

    @torch.no_grad()
    def compute_log_prob(self, td):
        from verl.utils import tensordict_utils as tu

        ids, pos = td["input_ids"], td["position_ids"]
        offsets = ids.offsets()
        vals = []
        for i in range(len(offsets) - 1):
            seq = ids.values()[offsets[i]:offsets[i + 1]]
            logits = self.model(input_ids=seq[None], position_ids=pos[i][None]).logits[0]
            vals.append(torch.log_softmax(logits, -1).gather(-1, torch.roll(seq, -1)[:, None])[:, 0])
        nested = torch.nested.nested_tensor_from_jagged(torch.cat(vals), offsets=offsets)
        return tu.get_tensordict(tensor_dict={"log_probs": nested}, non_tensor_dict={"metrics": {}})

    def update_actor(self, td):
        from verl.utils import tensordict_utils as tu
        from verl.utils.metric import AggregationType, Metric

        self.updates.append(td)
        pg = Metric(AggregationType.SUM)
        pg.extend([0.2, 0.05])  # two micro-batches; dp-aggregated to a float per mini-batch, as train_mini_batch does
        metrics = {"loss": [0.25], "grad_norm": [1.5], "actor/pg_loss": [Metric.aggregate_dp([pg])],
                   "actor/pg_clipfrac": [0.1, 0.3], "actor/ppo_kl": [0.01, 0.03]}
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})


def test_verl_engine_step_with_faked_workers(model_dir):
    from verl.utils import tensordict_utils as tu

    from trainer_backend.engines.verl_engine import VerlEngine

    eng = VerlEngine.__new__(VerlEngine)
    eng.config, eng.policy_version, eng.world_size, eng.pad_id = VerlEngineConfig(), 3, 2, 0
    eng.wg = _FakeWorkerGroup(model_dir)
    rows = multi_turn_rows()
    rows[1] = dataclasses.replace(rows[1], behaviour_logprobs=None)  # this row's old log-probs get recomputed
    m = eng.step(rows)
    assert eng.policy_version == 4 and m["policy_version"] == 4
    assert m["loss"] == 0.25 and m["grad_norm"] == 1.5 and m["clip_frac"] == pytest.approx(0.2)
    assert m["rows"] == 5 and m["rollouts"] == 4
    (td,) = eng.wg.updates
    assert len(td["advantages"]) == 6  # padded to a multiple of the dp size
    assert tu.get(td, "mini_batch_size") == 6 and tu.get(td, "epochs") == 1  # one update per step
    old = td["old_log_probs"]
    # row 1: recomputed log-probs on its trained tokens; others: vLLM's
    want = _FakeWorkerGroup(model_dir)
    ids = torch.tensor([rows[1].input_ids])
    with torch.no_grad():
        lp = torch.log_softmax(want.model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    c = split_point(rows[1])
    k = len(rows[1]) - c
    mask = torch.tensor(rows[1].loss_mask[c:], dtype=torch.float32)
    assert torch.allclose(old[1, :k], lp[c - 1:] * mask, atol=1e-5)
    r0 = rows[0]
    c0 = split_point(r0)
    assert old[0, :len(r0) - c0].tolist() == torch.tensor(r0.behaviour_logprobs[c0:], dtype=torch.float32).tolist()
