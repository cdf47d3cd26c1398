"""Roofline math: the floor time of a piece of work under the device's ceilings, and how close we got.

floor = max(flops / peak[dtype], bytes / bandwidth); the larger term names the bound; the fraction
achieved is floor / measured. A ceiling must be one: nothing may run above it. So where both exist,
each ceiling (every precision's peak and the HBM bandwidth) is the LARGER of the datasheet's dense
figure and the probe's measurement: a probed cuBLAS rate is what cuBLAS reached, not what the chip can
do (a kernel beating it read "109% of the roof" against it). A fraction above 1.0 is then a bug in a
ceiling or in a work count, and ``roofline(..., strict=True)`` raises :class:`CeilingError` for it.
Ceilings come, in order of preference, from

1. the probe cache of the device (``warpforge probe`` measured them: source ``"probe ..."``), each
   raised to the datasheet's figure where that is higher; precisions the probe could not measure (no
   fp8 tensor cores, an error) take the datasheet's, else the rules in :func:`_fill_missing`;
2. the datasheet (:mod:`warpforge.hw.specs`: source ``"datasheet ..."``);
3. for the CPU with no probe cache, a fixed nominal estimate (source says so); deliberately not
   measured here, because ceilings() is called per benchmark record and must be cheap and
   deterministic. ``warpforge probe`` on a CPU-only machine caches measured CPU figures, which then win;
4. for an unknown GPU with no cache, a nominal estimate whose source tells you to run the probe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from warpforge import dtypes
from warpforge.hw.specs import PRECISIONS, spec_for

# Nominal CPU figures (no probe cache): a few cores of a server CPU. Only the order of magnitude
# matters; the roofline fraction on CPU is for smoke tests, not for claims.
CPU_NOMINAL_GBPS = 20.0
CPU_NOMINAL_TFLOPS = 0.2
# Unknown GPU without a probe cache: roughly an upper-mid datacenter part (A100-class memory).
UNKNOWN_GPU_GBPS = 1500.0
UNKNOWN_GPU_FP16_TFLOPS = 300.0

_DTYPE_KEYS: dict[Any, str] = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int8: "int8",
    torch.uint8: "int8",
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPE_KEYS[getattr(torch, _name)] = "fp8"
_STR_ALIASES = {
    **dtypes.ALIASES, "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "e4m3": "fp8", "e5m2": "fp8", "uint8": "int8",
}


class CeilingError(ValueError):
    """A roofline fraction (or a utilisation) above 1.0: the ceiling or the work count is wrong."""


def dtype_key(dtype: torch.dtype | str) -> str:
    """The ceiling key for a precision: torch.bfloat16 -> "bf16", "float32" -> "fp32", "tf32" -> "tf32".

    torch.float32 maps to "fp32" (plain FFMA); pass "tf32" explicitly for work that runs on tf32
    tensor cores. Raises ValueError for precisions without a ceiling (float64, int32, ...).
    """
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        key = _STR_ALIASES.get(key, key)
        if key in PRECISIONS:
            return key
    elif dtype in _DTYPE_KEYS:
        return _DTYPE_KEYS[dtype]
    raise ValueError(f"dtype: no roofline ceiling for {dtype!r}; expected a torch float32/float16/bfloat16/"
                     f"float8/int8 dtype or one of {PRECISIONS}")


@dataclass(frozen=True)
class Ceilings:
    """The limits work runs against on one device: memory bandwidth and a matrix peak per precision."""

    device: str
    hbm_GBps: float
    tflops: dict[str, float]  # keys PRECISIONS; int8 in TOPS
    l2_GBps: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not (isinstance(self.hbm_GBps, (int, float)) and self.hbm_GBps > 0 and math.isfinite(self.hbm_GBps)):
            raise ValueError(f"hbm_GBps must be a finite number > 0, got {self.hbm_GBps!r}")
        missing = [k for k in PRECISIONS if k not in self.tflops]
        if missing:
            raise ValueError(f"tflops is missing keys {missing} (needs all of {PRECISIONS})")
        bad = {k: v for k, v in self.tflops.items() if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v))}
        if bad:
            raise ValueError(f"tflops values must be finite numbers > 0, got {bad}")
        if self.l2_GBps is not None and not self.l2_GBps > 0:
            raise ValueError(f"l2_GBps must be > 0 or None, got {self.l2_GBps!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"device": self.device, "hbm_GBps": self.hbm_GBps, "tflops": dict(self.tflops),
                "l2_GBps": self.l2_GBps, "source": self.source}


def _fill_missing(tf: dict[str, float | None]) -> dict[str, float]:
    """Complete a partial precision table by rules that hold on NVIDIA tensor-core GPUs.

    fp16 <-> bf16 run at one rate; tf32 is half of fp16; int8 is twice fp16 (Turing onwards);
    fp8 without fp8 tensor cores runs at best at the fp16 rate (it is upcast). fp32 is at least
    known from the caller (plain FFMA is never missing from a probe or a datasheet).
    """
    out = {k: v for k, v in tf.items() if v}
    if "fp32" not in out:
        raise ValueError("an fp32 figure is needed to complete the precision table")
    half = out.get("fp16") or out.get("bf16")
    if half is None:  # no tensor-core figure at all (a CPU): every precision runs at the fp32 rate
        return {k: out.get(k, out["fp32"]) for k in PRECISIONS}
    out.setdefault("fp16", half)
    out.setdefault("bf16", half)
    out.setdefault("tf32", half / 2)
    out.setdefault("int8", out.get("fp8") or 2 * half)
    out.setdefault("fp8", half)
    return {k: float(out[k]) for k in PRECISIONS}


def ceilings_from_probe(result: dict[str, Any]) -> Ceilings:
    """Ceilings from a probe result (the cached JSON of ``warpforge probe``)."""
    dev = result["device"]
    name = dev["name"]
    where = result.get("time", "unknown time")
    if dev.get("kind") == "cpu":
        cpu = result["cpu"]
        return Ceilings(device=name, hbm_GBps=float(cpu["memcpy_GBps"]),
                        tflops=_fill_missing({"fp32": cpu["fp32_matmul_GFLOPs"] / 1e3}),
                        source=f"probe (CPU, measured {where})")
    hbm = result["hbm"]
    bw = [v for k, v in hbm.items() if k.endswith("_GBps") and isinstance(v, (int, float)) and v > 0]
    if not bw:
        raise ValueError("probe result has no HBM bandwidth figure")
    measured = {k: v.get("tflops") for k, v in result.get("matmul", {}).items() if isinstance(v, dict)}
    spec = spec_for(name)
    sheet = spec.tflops if spec is not None else {}
    tf: dict[str, float | None] = {}
    raised: list[str] = []  # precisions where the datasheet is above what the probe measured
    for k in PRECISIONS:
        m, d = measured.get(k) or None, sheet.get(k) or None
        tf[k] = max(x for x in (m, d) if x) if (m or d) else None
        if d and (not m or d > m):
            raised.append(k)
    if not tf["fp32"]:
        raise ValueError("probe result has no fp32 matmul figure and the device has no datasheet")
    hbm_bw = max(bw)
    if spec is not None and spec.hbm_GBps > hbm_bw:
        hbm_bw = float(spec.hbm_GBps)
        raised.append("hbm")
    source = f"probe (measured {where})"
    if raised:
        source += f"; datasheet {spec.name} where higher: {', '.join(raised)}"  # type: ignore[union-attr]
    sweep = result.get("sweep")
    l2 = sweep.get("plateau_GBps") if isinstance(sweep, dict) else None
    return Ceilings(device=name, hbm_GBps=hbm_bw, tflops=_fill_missing(tf),
                    l2_GBps=float(l2) if l2 else None, source=source)


def _device_name(device: torch.device | str | int | None) -> tuple[str, bool]:
    """(name, is_cpu) for None (current device), a torch.device / "cuda:1" / index, or a device name."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:  # a device name such as "NVIDIA H200" (or this machine's CPU model)
            from warpforge.hw.probe import cpu_name

            return device, device == cpu_name()
    if isinstance(device, int):
        device = torch.device("cuda", device)
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        from warpforge.hw.probe import cpu_name

        return cpu_name(), True
    if device.type != "cuda":
        raise ValueError(f"device: expected cuda, cpu or a device name, got {device}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {device} requested but CUDA is not available")
    return torch.cuda.get_device_name(device), False


