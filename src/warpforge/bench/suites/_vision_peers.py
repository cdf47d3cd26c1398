"""The peers of suite ``vision``, each in its best documented configuration, and what they share.

Every peer takes the fp32 inputs ours takes and returns fp32 outputs (:class:`PeerIO`). The convnets'
peers (``CONVNETS``) run channels_last, weights and input, as PyTorch's performance guide recommends for
convolutions: cuDNN's fp16 kernels are NHWC, and an NCHW fp16 conv pays a layout transpose around it. The
input is cast and relaid in one copy at the boundary. torch.compile runs in reduce-overhead and in its
fastest mode, max-autotune (both replay CUDA graphs); the eager fp16 model also runs captured by hand in one
CUDA graph. Imports of warpforge.optimize stay inside functions (bench --list stays cheap).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

REFERENCE = "eager-fp32"
EAGER16 = "eager-fp16"
COMPILE = "torch.compile-reduce-overhead-fp16"
COMPILE_MAX = "torch.compile-max-autotune-fp16"  # inductor's autotuned kernels, in CUDA graphs (minutes to build)
GRAPH = "cuda-graph-eager-fp16"
# Convnets: their peers run channels_last (see the module docstring). ViT (one patch conv) and the planner
# (none) stay as written.
CONVNETS = frozenset({"mobilenet_v2", "resnet50", "bev_lss"})


def _clone(out: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


class PeerIO(nn.Module):
    """A peer's boundary: fp32 inputs cast to ``dtype`` on entry (4-D ones to channels_last in the same copy
    when ``channels_last``), floating outputs back to fp32: the peers take and return what ours does."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype, channels_last: bool) -> None:
        super().__init__()
        self.inner, self.dtype, self.channels_last = inner, dtype, channels_last

    def _in(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        if self.channels_last and x.dim() == 4:
            return x.to(dtype=self.dtype, memory_format=torch.channels_last)
        return x.to(self.dtype)

    def forward(self, *args: Any) -> Any:
        out = self.inner(*(self._in(a) for a in args))
        return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, out)

    def extra_repr(self) -> str:
        return f"compute={self.dtype}, channels_last={self.channels_last}"


class Shared:
    """What several candidates of one case reuse: the peers' copies of the model (fp32 and fp16: eager,
    compiled, graphed), each in its best documented layout. ``loaded``: the case's ``_vision_run.Loaded``.
    ``gate`` (kind, budget): ours is gated as ``warpforge optimize`` gates it (``_vision_run.build_ours``)."""

    def __init__(self, loaded: Any, precision: str = "fp16", gate: tuple[str, Any] | None = None,
                 channels_last: bool = False) -> None:
        self.loaded, self.precision, self.gate = loaded, precision, gate
        self.channels_last = channels_last
        self._half: nn.Module | None = None
        self._fp32: nn.Module | None = None
        self.dynamo_reset = False  # torch._dynamo.reset() once per case: a second reset drops the first compile

    def _peer_copy(self, dtype: torch.dtype) -> nn.Module:
        m = copy.deepcopy(self.loaded.model).to(dtype)
        if self.channels_last:
            m = m.to(memory_format=torch.channels_last)
        return PeerIO(m, dtype, self.channels_last).eval()

    def half(self) -> nn.Module:
        if self._half is None:
            self._half = self._peer_copy(torch.float16)
        return self._half

    def fp32(self) -> nn.Module:
        """The eager fp32 peer: the model as given, channels_last for a convnet (its outputs are the
        reference, computed with TF32 off)."""
        if self._fp32 is None:
            self._fp32 = self._peer_copy(torch.float32) if self.channels_last else self.loaded.model
        return self._fp32


def _layout(s: Shared) -> str:
    return "channels_last (weights and input)" if s.channels_last else "as written (NCHW)"


