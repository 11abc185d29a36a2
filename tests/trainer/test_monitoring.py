"""Health checks (the troubleshooting checklist) and the metric writers (TensorBoard, W&B offline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_backend.daemon.monitoring import REMEDIES, HealthChecks, HealthConfig, Monitor


def _kinds(checks: HealthChecks, **metrics) -> set[str]:
    return {f.kind for f in checks.check(metrics)}


def test_entropy_collapse_by_floor_and_by_drop():
    checks = HealthChecks(HealthConfig(entropy_floor=0.02, entropy_drop=0.1, window=5))
    for _ in range(3):
        assert _kinds(checks, entropy=1.0) == set()
    assert _kinds(checks, entropy=0.5) == set()
    assert _kinds(checks, entropy=0.05) == {"entropy_collapse"}  # below 10% of the first steps' 1.0
    assert _kinds(HealthChecks(), entropy=0.01) == {"entropy_collapse"}  # the floor, from the first step


def test_kl_negative_rewards_and_grad_spikes():
    checks = HealthChecks(HealthConfig(kl_limit=0.5, grad_spike=10.0))
    assert _kinds(checks, approx_kl=0.7) == {"kl_explosion"}
    assert _kinds(checks, kl_ref=-0.9) == {"kl_explosion"}
    assert _kinds(checks, reward_max=-0.1, reward_min=-2.0) == {"negative_rewards"}
    assert _kinds(checks, reward_max=0.0) == set()
    for g in (1.0, 1.2, 0.9, 1.1, 1.0):
        assert _kinds(checks, grad_norm=g) == set()
    [spike] = checks.check({"grad_norm": 25.0})
    assert spike.kind == "grad_norm_spike" and spike.data["median"] == pytest.approx(1.0) and spike.remedy
    assert _kinds(HealthChecks(HealthConfig(enabled=False)), entropy=0.0, approx_kl=9.0) == set()
    assert set(REMEDIES) == {"entropy_collapse", "kl_explosion", "negative_rewards", "grad_norm_spike",
                             "prefix_breaks", "retokenize_mismatch"}


def test_tensorboard_and_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    mon = Monitor(tensorboard=str(tmp_path / "tb"), wandb_project="lightning-test", wandb_mode="offline",
                  run_name="t", config={"lr": 1e-4}, wandb_dir=str(tmp_path))
    for step in range(1, 4):
        mon.log(step, {"loss": 1.0 / step, "entropy": 0.5, "name": "ignored", "flag": True})
    mon.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    [run] = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run.glob("*.wandb"))  # the offline run, for a later `wandb sync`

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([1.0, 0.5, 1 / 3])
    assert "name" not in acc.Tags()["scalars"] and "flag" not in acc.Tags()["scalars"]


def _no_wandb_login(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))


def test_wandb_online_without_an_api_key_falls_back_to_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("wandb")
    _no_wandb_login(monkeypatch, tmp_path)
    mon = Monitor(wandb_project="lightning-test", wandb_mode="online", run_name="t", wandb_dir=str(tmp_path))
    mon.log(1, {"loss": 1.0})
    mon.close()
    assert any("no API key" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    [run] = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run.glob("*.wandb"))


def test_wandb_online_with_no_reachable_server_falls_back_to_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A key, but the W&B host does not answer (a closed loopback port stands in for no network)."""
    pytest.importorskip("wandb")
    import socket

    _no_wandb_login(monkeypatch, tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: connections are refused
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    mon = Monitor(wandb_project="lightning-test", wandb_mode="online", run_name="t", wandb_dir=str(tmp_path),
                  wandb_init_timeout_s=3)  # the port refuses: wandb retries until this ends
    mon.log(1, {"loss": 1.0})
    mon.close()
    assert any("did not start" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    assert list((tmp_path / "wandb").glob("offline-run-*"))