def ceilings(device: torch.device | str | int | None = None) -> Ceilings:
    """The ceilings for ``device`` (default: the current CUDA device, else the CPU). See module docstring."""
    from warpforge.hw.probe import load_cached

    name, is_cpu = _device_name(device)
    cached = load_cached(name)
    if cached is not None:
        try:
            return ceilings_from_probe(cached)
        except (KeyError, TypeError, ValueError):
            pass  # a cache from an older schema or a failed probe: fall through to the datasheet
    if is_cpu:
        return Ceilings(device=name, hbm_GBps=CPU_NOMINAL_GBPS,
                        tflops={k: CPU_NOMINAL_TFLOPS for k in PRECISIONS},
                        source="nominal CPU estimate (no probe cache; run `warpforge probe`)")
    spec = spec_for(name)
    if spec is not None:
        return Ceilings(device=name, hbm_GBps=float(spec.hbm_GBps), tflops=_fill_missing(spec.tflops),
                        source=f"datasheet {spec.name} (no probe cache; run `warpforge probe`)")
    return Ceilings(device=name, hbm_GBps=UNKNOWN_GPU_GBPS,
                    tflops=_fill_missing({"fp32": UNKNOWN_GPU_FP16_TFLOPS / 16, "fp16": UNKNOWN_GPU_FP16_TFLOPS}),
                    source="nominal estimate for an unknown GPU (no datasheet, no probe cache; run `warpforge probe`)")


