"""Suite ``memory``: copy, fill and sum, our Triton kernels against torch (and torch.compile on a GPU).

Pure bandwidth work, so the figure is GB/s from bytes read + written and the roofline is the HBM
ceiling. Sizes are large enough that the working set dwarfs L2 (H200: 50 MiB): 1 GiB per tensor,
256 MiB with --quick (still ~5x L2, while the run stays short). On a CPU machine the kernels run
their torch reference (docs/design.md, "Dispatch"), at 4 MiB so the whole suite takes seconds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from warpforge.bench.suite import Case, Suite
from warpforge.kernels import memory as wf_memory
from warpforge.kernels.tolerance import tolerance

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MiB = 1 << 20
OPS = ("copy", "fill", "sum")


def _torch_copy(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(src)


def _torch_fill(out: torch.Tensor, value: float) -> torch.Tensor:
    return out.fill_(value)


def _torch_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dtype=torch.float32)


def _ours_copy(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return wf_memory.copy(src, out=out)


def _ours_fill(out: torch.Tensor, value: float) -> torch.Tensor:
    wf_memory.fill(out, value)
    return out


def _ours_sum(x: torch.Tensor) -> torch.Tensor:
    return wf_memory.sum(x)


def _peers(eager: Callable, with_compile: bool) -> dict[str, Callable]:
    peers: dict[str, Callable] = {"torch": eager}
    if with_compile:
        # Compiled lazily on the first (untimed, checked) call; if inductor cannot build here the
        # peer raises there and is recorded as an error instead of stopping the suite.
        peers["torch.compile"] = torch.compile(eager)
    return peers


def _size_label(nbytes: int) -> str:
    return f"{nbytes // (1 << 30)}GiB" if nbytes % (1 << 30) == 0 else f"{nbytes // MiB}MiB"


def _cases_for(short: str, dtype: torch.dtype, nbytes: int, with_compile: bool) -> list[Case]:
    size = dtype.itemsize
    n = nbytes // size
    label = f"{short} {_size_label(nbytes)}"
    base = {"dtype": str(dtype).removeprefix("torch."), "numel": n, "bytes_per_tensor": n * size}

    def copy_inputs(gen: torch.Generator, device: torch.device) -> tuple:
        src = torch.randn(n, generator=gen, device=device).to(dtype)  # [n]
        out = torch.full((n,), float("nan"), dtype=dtype, device=device)  # poison: unwritten shows
        return src, out

    def fill_inputs(gen: torch.Generator, device: torch.device) -> tuple:
        out = torch.full((n,), float("nan"), dtype=dtype, device=device)
        # 1 + k/32 is exact in bf16 and fp32, so the float64 reference needs no rounding model.
        k = int(torch.randint(1, 64, (1,), generator=gen, device=device).item())
        return out, 1.0 + k / 32

    def sum_inputs(gen: torch.Generator, device: torch.device) -> tuple:
        # Positive values: no cancellation, so the relative error measures accumulation, not luck.
        x = (torch.rand(n, generator=gen, device=device) + 0.5).to(dtype)  # [n]
        return (x,)

    return [
        Case(name=f"copy {label}", params={"op": "copy", **base}, make_inputs=copy_inputs,
             ours=_ours_copy, peers=_peers(_torch_copy, with_compile),
             reference=lambda src, out: src.to(torch.float64),
             flops=0, bytes=2 * n * size, dtype=dtype, metric="GBps",
             tol=0.0),  # a copy does no arithmetic: any difference is a bug
        Case(name=f"fill {label}", params={"op": "fill", **base}, make_inputs=fill_inputs,
             ours=_ours_fill, peers=_peers(_torch_fill, with_compile),
             reference=lambda out, v: torch.full(out.shape, v, dtype=torch.float64, device=out.device),
             flops=0, bytes=n * size, dtype=dtype, metric="GBps",
             tol=0.0),  # the value is exact in dtype: every element must equal it
        Case(name=f"sum {label}", params={"op": "sum", **base}, make_inputs=sum_inputs,
             ours=_ours_sum, peers=_peers(_torch_sum, with_compile),
             reference=lambda x: x.to(torch.float64).sum(),
             flops=n, bytes=n * size + 4, dtype=dtype, metric="GBps",
             # Accumulates in fp32 whatever the input dtype (bf16 inputs are exact in the reference).
             tol=tolerance(torch.float32)),
    ]


def _cases(quick: bool) -> list[Case]:
    gpu = torch.cuda.is_available()
    nbytes = (256 * MiB if quick else 1 << 30) if gpu else 4 * MiB
    cases = [c for short, dtype in DTYPES.items() for c in _cases_for(short, dtype, nbytes, with_compile=gpu)]
    return sorted(cases, key=lambda c: OPS.index(c.params["op"]))  # stable: fp32 before bf16 per op


SUITE = Suite(
    name="memory",
    description="copy, fill and sum (fp32, bf16) at sizes far beyond L2: GB/s against the HBM roofline",
    cases=_cases,
)
