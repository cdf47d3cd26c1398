"""Profile a whole training step: loader wait, host-to-device copies, forward, backward, optimizer,
collectives (overlapped and exposed), and what no phase covers.

``profile_train(setup)`` runs warm-up steps, then plain steps (nothing recorded: the reference step time
and the profiler's overhead), instrumented steps (spans per phase), one memory step (tensor sizes, saved
activations) and one layer step (each parametrised layer's forward time beside its FLOPs). On CPU every
span is a host timer; on a GPU each boundary also records a CUDA event, phase times are event
deltas, and a traced window splits NCCL kernels into overlapped with compute and exposed.

A factory hands over a :class:`TrainSetup` (or a tuple ``(model, optimizer, loader, loss_fn)``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from warpforge.profile.flops import tensors_in
from warpforge.profile.train_breakdown import StepRecord


@dataclass
class TrainSetup:
    """What ``warpforge profile --train`` profiles; a factory returns one (or ``(model, optimizer, loader,
    loss_fn)``, which becomes one).

    Either ``model``, ``optimizer`` and ``loss_fn`` (warpforge runs ``loss_fn(model(*batch[:-1]),
    batch[-1])``, ``backward``, ``optimizer.step()``, ``zero_grad``), or ``step``: ``step(batch)`` runs one
    whole step itself; give ``model`` and ``optimizer`` beside it to have forward, parameters and optimizer
    state named. Each batch from ``loader`` is moved to ``device`` (tensors in tuples, lists and dicts)
    before the step sees it, so the copy is timed as its own phase.
    """

    loader: Iterable[Any]
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    loss_fn: Callable[..., torch.Tensor] | None = None
    step: Callable[[Any], Any] | None = None
    device: torch.device | str | None = None  # default: the model's device, else cpu
    name: str = "train"

    def __post_init__(self) -> None:
        if not isinstance(self.loader, Iterable):
            raise ValueError(f"TrainSetup.loader must be iterable (a DataLoader), got {type(self.loader).__name__}")
        if self.step is None:
            missing = [k for k in ("model", "optimizer", "loss_fn") if getattr(self, k) is None]
            if missing:
                raise ValueError(f"TrainSetup needs step=callable, or model, optimizer and loss_fn "
                                 f"(missing: {', '.join(missing)})")
        elif not callable(self.step):
            raise ValueError(f"TrainSetup.step must be callable, got {type(self.step).__name__}")
        if self.model is not None and not isinstance(self.model, nn.Module):
            raise ValueError(f"TrainSetup.model must be a torch.nn.Module, got {type(self.model).__name__}")
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ValueError(f"TrainSetup.optimizer must be a torch.optim.Optimizer, got "
                             f"{type(self.optimizer).__name__}")
        if self.device is None:
            p = next(self.model.parameters(), None) if self.model is not None else None
            self.device = p.device if p is not None else torch.device("cpu")
        self.device = torch.device(self.device)

    @classmethod
    def from_factory_result(cls, obj: Any, name: str = "train") -> TrainSetup:
        if isinstance(obj, TrainSetup):
            return obj
        if isinstance(obj, tuple) and len(obj) == 4:
            model, optimizer, loader, loss_fn = obj
            return cls(loader=loader, model=model, optimizer=optimizer, loss_fn=loss_fn, name=name)
        raise ValueError(f"the factory returned {type(obj).__name__}; expected a TrainSetup or a tuple "
                         "(model, optimizer, loader, loss_fn)")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 10  # instrumented steps
    warmup: int = 3
    plain: int | None = None  # un-instrumented reference steps (default: = steps)
    trace_comm: bool = True  # on a GPU with collectives, trace a window to split NCCL time

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.plain is not None and self.plain < 0:
            raise ValueError(f"plain steps must be >= 0, got {self.plain}")


def to_device(x: Any, device: torch.device) -> Any:
    """Tensors in ``x`` (nested tuples, lists, dicts) on ``device``; pinned ones copied asynchronously."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=x.is_pinned()) if x.device != device else x
    if isinstance(x, (list, tuple)):
        moved = [to_device(v, device) for v in x]
        return type(x)(moved) if isinstance(x, list) or not hasattr(x, "_fields") else type(x)(*moved)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def storage_of(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the storage this rank holds for ``t``: a sharded tensor (FSDP's DTensor
    parameters, their gradients and optimizer state) gives its local shard; None for an empty tensor or one
    whose storage is not materialized (FSDP frees unsharded parameters between uses)."""
    if hasattr(t, "to_local"):
        t = t.to_local()
    if not t.numel():
        return None
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except RuntimeError:
        return None


def nbytes(ts: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``ts`` (see storage_of)."""
    seen: dict[int, int] = {}
    for t in ts:
        s = storage_of(t)
        if s is not None:
            seen.setdefault(*s)
    return sum(seen.values())


class Clock:
    """Marks on one timeline: host ns on CPU; CUDA events on a GPU (resolved to ms after the step syncs)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter_ns()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def resolve(self, first: Any, m: Any) -> float:
        return first.elapsed_time(m) if self.cuda else float(m - first)

    @property
    def unit_ms(self) -> float:
        return 1.0 if self.cuda else 1e-6


class Recorder:
    """Collects one step's spans; the hooks below (backward, optimizer, collectives, DDP buckets) call it."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.active = False
        self._open: list[tuple[str, Any]] = []
        self.marks: list[tuple[str, str, Any, Any, int]] = []  # (kind, name, m0, m1, bytes)
        self.async_host: list[tuple[str, int, int, int]] = []  # host-ns (op, issued, landed, bytes)
        self.activation_bytes: int | None = None
        self.on_backward: Callable[[], None] | None = None

    def begin(self) -> None:
        self.active, self._open, self.marks, self.async_host = True, [], [], []
        self.first = self.clock.mark()

    @contextlib.contextmanager
    def span(self, name: str, kind: str = "phase", nbytes_: int = 0) -> Iterator[None]:
        if not self.active or (kind == "phase" and any(k == "phase" for k, _ in self._open)):
            yield  # a phase inside a phase (the step form's hooks inside warpforge's own spans) counts once
            return
        m0 = self.clock.mark()
        self._open.append((kind, name))
        try:
            yield
        finally:
            self._open.pop()
            self.marks.append((kind, name, m0, self.clock.mark(), nbytes_))

    def finish(self) -> StepRecord:
        end = self.clock.mark()
        self.clock.sync()
        self.active = False
        r = self.clock.resolve
        rec = StepRecord(start=0.0, end=r(self.first, end), unit_ms=self.clock.unit_ms)
        for kind, name, m0, m1, n in self.marks:
            if kind == "phase":
                rec.phases.append((name, r(self.first, m0), r(self.first, m1)))
            else:
                rec.sync_comm.append((name, r(self.first, m0), r(self.first, m1), n))
        rec.phases.sort(key=lambda p: p[1])
        if not self.clock.cuda:  # host-clock async spans; on a GPU the traced window splits device comm
            rec.async_comm = [(op, a - self.first, b - self.first, n) for op, a, b, n in self.async_host]
        return rec


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "all_to_all_single", "reduce")


