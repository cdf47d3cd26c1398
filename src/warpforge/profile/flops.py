"""FLOPs and bytes per operator, counted by a TorchDispatchMode over one call of the model.

Every aten operator that reaches the dispatcher is filed under the running module (``scope.py``)
with its FLOPs, the bytes it must move (inputs read + outputs written at their dtypes) and the
precision whose compute ceiling applies. Triton kernels launched straight from Python (warpforge's
own kernels) never reach the dispatcher: while counting, their launches are recorded too, with the
bytes of their tensor arguments. Formulas (``formulas.py``) follow ``torch.utils.flop_counter`` for
matmul, convolution and attention, so totals agree with it where both count.

Conventions:
* views, reshapes and allocations (``empty``) move nothing: not recorded;
* bytes count what a single fused kernel must touch: a broadcast (stride-0) input is read once,
  an argument passed twice is read once, ``copy_``/``fill_`` do not read their destination,
  gathers (embedding, index_select) read the gathered rows, not the whole table;
* an operator with no formula counts 0 FLOPs, still counts its bytes, and is listed in ``uncounted``.

``count(..., kernels=True)`` on a GPU also runs the counted call under the profiler, each operator call in
a range of its own, and keeps which kernels every counted operator launched (``Counts.kernels``): that is
how kernels replayed from a CUDA graph are matched to the eager operators that were captured.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from warpforge.profile import formulas as F

# Operators whose first argument is only written (reading it would double its bytes).
WRITE_ONLY_SELF = frozenset({"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_",
                             "exponential_", "geometric_", "log_normal_", "cauchy_"})
# Allocation without a write: no bytes until something fills it.
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                         "empty_permuted", "resize_", "set_", "lift_fresh", "alias", "detach", "detach_"})
# Gathers read the rows they return, not the whole source tensor.
GATHERS = frozenset({"embedding", "index_select", "gather", "take", "index"})
TRITON_PREFIX = "triton::"


@dataclass(frozen=True)
class OpCount:
    """One operator call of the counted pass."""

    module: str  # module path ("" = root)
    op: str  # "aten::addmm", or "triton::<jit function>" for a Triton launch
    kind: str  # one of formulas.KINDS, "triton" or "unknown"
    flops: int
    bytes: int
    ceiling: str | None  # precision key of the compute roof (hw.roofline); None: no ceiling (float64)
    shapes: str  # input shapes, e.g. "[8, 64] x [64, 128]"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Counts:
    """Everything one counted call did, in call order."""

    records: list[OpCount] = field(default_factory=list)
    uncounted: Counter[str] = field(default_factory=Counter)  # op -> calls with no FLOP formula
    module_calls: Counter[str] = field(default_factory=Counter)  # module path -> forward calls
    error: str | None = None  # why counting stopped early (the model still ran)
    # record index -> names of the device work it launched, in order; None when the call was not traced
    # (then only Triton records name their kernel: the jit function's name).
    kernels: dict[int, list[str]] | None = None

    def kernels_of(self, i: int) -> list[str]:
        """Kernel names record ``i`` launched: from the traced call, else a Triton record's own name."""
        if self.kernels is not None:
            return self.kernels.get(i, [])
        op = self.records[i].op
        return [op[len(TRITON_PREFIX):]] if op.startswith(TRITON_PREFIX) else []

    @property
    def flops(self) -> int:
        return sum(r.flops for r in self.records)

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.records)


# ---- bytes -------------------------------------------------------------------------------------------

def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches to read or write ``t`` once: broadcast (stride-0) dims count once."""
    if t.numel() == 0:
        return 0
    try:
        n = 1
        for size, stride in zip(t.shape, t.stride()):
            if stride != 0:
                n *= size
    except (RuntimeError, NotImplementedError):  # sparse or nested layouts have no strides
        n = t.numel()
    return n * t.element_size()


def _key(t: torch.Tensor) -> tuple:
    try:
        ptr = t.data_ptr()
    except (RuntimeError, NotImplementedError):
        ptr = id(t)
    return ptr, tuple(t.shape), tuple(t.stride()) if t.layout == torch.strided else (), t.dtype


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def tensors_in(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x``: nested tuples, lists and dicts (any pytree), in order; other leaves are dropped."""
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _write_only_args(func, args: tuple, kwargs: dict) -> set[int]:
    """ids of arguments only written: ``out=`` tensors, and self of copy_/fill_/... ."""
    ids: set[int] = set()
    for a in func._schema.arguments:
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write and a.name in kwargs:
            ids.update(id(t) for t in tensors_in(kwargs[a.name]))
    if func.overloadpacket.__name__ in WRITE_ONLY_SELF and args and isinstance(args[0], torch.Tensor):
        ids.add(id(args[0]))
    return ids


