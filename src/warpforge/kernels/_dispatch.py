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
# A kernel launched with PDL may start while the kernel before it in the stream is still finishing:
# its programs become resident, run up to ``pdl_enter``'s ``griddepcontrol.wait`` (which returns once
# the previous grid has completed and its writes are visible). The next kernel may launch in turn once
# every program of this one has run ``griddepcontrol.launch_dependents``: at entry (mode "early", right
# after the wait) or after its main loop (mode "late", ``pdl_release``), so that the next grid's programs
# do not sit resident through this one's last wave. Inside a CUDA graph of many short kernels (an LLM
# decode step: ~10 per layer) that hides most of each kernel-to-kernel launch gap. Correctness stays
# stream order whatever the mode, since every kernel waits before it reads anything an earlier kernel
# writes or writes anything itself (the GEMV loads its first tile of static weights before the wait:
# PDL is for graphs over fixed weights). Off unless a caller opts in with ``programmatic_launch()``
# (the LLM engine's decode graphs); ``pdl(x)`` is what launchers ask (a mode code, 0 when off).
# H200, Llama-3.2-1B shape, batch 1: early 798 tok/s against 879 without PDL (benchmarks/NOTES.md).

PDL_OFF, PDL_EARLY, PDL_LATE = 0, 1, 2
PDL_MODES = {False: PDL_OFF, True: PDL_EARLY, "early": PDL_EARLY, "late": PDL_LATE}
_PDL = contextvars.ContextVar("warpforge_pdl", default=PDL_OFF)
_PDL_CAPABLE: dict[int, bool] = {}


def pdl_mode(enabled: bool | str) -> int:
    """The mode code of ``enabled``: False (off), True or "early", "late"."""
    if isinstance(enabled, (bool, str)) and enabled in PDL_MODES:
        return PDL_MODES[enabled]
    raise ValueError(f"pdl: expected False, True, 'early' or 'late', got {enabled!r}")


@contextlib.contextmanager
def programmatic_launch(enabled: bool | str = True) -> Iterator[None]:
    """Launch the kernels that support it with programmatic dependent launch inside this block
    (True or "early": each kernel lets the next launch right after its wait; "late": after its main loop)."""
    token = _PDL.set(pdl_mode(enabled))
    try:
        yield
    finally:
        _PDL.reset(token)


def pdl(x: torch.Tensor) -> int:
    """The PDL mode a launch on x's device uses: asked for, CUDA (not the interpreter), sm_90+; else 0.
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
    """First statement of a PDL-capable kernel (PDL a mode code): wait for the previous grid, then, in the
    early mode, let the next one launch. (Kernel tests may set PDL in the interpreter to run a kernel's
    PDL-only code paths; the wait is then skipped, stream order being the interpreter's anyway.)"""
    if PDL != 0 and _GDC:
        tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """After a kernel's main loop, in the late mode: let the next grid launch."""
    if PDL == 2 and _GDC:
        tl.extra.cuda.gdc_launch_dependents()