@contextlib.contextmanager
def instrumented(rec: Recorder, setup: TrainSetup) -> Iterator[None]:
    """Hooks that file a step's work under phases while ``rec.active``: backward (torch.autograd.backward),
    optimizer steps (torch.optim's global step hooks), the model's forward, and torch.distributed
    collectives called from Python (synchronous ones are exposed; asynchronous ones until they land)."""
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    stack = contextlib.ExitStack()
    orig_backward = torch.autograd.backward

    def backward(*a: Any, **k: Any) -> Any:
        if rec.on_backward is not None:
            rec.on_backward()
        with rec.span("backward"):
            return orig_backward(*a, **k)

    torch.autograd.backward = backward
    stack.callback(setattr, torch.autograd, "backward", orig_backward)
    opt_pre, opt_post = _span_hooks(rec, "optimizer")
    for h in (register_optimizer_step_pre_hook(opt_pre), register_optimizer_step_post_hook(opt_post)):
        stack.callback(h.remove)
    if setup.step is not None and setup.model is not None:
        fwd_pre, fwd_post = _span_hooks(rec, "forward")
        for h in (setup.model.register_forward_pre_hook(fwd_pre), setup.model.register_forward_hook(fwd_post)):
            stack.callback(h.remove)
    if dist.is_available():
        for op in COLLECTIVES:
            orig = getattr(dist, op, None)
            if orig is not None:
                setattr(dist, op, _wrap_collective(rec, op, orig))
                stack.callback(setattr, dist, op, orig)
    with stack:
        yield



