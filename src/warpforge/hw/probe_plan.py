"""The sizes and repeats of every ``warpforge probe`` measurement: the full run and ``--quick``.

Read by the probe (hw/probe.py) and by the measurements it runs (hw/_probe_measure.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

GiB, MiB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class ProbePlan:
    """Sizes and repeats of every measurement (see FULL and QUICK)."""

    hbm_bytes: int  # per buffer; copy moves twice this
    hbm_rep: int
    burst: int  # back-to-back calls per timed sample for sub-millisecond kernels
    sweep_MiB: tuple[int, ...]
    sweep_bytes_per_launch: int
    sweep_rep: int
    chase_steps: int  # timed hops for L1 and L2
    chase_hbm_steps: int  # HBM hops take ~0.35 us each
    chase_rep: int
    matmul_n: int
    matmul_rep: int
    fp32_rep: int  # plain fp32 8192^3 takes ~22 ms per call on an H200
    launch_kernels: int
    launch_rep: int
    pcie_bytes: int
    pcie_rep: int
    cpu_copy_bytes: int
    cpu_matmul_n: int
    cpu_rep: int

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if k == "sweep_MiB":
                if not v or any(not (isinstance(m, int) and m >= 1) for m in v):
                    raise ValueError(f"ProbePlan.sweep_MiB must be a non-empty tuple of ints >= 1, got {v!r}")
            elif not (isinstance(v, int) and v >= 1):
                raise ValueError(f"ProbePlan.{k} must be an int >= 1, got {v!r}")


FULL = ProbePlan(
    hbm_bytes=2 * GiB, hbm_rep=10, burst=4,
    sweep_MiB=(1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 72, 80, 96, 128, 192, 256, 384, 512),
    sweep_bytes_per_launch=2 * GiB, sweep_rep=5,
    chase_steps=20000, chase_hbm_steps=8192, chase_rep=3,
    matmul_n=8192, matmul_rep=20, fp32_rep=5,
    launch_kernels=1000, launch_rep=10,
    pcie_bytes=256 * MiB, pcie_rep=5,
    cpu_copy_bytes=256 * MiB, cpu_matmul_n=2048, cpu_rep=5,
)
QUICK = ProbePlan(
    hbm_bytes=2 * GiB, hbm_rep=5, burst=4,
    sweep_MiB=(1, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 128, 256, 512),
    sweep_bytes_per_launch=1 * GiB, sweep_rep=3,
    chase_steps=10000, chase_hbm_steps=4096, chase_rep=2,
    matmul_n=8192, matmul_rep=8, fp32_rep=2,
    launch_kernels=500, launch_rep=5,
    pcie_bytes=128 * MiB, pcie_rep=3,
    cpu_copy_bytes=64 * MiB, cpu_matmul_n=1024, cpu_rep=3,
)


__all__ = ["FULL", "QUICK", "GiB", "MiB", "ProbePlan"]
