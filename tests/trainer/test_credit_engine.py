"""Per-turn credit in the engines and the daemon: per-token advantages in the micro-batches (exact
across micro-batches), PPO's GAE with per-step token rewards against verl's, the verl DataProto,
the refusals at step time, and the daemon end to end with per-step rewards from a real SQLite store."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lightning_middleware import TraceStore, rollout, wrap  # noqa: E402
from lightning_middleware.rows import Row  # noqa: E402
from lightning_middleware.testing import LLMTestServer  # noqa: E402
from tests.trainer.tiny_models import save_tiny_qwen2  # noqa: E402
from trainer_backend.algorithms.advantages import CriticConfig, rollout_advantages_and_returns  # noqa: E402
from trainer_backend.algorithms.losses import LossConfig  # noqa: E402
from trainer_backend.daemon.config import GroupPolicy, TrainerConfig  # noqa: E402
from trainer_backend.daemon.trainer_daemon import TrainerDaemon  # noqa: E402
from trainer_backend.engines.batching import make_micro_batch  # noqa: E402
from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig  # noqa: E402

VOCAB = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("credit") / "m", vocab=VOCAB, hidden=32, layers=2)


def per_turn_rows() -> list[Row]:
    """a: three calls merged in one row, then a row after a prefix break; b and c single rows; the
    advantages differ by call (as credit.label places them), behaviour log-probs perturbed."""
    def row(rid: str, task: str, ids: list[int], mask: list[int], adv: list[float]) -> Row:
        lps = tuple(-1.0 - 0.1 * (i % 3) if m else 0.0 for i, m in enumerate(mask))
        return Row(rollout_id=rid, task_id=task, agent=None, input_ids=tuple(ids), loss_mask=tuple(mask),
                   behaviour_logprobs=lps, reward=1.0, token_advantages=tuple(adv),
                   advantage=sum(a for a, m in zip(adv, mask) if m) / sum(mask))
    return [row("a", "t", [1, 2, 10, 11, 20, 12, 30, 13, 14], [0, 0, 1, 1, 0, 1, 0, 1, 1],
                [0, 0, 1.5, 1.5, 0, -0.5, 0, 0.25, 0.25]),
            row("a", "t", [5, 6, 15, 16], [0, 0, 1, 1], [0, 0, 2.0, 2.0]),
            row("b", "t", [1, 2, 17, 18, 19], [0, 0, 1, 1, 1], [0, 0, -1.0, -1.0, -1.0]),
            row("c", "u", [3, 4, 21, 22, 23, 24], [0, 0, 1, 0, 1, 1], [0, 0, 0.7, 0, -0.3, -0.3])]


def _sgd_step(model_dir: Path, rows: list[Row], **kw) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step with SGD at lr 1 (the weight change is -grad) and the metrics."""
    eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", lr=1e-3, grad_clip=None, **kw))
    eng.optimizer = torch.optim.SGD(eng.master, lr=1.0)
    before = {k: v.detach().clone() for k, v in eng.model.state_dict().items()}
    m = eng.step(rows)
    return m, {k: before[k] - v for k, v in eng.model.state_dict().items()}


def _assert_same_step(a: tuple[dict[str, float], dict[str, torch.Tensor]],
                      b: tuple[dict[str, float], dict[str, torch.Tensor]]) -> None:
    (m1, g1), (m2, g2) = a, b
    for key in ("loss", "grad_norm", "clip_frac"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-6), key
    scale = max(float(g.abs().max()) for g in g2.values())
    assert scale > 1e-4
    for k in g1:
        torch.testing.assert_close(g1[k], g2[k], rtol=1e-4, atol=1e-6 * scale, msg=k)


# ---------------------------------------------------------------- torch engine


def test_micro_batches_carry_each_tokens_advantage():
    rows = per_turn_rows()
    w = [torch.tensor(r.loss_mask, dtype=torch.float32) for r in rows]
    mb = make_micro_batch(rows, [0, 2], w)
    assert mb.advantages[0].tolist() == pytest.approx(rows[0].token_advantages[1:])  # the predicted positions
    assert mb.advantages[1, :4].tolist() == pytest.approx(rows[2].token_advantages[1:])
    assert mb.advantages[1, 4:].tolist() == pytest.approx([rows[2].advantage] * 4)  # padding: weight 0


