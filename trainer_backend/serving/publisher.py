"""Publish a checkpoint into a running vLLM server (hot weight swap).

Sequence (all over HTTP, the server runs with ``VLLM_SERVER_DEV_MODE=1`` and the
``trainer_backend.serving.worker_extension.LightningWorkerExtension`` worker extension):

1. gateway ``POST /admin/pause`` (optional: only when a gateway URL is given; with its bearer
   token, through `lightning_middleware.gateway.admin.GatewayAdmin`),
2. engine ``POST /pause?mode=wait`` (in-flight requests finish, new ones wait); or, with
   ``pause="keep"``, ``mode=keep``: in-flight requests are frozen where they are, not drained,
3. ``POST /collective_rpc`` ``lightning_reload`` (reload from safetensors and
   re-pack the CPU output layer, see the worker extension),
4. ``POST /reset_prefix_cache`` (a reload does NOT invalidate cached KV; the pause's own clear
   happened before the reload); kept requests are preempted by it (``reset_running_requests``),
   so on resume their context is computed again with the new weights,
5. ``POST /update_weight_version`` (tag),
6. engine ``POST /resume`` and gateway ``POST /admin/resume``, always, in ``finally``; after a
   successful swap the gateway resumes with the new policy version (an integer tag), so the
   calls it serves from then on are stamped with it; after a failed one the version stays.

Then it verifies: ``/weight_info`` reports the tag, the worker's output-layer probe
is within rounding; ``weights_changed`` says whether the parameter checksum moved. The checksum is a float64 sum
of |w| over the parameters vLLM keeps as tensors; on CPU the linear layers' weights
are pre-packed into oneDNN handles and are not among them, so it covers embeddings,
norms and biases only: a cheap "did the reload touch the weights" signal, not a
proof. The proof is in the tests (logprobs equal an HF forward pass). Core module:
httpx only.

Why ``keep`` (in-flight weight updates, as PipelineRL and AReaL's interruptible rollouts do): a
``wait`` pause lasts as long as the longest completion in flight, and the trainer waits with it
(14-15 s in some steps of a BFCL run on 2 CPU cores; docs/serving.md). Kept, a completion
that spans the swap has its first tokens from the old weights and the rest from the new, each
token's log-prob the one it was sampled with: what the trainer's importance ratio compares
against. Its call keeps one policy version, stamped before the swap (`lightning_middleware`'s
capture), so its staleness counts from its older part. An adapter publish resets the same way
(tested for full weights only).

A checkpoint that holds LoRA adapters (one, or one folder per policy) publishes by served name
instead of step 3 (adapters.py: staged by the worker before the pause, committed in it, no
second prefix-cache reset: see `_swap`); the base weights stay.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import httpx

from lightning_middleware.gateway.admin import GatewayAdmin
from trainer_backend.serving.adapters import AdapterError, AdapterSlots

log = logging.getLogger(__name__)

PauseMode = Literal["wait", "keep"]  # vLLM's /pause modes the publisher uses (not "abort": it loses work)

ADAPTER_CONFIG = "adapter_config.json"  # peft's: a checkpoint holding it is a LoRA adapter folder

# The output-layer probe compares the packed GEMM against x @ W.T for a random x
# with unit-variance entries; fp32 rounding gives ~1e-5, stale weights give O(1).
LM_HEAD_TOLERANCE = 1e-2


class PublishError(RuntimeError):
    """A weight swap failed (the engine was resumed nonetheless)."""


@dataclass(frozen=True)
class PublishResult:
    """What one publish did and how long each phase took (seconds)."""

    version: str
    checkpoint_dir: str
    gateway_pause_s: float | None
    engine_pause_s: float
    reload_s: float
    reset_cache_s: float
    tag_s: float
    resume_s: float
    paused_s: float  # engine paused -> resumed: what requests felt
    total_s: float
    worker_reload_s: float  # reload_weights inside the worker
    worker_repack_s: float
    checksum_before: float | None
    checksum_after: float
    lm_head_max_err: float | None
    reported_version: str | None
    weights_changed: bool  # checksum moved; False when the same weights come again
    verified: bool  # version tag and output-layer probe check out
    problems: tuple[str, ...] = ()
    stage_s: float = 0.0  # adapters: read and checked by the worker before the pause


class WeightPublisher:
    """Swaps weights into a vLLM server; ``server_url`` may end in ``/v1``."""

    def __init__(
        self,
        server_url: str,
        *,
        gateway_url: str | None = None,
        gateway_token: str | None = None,
        timeout: float = 300.0,
        reset_retries: int = 20,
        adapter_name: str | None = None,
        served_root: str | os.PathLike[str] | None = None,
        pause: PauseMode = "wait",
    ) -> None:
        """`gateway_token`: the gateway's bearer token (default: $LIGHTNING_GATEWAY_TOKEN).
        `adapter_name`: the served model name of a LoRA policy; a checkpoint that is an adapter
        folder is published under it (no full reload). `served_root`: where each served adapter's
        own folder is kept (default: `served-adapters/` beside the checkpoints; adapters.py).
        `pause`: what requests in flight do during the swap: "wait" (they finish on the old
        weights first) or "keep" (frozen, then continued on the new ones; the module's docstring)."""
        if pause not in get_args(PauseMode):
            raise ValueError(f"pause must be one of {', '.join(get_args(PauseMode))}, not {pause!r}")
        self.pause = pause
        self.adapter_name = adapter_name
        self.server_url = server_root(server_url)
        self.gateway_url = gateway_url.rstrip("/") if gateway_url else None
        self.gateway: GatewayAdmin | None = None
        if self.gateway_url:
            self.gateway = (GatewayAdmin(self.gateway_url, token=gateway_token, timeout=timeout) if gateway_token
                            else GatewayAdmin.from_env(self.gateway_url, timeout=timeout))
        self.timeout = timeout
        self.reset_retries = reset_retries
        self._slots = AdapterSlots(self.server_url, self._rpc, Path(served_root) if served_root else None)

    def weight_version(self) -> str | None:
        with httpx.Client(timeout=self.timeout) as c:
            return _ok(c.get(f"{self.server_url}/weight_info")).json().get("weight_version")

    def checksum(self) -> dict[str, Any]:
        """The worker extension's parameter checksum and output-layer probe."""
        with httpx.Client(timeout=self.timeout) as c:
            return self._rpc(c, "lightning_checksum", {})

    def publish(self, checkpoint_dir: str | os.PathLike[str], version: str | int) -> PublishResult:
        """Swap the weights in ``checkpoint_dir`` (safetensors) in, tagged ``version``."""
        ckpt = str(Path(checkpoint_dir).resolve())
        tag = str(version)
        adapters = self._adapters_in(Path(ckpt))
        if adapters:
            return self._publish_adapters(ckpt, tag, adapters)
        if not any(Path(ckpt).glob("*.safetensors")):  # fail before pausing anything
            raise PublishError(f"no *.safetensors in {ckpt}")
        with httpx.Client(timeout=self.timeout) as c:
            before = self._rpc(c, "lightning_checksum", {}).get("checksum")
            def reload() -> dict[str, Any]:
                info = self._rpc(c, "lightning_reload", {"weights_path": ckpt})
                if "error" in info:  # the worker answers a failed reload, saying if it restored the old weights
                    state = "previous weights restored" if info.get("restored") else "WEIGHTS MAY BE MIXED"
                    raise PublishError(f"reload of {ckpt} failed ({state}): {info['error']}")
                return info

            t, paused_s, total, info = self._swap(c, tag, reload)
            reported = _ok(c.get(f"{self.server_url}/weight_info")).json().get("weight_version")
            after = self._rpc(c, "lightning_checksum", {})["checksum"]
        return self._result(ckpt, tag, t, paused_s, total, before, after, info, reported)

    def _swap(self, c: httpx.Client, tag: str, reload: Callable[[], Any],
              reset: bool = True) -> tuple[dict[str, float], float, float, Any]:
        """Pause (gateway, then engine), `reload`, reset the prefix cache, tag, resume: the steps
        of every publish, timed. Returns (timings, engine paused s, total s, what reload returned).

        `reset=False` leaves out the second prefix-cache reset: the pause cleared the cache (vLLM's
        `/pause` resets it once in-flight requests have drained; `clear_cache` is sent), and while
        the engine is paused nothing runs, so nothing is cached before the resume. A `keep` pause
        resets anyway: its frozen requests hold the old weights' KV. The steps run one after
        another: run concurrently they lengthened the pause (docs/benchmarks.md).
        """
        t: dict[str, float] = {"reset_cache": 0.0}
        t_start = time.perf_counter()
        gw_paused = swapped = False
        engine_paused_at: float | None = None
        info: Any = None
        try:
            if self.gateway is not None:
                gateway = self.gateway
                # keep: new calls wait at the gateway, those in flight are frozen in vLLM, not drained
                _timed(t, "gateway_pause", lambda: gateway.pause(wait=self.pause == "wait", timeout=self.timeout))
                gw_paused = True
            _timed(t, "engine_pause", lambda: _ok(c.post(f"{self.server_url}/pause",
                                                         params={"mode": self.pause, "clear_cache": "true"})))
            engine_paused_at = time.perf_counter()
            info = _timed(t, "reload", reload)
            if reset or self.pause == "keep":  # kept requests hold KV of the old weights
                _timed(t, "reset_cache", lambda: self._reset_prefix_cache(c))
            _timed(t, "tag", lambda: _ok(c.post(f"{self.server_url}/update_weight_version",
                                                json={"new_version": tag})))
            swapped = True
        finally:
            t_resume = time.perf_counter()
            # Resume even if the pause call itself failed: it may have taken
            # effect server-side, and /resume on a running engine is harmless.
            self._resume(c, gw_paused, _int_tag(tag) if swapped else None)
            t["resume"] = time.perf_counter() - t_resume
            paused_s = time.perf_counter() - engine_paused_at if engine_paused_at else 0.0
        return t, paused_s, time.perf_counter() - t_start, info

    def _adapters_in(self, ckpt: Path) -> list[tuple[str, Path]]:
        """(served name, folder) of the LoRA adapters a checkpoint holds: itself (under
        `adapter_name`), or one subfolder per policy (a policy set's checkpoint, by folder name)."""
        if (ckpt / ADAPTER_CONFIG).is_file():
            if not self.adapter_name:
                raise PublishError(f"{ckpt} is a LoRA adapter: give the publisher adapter_name (its served name)")
            return [(self.adapter_name, ckpt)]
        return sorted((d.name, d) for d in ckpt.iterdir() if (d / ADAPTER_CONFIG).is_file()) if ckpt.is_dir() else []

    def _publish_adapters(self, ckpt: str, tag: str, adapters: list[tuple[str, Path]]) -> PublishResult:
        """Publish LoRA adapter folders by served name, all in one pause (adapters.py: staged while
        serving, committed in the pause; no second prefix-cache reset: see `_swap`); the base weights stay."""
        missing = [str(path) for _, path in adapters if not (path / "adapter_model.safetensors").is_file()]
        if missing:  # fail before pausing anything
            raise PublishError(f"no adapter_model.safetensors in {', '.join(missing)}")
        with httpx.Client(timeout=self.timeout) as c:
            try:
                plan = self._slots.prepare(c, Path(ckpt), adapters)  # a bad adapter fails here, unpaused
            except AdapterError as exc:
                raise PublishError(str(exc)) from exc

            def reload() -> float:
                try:
                    return self._slots.apply(c, plan)
                except AdapterError as exc:
                    raise PublishError(str(exc)) from exc

            t, paused_s, total, commit_s = self._swap(c, tag, reload, reset=False)
            self._slots.refresh(plan)
            reported = _ok(c.get(f"{self.server_url}/weight_info")).json().get("weight_version")
        problems = () if reported == tag else (f"server reports version {reported!r}, expected {tag!r}",)
        log.info("published adapters %s from %s as %s in %.3f s (paused %.4f s; %d staged, %d registered)",
                 ", ".join(name for name, _ in adapters), ckpt, tag, total, paused_s, len(plan.staged),
                 len(plan.register))
        return PublishResult(
            version=tag, checkpoint_dir=ckpt, gateway_pause_s=t.get("gateway_pause"),
            engine_pause_s=t["engine_pause"], reload_s=t["reload"], reset_cache_s=t["reset_cache"],
            tag_s=t["tag"], resume_s=t["resume"], paused_s=paused_s, total_s=total, worker_reload_s=commit_s,
            worker_repack_s=0.0, checksum_before=None, checksum_after=float("nan"), lm_head_max_err=None,
            reported_version=reported, weights_changed=True, verified=not problems, problems=problems,
            stage_s=plan.stage_s,
        )  # fmt: skip

    def _result(
        self, ckpt: str, tag: str, t: dict[str, float], paused_s: float, total: float,
        before: float | None, after: float, info: dict[str, Any], reported: str | None,
    ) -> PublishResult:  # fmt: skip
        problems = []
        if reported != tag:
            problems.append(f"server reports version {reported!r}, expected {tag!r}")
        err = info.get("lm_head_max_err")
        if err is not None and err > LM_HEAD_TOLERANCE:
            problems.append(f"output layer computes with stale weights (probe error {err:.3g})")
        changed = before is None or after != before
        if not changed:  # legitimate when the same weights are published again
            log.warning("parameter checksum unchanged after publishing %s", ckpt)
        result = PublishResult(
            version=tag, checkpoint_dir=ckpt, gateway_pause_s=t.get("gateway_pause"),
            engine_pause_s=t["engine_pause"], reload_s=t["reload"], reset_cache_s=t["reset_cache"],
            tag_s=t["tag"], resume_s=t["resume"], paused_s=paused_s, total_s=total,
            worker_reload_s=info.get("reload_s", 0.0), worker_repack_s=info.get("repack_s", 0.0),
            checksum_before=before, checksum_after=after, lm_head_max_err=err,
            reported_version=reported, weights_changed=changed, verified=not problems,
            problems=tuple(problems),
        )  # fmt: skip
        level = logging.INFO if result.verified else logging.WARNING
        log.log(level, "published %s as %r in %.3f s (paused %.3f s)%s", ckpt, tag, total,
                paused_s, "" if result.verified else f": {'; '.join(problems)}")  # fmt: skip
        return result

    def _rpc(self, c: httpx.Client, method: str, kwargs: dict[str, str]) -> dict[str, Any]:
        body = {"method": method, "kwargs": kwargs, "timeout": self.timeout}
        results = _ok(c.post(f"{self.server_url}/collective_rpc", json=body)).json()["results"]
        if not results or not isinstance(results[0], dict):
            raise PublishError(f"{method} returned {results!r}; is the worker extension loaded?")
        return results[0]  # one worker on CPU; with TP>1 all ranks load the same files

    def _reset_prefix_cache(self, c: httpx.Client) -> None:
        # Fails (success=false) while blocks are held; paused in "wait" mode none
        # should be, but retry briefly rather than serve stale KV. Kept requests hold theirs:
        # they are preempted, and computed again from their tokens on resume.
        params = {"reset_running_requests": "true"} if self.pause == "keep" else None
        for _ in range(self.reset_retries):
            if _ok(c.post(f"{self.server_url}/reset_prefix_cache", params=params)).json().get("success", True):
                return
            time.sleep(0.05)
        raise PublishError("could not reset the prefix cache; stale KV would be served")

    def _resume(self, c: httpx.Client, gateway: bool, version: int | None) -> None:
        try:
            _post_retry(c, f"{self.server_url}/resume")
        finally:
            if gateway and self.gateway is not None:
                self.gateway.resume(policy_version=version)


def _post_retry(c: httpx.Client, url: str, attempts: int = 3) -> None:
    """POST that survives a connection the server reset after an earlier error: a
    server left paused would hold every later request forever."""
    for i in range(attempts):
        try:
            _ok(c.post(url))
            return
        except httpx.TransportError:
            if i == attempts - 1:
                raise
            time.sleep(0.1)


def _int_tag(tag: str) -> int | None:
    """The policy version a tag names, if it is one (the trainer tags with integers)."""
    try:
        return int(tag)
    except ValueError:
        return None


def server_root(url: str) -> str:
    """A server URL without a trailing `/v1`."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _ok(resp: httpx.Response) -> httpx.Response:
    if resp.status_code >= 400:
        raise PublishError(f"{resp.request.method} {resp.request.url} -> {resp.status_code}: {resp.text[:500]}")
    return resp


def _timed(times: dict[str, float], name: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    out = fn()
    times[name] = time.perf_counter() - t0
    return out
