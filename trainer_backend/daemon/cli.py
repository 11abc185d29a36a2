"""`lightning-mw trainer`: the daemon with a torch or verl engine and a weight publisher.

Every setting lives in `settings.TrainerSettings` (a TOML file with `--config`); each flag here
overrides one field of it, and `--print-config` shows the result. Registering the command
imports nothing heavy: torch comes in when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from lightning_middleware.records import Event
from lightning_middleware.store import TraceStore
from trainer_backend.daemon.config import StepResult
from trainer_backend.daemon.drift import DriftWatch
from trainer_backend.daemon.monitoring import Monitor
from trainer_backend.daemon.settings import SettingsError, TrainerSettings
from trainer_backend.daemon.trainer_daemon import TrainerDaemon
from trainer_backend.engines.base import Engine
from trainer_backend.serving.parity import RISK, TemplateParity
from trainer_backend.serving.publisher import WeightPublisher

log = logging.getLogger(__name__)

# flag -> (settings field, type, help); every default is None: "not given, the file or the default decides"
FLAGS: dict[str, tuple[str, Any, str]] = {
    "--store": ("run.store", str, "trace store URL (required, here or in the config)"),
    "--model": ("run.model", str, "base model directory, HF format (required, here or in the config)"),
    "--serve": ("run.serve", str, "vLLM server URL to publish weights to (omit: no publishing)"),
    "--gateway": ("run.gateway", str, "gateway URL to pause during swaps"),
    "--gateway-token": ("run.gateway_token", str, "the gateway's bearer token (default: $LIGHTNING_GATEWAY_TOKEN)"),
    "--publish-pause": ("run.publish_pause", str, "during a swap, requests in flight wait: finish on the old "
                                                  "weights (default); keep: go on with the new ones"),
    "--engine": ("run.engine", str, "torch (one machine) or verl (GPU clusters)"),
    "--mode": ("run.mode", str, "async (train while agents run) or sync"),
    "--checkpoints": ("run.checkpoints", str, "checkpoint directory"),
    "--trainer-id": ("run.trainer_id", str, "this lineage's name; one live daemon per id"),
    "--max-steps": ("run.max_steps", int, "stop after this many steps"),
    "--max-staleness": ("run.max_staleness", int, "async: policy versions a rollout may lag"),
    "--stale": ("run.stale", str, "async: drop (default) or keep (train, the PPO ratio corrects) rollouts "
                                  "past --max-staleness"),
    "--max-len": ("run.max_len", int, "truncate training rows to this many tokens"),
    "--tensorboard": ("monitor.tensorboard", str, "write step metrics to this TensorBoard log dir"),
    "--wandb-project": ("monitor.wandb_project", str, "log step metrics to this Weights & Biases project"),
    "--wandb-mode": ("monitor.wandb_mode", str, "online | offline (sync later) | disabled"),
    "--eval-every": ("eval.every", int, "held-out evaluation every N steps (needs --eval-agent, --eval-tasks)"),
    "--eval-agent": ("eval.agent", str, "the agent function for evaluation, package.module:function"),
    "--eval-tasks": ("eval.tasks", str, "held-out tasks, a JSONL file"),
    "--early-stop-patience": ("eval.patience", int, "stop after N evaluations without improvement"),
    "--group-size": ("group.size", int, "rollouts per task in a full group"),
    "--groups-per-step": ("group.per_step", int, "groups a step waits for"),
    "--group-timeout": ("group.timeout_s", float, "a group older than this trains with what it has"),
    "--algo": ("algorithm.name", str, "grpo | dr_grpo | rloo | reinforce_pp | gspo | ppo | dpo"),
    "--advantage-level": ("algorithm.advantage_level", str, "rollout (default) | sample (each row its own sample)"),
    "--credit": ("algorithm.credit", str, "rollout (default: the rollout's reward on every token) | per-turn "
                                           "(each call's return: its and later per-step rewards + the final)"),
    "--credit-gamma": ("algorithm.credit_gamma", float, "per-turn: the discount per call (default 1)"),
    "--loss-agg": ("algorithm.loss_agg", str,
                   "rollout-token-mean (default) | token-mean | seq-mean-token-mean | seq-mean-token-sum"),
    "--lr": ("optim.lr", float, "peak learning rate"),
    "--lr-schedule": ("optim.lr_schedule", str, "constant | linear | cosine (after the warm-up)"),
    "--warmup-steps": ("optim.warmup_steps", int, "linear lr warm-up steps"),
    "--max-grad-norm": ("optim.max_grad_norm", float, "gradient clipping norm"),
    "--clip-low": ("loss.clip_low", float, "PPO ratio clip below 1"),
    "--clip-high": ("loss.clip_high", float, "PPO ratio clip above 1 (0.28: clip-higher)"),
    "--dual-clip": ("loss.dual_clip", float, "dual clip c for negative advantages (default 3; 0 turns it off)"),
    "--kl-coef": ("loss.kl_coef", float, "KL to the frozen base model (in the loss, or see --kl-in)"),
    "--kl-estimator": ("loss.kl_estimator", str, "k1 | k2 | k3"),
    "--kl-in": ("loss.kl_in", str, "loss (default) | reward (a per-token penalty in the reward, as verl's)"),
    "--critic-lr": ("critic.lr", float, "ppo: the critic's learning rate"),
    "--critic-warmup-steps": ("critic.warmup_steps", int, "ppo: steps in which only the critic learns"),
    "--gamma": ("critic.gamma", float, "ppo: GAE discount (default 1)"),
    "--lam": ("critic.lam", float, "ppo: GAE lambda (default 1)"),
    "--dpo-beta": ("dpo.beta", float, "dpo: beta (default 0.1)"),
    "--entropy-coef": ("loss.entropy_coef", float, "entropy bonus"),
    "--tis-threshold": ("loss.tis_threshold", float, "truncated importance sampling for stale rollouts (e.g. 2)"),
    "--lora-rank": ("lora.rank", int, "train a LoRA adapter of this rank (0: every weight); serve with "
                                      "--max-lora-rank"),
    "--lora-alpha": ("lora.alpha", int, "LoRA alpha (the update is scaled by alpha / rank)"),
    "--lora-name": ("lora.name", str, "the adapter's served model name, what the agents call (default policy)"),
    "--policies": ("lora.policies", lambda text: tuple(n for n in text.split(",") if n),
                   "separate LoRA policies, comma-separated served names (e.g. coder,reviewer)"),
    "--default-policy": ("lora.default_policy", str, "the policy that trains calls of any other model"),
    "--reward-version": ("rewards.version", str, "train on the final reward of this reward configuration's hash "
                                                 "(lightning-mw rewards check/rescore print it)"),
    "--reward-config": ("rewards.config", str, "a reward configuration whose ranking judge ranks each ready group "
                                               "before it trains (and whose version is trained on)"),
    "--precision": ("engine.precision", str, "auto (bf16 where native and faster, else fp32) | fp32 | bf16 | "
                                             "bf16-autocast"),
    "--micro-batch-tokens": ("engine.micro_batch_tokens", int, "padded tokens per micro-batch"),
}
SWITCHES = {  # store_true flags: only an explicit flag overrides the file
    "--freeze-embeddings": ("engine.freeze_embeddings", "freeze the (tied) embeddings"),
    "--compile": ("engine.compile", "torch.compile the decoder layers"),
    "--gradient-checkpointing": ("engine.gradient_checkpointing", "recompute activations in backward"),
    "--allow-template-mismatch": ("run.allow_template_mismatch", "train though the served model tokenises "
                                  "differently from --model (a warning instead of a refusal): " + RISK),
}


def add_cli(sub: Any) -> None:
    p = sub.add_parser("trainer", help="run the trainer daemon: poll the store, train, publish weights")
    p.add_argument("--config", default=None, help="a trainer.toml (flags override it)")
    p.add_argument("--print-config", action="store_true", help="print the resolved configuration and exit")
    for flag, (_field, typ, help_text) in FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=help_text)
    for flag, (_field, help_text) in SWITCHES.items():
        p.add_argument(flag, action="store_true", default=None, help=help_text)
    p.add_argument("--bf16", action="store_true", help="= --precision bf16 (verl: the FSDP compute dtype)")
    p.set_defaults(func=run_trainer)


def settings_from(args: argparse.Namespace) -> TrainerSettings:
    """The configuration the flags and `--config` give (SettingsError names what is wrong)."""
    overrides: dict[str, Any] = {}
    for flag, (field, _t, _h) in FLAGS.items():
        overrides[field] = getattr(args, flag.lstrip("-").replace("-", "_"))
    for flag, (field, _h) in SWITCHES.items():
        overrides[field] = getattr(args, flag.lstrip("-").replace("-", "_"))
    if getattr(args, "bf16", False) and overrides["engine.precision"] is None:
        overrides["engine.precision"] = "bf16"
    return TrainerSettings.load(args.config, overrides)


def _served_ahead(publisher: WeightPublisher, version: int) -> bool:
    """The server serves a trainer's version tag (an integer) other than the committed one: weights of
    a step that never committed. A fresh vLLM reports "default" and needs no publish."""
    served = publisher.weight_version()
    try:
        return served is not None and int(served) != version
    except ValueError:
        return False


def _tokenizer(model_dir: str) -> Any | None:
    """The model folder's tokenizer, for the parity and drift checks; None (a warning) without one:
    training itself needs none, it trains on the stored token IDs."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError or TypeError here
        why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    else:
        if getattr(tokenizer, "chat_template", None):
            return tokenizer
        why = "it has no chat template"
    log.warning("no chat tokenizer in %s (%s): the served model's chat template is not checked and stored "
                "calls are not re-tokenised", model_dir, why)
    return None


