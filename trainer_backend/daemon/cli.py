"""`lightning-mw trainer`: the daemon with a torch or verl engine and a weight publisher."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_middleware.store import TraceStore
from trainer_backend.daemon.trainer_daemon import GroupPolicy, StepResult, TrainerConfig, TrainerDaemon
from trainer_backend.engines.base import Engine
from trainer_backend.serving.publisher import WeightPublisher

if TYPE_CHECKING:  # torch: imported when the command runs, not when the CLI registers it
    from trainer_backend.algorithms.grpo import LossConfig

log = logging.getLogger(__name__)


def add_cli(sub: Any) -> None:
    p = sub.add_parser("trainer", help="run the trainer daemon: poll the store, train, publish weights")
    p.add_argument("--store", required=True, help="trace store URL")
    p.add_argument("--model", required=True, help="base model directory (HF format)")
    p.add_argument("--serve", default=None, help="vLLM server URL to publish weights to (omit: no publishing)")
    p.add_argument("--gateway", default=None, help="gateway URL to pause during swaps")
    p.add_argument("--gateway-token", default=None,
                   help="the gateway's bearer token (default: $LIGHTNING_GATEWAY_TOKEN)")
    p.add_argument("--engine", choices=["torch", "verl"], default="torch")
    p.add_argument("--mode", choices=["async", "sync"], default="async")
    p.add_argument("--checkpoints", default="runs/checkpoints")
    p.add_argument("--trainer-id", default="trainer-0")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=16)
    p.add_argument("--group-timeout", type=float, default=300.0)
    p.add_argument("--max-staleness", type=int, default=1)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--dual-clip", type=float, default=3.0, metavar="C",
                   help="PPO dual clip for negative advantages: token loss at most -A*C (default 3, as verl; "
                        "0 turns it off)")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--freeze-embeddings", action="store_true")
    p.add_argument("--bf16", action="store_true",
                   help="bf16 compute with fp32 master weights (torch: --precision bf16; verl: FSDP param dtype)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16-autocast", "bf16"), default=None,
                   help="torch engine precision (overrides --bf16); default auto: bf16 where the device "
                        "computes it natively and faster than fp32 (measured once, cached), else fp32")
    p.add_argument("--compile", action="store_true",
                   help="torch engine: torch.compile the decoder layers (faster steps after a slow first few)")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--tensorboard", default=None, help="write step metrics to this TensorBoard log dir")
    p.set_defaults(func=run_trainer)


def run_trainer(args: argparse.Namespace) -> int:
    config = TrainerConfig(
        checkpoint_dir=args.checkpoints, trainer_id=args.trainer_id, mode=args.mode,
        max_staleness=args.max_staleness, max_len=args.max_len,
        group=GroupPolicy(group_size=args.group_size, groups_per_step=args.groups_per_step,
                          group_timeout_s=args.group_timeout),
    )
    store = TraceStore(args.store)
    start_dir, version = TrainerDaemon.resume_point(store, args.model, args.trainer_id)
    engine = make_engine(args, start_dir, version)
    publisher = None
    if args.serve:
        publisher = WeightPublisher(args.serve, gateway_url=args.gateway, gateway_token=args.gateway_token)
        if version > 0:  # the server may hold weights of a step that never committed
            publisher.publish(start_dir, version)
    daemon = TrainerDaemon(store, engine, config, publisher)
    tb = _tensorboard(args.tensorboard)

    def report(result: StepResult) -> None:
        m = result.metrics
        print(f"step {result.step:4d}  v{result.policy_version}  reward {m['reward_mean']:.3f}  "
              f"success {m['success_rate']:.2f}  loss {m.get('loss', float('nan')):+.4f}  "
              f"kl {m.get('approx_kl', float('nan')):.4f}  {m['step_time_s']:.1f}s", flush=True)
        if tb is not None:
            for k, v in m.items():
                if isinstance(v, (int, float)):
                    tb.add_scalar(k, v, result.step)
            tb.flush()

    print(f"trainer {config.trainer_id}: {args.engine} engine from {start_dir} (version {version}), "
          f"{config.mode} mode, waiting for {config.group.groups_per_step} groups of {config.group.group_size}")
    try:
        daemon.run(max_steps=args.max_steps, on_step=report)
    except KeyboardInterrupt:
        print("stopped")
    return 0


def make_engine(args: argparse.Namespace, start_dir: Path, version: int) -> Engine:
    """The engine the `trainer` flags ask for, starting from `start_dir` at `version`."""
    loss = loss_config(args)
    if args.engine == "verl":
        import torch

        from trainer_backend.engines.verl_engine import VerlEngine, VerlEngineConfig

        n_gpus = int(os.environ.get("VERL_N_GPUS", torch.cuda.device_count() or 1))
        vcfg = VerlEngineConfig(lr=args.lr, n_gpus=n_gpus, max_token_len_per_gpu=max(args.micro_batch_tokens, 1024),
                                freeze_embeddings=args.freeze_embeddings,
                                param_dtype="bf16" if args.bf16 else "fp32", loss=loss)
        return VerlEngine(start_dir, vcfg, policy_version=version, work_dir=Path(args.checkpoints) / "_verl")
    from trainer_backend.engines.torch_engine import TorchEngine, TorchEngineConfig

    cfg = TorchEngineConfig(lr=args.lr, micro_batch_tokens=args.micro_batch_tokens,
                            freeze_embeddings=args.freeze_embeddings,
                            precision=args.precision or ("bf16" if args.bf16 else "auto"), compile=args.compile,
                            loss=loss)
    return TorchEngine(start_dir, cfg, policy_version=version)


def loss_config(args: argparse.Namespace) -> LossConfig:
    from trainer_backend.algorithms.grpo import LossConfig

    if args.dual_clip and args.dual_clip <= 1.0:
        raise SystemExit(f"--dual-clip must be > 1 (or 0 for off), got {args.dual_clip}")
    return LossConfig(dual_clip_c=args.dual_clip or None)


def _tensorboard(logdir: str | None) -> Any:
    if not logdir:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("tensorboard is not installed; --tensorboard ignored")
        return None
    return SummaryWriter(logdir)
