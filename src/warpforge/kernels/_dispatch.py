"""Where a kernel call runs: the Triton kernel on CUDA tensors, the torch reference on CPU.

Kernel tests force the Triton path on CPU tensors (through Triton's interpreter) so CI checks the
kernels' own code. The interpreter must be chosen before any ``@triton.jit`` runs, so this module
is imported first by every module that defines Triton kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    # Without a GPU the only way to execute a Triton kernel is its interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

import triton  # noqa: E402  (after the interpreter is chosen)
import triton.language as tl  # noqa: E402

_forced = False


@contextlib.contextmanager
def force_triton() -> Iterator[None]:
    """Run Triton kernels even on CPU tensors (through the interpreter). For kernel tests."""
    global _forced
    if not INTERPRET and not torch.cuda.is_available():
        raise RuntimeError("force_triton on CPU needs TRITON_INTERPRET=1 before triton kernels load")
    prev, _forced = _forced, True
    try:
        yield
    finally:
        _forced = prev


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel should run for these tensors (all CUDA, or forced on CPU)."""
    if _forced:
        return True
    return all(t.is_cuda for t in tensors if t is not None)


# ---- programmatic dependent launch (Hopper) ------------------------------------------------------
# A PDL kernel may start while the one before it finishes: its programs run up to ``pdl_enter``'s
# ``griddepcontrol.wait``, and ``pdl_release`` lets the next grid launch after this one's main loop (not at
# entry: the next grid's programs would sit resident through this one's last wave, which measured slower).
# In a CUDA graph of many short kernels (an LLM decode step) that hides launch gaps; stream order holds since
# every kernel waits before touching what an earlier one writes (the GEMV's first static-weight tile loads
# before it). Opt-in via ``programmatic_launch()`` (EngineConfig.pdl); awaits its A/B (notes/llm.md).

PDL_OFF, PDL_ON = 0, 1
_PDL = contextvars.ContextVar("warpforge_pdl", default=PDL_OFF)
_PDL_CAPABLE: dict[int, bool] = {}


@contextlib.contextmanager
def programmatic_launch(enabled: bool = True) -> Iterator[None]:
    """Launch the kernels that support it with programmatic dependent launch inside this block."""
    if not isinstance(enabled, bool):
        raise ValueError(f"pdl: expected True or False, got {enabled!r}")
    token = _PDL.set(PDL_ON if enabled else PDL_OFF)
    try:
        yield
    finally:
        _PDL.reset(token)


def pdl(x: torch.Tensor) -> int:
    """Whether a launch on x's device uses PDL (1) or not (0): asked for, CUDA (not the interpreter), sm_90+.
    Launchers pass it as the kernel's ``PDL`` constexpr and ``launch_pdl=bool(...)``."""
    mode = _PDL.get()
    if not mode or INTERPRET or not x.is_cuda:
        return PDL_OFF
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if idx not in _PDL_CAPABLE:
        _PDL_CAPABLE[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return mode if _PDL_CAPABLE[idx] else PDL_OFF


_GDC: tl.constexpr = tl.constexpr(not INTERPRET)  # the interpreter has no griddepcontrol: a no-op there


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a PDL-capable kernel: wait for the previous grid. (Kernel tests may set PDL in
    the interpreter to run a kernel's PDL-only code paths; the wait is then skipped, stream order being
    the interpreter's anyway.)"""
    if PDL != 0 and _GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """After a kernel's main loop: let the next grid launch."""
    if PDL != 0 and _GDC:
        tl.extra.cuda.gdc_launch_dependents()
