"""`lightning-mw serve MODEL_DIR`, `lightning-mw vllm-env` and `lightning-mw merge-lora ADAPTER`."""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from lightning_middleware.errors import UsageError
from trainer_backend.serving.env import VLLMServerError, ensure_vllm_env
from trainer_backend.serving.merge import DTYPES, merge_adapter
from trainer_backend.serving.server import VLLMServer


def add_cli(subparsers: Any) -> None:
    """Register ``serve MODEL_DIR``, ``vllm-env`` and ``merge-lora`` on an argparse subparsers object."""
    serve = subparsers.add_parser("serve", help="run a vLLM server for a model folder")
    serve.add_argument("model_dir")
    serve.add_argument("--port", type=int, default=None, help="default: a free port")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--max-model-len", type=int, default=1024)
    serve.add_argument("--kv-cache-gib", type=float, default=1)
    serve.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    serve.add_argument("--dtype", default="auto")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--log-path", default=None)
    serve.add_argument("--max-lora-rank", type=int, default=None,
                       help="serve LoRA adapters up to this rank, hot-loaded by the trainer (--lora-rank)")
    serve.add_argument("--max-loras", type=int, default=4, help="adapters in one batch (with --max-lora-rank)")
    serve.add_argument("--vllm-args", default="", help='extra vLLM flags, one string: "--max-num-seqs 8"')
    serve.set_defaults(func=_cmd_serve)
    env = subparsers.add_parser("vllm-env", help="create the vLLM server environment")
    env.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    env.add_argument("--force", action="store_true", help="recreate it")
    env.set_defaults(func=_cmd_vllm_env)
    merge = subparsers.add_parser("merge-lora", help="merge a trained LoRA adapter into its base model: a plain "
                                                     "Hugging Face folder, served without adapters")
    merge.add_argument("adapter_dir", help="the adapter checkpoint (a trainer's --lora-rank checkpoint)")
    merge.add_argument("--out", required=True, help="the new model folder")
    merge.add_argument("--base", default=None, help="the base model folder (default: the one the adapter names)")
    merge.add_argument("--dtype", default="base", choices=DTYPES, help="the saved dtype (default: the base's)")
    merge.set_defaults(func=_cmd_merge)


def _cmd_merge(args: argparse.Namespace) -> int:
    out = merge_adapter(args.adapter_dir, args.out, base=args.base, dtype=args.dtype)
    print(f"merged {args.adapter_dir} into {out}")
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    model = Path(args.model_dir).expanduser()
    if not model.is_dir():
        raise UsageError(f"no model folder at {args.model_dir}")
    if not (model / "config.json").is_file():
        raise UsageError(f"{args.model_dir} has no config.json: not a Hugging Face model folder")
    extra = shlex.split(args.vllm_args)
    server = VLLMServer(
        args.model_dir, port=args.port, host=args.host, max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib, device=args.device, dtype=args.dtype,
        served_model_name=args.served_model_name, log_path=args.log_path, extra_args=extra,
        max_lora_rank=args.max_lora_rank, max_loras=args.max_loras,
    )  # fmt: skip
    ensure_vllm_env(device=server.device)
    # `kill PID` must stop the server too: it runs in its own process group.
    signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        server.start()
    except VLLMServerError as exc:  # the log holds the details; the command says where it is
        raise UsageError(f"vLLM did not start: {exc.reason} (log {server.log_path})") from None
    try:
        print(f"vLLM serving {args.model_dir} at {server.base_url} (log {server.log_path})")
        print("Ctrl-C to stop.")
        while server.is_running():
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _cmd_vllm_env(args: argparse.Namespace) -> int:
    print(ensure_vllm_env(device=args.device, force=args.force))
    return 0


if __name__ == "__main__":  # pragma: no cover - manual use
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(prog="python -m trainer_backend.serving.cli")
    add_cli(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(ns.func(ns))