def build_reference(s: Shared, device: torch.device) -> tuple[Callable, dict[str, Any]]:
    """Eager fp32: its validation outputs (strict fp32) are the reference; it is timed with torch's
    default TF32 settings, as a user who does not touch them runs it."""
    return s.fp32(), {"candidate": REFERENCE, "precision": "fp32", "reference": "strict fp32 (TF32 off)",
                      "layout": _layout(s), "timed_tf32": {"cudnn": torch.backends.cudnn.allow_tf32,
                                                           "matmul": torch.backends.cuda.matmul.allow_tf32}}


def build_eager16(s: Shared, device: torch.device) -> tuple[Callable, dict[str, Any]]:
    if device.type != "cuda":
        raise RuntimeError("fp16 peers run on CUDA only (half-precision convolutions on CPU are slow or missing)")
    return s.half(), {"candidate": EAGER16, "precision": "fp16", "layout": _layout(s)}


def _build_compiled(s: Shared, device: torch.device, name: str, mode: str) -> tuple[Callable, dict[str, Any]]:
    """torch.compile(mode=...) of the fp16 model; both modes used here replay inductor's kernels in CUDA graphs."""
    if device.type != "cuda":
        raise RuntimeError(f"torch.compile {mode} (CUDA graphs) runs on CUDA only")
    if not s.dynamo_reset:  # once per case: earlier cases' code never counts against its limits; a second
        torch._dynamo.reset()  # reset would throw away this case's other compiled peer (recompiling it while timed)
        s.dynamo_reset = True
    from warpforge.bench.suites._inductor import cudagraph_skips

    skips0 = cudagraph_skips()
    compiled = torch.compile(s.half(), mode=mode)

    def fn(*args: Any) -> Any:
        # Its graphs' outputs are overwritten by the next replay: mark the new step and hand out copies, as
        # ours (CudaGraphed) does.
        torch.compiler.cudagraph_mark_step_begin()
        return _clone(compiled(*args))

    with torch.no_grad():
        for _ in range(3):  # compile, then cudagraph trees' warm-up and recording runs
            fn(*s.loaded.inputs)
    info = {"candidate": name, "precision": "fp16", "compile_mode": mode, "layout": _layout(s),
            "cudagraph_skips": cudagraph_skips() - skips0}
    if info["cudagraph_skips"]:
        info["note"] = "Inductor skipped CUDA graphs for part of the model: kernels launched one by one there"
    return fn, info


def build_compile(s: Shared, device: torch.device) -> tuple[Callable, dict[str, Any]]:
    """torch.compile(mode="reduce-overhead") of the fp16 model: inductor kernels replayed in CUDA graphs."""
    return _build_compiled(s, device, COMPILE, "reduce-overhead")


def build_compile_max(s: Shared, device: torch.device) -> tuple[Callable, dict[str, Any]]:
    """torch.compile(mode="max-autotune"): inductor benchmarks its GEMM/conv templates against the library
    kernels and keeps the fastest, and replays CUDA graphs; its fastest documented mode (minutes to build).
    ``WARPFORGE_BENCH_MAX_AUTOTUNE=0`` skips it (the record then says the fastest mode was not measured)."""
    from warpforge import settings

    if not settings.current().bench_max_autotune:
        raise RuntimeError("skipped: WARPFORGE_BENCH_MAX_AUTOTUNE=0 (torch.compile's fastest mode not measured)")
    return _build_compiled(s, device, COMPILE_MAX, "max-autotune")


def build_graph(s: Shared, device: torch.device) -> tuple[Callable, dict[str, Any]]:
    """The eager fp16 model captured by hand in one CUDA graph (inputs copied in, outputs copied out)."""
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs run on CUDA only")
    from warpforge.optimize.runtime import CudaGraphed

    return CudaGraphed(s.half(), s.loaded.inputs), {"candidate": GRAPH, "precision": "fp16", "layout": _layout(s)}


PEERS: dict[str, Callable[[Shared, torch.device], tuple[Callable, dict[str, Any]]]] = {
    REFERENCE: build_reference, EAGER16: build_eager16, COMPILE: build_compile, COMPILE_MAX: build_compile_max,
    GRAPH: build_graph}
