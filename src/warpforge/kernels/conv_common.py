"""What every conv kernel family shares (conv.py, conv_gemm.py, conv_pointwise.py, conv_depthwise.py,
conv_stem.py, conv_int8.py): the validated problem (``_Geometry``), the implicit GEMM's K-loop modes, and
the weight layouts the kernels read, repacked once per weight tensor.

Weight layout the kernels want: channels_last ([Cout, KH, KW, C/groups] physically) for the GEMM, and
[KH, KW, Cout] physically for depthwise. :func:`prepare_conv_weight` returns that (same torch shape,
kernel-friendly strides, usable by ``F.conv2d`` too); the launchers repack any other weight once and
cache it per weight tensor (invalidated when the tensor changes in place or is freed).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter needs it among a @jit function's globals)

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)

CONV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CONV_ACTIVATIONS = (None, "relu", "silu", "gelu", "relu6")
# The implicit GEMM's K loops (conv_gemm.py): a plain GEMM (1x1, stride 1, no padding), one (kh, kw) tap and
# a chunk of channels per step (C/groups a multiple of 16), or K walked as one flat index (small C).
MODE_PLAIN, MODE_TAPS, MODE_FLAT = 0, 1, 2


@triton.jit
def _out_pixels(offs, OH, OW):
    """Flat output-pixel indices over [N, OH, OW] (NHWC order, the kernels' M dimension) as (image, row,
    column)."""
    ow = offs % OW
    t = offs // OW
    oh = t % OH
    nb = t // OH
    return nb, oh, ow


def _pair(v, name: str, lo: int) -> tuple[int, int]:
    if isinstance(v, int) and not isinstance(v, bool):
        v = (v, v)
    if (not isinstance(v, (tuple, list)) or len(v) != 2
            or not all(isinstance(e, int) and not isinstance(e, bool) and e >= lo for e in v)):
        raise ValueError(f"{name} must be an int >= {lo} or a pair of them, got {v!r}")
    return int(v[0]), int(v[1])


def _check_nchw_cl(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D [N, C, H, W] (channels_last memory), got shape {tuple(t.shape)}")
    if not t.is_contiguous(memory_format=torch.channels_last):
        raise ValueError(f"{name} must be channels_last contiguous (t.contiguous(memory_format="
                         f"torch.channels_last)), got strides {tuple(t.stride())}")


@dataclass(frozen=True)
class _Geometry:
    """A validated conv problem: sizes, stride/padding/dilation pairs, output size."""

    n: int
    cin: int
    h: int
    w: int
    cout: int
    cin_g: int
    kh: int
    kw: int
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    groups: int
    oh: int
    ow: int

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.n, self.cout, self.oh, self.ow)


def _geometry(x, weight, bias, stride, padding, dilation, groups, activation, any_layout: bool = False) -> _Geometry:
    """Shape checks shared by conv2d and conv2d_int8 (dtypes are each launcher's own); ``any_layout``: x
    may have any strides (an image read by the space-to-depth pack)."""
    if any_layout:
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"x must be a 4-D torch.Tensor [N, C, H, W], got {getattr(x, 'shape', type(x).__name__)}")
    else:
        _check_nchw_cl(x, "x")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 4:
        raise ValueError("weight must be a 4-D tensor [Cout, C/groups, KH, KW], got "
                         f"{getattr(weight, 'shape', weight)}")
    sh, sw = _pair(stride, "stride", 1)
    ph, pw = _pair(padding, "padding", 0)
    dh, dw = _pair(dilation, "dilation", 1)
    n, cin, h, w = x.shape
    cout, cin_g, kh, kw = weight.shape
    if not isinstance(groups, int) or groups < 1 or cin % groups or cout % groups:
        raise ValueError(f"groups must be an int >= 1 dividing C={cin} and Cout={cout}, got {groups!r}")
    if cin_g * groups != cin:
        raise ValueError(f"weight must be [Cout, C/groups={cin // groups}, KH, KW] for x with C={cin} and "
                         f"groups={groups}, got shape {tuple(weight.shape)}")
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"x spatial size {h}x{w} is too small for kernel {kh}x{kw} with padding {(ph, pw)} "
                         f"and dilation {(dh, dw)} (output would be {oh}x{ow})")
    if activation not in CONV_ACTIVATIONS:
        raise ValueError(f"activation must be one of {CONV_ACTIVATIONS}, got {activation!r}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (cout,)
                             or bias.device != x.device or not bias.is_floating_point()):
        raise ValueError(f"bias must be a float tensor [{cout}] on {x.device}, got {getattr(bias, 'shape', bias)}")
    return _Geometry(n, cin, h, w, cout, cin_g, kh, kw, (sh, sw), (ph, pw), (dh, dw), groups, oh, ow)


def _check_out(t: torch.Tensor | None, name: str, geo: _Geometry, dtype: torch.dtype, device: torch.device) -> None:
    if t is None:
        return
    _check_nchw_cl(t, name)
    if tuple(t.shape) != geo.out_shape or t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be {list(geo.out_shape)} {dtype} on {device}, got "
                         f"{list(t.shape)} {t.dtype} on {t.device}")


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def pointwise_ok(g: _Geometry) -> bool:
    """A 1x1 conv without padding, one group: what the persistent pointwise kernel serves (any stride)."""
    return g.kh == 1 and g.kw == 1 and g.padding == (0, 0) and g.groups == 1


def strided_pointwise(x: torch.Tensor, g: _Geometry) -> tuple[torch.Tensor, _Geometry]:
    """A strided 1x1 conv without padding (ResNet's downsample shortcuts) is the stride-1 1x1 conv of the
    subsampled view x[:, :, ::sh, ::sw] (no copy: channels_last rows stay contiguous), which MODE_PLAIN runs
    without the taps loop's per-step tap arithmetic. Other convs: (x, g) unchanged."""
    if not (g.kh == 1 and g.kw == 1 and g.padding == (0, 0) and g.stride != (1, 1)):
        return x, g
    xv = x[:, :, ::g.stride[0], ::g.stride[1]][:, :, :g.oh, :g.ow]
    return xv, _Geometry(g.n, g.cin, g.oh, g.ow, g.cout, g.cin_g, 1, 1, (1, 1), (0, 0), (1, 1), g.groups, g.oh, g.ow)


def gemm_mode(g: _Geometry) -> int:
    """MODE_PLAIN for 1x1/stride-1/unpadded, MODE_TAPS when C/groups is a multiple of 16, else MODE_FLAT."""
    if g.kh == 1 and g.kw == 1 and g.stride == (1, 1) and g.padding == (0, 0):
        return MODE_PLAIN
    return MODE_TAPS if g.cin_g % 16 == 0 else MODE_FLAT


def _is_depthwise(cin: int, cout: int, groups: int) -> bool:
    return groups > 1 and groups == cin and cout % cin == 0


def prepare_conv_weight(weight: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """weight [Cout, C/groups, KH, KW] with the strides the kernels read fastest; same values and shape.

    GEMM convs: channels_last. Depthwise (C/groups == 1 and groups > 1): [KH, KW, Cout] physically.
    The result is a valid ``F.conv2d`` weight too, so a model can keep it as its parameter.
    """
    if weight.dim() != 4:
        raise ValueError(f"weight must be [Cout, C/groups, KH, KW], got shape {tuple(weight.shape)}")
    if weight.shape[1] == 1 and groups > 1:
        return weight.permute(2, 3, 1, 0).contiguous().permute(3, 2, 0, 1)
    return weight.contiguous(memory_format=torch.channels_last)


def _is_prepared(weight: torch.Tensor, depthwise: bool) -> bool:
    cout, cg, kh, kw = weight.shape
    if depthwise:
        want = {0: 1, 2: kw * cout, 3: cout}
        return all(weight.stride(d) == s or weight.shape[d] == 1 for d, s in want.items())
    return weight.is_contiguous(memory_format=torch.channels_last)


# id(weight) -> (weakref to it, (data_ptr, version, tag), derived tensor): one cache per kind of repack
# (_PREPARED: the kernel layout, tag = depthwise; conv_depthwise's fp32 copies, conv_stem's space-to-depth
# weights), each entry made once per (tensor, version) and dropped when the tensor is freed.
_PREPARED: dict[int, tuple[weakref.ref, tuple, torch.Tensor]] = {}


def _cached_per_weight(cache: dict, weight: torch.Tensor, tag, make) -> torch.Tensor:
    key = (weight.data_ptr(), weight._version, tag)
    hit = cache.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1] == key:
        return hit[2]
    derived = make(weight.detach())
    wid = id(weight)
    cache[wid] = (weakref.ref(weight, lambda _r, wid=wid: cache.pop(wid, None)), key, derived)
    return derived


def _prepared(weight: torch.Tensor, groups: int, depthwise: bool) -> torch.Tensor:
    """The weight in the kernel layout, repacked at most once per (tensor, version)."""
    if _is_prepared(weight, depthwise):
        return weight
    return _cached_per_weight(_PREPARED, weight, depthwise, lambda w: prepare_conv_weight(w, groups))


def _into(y: torch.Tensor, out: torch.Tensor, given: bool) -> torch.Tensor:
    """The reference path's result y as the launcher returns it: copied into a caller's ``out``; with no
    ``out`` given, y itself where it already is what ``out`` would be (dtype, shape, strides): the copy of a
    large activation is a good part of a CPU forward, and y is the reference's own fresh tensor."""
    if not given and y.dtype == out.dtype and y.shape == out.shape and y.stride() == out.stride():
        return y
    return out.copy_(y)


__all__ = ["CONV_ACTIVATIONS", "CONV_DTYPES", "MODE_FLAT", "MODE_PLAIN", "MODE_TAPS", "gemm_mode", "pointwise_ok",
           "prepare_conv_weight", "strided_pointwise"]