def run_trainer(args: argparse.Namespace) -> int:
    settings = settings_from(args)  # SettingsError: lightning-mw prints it on one line, exits 2
    if not args.print_config:
        if settings.run.store is None or settings.run.model is None:
            raise SettingsError("run.store and run.model are required (--store, --model, or the config)")
        if not Path(settings.run.model).is_dir():
            raise SettingsError(f"run.model: no model folder at {settings.run.model}")
    if args.print_config:
        print(settings.to_toml(), end="")
        return 0
    r = settings.run
    assert r.store is not None and r.model is not None
    store = TraceStore(r.store)
    config = settings.trainer_config()
    start_dir, version = TrainerDaemon.resume_point(store, r.model, config.trainer_id)
    parity = None
    tokenizer = _tokenizer(r.model)
    if r.serve and tokenizer is not None:  # before the engine and any publish: a server that tokenises
        # differently is refused
        parity = TemplateParity(r.model, r.serve, allow_mismatch=r.allow_template_mismatch, tokenizer=tokenizer)
        try:
            served = parity.require("at the trainer's start")
        except BaseException:
            parity.close()
            store.close()
            raise
        if not served.ok:
            store.add_event(Event(kind="template_mismatch", message=served.message("at the trainer's start"),
                                  source=config.trainer_id, data={"version": version, "allowed": True}))
    engine = make_engine(settings, start_dir, version)
    publisher = make_publisher(settings)
    if publisher is not None:
        if version > 0:  # the server may hold weights of a step that never committed
            publisher.publish(start_dir, version)
        elif settings.lora.rank:  # a new adapter (the base exactly): served before any agent asks for it
            publisher.publish(engine.save(Path(config.checkpoint_dir) / "v000000"), 0)
        elif _served_ahead(publisher, version):  # a first step published, killed before its commit
            publisher.publish(start_dir, version)
    drift = DriftWatch(store, tokenizer=tokenizer, parity=parity, source=config.trainer_id)
    daemon = TrainerDaemon(store, engine, config, publisher, drift)
    mon = settings.monitor
    monitor = Monitor(tensorboard=mon.tensorboard, wandb_project=mon.wandb_project, wandb_mode=mon.wandb_mode,
                      run_name=config.trainer_id, config=settings.model_dump())

    def report(result: StepResult) -> None:
        m = result.metrics
        print(f"step {result.step:4d}  v{result.policy_version}  reward {m['reward_mean']:.3f}  "
              f"success {m['success_rate']:.2f}  loss {m.get('loss', float('nan')):+.4f}  "
              f"kl {m.get('approx_kl', float('nan')):.4f}  {m['step_time_s']:.1f}s", flush=True)
        monitor.log(result.step, m)

    print(f"trainer {config.trainer_id}: {r.engine} engine, {config.algorithm} from {start_dir} "
          f"(version {version}), {config.mode} mode, waiting for {config.group.groups_per_step} groups "
          f"of {config.group.group_size}")
    try:
        daemon.run(max_steps=r.max_steps, on_step=report)
    except KeyboardInterrupt:
        print("stopped")
    finally:
        daemon.close()
        monitor.close()
        if parity is not None:
            parity.close()
    return 0


