"""Which kernels one call would launch on CUDA, counted on any machine (a CPU one included).

    with record_launches() as log:
        model(x)
    print(log.table())          # one row per launch: Triton kernel (with its constexprs) or torch op
    log.summary()               # {"triton": 57, "torch": 4, "by_name": {...}, "bytes": ...}

Why: on CPU tensors warpforge's kernels run their torch references, so a CPU run says nothing about
how many kernels the CUDA path launches between two layers, and at batch 32 each extra kernel costs
a launch slot in the CUDA graph and a full activation round trip through HBM. Inside this block the
kernels take their Triton path (``force_triton``) and every ``kernel[grid](...)`` launch is recorded
instead of run (its outputs are left as allocated: values are garbage, shapes and dtypes are right,
which is all the launchers' control flow reads). Torch ops that would launch a CUDA kernel (not views,
not allocations) are recorded through a ``TorchDispatchMode``, wherever they are called from. The
tuner does not run (no GPU: the interpreter's fixed tiling), so a split-K tiling the GPU would pick
shows as one launch here; at batch 32 the conv tuner never allows split-K (conv_tuning._fits).

``bytes`` per launch is the size of every tensor argument, each counted once (inputs read once,
outputs written once): the compulsory HBM traffic, not a measurement.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from warpforge.kernels import force_triton
from warpforge.profile.flops import tensors_in

# Torch ops that launch no kernel: allocations without a fill, and metadata-only ops.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "alias", "_reshape_alias", "as_strided_", "set_", "resize_", "_local_scalar_dense", "is_same_size",
              "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}
# Constexpr arguments worth showing next to a Triton kernel's name (what distinguishes its variants).
_SHOWN = ("MODE", "INT_ACC", "QUANT_OUT", "X_ZERO", "OUT_ZERO", "HAS_RES", "ACT", "SPLIT_K", "ZERO", "DUAL_OUT",
          "KH", "KW")


@dataclass
class Launch:
    kind: str  # "triton" | "torch"
    name: str  # kernel function name, or the aten op
    detail: str  # constexprs / dtypes and shapes
    bytes: int  # every tensor argument's size, each once


@dataclass
class LaunchLog:
    launches: list[Launch] = field(default_factory=list)

    def count(self, kind: str | None = None) -> int:
        return sum(1 for x in self.launches if kind is None or x.kind == kind)

    def by_name(self) -> dict[str, int]:
        return dict(Counter(f"{x.kind}:{x.name}" for x in self.launches))

    def summary(self) -> dict:
        return {"total": self.count(), "triton": self.count("triton"), "torch": self.count("torch"),
                "by_name": self.by_name(), "bytes": sum(x.bytes for x in self.launches)}

    def table(self) -> str:
        rows = [f"{i:4d} {x.kind:6s} {x.name:34s} {x.bytes / 2**20:9.2f} MiB  {x.detail}"
                for i, x in enumerate(self.launches)]
        s = self.summary()
        rows.append(f"total {s['total']} launches ({s['triton']} Triton, {s['torch']} torch), "
                    f"{s['bytes'] / 2**20:.1f} MiB of tensor arguments")
        return "\n".join(rows)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape)) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


class _TorchOps(TorchDispatchMode):
    def __init__(self, log: LaunchLog) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_KERNEL:
            return out
        if name in ("_to_copy", "to") and all(isinstance(a, torch.Tensor) for a in args[:1]):
            src = args[0]
            dst = out if isinstance(out, torch.Tensor) else None
            if dst is not None and dst.dtype == src.dtype and dst.device == src.device and dst.stride() == src.stride():
                return out
        ins = tensors_in(args) + tensors_in(kwargs)
        outs = tensors_in(out)
        detail = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in ins[:3])
        self.log.launches.append(Launch("torch", name, detail, _nbytes(ins + outs)))
        return out


@contextlib.contextmanager
def record_launches() -> Iterator[LaunchLog]:
    """Record (and skip) every Triton launch and every kernel-launching torch op inside the block."""
    from triton.runtime import interpreter, jit

    log = LaunchLog()
    originals = []

    def fake_run(self, *args, grid, warmup=False, **kwargs):
        fn = getattr(self, "fn", None)
        name = getattr(fn, "__name__", None) or getattr(self, "__name__", "kernel")
        shown = ", ".join(f"{k}={kwargs[k]}" for k in _SHOWN if k in kwargs)
        ts = tensors_in(list(args)) + tensors_in(kwargs)
        dtypes = "/".join(dict.fromkeys(str(t.dtype).removeprefix("torch.") for t in ts))
        log.launches.append(Launch("triton", name, f"{shown} [{dtypes}]", _nbytes(ts)))
        return None

    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        originals.append((cls, cls.run))
        cls.run = fake_run
    try:
        with force_triton(), _TorchOps(log), torch.no_grad():
            yield log
    finally:
        for cls, run in originals:
            cls.run = run


__all__ = ["Launch", "LaunchLog", "record_launches"]
