"""Datasheet figures of the GPUs warpforge knows, to set measured ceilings beside.

Every peak is DENSE (no 2:4 sparsity): NVIDIA's tables print the sparse figure with an asterisk,
and we halve it. Matrix peaks are tensor-core rates with fp32 accumulation where the datasheet
distinguishes (GeForce parts run fp16-accumulate twice as fast; torch/cuBLAS accumulate in fp32).
``int8`` is TOPS, kept in the same table as the TFLOP/s figures. ``pcie_GBps`` is ONE direction
(the datasheets print the bidirectional total: Gen4 x16 64 GB/s -> 32, Gen5 x16 128 GB/s -> 64).
``l2_MiB`` is what the driver reports (``L2_cache_size``), which is what the cache sweep sees.
``nvlink_GBps`` is ONE direction per GPU (the datasheets print the bidirectional total: 900 GB/s on
Hopper SXM -> 450, 600 GB/s on A100 SXM -> 300); ``None``: no NVLink (the GPUs talk over PCIe).

Sources (vendor datasheets / whitepapers):
  [H100]  NVIDIA H100 Tensor Core GPU datasheet (SXM5, PCIe, NVL columns)
  [H200]  NVIDIA H200 Tensor Core GPU datasheet (SXM and NVL columns)
  [A100]  NVIDIA A100 Tensor Core GPU datasheet (40GB/80GB, SXM4/PCIe)
  [L40S]  NVIDIA L40S GPU datasheet
  [L4]    NVIDIA L4 Tensor Core GPU datasheet
  [ADA]   NVIDIA Ada Lovelace GPU architecture whitepaper, appendix table (GeForce RTX 4090)
  [ORIN]  NVIDIA Jetson AGX Orin series datasheet / technical brief (64GB module)
SM counts, boost clocks and L2 sizes come from the same documents or the architecture whitepapers.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8", "int8")


@dataclass(frozen=True)
class DeviceSpec:
    """One GPU's datasheet. Peaks in TFLOP/s (int8 in TOPS), dense; ``None``: the chip lacks it."""

    name: str
    match: tuple[str, ...]  # substrings of the name torch reports, matched as whole words, any case
    sms: int
    l2_MiB: float
    hbm_GBps: float  # device memory bandwidth (HBM, GDDR or LPDDR)
    pcie_GBps: float | None  # host link, one direction; None: integrated (shares DRAM with the CPU)
    sm_clock_MHz: int  # boost clock
    fp32: float  # plain FFMA rate (not tf32)
    tf32: float | None
    fp16: float | None
    bf16: float | None
    fp8: float | None
    int8: float | None
    source: str  # which document the figures come from
    nvlink_GBps: float | None = None  # GPU-to-GPU link, one direction; None: no NVLink

    def __post_init__(self) -> None:
        if not self.match or not all(isinstance(m, str) and m.strip() for m in self.match):
            raise ValueError(f"{self.name}: match must be a non-empty tuple of non-empty strings")
        for attr in ("sms", "l2_MiB", "hbm_GBps", "sm_clock_MHz", "fp32"):
            if not getattr(self, attr) > 0:
                raise ValueError(f"{self.name}: {attr} must be > 0, got {getattr(self, attr)!r}")
        for attr in ("pcie_GBps", "nvlink_GBps", *PRECISIONS):
            v = getattr(self, attr)
            if v is not None and not v > 0:
                raise ValueError(f"{self.name}: {attr} must be > 0 or None, got {v!r}")

    @property
    def tflops(self) -> dict[str, float | None]:
        """Dense peaks keyed like :class:`warpforge.hw.roofline.Ceilings` (``None``: not supported)."""
        return {k: getattr(self, k) for k in PRECISIONS}

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["match"] = list(self.match)
        return d


_H100 = "NVIDIA H100 Tensor Core GPU datasheet"
_H200 = "NVIDIA H200 Tensor Core GPU datasheet"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet"

