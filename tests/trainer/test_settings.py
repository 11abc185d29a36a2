"""The trainer's configuration: a TOML file, flags over it, validation that names the field."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from lightning_middleware.cli import main
from trainer_backend.daemon.cli import add_cli, run_trainer, settings_from
from trainer_backend.daemon.settings import SettingsError, TrainerSettings

CONFIG = """
[run]
store = "sqlite:///traces.db"
model = "/models/base"
mode = "sync"

[group]
size = 4
per_step = 2

[algorithm]
name = "rloo"
advantage_level = "sample"

[optim]
lr = 3e-5
lr_schedule = "cosine"
total_steps = 100

[loss]
kl_coef = 0.02
kl_estimator = "k1"
dual_clip = 0
"""


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    return parser.parse_args(["trainer", *argv])


def test_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "trainer.toml"
    path.write_text(CONFIG)
    s = settings_from(_parse("--config", str(path), "--lr", "1e-5", "--group-size", "8"))
    assert s.optim.lr == 1e-5 and s.group.size == 8  # the flags win
    assert s.group.per_step == 2 and s.algorithm.name == "rloo" and s.run.mode == "sync"  # the file
    assert s.loss.dual_clip is None and s.loss.kl_estimator == "k1" and s.engine.precision == "auto"  # defaults
    cfg, eng = s.trainer_config(), s.engine_config()
    assert (cfg.algorithm, cfg.advantage_level, cfg.group.group_size) == ("rloo", "sample", 8)
    assert (eng.lr, eng.lr_schedule, eng.total_steps, eng.loss.kl_coef, eng.loss.dual_clip_c) == (
        1e-5, "cosine", 100, 0.02, None)
    assert TrainerSettings.load(None, {}).run.engine == "torch"
    assert eng.share_prefixes and not TrainerSettings.load(None, {"engine.share_prefixes": False}).engine_config(
        ).share_prefixes


def test_eval_and_stale_flags_reach_the_daemon_config(tmp_path: Path) -> None:
    s = settings_from(_parse("--eval-every", "3", "--eval-agent", "pkg.mod:agent", "--eval-tasks", "val.jsonl",
                             "--early-stop-patience", "2", "--stale", "keep", "--max-staleness", "1"))
    cfg = s.trainer_config()
    assert cfg.eval is not None and (cfg.eval.every, cfg.eval.agent, cfg.eval.tasks, cfg.eval.patience) == (
        3, "pkg.mod:agent", "val.jsonl", 2)
    assert (cfg.stale, cfg.max_staleness) == ("keep", 1)
    assert settings_from(_parse()).trainer_config().eval is None and settings_from(_parse()).run.stale == "drop"
    with pytest.raises(SettingsError, match="eval.every needs eval.agent and eval.tasks"):
        settings_from(_parse("--eval-every", "3"))
    with pytest.raises(SettingsError, match="run.stale: Input should be 'drop' or 'keep'"):
        settings_from(_parse("--stale", "maybe"))


def test_publish_pause_flag(tmp_path: Path) -> None:
    """`--publish-pause keep`: requests in flight go on with the new weights (serving/publisher.py);
    "abort" (lose them) is not offered."""
    assert settings_from(_parse()).run.publish_pause == "wait"
    assert settings_from(_parse("--publish-pause", "keep")).run.publish_pause == "keep"
    with pytest.raises(SettingsError, match="run.publish_pause: Input should be 'wait' or 'keep'"):
        settings_from(_parse("--publish-pause", "abort"))


def test_the_trainer_publishes_as_the_settings_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """`lightning-mw trainer`'s publisher (make_publisher): the pause mode, the gateway and a single
    LoRA policy's served name reach it; separate policies publish each adapter by folder; no server, none."""
    from trainer_backend.daemon.cli import make_publisher

    monkeypatch.setenv("LIGHTNING_GATEWAY_TOKEN", "t")
    assert make_publisher(settings_from(_parse())) is None
    full = make_publisher(settings_from(_parse("--serve", "http://127.0.0.1:8000/v1", "--publish-pause", "keep")))
    assert full is not None and (full.pause, full.server_url, full.adapter_name, full.gateway) == (
        "keep", "http://127.0.0.1:8000", None, None)
    lora = make_publisher(settings_from(_parse("--serve", "http://s:1", "--gateway", "http://g:2",
                                               "--lora-rank", "8", "--lora-name", "coder")))
    assert lora is not None and (lora.pause, lora.adapter_name, lora.gateway_url) == ("wait", "coder", "http://g:2")
    team = make_publisher(settings_from(_parse("--serve", "http://s:1", "--lora-rank", "8",
                                               "--policies", "coder,reviewer")))
    assert team is not None and team.adapter_name is None


def test_print_config_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trainer.toml"
    path.write_text(CONFIG)
    assert run_trainer(_parse("--config", str(path), "--print-config", "--algo", "gspo")) == 0
    printed = capsys.readouterr().out
    assert 'name = "gspo"' in printed and "lr = 3e-05" in printed
    again = tmp_path / "resolved.toml"
    again.write_text(printed)
    assert TrainerSettings.load(again) == TrainerSettings.load(path, {"algorithm.name": "gspo"})