@pytest.mark.parametrize("loss", [LossConfig(), LossConfig(agg="seq-mean-token-mean", ratio_level="sequence",
                                                dual_clip_c=None)], ids=["grpo", "gspo"])
def test_per_turn_step_is_exact_across_micro_batches(model_dir, loss):
    rows = per_turn_rows()
    one = _sgd_step(model_dir, rows, micro_batch_tokens=10_000, loss=loss)
    many = _sgd_step(model_dir, rows, micro_batch_tokens=9, loss=loss)
    assert one[0]["micro_batches"] == 1 and many[0]["micro_batches"] >= 3
    _assert_same_step(one, many)


def test_equal_token_advantages_take_the_rollout_level_step(model_dir):
    rows = [dataclasses.replace(r, advantage=0.8 if r.rollout_id == "a" else -0.8) for r in per_turn_rows()]
    same = [dataclasses.replace(r, token_advantages=tuple(r.advantage * m for m in r.loss_mask)) for r in rows]
    _assert_same_step(_sgd_step(model_dir, [dataclasses.replace(r, token_advantages=None) for r in rows]),
                      _sgd_step(model_dir, same))
    differ = _sgd_step(model_dir, per_turn_rows())[1]
    base = _sgd_step(model_dir, [dataclasses.replace(r, token_advantages=None) for r in per_turn_rows()])[1]
    assert any(not torch.allclose(differ[k], base[k]) for k in differ)  # per-token values do reach the loss


def test_per_turn_rows_with_the_kl_in_the_reward_are_refused_at_step_time(model_dir):
    eng = TorchEngine(model_dir, TorchEngineConfig(precision="fp32", old_logprobs="recompute",
                                                   loss=LossConfig(kl_in_reward_coef=0.1)))
    with pytest.raises(ValueError, match="per-turn credit with the KL in the reward runs with ppo only"):
        eng.step(per_turn_rows())


# ---------------------------------------------------------------- PPO: per-step token rewards in GAE


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.8)])
def test_gae_with_step_rewards_matches_verl(gamma, lam):
    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    g = torch.Generator().manual_seed(7)
    # verl's view: one response per rollout, observation tokens masked, step rewards at call ends
    mask = torch.tensor([[1, 1, 0, 1, 0, 1, 1, 1], [1, 1, 1, 0, 0, 1, 0, 0]], dtype=torch.float32)
    values = torch.randn(2, 8, generator=g)
    token_rewards = torch.zeros(2, 8)
    token_rewards[0, 1], token_rewards[0, 3] = 0.5, -0.25  # calls ending at 1 and 3
    token_rewards[0, 7] = 1.0 + 0.125  # the last call's step reward + the final reward
    token_rewards[1, 2], token_rewards[1, 5] = 0.3, 0.0
    ref_adv, ref_ret = core.compute_gae_advantage_return(token_rewards, values, mask, torch.tensor(gamma),
                                                         torch.tensor(lam))
    # ours: rollout 0 in two rows (a break after position 3), per-step rewards beside the final one
    pos = [mask[b].nonzero().squeeze(-1) for b in range(2)]
    pieces = [(0, pos[0][:3]), (0, pos[0][3:]), (1, pos[1])]
    steps = {0: token_rewards[0].clone(), 1: token_rewards[1].clone()}
    steps[0][7] -= 1.0  # the final reward comes from reward_of
    adv, ret = rollout_advantages_and_returns([f"r{b}" for b, _ in pieces], {"r0": 1.0, "r1": 0.0},
                                              [values[b, p] for b, p in pieces], gamma=gamma, lam=lam,
                                              step_rewards=[steps[b][p] for b, p in pieces])
    for (b, p), a, r in zip(pieces, adv, ret):
        assert torch.allclose(a, ref_adv[b, p], atol=1e-6, rtol=0)
        assert torch.allclose(r, ref_ret[b, p], atol=1e-6, rtol=0)


