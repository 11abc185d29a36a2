"""Which floating-point format to compute in, decided once from what the hardware really does.

bf16 halves memory traffic and, where the CPU has native bf16 dot products (AVX512-BF16, AMX)
or on a GPU, runs matmuls several times faster than fp32. Where it has none (an AVX2-only
CPU), PyTorch emulates bf16 and a matmul runs ~60x *slower* than fp32. Instruction flags alone
do not settle it (oneDNN may use an emulated bf16 path on AVX-512 without the BF16 extension),
so the answer is a short measured probe (~1 s): bf16 and fp32 matmuls timed side by side on
one thread, plus torch's own check that oneDNN has bf16 kernels here at all.
The result is cached in memory and on disk per machine kind, torch version and ISA limits.

    probe = bf16_probe()            # BF16Probe(native=True, bf16_gflops=..., fp32_gflops=...)
    resolve_precision("auto")       # "bf16" where native and faster, else "fp32"
    resolve_precision("bf16")       # honoured; warns with the measured cost where not native

`LIGHTNING_BF16=1` / `=0` forces the probe's answer (tests, or a machine whose timing is noisy).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

# bf16 must beat fp32 by this factor to be chosen: a tie is not worth bf16's rounding.
MIN_SPEEDUP = 1.5
_PROBE_SIZE = 384
_PROBE_VERSION = 1
_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


@dataclass(frozen=True)
class BF16Probe:
    """What the probe found on one device kind."""

    device: str  # "cpu" or "cuda"
    native: bool  # bf16 is supported natively and at least MIN_SPEEDUP times faster than fp32
    reason: str  # one line: why (capability, measured speeds, or forced)
    bf16_gflops: float | None = None  # measured single-thread matmul speeds (None: not timed)
    fp32_gflops: float | None = None
    capability: str = ""  # torch.backends.cpu.get_cpu_capability() on CPU, the GPU's name on CUDA

    @property
    def slowdown(self) -> float | None:
        """How many times slower a bf16 matmul is than an fp32 one (None: not measured)."""
        if not self.bf16_gflops or not self.fp32_gflops:
            return None
        return self.fp32_gflops / self.bf16_gflops


def bf16_probe(device: str = "cpu", *, cache_dir: str | os.PathLike[str] | None = None) -> BF16Probe:
    """Is bf16 native and faster than fp32 on `device`? Forced by `LIGHTNING_BF16`, else cached."""
    forced = os.environ.get("LIGHTNING_BF16", "").strip().lower()
    if forced in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        native = forced in ("1", "true", "yes", "on")
        return BF16Probe(device=device, native=native, reason=f"forced by LIGHTNING_BF16={forced}")
    if device.startswith("cuda"):
        return _cuda_probe()
    return _cpu_probe(str(cache_dir) if cache_dir is not None else None)


def resolve_precision(requested: str | None, *, device: str = "cpu", probe: BF16Probe | None = None,
                      bf16_name: str = "bf16") -> str:
    """The precision to use for `requested`: "auto" (or None) becomes `bf16_name` where bf16 is
    native and faster, else "fp32"; an explicit bf16 request is honoured, with a warning that
    names the measured cost where bf16 is not native. Anything else is returned as given."""
    requested = requested or "auto"
    if requested == "auto":
        p = probe or bf16_probe(device)
        chosen = bf16_name if p.native else "fp32"
        log.info("precision auto -> %s on %s (%s)", chosen, device, p.reason)
        return chosen
    if requested.startswith("bf16"):
        p = probe or bf16_probe(device)
        if not p.native:
            cost = f" (a bf16 matmul measured {p.slowdown:.0f}x slower than fp32 here)" if p.slowdown else ""
            log.warning("precision %s requested on a %s without fast native bf16%s: %s; "
                        "'auto' or 'fp32' would be faster", requested, device, cost, p.reason)
    return requested


def autocast_dtype(device: str = "cpu", *, probe: BF16Probe | None = None) -> str | None:
    """"bfloat16" to autocast with where bf16 is native and faster, else None (run in fp32)."""
    return "bfloat16" if (probe or bf16_probe(device)).native else None


def cpu_kind() -> str:
    """A short name for this CPU's vector kind, to print beside every measured figure:
    "AMX-BF16", "AVX512-BF16", "AVX-512" (no BF16), "AVX2" or the bare machine name."""
    flags = set(_cpuinfo_fields().get("flags", "").split())
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"),
                       ("avx2", "AVX2")):
        if flag in flags:
            return name
    return platform.machine()


def describe_machine() -> dict[str, object]:
    """CPU model, vector kind, core count and the bf16 probe's answer (for results files)."""
    return {"cpu": _cpuinfo_fields().get("model name", platform.processor()), "kind": cpu_kind(),
            "cores": os.cpu_count(), "isa_limits": {k: os.environ[k] for k in _ISA_ENV if k in os.environ},
            "bf16": asdict(bf16_probe())}


