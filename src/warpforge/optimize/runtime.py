"""What wraps a chosen model at run time: precision casts at its boundary and CUDA-graph replay (a graph per
input shape: :class:`GraphBuckets`).

Every candidate takes the inputs the user's model takes and returns floating outputs in fp32 (the
reference's dtype), whatever it computes in, so candidates are interchangeable and the gate compares
like with like. :class:`CastIO` is an ``nn.Module`` so it is part of what gets exported or pickled.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from warpforge.timing import own_cublas_workspace


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """fp32 without TF32 for matmuls and cuDNN convolutions (TF32 is cuDNN's default on Ampere and later:
    a 10-bit mantissa, the same as fp16's, would blur a reference 16-bit candidates are judged against)."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, x)


def raw_inputs(module: nn.Module) -> tuple[int, ...]:
    """The positional inputs a graph takes as the caller gives them (passes/image_input.py). The pass writes
    them twice because neither copy survives everything: a GraphModule's attributes survive pickling but not
    ``copy.deepcopy`` (it keeps only what the graph references), its ``meta`` the reverse."""
    meta = getattr(module, "meta", None)
    return tuple(getattr(module, "raw_inputs", None) or (meta.get("raw_inputs", ()) if isinstance(meta, dict) else ()))


class CastIO(nn.Module):
    """``inner`` computing in ``dtype``: floating inputs cast to it on entry, floating outputs to
    ``out_dtype`` on exit (no-ops when the dtypes already match). The positional inputs that ``inner`` takes
    as given (:func:`raw_inputs`; passes/image_input.py: an image a space-to-depth stem reads and casts
    itself) go in uncast; CastIO keeps their positions itself, so copies and pickles of it keep them too."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype, out_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inner = inner
        self.dtype = dtype
        self.out_dtype = out_dtype
        self.raw_inputs = raw_inputs(inner)

    def forward(self, *args: Any) -> Any:
        raw = getattr(self, "raw_inputs", ())  # absent in a CastIO pickled before the field existed
        cast = tuple(a if i in raw else _cast_floats(a, self.dtype) for i, a in enumerate(args)) if raw else \
            _cast_floats(args, self.dtype)
        return _cast_floats(self.inner(*cast), self.out_dtype)

    def extra_repr(self) -> str:
        return f"compute={self.dtype}, outputs={self.out_dtype}"


def dynamic_batch_shapes(module: nn.Module, inputs: tuple) -> tuple:
    """torch.export's ``dynamic_shapes`` leaving the leading (batch) dim of each tensor input to export
    (``Dim.AUTO``: symbolic unless the model fixes it; a batch of 1 always specializes). A ``forward(*args)``
    (e.g. CastIO's) is one tuple argument to export, so its specs are nested one level."""
    specs = tuple({0: torch.export.Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() >= 1 else None for x in inputs)
    params = list(inspect.signature(module.forward).parameters.values())
    return (specs,) if params and params[0].kind is inspect.Parameter.VAR_POSITIONAL else specs


def static_cuda_inputs(inputs: tuple) -> bool:
    """True when every input is a CUDA tensor (what a CUDA graph can be fed through copies)."""
    return bool(inputs) and all(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs)


class CudaGraphed:
    """``fn`` captured in a CUDA graph for inputs shaped like ``example_inputs``; replayed per call.

    A call copies its inputs into the graph's static buffers, replays, and returns a *copy* of the
    static outputs (the next replay overwrites them; returning them would hand out tensors that change
    under the caller). Inputs of another shape, dtype or device run ``fn`` directly, uncaptured.
    """

    def __init__(self, fn: Callable[..., Any], example_inputs: tuple, warmup: int = 3) -> None:
        if not static_cuda_inputs(example_inputs):
            raise ValueError("CudaGraphed needs example_inputs that are all CUDA tensors")
        self.fn = fn
        self.static_in = tuple(x.clone() for x in example_inputs)
        self.keys = [(x.shape, x.dtype, x.device) for x in example_inputs]
        dev = example_inputs[0].device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(warmup):  # autotuning, lazy loads and workspace allocation happen here, uncaptured
                fn(*self.static_in)
        torch.cuda.current_stream(dev).wait_stream(side)
        torch.cuda.synchronize(dev)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.no_grad(), own_cublas_workspace(), torch.cuda.graph(self.graph):
                self.static_out = fn(*self.static_in)
        except Exception as e:
            raise RuntimeError(f"CUDA-graph capture failed ({type(e).__name__}: {e}); the model must not "
                               "synchronize with the host (.item(), .cpu(), data-dependent shapes)") from e
        torch.cuda.synchronize(dev)

    def __call__(self, *args: Any) -> Any:
        if len(args) != len(self.keys) or any(not isinstance(a, torch.Tensor) or (a.shape, a.dtype, a.device) != k
                                              for a, k in zip(args, self.keys)):
            return self.fn(*args)
        for dst, src in zip(self.static_in, args):
            dst.copy_(src)
        self.graph.replay()
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.static_out)


def _shape_key(args: tuple) -> tuple:
    return tuple((tuple(a.shape), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a).__name__,)
                 for a in args)


class GraphBuckets:
    """One CUDA graph per input shape (a bucket is an exact shape: a graph replays fixed sizes), so a model with
    a free batch or declared dynamic dims (optimize.shapes) replays graphs at every size it is called with.

    The example inputs' graph is captured here (a failure raises, as :class:`CudaGraphed`'s does) and kept;
    another shape's graph is captured on its first call (warm-up and capture: that call is slow) and the least
    recently used of those is dropped past ``max_graphs`` (each graph holds its own activation memory). A shape
    whose capture fails runs uncaptured from then on (``failed`` says why). ``capture`` and ``capturable``
    make the bucketing testable without a GPU."""

    def __init__(self, fn: Callable[..., Any], example_inputs: tuple, max_graphs: int = 8,
                 capture: Callable[[Callable[..., Any], tuple], Callable[..., Any]] | None = None,
                 capturable: Callable[[tuple], bool] = static_cuda_inputs) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.fn = fn
        self.max_graphs = max_graphs
        self.capture = capture or (lambda f, args: CudaGraphed(f, args))
        self.capturable = capturable
        self.failed: dict[tuple, str] = {}
        self.pinned = _shape_key(example_inputs)
        self.graphs: OrderedDict[tuple, Callable[..., Any]] = OrderedDict()
        self.graphs[self.pinned] = self.capture(fn, example_inputs)

    def shapes(self) -> list[list[list[int]]]:
        """The input shapes with a graph, most recently used last."""
        return [[list(k[0]) for k in key if len(k) == 3] for key in self.graphs]

    def __call__(self, *args: Any) -> Any:
        key = _shape_key(args)
        graph = self.graphs.get(key)
        if graph is not None:
            self.graphs.move_to_end(key)
            return graph(*args)
        if key in self.failed or not self.capturable(args):
            return self.fn(*args)
        try:
            graph = self.capture(self.fn, args)
        except RuntimeError as e:
            self.failed[key] = str(e)
            return self.fn(*args)
        self.graphs[key] = graph
        while len(self.graphs) > self.max_graphs:
            oldest = next(k for k in self.graphs if k != self.pinned)
            del self.graphs[oldest]
        return graph(*args)


__all__ = ["CastIO", "CudaGraphed", "GraphBuckets", "dynamic_batch_shapes", "static_cuda_inputs"]