# Hopper SXM: 132 SMs, 1980 MHz boost. H200 = H100 compute with HBM3e; its driver reports a 60 MiB
# L2 (62914560 B, measured on our H200) where the H100 reports 50 MiB.
SPECS: tuple[DeviceSpec, ...] = (
    DeviceSpec("H100 SXM", ("H100 80GB HBM3", "H100 SXM", "H100 SXM5", "H100"), sms=132, l2_MiB=50,
               hbm_GBps=3350, pcie_GBps=64, sm_clock_MHz=1980,
               fp32=67, tf32=494.5, fp16=989.5, bf16=989.5, fp8=1979, int8=1979, source=f"{_H100}, SXM5 column",
               nvlink_GBps=450),
    DeviceSpec("H100 PCIe", ("H100 PCIe",), sms=114, l2_MiB=50, hbm_GBps=2000, pcie_GBps=64, sm_clock_MHz=1755,
               fp32=51, tf32=378, fp16=756.5, bf16=756.5, fp8=1513, int8=1513, source=f"{_H100}, PCIe column",
               nvlink_GBps=300),
    DeviceSpec("H100 NVL", ("H100 NVL",), sms=132, l2_MiB=50, hbm_GBps=3900, pcie_GBps=64, sm_clock_MHz=1785,
               fp32=60, tf32=417.5, fp16=835.5, bf16=835.5, fp8=1670.5, int8=1670.5, source=f"{_H100}, NVL column",
               nvlink_GBps=300),
    DeviceSpec("H200", ("H200", "H200 SXM"), sms=132, l2_MiB=60, hbm_GBps=4800, pcie_GBps=64, sm_clock_MHz=1980,
               fp32=67, tf32=494.5, fp16=989.5, bf16=989.5, fp8=1979, int8=1979, source=f"{_H200}, SXM column",
               nvlink_GBps=450),
    DeviceSpec("H200 NVL", ("H200 NVL",), sms=132, l2_MiB=60, hbm_GBps=4800, pcie_GBps=64, sm_clock_MHz=1785,
               fp32=60, tf32=417.5, fp16=835.5, bf16=835.5, fp8=1670.5, int8=1670.5, source=f"{_H200}, NVL column",
               nvlink_GBps=450),
    # Ampere A100: 108 SMs, 1410 MHz, 40 MiB L2; no fp8 tensor cores.
    DeviceSpec("A100 SXM 80GB", ("A100-SXM4-80GB", "A100 SXM4 80GB", "A100 SXM 80GB", "A100"), sms=108, l2_MiB=40,
               hbm_GBps=2039, pcie_GBps=32, sm_clock_MHz=1410,
               fp32=19.5, tf32=156, fp16=312, bf16=312, fp8=None, int8=624, source=f"{_A100}, 80GB SXM column",
               nvlink_GBps=300),
    DeviceSpec("A100 PCIe 80GB", ("A100 80GB PCIe", "A100-PCIE-80GB"), sms=108, l2_MiB=40,
               hbm_GBps=1935, pcie_GBps=32, sm_clock_MHz=1410,
               fp32=19.5, tf32=156, fp16=312, bf16=312, fp8=None, int8=624, source=f"{_A100}, 80GB PCIe column",
               nvlink_GBps=300),
    DeviceSpec("A100 40GB", ("A100-SXM4-40GB", "A100-PCIE-40GB", "A100 40GB"), sms=108, l2_MiB=40,
               hbm_GBps=1555, pcie_GBps=32, sm_clock_MHz=1410,
               fp32=19.5, tf32=156, fp16=312, bf16=312, fp8=None, int8=624, source=f"{_A100}, 40GB columns"),
    # Ada: L40S 142 SMs / 96 MiB L2, L4 58 SMs / 48 MiB, RTX 4090 128 SMs / 72 MiB.
    DeviceSpec("L40S", ("L40S",), sms=142, l2_MiB=96, hbm_GBps=864, pcie_GBps=32, sm_clock_MHz=2520,
               fp32=91.6, tf32=183, fp16=362.05, bf16=362.05, fp8=733, int8=733, source="NVIDIA L40S GPU datasheet"),
    DeviceSpec("L4", ("L4",), sms=58, l2_MiB=48, hbm_GBps=300, pcie_GBps=32, sm_clock_MHz=2040,
               fp32=30.3, tf32=60, fp16=121, bf16=121, fp8=242.5, int8=242.5,
               source="NVIDIA L4 Tensor Core GPU datasheet"),
    DeviceSpec("RTX 4090", ("RTX 4090", "GeForce RTX 4090"), sms=128, l2_MiB=72, hbm_GBps=1008, pcie_GBps=32,
               sm_clock_MHz=2520, fp32=82.6, tf32=82.6, fp16=165.2, bf16=165.2, fp8=330.3, int8=660.6,
               source="NVIDIA Ada Lovelace architecture whitepaper, RTX 4090, fp32-accumulate rates"),
    # Orin's datasheet gives the GPU's sparse INT8 (170 TOPS) and FP32 (5.3 TFLOPS) only. Its
    # GA10B SMs have A100-class tensor cores (170/2 TOPS dense at 16 SMs x 1.3 GHz = 2048 int8
    # FMA/clk/SM, as on A100), so fp16/bf16 = int8/2 and tf32 = int8/4, as on A100. LPDDR5 shared
    # with the CPU: no PCIe link to measure.
    DeviceSpec("Jetson AGX Orin", ("Orin", "Jetson AGX Orin"), sms=16, l2_MiB=4, hbm_GBps=204.8, pcie_GBps=None,
               sm_clock_MHz=1300, fp32=5.3, tf32=21.25, fp16=42.5, bf16=42.5, fp8=None, int8=85,
               source="NVIDIA Jetson AGX Orin series datasheet (64GB); "
                      "tensor rates derived from its sparse INT8 figure"),
)


def _norm(s: str) -> str:
    return re.sub(r"[\s_\-]+", " ", s.strip().lower())


def _matches(pattern: str, name: str) -> bool:
    # Whole words only: "L4" must not match "NVIDIA L40S", "H100" must not match "H1000".
    return re.search(rf"(?<![a-z0-9]){re.escape(_norm(pattern))}(?![a-z0-9])", _norm(name)) is not None


def spec_for(device_name: str | None) -> DeviceSpec | None:
    """The datasheet for a device name as torch reports it ("NVIDIA H200", "NVIDIA H100 80GB HBM3").

    The most specific match wins (the longest matching pattern), so "NVIDIA H100 PCIe" gets the
    PCIe part and not the generic H100 entry. ``None`` for unknown devices and for the CPU.
    """
    if not device_name:
        return None
    best: tuple[int, DeviceSpec] | None = None
    for spec in SPECS:
        for pattern in spec.match:
            if _matches(pattern, device_name) and (best is None or len(_norm(pattern)) > best[0]):
                best = (len(_norm(pattern)), spec)
    return best[1] if best else None