def _ppo_rows(step: float) -> list[Row]:
    rows = [dataclasses.replace(r, token_advantages=None, advantage=0.0, behaviour_logprobs=None)
            for r in per_turn_rows()]
    # a per-step reward on each row's first completion token (a one-token call)
    return [dataclasses.replace(r, token_rewards=tuple(step if i == r.loss_mask.index(1) else 0.0
                                                       for i in range(len(r)))) for r in rows]


def _ppo_step(model_dir: Path, rows: list[Row], budget: int) -> dict[str, float]:
    torch.manual_seed(0)  # the value head
    cfg = TorchEngineConfig(lr=1e-3, precision="fp32", old_logprobs="recompute", critic=CriticConfig(lr=1e-3),
                            micro_batch_tokens=budget)
    return TorchEngine(model_dir, cfg).step(rows)


def test_ppo_per_step_rewards_change_gae_and_stay_exact_across_micro_batches(model_dir):
    with_steps = [_ppo_step(model_dir, _ppo_rows(0.5), budget) for budget in (10_000, 9)]
    for key in ("loss", "vf_loss", "grad_norm", "critic_grad_norm"):
        assert with_steps[0][key] == pytest.approx(with_steps[1][key], rel=1e-4, abs=1e-6), key
    zero = _ppo_step(model_dir, _ppo_rows(0.0), 10_000)
    plain = _ppo_step(model_dir, [dataclasses.replace(r, token_rewards=None) for r in _ppo_rows(0.0)], 10_000)
    assert zero["vf_loss"] == plain["vf_loss"] and zero["loss"] == plain["loss"]  # zeros change nothing
    assert with_steps[0]["vf_loss"] != pytest.approx(plain["vf_loss"])  # the rewards reach the returns


# ---------------------------------------------------------------- verl's DataProto


def test_dataproto_carries_per_token_advantages():
    pytest.importorskip("verl")
    from trainer_backend.engines.verl_rows import dataproto_to_rows, rows_to_dataproto, split_point

    rows = per_turn_rows()
    data = rows_to_dataproto(rows)
    for i, r in enumerate(rows):
        c = split_point(r)
        expected = [a * m for a, m in zip(r.token_advantages[c:], r.loss_mask[c:])]
        assert data.batch["advantages"][i, :len(r) - c].tolist() == pytest.approx(expected)
    back = dataproto_to_rows(data)
    assert back[0].token_advantages is not None and back[1].token_advantages is None  # a's second row: one call
    trained = [a for a, m in zip(back[0].token_advantages, back[0].loss_mask) if m]
    assert trained == pytest.approx([a for a, m in zip(rows[0].token_advantages, rows[0].loss_mask) if m])


# ---------------------------------------------------------------- the daemon, end to end


@pytest.fixture(scope="module")
def bytes_model(tmp_path_factory) -> Path:
    """The test server's token IDs are UTF-8 bytes: a 260-token vocabulary."""
    return save_tiny_qwen2(tmp_path_factory.mktemp("credit_bytes") / "m", vocab=260, hidden=32, layers=1,
                           max_positions=1024)


def _rollouts(server: LLMTestServer, store: TraceStore, tasks: dict[str, list[tuple[float, float | None]]]) -> None:
    """Two-turn rollouts; per rollout (final reward, per-step reward of the first call or None)."""
    client = wrap(openai.OpenAI(base_url=server.base_url, api_key="x"), store=store)
    for task, specs in tasks.items():
        for i, (final, step) in enumerate(specs):
            with rollout(task, store=store) as r:
                msgs = [{"role": "user", "content": f"{task} try {i}"}]
                out = client.chat.completions.create(model="m", messages=msgs, max_tokens=12)
                if step is not None:
                    r.reward(step, call_index=r.last_call_index)
                msgs += [{"role": "assistant", "content": out.choices[0].message.content},
                         {"role": "user", "content": "again"}]
                client.chat.completions.create(model="m", messages=msgs, max_tokens=12)
                r.reward(final)
    store.flush()