def test_print_config_lists_every_option_and_a_filled_in_one_loads(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Options whose default is None (`tis_threshold`, `total_steps`, `patience`, ...) were left out."""
    assert run_trainer(_parse("--print-config")) == 0
    printed = capsys.readouterr().out
    s = TrainerSettings.load(None)
    for section, values in s.model_dump().items():
        assert f"[{section}]" in printed
        for key in values:
            assert re.search(rf"^(# )?{key} = ", printed, re.M), f"{section}.{key} missing from --print-config"
    assert "# tis_threshold = <float>  (not set)" in printed and "# patience = <int>  (not set)" in printed
    saved = tmp_path / "saved.toml"
    saved.write_text(printed)
    assert TrainerSettings.load(saved) == s  # as it is
    saved.write_text(printed.replace("# tis_threshold = <float>  (not set)", "tis_threshold = 2.5"))
    assert TrainerSettings.load(saved).loss.tis_threshold == 2.5  # and uncommented, filled in


@pytest.mark.parametrize(("text", "message"), [
    ("[loss]\nclip_low = -0.1\n", "loss.clip_low: Input should be greater than 0"),
    ("[loss]\nclip_lo = 0.1\n", "loss.clip_lo: Extra inputs are not permitted"),
    ("[algorithm]\nname = \"ppo2\"\n", "algorithm.name: Input should be 'grpo'"),
    ("[group]\nsize = 2\nmin_size = 4\n", "group.min_size (4) is larger than group.size (2)"),
    ("[optim]\nlr_schedule = \"linear\"\n", "needs optim.total_steps or run.max_steps"),
    ("[run\n", "is not valid TOML"),
])
def test_bad_configs_name_the_field(tmp_path: Path, text: str, message: str,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SettingsError, match="^") as err:
        TrainerSettings.load(path)
    assert message in str(err.value)
    assert main(["trainer", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_store_and_model_are_required(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trainer", "--store", "sqlite:///x.db"]) == 2
    assert "run.store and run.model are required" in capsys.readouterr().err
    assert main(["trainer", "--store", "sqlite:///x.db", "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "run.model: no model folder at /nonexistent" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SettingsError, match="cannot read"):
        TrainerSettings.load("/nonexistent/trainer.toml")


def test_ppo_dpo_and_the_kl_in_the_reward() -> None:
    s = settings_from(_parse("--algo", "ppo", "--critic-lr", "3e-6", "--gamma", "0.99", "--lam", "0.95",
                             "--critic-warmup-steps", "5", "--kl-coef", "0.05", "--kl-in", "reward"))
    eng, cfg = s.engine_config(), s.trainer_config()
    assert eng.critic is not None and (eng.critic.lr, eng.critic.gamma, eng.critic.lam, eng.critic.warmup_steps) == (
        3e-6, 0.99, 0.95, 5)
    assert (eng.loss.kl_coef, eng.loss.kl_in_reward_coef) == (0.0, 0.05) and eng.dpo is None
    assert cfg.algorithm == "ppo" and not cfg.group.skip_uniform  # PPO learns from uniform groups
    d = settings_from(_parse("--algo", "dpo", "--dpo-beta", "0.3", "--kl-coef", "0.05"))
    eng = d.engine_config()
    assert eng.dpo is not None and eng.dpo.beta == 0.3 and eng.critic is None and eng.loss.kl_coef == 0.05
    assert d.trainer_config().group.skip_uniform
    g = settings_from(_parse("--algo", "reinforce_pp", "--kl-coef", "0.1", "--kl-in", "reward")).engine_config()
    assert g.loss.advantage == "reinforce_pp" and g.loss.kl_in_reward_coef == 0.1  # re-estimated in the engine
    with pytest.raises(SettingsError, match="need engine 'torch'"):
        settings_from(_parse("--algo", "ppo", "--engine", "verl"))
    with pytest.raises(SettingsError, match="algorithm.name"):
        settings_from(_parse("--algo", "a2c"))


def test_lora_from_the_flags() -> None:
    s = settings_from(_parse("--lora-rank", "16", "--lora-alpha", "32", "--lora-name", "coder"))
    eng = s.engine_config()
    assert eng.lora is not None and (eng.lora.rank, eng.lora.alpha) == (16, 32) and s.lora.name == "coder"
    assert settings_from(_parse()).engine_config().lora is None  # rank 0: every weight trains
    verl = settings_from(_parse("--lora-rank", "8", "--engine", "verl"))  # one LoRA policy: verl's own LoRA
    assert verl.run.engine == "verl" and verl.engine_config().lora.rank == 8
    # several LoRA policies on verl: one verl LoRA engine per policy (engines/verl_policies.py)
    team = settings_from(_parse("--lora-rank", "8", "--engine", "verl", "--policies", "coder,reviewer",
                                "--default-policy", "coder"))
    assert (team.run.engine, team.lora.policies, team.lora.default_policy) == ("verl", ("coder", "reviewer"), "coder")
    with pytest.raises(SettingsError, match="lora.policies: separate policies are LoRA adapters"):
        settings_from(_parse("--engine", "verl", "--policies", "coder,reviewer"))  # still LoRA only


def test_the_rewards_section_round_trips_and_reaches_the_daemon(tmp_path: Path) -> None:
    path = tmp_path / "trainer.toml"
    path.write_text('[rewards]\nversion = "abc123"\nwait_for = { human = 600, reward_model = 30.5 }\n'
                    'on_deadline = "skip"\nrank_ahead = false\n')
    s = TrainerSettings.load(path)
    again = tmp_path / "again.toml"
    again.write_text(s.to_toml())
    assert TrainerSettings.load(again) == s
    policy = s.trainer_config().rewards
    assert (policy.version, policy.on_deadline, policy.rank_ahead) == ("abc123", "skip", False)
    assert TrainerSettings().trainer_config().rewards.rank_ahead  # on unless turned off
    assert dict(policy.wait_for) == {"human": 600, "reward_model": 30.5}
    assert TrainerSettings.load(path, {"rewards.version": "def"}).rewards.version == "def"
    path.write_text('[rewards]\nwait_for = { human = -1 }\n')
    with pytest.raises(SettingsError, match="deadlines must be seconds >= 0"):
        TrainerSettings.load(path)
