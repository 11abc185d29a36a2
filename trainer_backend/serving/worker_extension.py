"""vLLM worker extension, loaded inside the vLLM server process.

Started with ``--worker-extension-cls trainer_backend.serving.worker_extension.LightningWorkerExtension``
(the launcher puts a folder holding only this package on the server's PYTHONPATH).
vLLM mixes this class into its worker, so ``self`` is the worker: its methods are
reachable over HTTP with ``POST /collective_rpc {"method": "lightning_reload", ...}``
(needs ``VLLM_SERVER_DEV_MODE=1``).

Runs in the vLLM environment: import only what that env has (torch, vllm), and
nothing from the rest of ``trainer_backend`` at module level.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import torch


def _check_checkpoint(weights_path: str) -> None:
    path = Path(weights_path)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors in {weights_path}")


class LightningWorkerExtension:
    """Weight reload that is correct for tied embeddings on CPU, plus checksums, plus LoRA
    adapters swapped in two phases (stage while serving, commit while paused)."""

    def lightning_reload(self, weights_path: str) -> dict[str, Any]:
        """Reload all weights from a safetensors folder and rebuild derived state.

        On CPU, ``reload_weights`` copies new values into the parameters but the
        output layer of a tied-embedding model keeps the pre-packed GEMM copy made
        at startup, so logits would come from the old weights. Re-running the
        layer's ``process_weights_after_loading`` rebuilds it. Returns timings and
        the output-layer probe error (see ``_lm_head_probe``).
        """
        # Errors come back as {"error": ...} rather than raised: a raised error
        # turns into a reset HTTP connection, and a half-done reload would leave the
        # model mixed, so restore the previous weights first.
        previous = str(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        try:
            _check_checkpoint(weights_path)
            self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            return {"error": f"{type(exc).__name__}: {exc}", "restored": self._restore(previous)}
        t1 = time.perf_counter()
        repacked = self._repack_lm_head()
        t2 = time.perf_counter()
        # The full checksum is left to lightning_checksum (called after resume, it
        # keeps ~0.2 s per 100M parameters out of the paused window); the probe is cheap.
        return {
            "reload_s": t1 - t0, "repack_s": t2 - t1, "repacked": repacked,
            "lm_head_max_err": self._lm_head_probe(),
        }

    def lightning_threads(self, threads: int = 0) -> dict[str, Any]:
        """How many OpenMP threads the model computes on from now on (torch's ops and vLLM's CPU
        kernels read the same count; 0 changes nothing): a server bound to every core at start can
        lend cores to a trainer and take them back (`VLLMServer.set_threads`)."""
        # An error comes back as {"error": ...}: one raised here fails vLLM's engine, not the call.
        try:
            if int(threads) > 0:
                # vLLM's CPU worker replaces torch.set_num_threads with a no-op once it has bound its
                # threads (each OpenMP thread to its core); the pool keeps those threads, and their
                # binding, when the count goes down and up again
                torch._C.set_num_threads(int(threads))
            return {"threads": torch.get_num_threads()}
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _restore(self, weights_path: str) -> bool:
        try:
            self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
            self._repack_lm_head()
            return True
        except Exception:  # noqa: BLE001 - the caller learns restored=False
            return False

    def lightning_checksum(self) -> dict[str, Any]:
        """Sum of |w| over all parameters (float64, shared ones counted once), and
        how far the output layer's real compute path is from its weights."""
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        total = 0.0
        count = 0
        with torch.no_grad():
            for _, p in model.named_parameters():
                total += p.detach().to(torch.float64).abs().sum().item()
                count += p.numel()
        return {"checksum": total, "num_params": count, "lm_head_max_err": self._lm_head_probe()}

    # LoRA adapters. vLLM's own in-place load (`load_inplace=True`) keeps that flag on the request
    # it stores for the name, so every later engine step reloads the adapter from its path, and a
    # request queued during the swap carries the previous version's path and swaps it back. Here
    # the API server keeps a plain request (loaded once, not in place) and the weights change
    # under its id: read and checked while serving (`stage`), put in the slot while paused (`commit`).

    def lightning_adapter_ids(self) -> dict[str, Any]:
        """The LoRA ids the worker holds (to learn which id the API server gave a name), and this
        worker's instance: ids recorded for an earlier instance (a restarted server) mean nothing."""
        try:
            ids = sorted(self._lora_worker().list_adapters())
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            return {"error": f"{type(exc).__name__}: {exc}"}
        if "_lightning_instance" not in self.__dict__:
            self.__dict__["_lightning_instance"] = uuid.uuid4().hex
        return {"ids": ids, "instance": self.__dict__["_lightning_instance"]}

    def lightning_stage_adapter(self, lora_int_id: int, path: str) -> dict[str, Any]:
        """Read and validate the adapter in `path` for id `lora_int_id`, not yet serving it."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        try:
            _check_checkpoint(path)
            request = LoRARequest(lora_name=f"staged-{lora_int_id}", lora_int_id=lora_int_id, lora_path=path)
            model = self._lora_worker()._load_adapter(request)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, nothing served changed
            return {"error": f"{type(exc).__name__}: {exc}"}
        self._staged_adapters()[lora_int_id] = model
        return {"stage_s": time.perf_counter() - t0}

    def lightning_commit_adapters(self, lora_int_ids: list[int]) -> dict[str, Any]:
        """Serve the staged adapters under their ids: what vLLM's in-place load does after reading."""
        from vllm.utils.gpu_sync_debug import gpu_sync_allowed

        staged = self._staged_adapters()
        missing = [i for i in lora_int_ids if i not in staged]
        if missing:
            return {"error": f"no staged adapter for ids {missing}"}
        t0 = time.perf_counter()
        manager = self._lora_worker()._adapter_manager
        with gpu_sync_allowed():
            for lora_int_id in lora_int_ids:
                manager.remove_adapter(lora_int_id)
                manager.add_adapter(staged.pop(lora_int_id))
                manager.activate_adapter(lora_int_id)
        return {"commit_s": time.perf_counter() - t0}

    def _lora_worker(self) -> Any:
        manager = getattr(self.model_runner, "lora_manager", None)  # type: ignore[attr-defined]
        if manager is None:
            raise RuntimeError("LoRA is not enabled on this server (--enable-lora)")
        return manager

    def _staged_adapters(self) -> dict[int, Any]:
        # an attribute of the worker made on first use: the extension has no __init__ of its own
        if "_lightning_staged" not in self.__dict__:
            self.__dict__["_lightning_staged"] = {}
        staged: dict[int, Any] = self.__dict__["_lightning_staged"]
        return staged

    def _lm_head(self) -> torch.nn.Module | None:
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        return getattr(model, "lm_head", None)

    def _repack_lm_head(self) -> bool:
        lm_head = self._lm_head()
        method = getattr(lm_head, "quant_method", None)
        if lm_head is None or method is None or not hasattr(method, "process_weights_after_loading"):
            return False
        with torch.no_grad():
            method.process_weights_after_loading(lm_head)
        return True

    def _lm_head_probe(self) -> float | None:
        """Max |apply(x) - x @ W.T| for a fixed random x: nonzero (beyond rounding)
        means the output layer computes with stale weights."""
        lm_head = self._lm_head()
        method = getattr(lm_head, "quant_method", None)
        weight = getattr(lm_head, "weight", None)
        if method is None or weight is None or not hasattr(method, "apply"):
            return None
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(2, weight.shape[1], generator=gen, dtype=torch.float32)
        x = x.to(device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            got = method.apply(lm_head, x)
            want = x @ weight.t()
        return float((got.float() - want.float()).abs().max().item())