def make_publisher(settings: TrainerSettings) -> WeightPublisher | None:
    """The publisher the settings ask for: one per served model (`run.serve`), through the gateway
    when one is named; a single LoRA policy's adapter under its served name; None with no server."""
    r, lora = settings.run, settings.lora
    if not r.serve:
        return None
    return WeightPublisher(r.serve, gateway_url=r.gateway, gateway_token=r.gateway_token,
                           adapter_name=lora.name if lora.rank and not lora.policies else None, pause=r.publish_pause)


def make_engine(settings: TrainerSettings, start_dir: Path, version: int) -> Engine:
    """The engine the settings ask for, starting from `start_dir` at `version`."""
    if settings.run.engine == "verl":
        import torch

        from trainer_backend.engines.verl_engine import VerlEngine, VerlEngineConfig

        n_gpus = int(os.environ.get("VERL_N_GPUS", torch.cuda.device_count() or 1))
        e, o = settings.engine, settings.optim
        vcfg = VerlEngineConfig(lr=o.lr, n_gpus=n_gpus, max_token_len_per_gpu=max(e.micro_batch_tokens, 1024),
                                freeze_embeddings=e.freeze_embeddings,
                                param_dtype="bf16" if e.precision.startswith("bf16") else "fp32",
                                loss=settings.loss_config(), lora=settings.engine_config().lora)
        work_dir = Path(settings.run.checkpoints) / "_verl"
        if settings.lora.policies:  # one verl LoRA engine per policy (engines/verl_policies.py)
            from trainer_backend.engines.verl_policies import VerlPolicySet

            return VerlPolicySet(start_dir, settings.lora.policies, vcfg, default=settings.lora.default_policy,
                                 policy_version=version, work_dir=work_dir)
        return VerlEngine(start_dir, vcfg, policy_version=version, work_dir=work_dir)
    if settings.lora.policies:
        from trainer_backend.engines.policies import PolicySet

        return PolicySet(start_dir, settings.lora.policies, settings.engine_config(),
                         default=settings.lora.default_policy, policy_version=version)
    from trainer_backend.engines.torch_engine import TorchEngine

    return TorchEngine(start_dir, settings.engine_config(), policy_version=version)