def op_bytes(func, args: tuple, kwargs: dict, out: Any) -> int:
    """Inputs read + outputs written, each distinct tensor once (see the module docstring)."""
    name = func.overloadpacket.__name__
    outs = tensors_in(out)
    if name in GATHERS:
        idx = [t for t in tensors_in((args, kwargs)) if not t.is_floating_point()]
        return sum(tensor_bytes(t) for t in idx) + 2 * sum(tensor_bytes(t) for t in outs)
    skip = _write_only_args(func, args, kwargs)
    seen: set[tuple] = set()
    total = 0
    for t in tensors_in((args, kwargs)):
        k = _key(t)
        if id(t) in skip or k in seen:
            continue
        seen.add(k)
        total += tensor_bytes(t)
    written: set[tuple] = set()
    for t in outs:
        k = _key(t)
        if k not in written:
            written.add(k)
            total += tensor_bytes(t)
    return total


def _is_view(func, args: tuple, kwargs: dict, out: Any) -> bool:
    """A view, or a non-mutating op whose outputs all share an input's storage (``to`` with the same
    dtype, ``contiguous`` of a contiguous tensor, ``_unsafe_view``): no data moves."""
    if func.is_view:
        outs = tensors_in(out)
        ins = {_storage_ptr(t) for t in tensors_in((args, kwargs))}
        # `to`/`contiguous` are flagged as views but copy when they must: check the storage.
        return all(_storage_ptr(t) in ins for t in outs)
    if func._schema.is_mutable:
        return False
    outs = tensors_in(out)
    if not outs:
        return False
    ins = {_storage_ptr(t) for t in tensors_in((args, kwargs))}
    ins.discard(None)
    return all(_storage_ptr(t) in ins for t in outs)


def _shapes(args: tuple, kwargs: dict) -> str:
    return " x ".join(str(list(t.shape)) for t in tensors_in((args, kwargs))[:4])


# ---- the counter -------------------------------------------------------------------------------------