def _span_hooks(rec: Recorder, name: str) -> tuple[Callable[..., None], Callable[..., None]]:
    """(pre, post) hooks that open a ``name`` span and close it, for the hook APIs that call one function before
    the work and another after (optimizer steps, module forwards) instead of wrapping it."""
    open_: list[contextlib.AbstractContextManager] = []

    def pre(*_a: Any) -> None:
        cm = rec.span(name)
        cm.__enter__()
        open_.append(cm)

    def post(*_a: Any) -> None:
        if open_:
            open_.pop().__exit__(None, None, None)

    return pre, post

def _wrap_collective(rec: Recorder, op: str, orig: Callable) -> Callable:
    def call(*a: Any, **k: Any) -> Any:
        if not rec.active or any(kind == "comm" for kind, _ in rec._open):  # one collective built on another
            return orig(*a, **k)
        n = nbytes(tensors_in(list(a[:2])))
        if k.get("async_op"):
            t0 = time.perf_counter_ns()
            work = orig(*a, **k)
            if work is not None and not rec.clock.cuda:
                work.get_future().then(lambda f: rec.async_host.append((op, t0, time.perf_counter_ns(), n)))
            return work
        with rec.span(op, kind="comm", nbytes_=n):
            return orig(*a, **k)

    call.__wrapped__ = orig  # type: ignore[attr-defined]
    return call


def ddp_comm_hook(rec: Recorder) -> Callable:
    """DDP's all-reduce of a gradient bucket (average), timed from hand-over to landing on the host clock."""
    import torch.distributed as dist

    all_reduce = getattr(dist.all_reduce, "__wrapped__", dist.all_reduce)

    def hook(state, bucket):  # unannotated: DDP checks annotations, and this module's are strings
        buf = bucket.buffer()
        world = dist.get_world_size(state) if state is not None else dist.get_world_size()
        t0 = time.perf_counter_ns()
        fut = all_reduce(buf.div_(world), group=state, async_op=True).get_future()

        def landed(f: torch.futures.Future) -> torch.Tensor:
            if rec.active:
                rec.async_host.append(("all_reduce (DDP bucket)", t0, time.perf_counter_ns(), buf.nbytes))
            v = f.value()
            return v[0] if isinstance(v, list) else v

        return fut.then(landed)

    return hook


class BatchStream:
    """Batches from a loader without end: a new epoch starts when one runs out (counted as loader wait)."""

    def __init__(self, loader: Iterable[Any]):
        self.loader = loader
        self.it = iter(loader)
        self.epochs = 0

    def next(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.epochs += 1
            self.it = iter(self.loader)
            try:
                return next(self.it)
            except StopIteration:
                raise ValueError("the loader yields no batches") from None


def run_step(setup: TrainSetup, stream: BatchStream, rec: Recorder, info: dict[str, Any]) -> None:
    """One training step; spans are recorded when ``rec`` is active."""
    with rec.span("data"):
        batch = stream.next()
    ts = tensors_in(batch)
    if ts and setup.device.type != "cpu":
        info["h2d_bytes"] = nbytes(t for t in ts if t.device.type == "cpu")
        info["pinned"] = all(t.is_pinned() for t in ts if t.device.type == "cpu")
    with rec.span("h2d"):
        batch = to_device(batch, setup.device)
    if setup.step is not None:
        setup.step(batch)
        return
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError("with model/optimizer/loss_fn each batch must be a tuple (inputs..., target); got "
                         f"{type(batch).__name__}" + (f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
    with rec.span("forward"):
        loss = setup.loss_fn(setup.model(*batch[:-1]), batch[-1])
    loss.backward()  # the backward hook times it
    with rec.span("optimizer"):
        setup.optimizer.step()
        setup.optimizer.zero_grad(set_to_none=True)