def roofline(flops: float, bytes_moved: float, dtype: torch.dtype | str, measured_ms: float | None,
             ceil: Ceilings | None = None, *, strict: bool = False) -> dict[str, Any]:
    """Floor time of work doing ``flops`` in ``dtype`` and moving ``bytes_moved`` through device memory.

    Returns {"floor_ms", "fraction", "bound", "compute_ms", "memory_ms"}:
    compute_ms = flops / peak[dtype], memory_ms = bytes / hbm bandwidth, floor_ms = their max,
    bound = "compute" when compute_ms > memory_ms else "memory" (a tie counts as memory-bound),
    fraction = floor_ms / measured_ms (None when measured_ms is None). With flops == 0 the
    precision is not looked up (integer copies have no compute ceiling).

    ``strict``: a fraction above 1.0 raises :class:`CeilingError` (the benchmark records: a figure above
    its ceiling is a bug, never a result). Left off, it is returned as is: the profiler places single
    operators whose operands may sit in L2, above the HBM roof.
    """
    for label, v in (("flops", flops), ("bytes_moved", bytes_moved)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{label} must be a finite number >= 0, got {v!r}")
    if measured_ms is not None and not (isinstance(measured_ms, (int, float)) and measured_ms > 0
                                        and math.isfinite(measured_ms)):
        raise ValueError(f"measured_ms must be a finite number > 0 or None, got {measured_ms!r}")
    c = ceil if ceil is not None else ceilings()
    compute_ms = flops / (c.tflops[dtype_key(dtype)] * 1e12) * 1e3 if flops > 0 else 0.0
    memory_ms = bytes_moved / (c.hbm_GBps * 1e9) * 1e3
    floor_ms = max(compute_ms, memory_ms)
    fraction = floor_ms / measured_ms if measured_ms is not None else None
    if strict and fraction is not None:
        check_fraction(fraction, "roofline fraction", c.source or c.device)
    return {
        "floor_ms": floor_ms,
        "fraction": fraction,
        "bound": "compute" if compute_ms > memory_ms else "memory",
        "compute_ms": compute_ms,
        "memory_ms": memory_ms,
    }


def check_fraction(value: float, what: str, against: str) -> float:
    """``value`` when it is at most 1.0 (plus float slack), else :class:`CeilingError`: a roofline fraction,
    an mfu or an mbu above one means a ceiling below what ran, or work counted that did not run."""
    if value > 1.0 + 1e-9:
        raise CeilingError(f"{what} {value:.4g} > 1 against {against}: the ceiling or the work count is wrong; "
                           "the figure is not stored")
    return value