class FlopCounter(TorchDispatchMode):
    """Records an :class:`OpCount` for every operator run under it; ``scope()`` names the module."""

    def __init__(self, scope: Callable[[], str] = lambda: "", *, mark: bool = False):
        super().__init__()
        self.scope = scope
        self.counts = Counts()
        self.mark = mark  # wrap every operator call in a profiler range "warpforge:count#<call>"
        self.calls = 0  # operator calls (and Triton launches) seen
        self.call_of: list[int] = []  # per record: the call that made it (ranges are named by call)

    def range(self, call: int):
        """The profiler range of operator call ``call`` (a no-op context unless marking)."""
        if not self.mark:
            return contextlib.nullcontext()
        from warpforge.profile.events import COUNT_PREFIX
        from warpforge.profile.scope import fast_range

        return fast_range(f"{COUNT_PREFIX}{call}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls += 1
        call = self.calls
        with self.range(call):
            out = func(*args, **kwargs)
        try:
            self._record(func, args, kwargs, out, call)
        except Exception as e:  # a formula must never break the model's run; say which op failed
            self.counts.uncounted[f"{func._schema.name} (formula error: {type(e).__name__})"] += 1
        return out

    def _append(self, rec: OpCount, call: int) -> None:
        self.counts.records.append(rec)
        self.call_of.append(call)

    def _record(self, func, args: tuple, kwargs: dict, out: Any, call: int = 0) -> None:
        name = func.overloadpacket.__name__
        if name in ALLOCATIONS or _is_view(func, args, kwargs, out):
            return
        flops, kind = F.flops(func, args, kwargs, out)
        if kind == "unknown":
            self.counts.uncounted[func._schema.name] += 1
        self._append(OpCount(
            module=self.scope(), op=func._schema.name, kind=kind, flops=int(flops),
            bytes=op_bytes(func, args, kwargs, out), ceiling=F.ceiling_key(kind, args, kwargs),
            shapes=_shapes(args, kwargs)), call)

    def record_triton(self, name: str, bound: dict[str, Any], metadata: dict | None) -> int:
        """One Triton launch: ``bound`` maps the jit function's argument names to the values passed.
        Returns the call number (the launch itself runs inside :meth:`range` of it)."""
        self.calls += 1
        ts = [t for t in tree_flatten(list(bound.values()))[0] if isinstance(t, torch.Tensor)]
        seen: set[tuple] = set()
        nbytes = 0
        for t in ts:
            if _key(t) not in seen:
                seen.add(_key(t))
                nbytes += tensor_bytes(t)
        md = metadata or {}
        flops = sum(int(md.get(k, 0)) for k in ("flops", "flops8", "flops16", "flops32", "flops64"))
        kind = "triton"
        if not flops:
            flops, kind = triton_gemm_flops(name, bound)
        nbytes = int(md.get("bytes", nbytes))
        fp = next((t for t in ts if t.is_floating_point()), None)
        ceiling = F.dtype_ceiling(fp.dtype, tensor_core=flops > 0, kind=kind) if fp is not None else "fp32"
        precision = bound.get("DOT_PRECISION")  # warpforge kernels say how fp32 dots run: "ieee" or "tf32"
        if fp is not None and fp.dtype == torch.float32 and flops > 0 and isinstance(precision, str):
            ceiling = "fp32" if precision == "ieee" else "tf32"
        self._append(OpCount(
            module=self.scope(), op=f"{TRITON_PREFIX}{name}", kind=kind, flops=flops, bytes=nbytes, ceiling=ceiling,
            shapes=_shapes(tuple(ts), {})), self.calls)
        return self.calls


def triton_gemm_flops(name: str, bound: dict[str, Any]) -> tuple[int, str]:
    """FLOPs of a Triton launch from the GEMM argument convention, when it follows it:
    integer ``M, N, K`` -> 2*M*N*K (a matmul/linear/GEMV kernel); a ``conv`` kernel with integer ``M``
    (output pixels), ``COUT``, ``CIN_G``, ``KH``, ``KW`` -> 2*M*COUT*CIN_G*KH*KW. Otherwise 0 ("triton")."""
    def ints(*keys: str) -> list[int] | None:
        vals = [bound.get(k) for k in keys]
        ok = all(isinstance(v, int) and not isinstance(v, bool) for v in vals)
        return [int(v) for v in vals] if ok else None

    conv = ints("M", "COUT", "CIN_G", "KH", "KW") if "conv" in name else None
    if conv:
        return 2 * conv[0] * conv[1] * conv[2] * conv[3] * conv[4], "conv"
    mnk = ints("M", "N", "K")
    if mnk:
        return 2 * mnk[0] * mnk[1] * mnk[2], "matmul"
    return 0, "triton"


@contextlib.contextmanager
def triton_launches(counter: FlopCounter) -> Iterator[None]:
    """While active, every Triton kernel launched through ``kernel[grid](...)`` is recorded in
    ``counter``: the jit function's name; the bytes of its tensor arguments (an upper bound for a kernel
    that touches part of a buffer, such as a paged KV cache); FLOPs from the kernel's
    ``launch_metadata`` when it declares one (as Triton's proton profiler reads them), else from the
    GEMM argument convention (:func:`triton_gemm_flops`)."""
    try:
        from triton.runtime import jit as tjit
    except ImportError:  # no Triton: nothing to record
        yield
        return
    classes = [tjit.JITFunction]
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    originals = {c: c.run for c in classes}

    def wrap(orig):
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup:
                fn = getattr(self, "fn", None)
                name = getattr(self, "__name__", None) or getattr(fn, "__name__", "triton_kernel")
                bound = {**dict(zip(getattr(self, "arg_names", []), args)), **kwargs}
                md = None
                lm = getattr(self, "launch_metadata", None)
                if callable(lm):
                    with contextlib.suppress(Exception):
                        md = lm(grid, None, bound)
                call = counter.record_triton(name, bound, md if isinstance(md, dict) else None)
                with counter.range(call):
                    return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
            return orig(self, *args, grid=grid, warmup=warmup, **kwargs)
        return run

    for c, orig in originals.items():
        c.run = wrap(orig)
    try:
        yield
    finally:
        for c, orig in originals.items():
            c.run = orig


def count(fn: Callable[..., Any], *inputs: Any, module: torch.nn.Module | None = None,
          grad: bool = False, kernels: bool = False) -> Counts:
    """Run ``fn(*inputs)`` once and count every operator (and Triton launch) it runs.

    ``module`` (default: ``fn`` when it is a Module) gets forward hooks so operators are filed
    under module paths. ``kernels``: on a GPU, also trace the call and keep the kernels each counted
    operator launched (``Counts.kernels``). A failure inside the model propagates; it is the caller's.
    """
    from warpforge.profile.scope import ModuleScope

    if module is None and isinstance(fn, torch.nn.Module):
        module = fn
    scope = ModuleScope(module) if module is not None else None
    traced = kernels and torch.cuda.is_available()
    counter = FlopCounter(scope.current if scope is not None else (lambda: ""), mark=traced)
    grad_ctx = contextlib.nullcontext() if grad else torch.inference_mode()
    prof = None
    with contextlib.ExitStack() as stack:
        if traced:
            from torch.profiler import ProfilerActivity, profile

            from warpforge.profile.trace import profiler_options

            prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                               **profiler_options()))
        if scope is not None:
            stack.enter_context(scope)
        stack.enter_context(grad_ctx)
        stack.enter_context(triton_launches(counter))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the mode's presence triggers advisory warnings in some ops
            with counter:
                fn(*inputs)
        if scope is not None:
            counter.counts.module_calls.update(scope.calls)
        if traced:
            torch.cuda.synchronize()  # every kernel of the call has run before the trace stops
    if prof is not None:
        from warpforge.profile.events import parse_kineto
        from warpforge.profile.trace import export_trace

        counter.counts.kernels = kernels_by_record(parse_kineto(export_trace(prof), device_type="cuda"),
                                                   counter.call_of)
    return counter.counts


def kernels_by_record(trace, call_of: list[int]) -> dict[int, list[str]]:
    """Record index -> device work its operator call launched (``call_of``: each record's call number,
    the ``n`` of its ``warpforge:count#n`` range in ``trace``)."""
    from warpforge.profile.events import work_in_ranges

    by_call = work_in_ranges(trace)
    return {i: by_call[c] for i, c in enumerate(call_of) if c in by_call}