def _daemon(store: TraceStore, model_dir: Path, ckpt: Path, **kw) -> TrainerDaemon:
    engine = TorchEngine(model_dir, TorchEngineConfig(lr=1e-3, precision="fp32"))
    config = TrainerConfig(checkpoint_dir=str(ckpt), group=GroupPolicy(group_size=4, groups_per_step=2),
                           poll_interval_s=0.05, **kw)
    return TrainerDaemon(store, engine, config)


TASKS = {"a": [(1.0, 0.5), (0.0, None), (1.0, -0.5), (0.0, 0.25)],
         "b": [(0.0, None), (0.0, 1.0), (0.0, None), (0.0, None)]}  # b: one final reward, steps differ


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[[str], TraceStore]]:
    """SQLite stores by name under tmp_path, closed after the test (their writer threads end with it)."""
    opened: list[TraceStore] = []

    def open_one(name: str) -> TraceStore:
        opened.append(TraceStore(f"sqlite:///{tmp_path / name}.db"))
        return opened[-1]

    yield open_one
    for store in opened:
        store.close()


def test_daemon_trains_per_turn_from_the_stores_step_rewards(llm_server, model_dir, bytes_model, tmp_path,
                                                             open_store):
    runs = {}
    for credit in ("rollout", "per-turn"):
        store = open_store(credit)
        _rollouts(llm_server, store, TASKS)
        with _daemon(store, bytes_model, tmp_path / f"ckpt-{credit}", credit=credit) as daemon:
            runs[credit] = (daemon.step_once(), store)
    rollout_step, _ = runs["rollout"]
    assert rollout_step is None  # rollout-level: group b has no signal, one group is not enough
    per_turn, store = runs["per-turn"]
    assert per_turn is not None
    m = per_turn.metrics
    assert m["n_groups"] == 2 and m["n_rollouts"] == 8  # b's per-step rewards are its signal
    assert m["step_rewards_used"] == 4 and m["step_rewards_unused"] == 0 and m["turns"] == 16
    assert m["step_reward_sum"] == pytest.approx(1.25)
    assert m["grad_norm"] > 0
    [step] = store.train_steps()
    assert step.metrics["step_rewards_used"] == 4  # recorded with the step, for the notebooks


def test_daemon_per_turn_without_step_rewards_takes_the_rollout_level_step(llm_server, bytes_model, tmp_path,
                                                                          open_store):
    results = {}
    for credit in ("rollout", "per-turn"):
        store = open_store(credit)
        _rollouts(llm_server, store, {"a": [(1.0, None), (0.0, None)] * 2, "b": [(0.0, None), (1.0, None)] * 2})
        with _daemon(store, bytes_model, tmp_path / f"ckpt-{credit}", credit=credit) as daemon:
            results[credit] = daemon.step_once()
    roll, turn = results["rollout"], results["per-turn"]
    assert roll is not None and turn is not None
    assert "step_rewards_used" not in roll.metrics  # the default step is unchanged
    assert turn.metrics["step_rewards_used"] == 0
    for key in ("loss", "grad_norm", "adv_abs_mean", "reward_mean"):
        assert turn.metrics[key] == pytest.approx(roll.metrics[key], rel=1e-5, abs=1e-7), key


def test_the_daemon_refuses_per_turn_dpo(tmp_path):
    with pytest.raises(ValueError, match="'dpo' compares whole rollouts"):
        TrainerConfig(checkpoint_dir=str(tmp_path), algorithm="dpo", credit="per-turn")