# ------------------------------------------------------------------ CPU

def _cpu_probe(cache_dir: str | None) -> BF16Probe:
    key = _machine_key()
    path = Path(cache_dir or _default_cache_dir()) / f"bf16-probe-{key}.json"
    try:
        return BF16Probe(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    result = _measure_cpu()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(result)))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: the in-memory cache still holds
        log.debug("bf16 probe not cached at %s: %s", path, exc)
    return result


@cache
def _measure_cpu() -> BF16Probe:
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    fp32, bf16 = _matmul_gflops(torch.float32), _matmul_gflops(torch.bfloat16)
    timing = f"1-thread {_PROBE_SIZE}^3 matmul: bf16 {bf16:.1f} GFLOP/s vs fp32 {fp32:.1f} GFLOP/s"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # No oneDNN bf16 path at all: torch falls back to scalar emulation (~60x slower).
        native, reason = False, f"no oneDNN bf16 kernels (CPU capability {capability}); {timing}"
    else:
        native, reason = bf16 >= MIN_SPEEDUP * fp32, f"{timing} (CPU capability {capability})"
    log.info("bf16 probe: %s -> %s", reason, "bf16" if native else "fp32")
    return BF16Probe("cpu", native, reason, round(bf16, 1), round(fp32, 1), capability)


def _matmul_gflops(dtype: object) -> float:
    """Best of a few timed single-thread square matmuls (best-of: the machine may be busy)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(_PROBE_SIZE, _PROBE_SIZE).to(dtype)  # type: ignore[call-overload]
        b = torch.randn(_PROBE_SIZE, _PROBE_SIZE).to(dtype)  # type: ignore[call-overload]
        a @ b  # first call: kernel selection, packing
        best = float("inf")
        deadline = time.perf_counter() + 0.5  # an emulated bf16 matmul takes ~0.1 s: bounded
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
            if time.perf_counter() > deadline:
                break
        return 2 * _PROBE_SIZE ** 3 / best / 1e9
    finally:
        torch.set_num_threads(threads)


def _machine_key() -> str:
    """One cache entry per CPU model and flags, torch version and ISA limits set in the env."""
    import torch

    cpu = _cpuinfo_fields()
    parts = [platform.machine(), cpu.get("model name", ""), cpu.get("flags", ""), torch.__version__,
             str(_PROBE_VERSION), *(f"{k}={os.environ.get(k, '')}" for k in _ISA_ENV)]
    return hashlib.sha1("\n".join(parts).encode()).hexdigest()[:12]


def _cpuinfo_fields() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"model name": platform.processor()}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if not sep:
            if fields:  # the first processor's block is enough
                break
            continue
        fields.setdefault(name.strip(), value.strip())
    return fields


def _default_cache_dir() -> Path:
    from trainer_backend.caching import lightning_home

    return lightning_home() / "probes"


# ------------------------------------------------------------------ CUDA

@cache
def _cuda_probe() -> BF16Probe:
    import torch

    if not torch.cuda.is_available():
        return BF16Probe("cuda", False, "no CUDA device")
    name = torch.cuda.get_device_name()
    native = bool(torch.cuda.is_bf16_supported())
    return BF16Probe("cuda", native, f"{name}: torch.cuda.is_bf16_supported() = {native}", capability=name)