def test_ppo_per_turn_from_the_settings_through_the_daemon(llm_server, bytes_model, tmp_path, open_store):
    """The same rollouts with and without per-step rewards: PPO's returns (its value loss) move with them."""
    from trainer_backend.daemon.settings import TrainerSettings

    results = {}
    for name, first_step in (("with", 1.0), ("without", None)):
        store = open_store(name)
        _rollouts(llm_server, store, {t: [(1.0, first_step), (0.0, None), (1.0, first_step), (0.0, None)]
                                      for t in ("a", "b")})
        s = TrainerSettings.load(None, {"algorithm.name": "ppo", "algorithm.credit": "per-turn", "critic.lr": 1e-3,
                                        "group.size": 4, "group.per_step": 2, "run.model": str(bytes_model),
                                        "run.checkpoints": str(tmp_path / f"ckpt-{name}"), "engine.precision": "fp32",
                                        "optim.lr": 1e-3})
        torch.manual_seed(0)  # the same value head in both runs
        with TrainerDaemon(store, TorchEngine(bytes_model, s.engine_config()), s.trainer_config()) as daemon:
            results[name] = daemon.step_once()
    with_steps, without = results["with"], results["without"]
    assert with_steps is not None and without is not None
    assert with_steps.metrics["step_rewards_used"] == 4 and without.metrics["step_rewards_used"] == 0
    assert with_steps.metrics["vf_loss"] > 0 and without.metrics["vf_loss"] > 0
    assert with_steps.metrics["vf_loss"] != pytest.approx(without.metrics["vf_loss"], rel=1e-3)


def test_late_per_step_rewards_are_waited_for_and_used(llm_server, bytes_model, tmp_path, open_store):
    """A judge scores each turn after the rollouts ended: `[rewards] wait_for` holds the groups
    until its per-step rewards are in, then per-turn credit trains on them."""
    from lightning_middleware import Reward
    from trainer_backend.daemon.reward_gate import RewardPolicy

    store = open_store("late")
    _rollouts(llm_server, store, {"a": [(1.0, None), (0.0, None)] * 2, "b": [(0.0, None)] * 4})
    with _daemon(store, bytes_model, tmp_path / "ckpt", credit="per-turn",
                 rewards=RewardPolicy(wait_for={"judge": 600})) as daemon:
        assert daemon.step_once() is None  # waiting for the judge
        for call_index, value in ((0, 0.5), (1, 0.0)):  # half of each group's first turns judged 0.5
            for task in ("a", "b"):
                for i, r in enumerate(store.query_rollouts(task_id=task)):
                    store.submit_reward(Reward(rollout_id=r.id, value=value * (i % 2), name="judge", final=False,
                                               call_index=call_index))
            store.flush()
            if call_index == 0:  # a per-call judge is in when every turn is judged, not at the first
                assert daemon.step_once() is None
        result = daemon.step_once()
    assert result is not None and result.metrics["n_groups"] == 2  # b's turns now differ
    assert result.metrics["step_rewards_used"] == 16 and result.metrics["step_reward_sum"] == pytest.approx(2.0)


def test_ppo_returns_carry_each_step_reward_from_its_token_on():
    """With values 0 and gamma = lam = 1 the returns are the reward-to-go: at each response token,
    the per-step rewards of its call and later ones plus the rollout's reward."""
    from trainer_backend.engines import model_advantages

    rows = [dataclasses.replace(r, token_advantages=None, reward=1.0) for r in per_turn_rows() if r.rollout_id == "a"]
    steps = {0: {3: 0.5, 5: -0.25}, 1: {3: 2.0}}  # row -> position -> reward (ends of calls)
    rows = [dataclasses.replace(r, token_rewards=tuple(steps[i].get(p, 0.0) for p in range(len(r))))
            for i, r in enumerate(rows)]
    w = [torch.tensor(r.loss_mask, dtype=torch.float32) for r in rows]
    batches = [make_micro_batch(rows, [0], w), make_micro_batch(rows, [1], w)]
    zeros = [torch.zeros(mb.targets.shape) for mb in batches]
    out = model_advantages.compute(rows, batches, zeros, LossConfig(), critic=CriticConfig(),
                                   values=lambda mb: torch.zeros(mb.targets.shape), ref_logprobs=None)
    assert out.returns is not None
    # the rollout's response tokens in order: row 0 at 2 3 5 7 8, row 1 at 2 3
    expected = {0: {2: 3.25, 3: 3.25, 5: 2.75, 7: 3.0, 8: 3.0}, 1: {2: 3.0, 3: 3.0}}
    for i, ret in enumerate(out.returns):
        got = {p + 1: float(ret[0, p]) for p in range(ret.shape[1]) if rows[i].loss_mask[p + 1]}
        assert got == pytest.approx(expected[i]), i
