"""INT8 post-training quantization (W8A8) of convolutions and linears, executing on real int8 kernels.

    model, report = quantize_model(gm, calib_inputs, observer="max")      # convs + linears
    model, report = quantize_linears(model, calib_inputs, observer="max")  # nn.Linear only

Calibration runs the model on ``calib_inputs`` with a forward pre-hook on every layer to quantize that
feeds its input to an observer (max, percentile or MSE-optimal clipping). Each layer is then replaced:

* nn.Linear -> :class:`QuantLinearW8A8` (``matmul_int8``);
* nn.Conv2d and the fuse_conv pass's FusedConv2d (BN already folded, activation and residual add in
  the epilogue) -> :class:`QuantConv2d` (``conv2d_int8``).

Weights are quantized per output channel (symmetric, at build time), inputs with the calibrated static
per-tensor scale; the kernels accumulate in int32 and dequantize in their epilogue. No fake quant: on
CUDA the GEMMs are int8 tensor-core kernels; on CPU the kernels run their exact references. Depthwise
convs stay float (memory-bound: int8 tensor cores gain them little). On an FX graph (``requant``) the
int8 layers' input quantizers move into the epilogue of the conv that produces their input: int8 out at
the consumers' scale, or float and int8 out from one epilogue when a float user (a residual add) reads
the same tensor; a tensor from any other node that several int8 layers read is quantized once. At
batch 32 a ResNet-50 forward then launches 58 kernels against the fp16 graph's 56, with 1484 MiB of
tensor arguments against 1831 (benchmarks/sweeps/launch_count.py; before: 77 kernels, 2046 MiB).
``warpforge.optimize`` builds its
``warpforge-int8`` candidate with :func:`quantize_model` (optimize/backends.py).
"""

from __future__ import annotations

import abc
import contextlib
import math
import operator
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import fx, nn

from warpforge.kernels import reference
from warpforge.kernels.conv_int8 import MAX_K, conv2d_int8
from warpforge.kernels.matmul import FLOAT_DTYPES
from warpforge.kernels.matmul_int8 import INT8_MAX, matmul_int8
from warpforge.kernels.quantize import QUANT_DTYPES, quantize_int8
from warpforge.optimize.passes import _fx
from warpforge.optimize.passes.fuse_conv import FusedConv2d
from warpforge.optimize.passes.pool import MaxPool2d, poolable

__all__ = ["KeptLayer", "LayerQuantReport", "MSEObserver", "MaxObserver", "Observer", "PercentileObserver",
           "QuantConv2d", "QuantLinearW8A8", "QuantReport", "QuantizeInput", "linear_repr", "make_observer",
           "quantize_linears", "quantize_model"]

MIN_AMAX = 1e-8  # an all-zero activation still gets a usable (tiny) scale


def weight_bias_correction(q: nn.Module, w: torch.Tensor, groups: int, x_mean: torch.Tensor) -> torch.Tensor:
    """Empirical bias correction (Nagel et al. 2019, "Data-Free Quantization"): the mean shift the int8
    weight's rounding puts on the output, ``-sum((w_q * w_scale - w) * E[x])`` per output channel, with E[x]
    the calibration inputs' mean per input channel (for a conv: over pixels, padding read as data). Adding
    it to the bias removes that shift. w: the float weight [Cout, C/groups, KH, KW] or [N, K]."""
    w = w.detach().float()
    shape = (-1,) + (1,) * (w.dim() - 1)
    err = q.weight_q.float() * q.weight_scale.reshape(shape) - w  # [Cout, C/groups(, KH, KW)]
    if w.dim() == 2:
        return -(err @ x_mean)
    cout, cin_g = w.shape[:2]
    per_group = x_mean.reshape(groups, cin_g)[torch.arange(cout, device=w.device) // (cout // groups)]
    return -(err.sum((2, 3)) * per_group).sum(1)


# ---- observers ----------------------------------------------------------------------------------
class Observer(abc.ABC):
    """Sees activations (``observe``) and chooses a clipping threshold; scale = threshold / levels.

    ``levels`` is 127 for the symmetric int8 grid; quantize_model sets 255 for data that were never
    negative (the unsigned grid, zero point -128).
    """

    name = "observer"
    levels = INT8_MAX

    @abc.abstractmethod
    def observe(self, x: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def threshold(self) -> float: ...

    def scale(self) -> float:
        return max(self.threshold(), MIN_AMAX) / self.levels


class MaxObserver(Observer):
    """The largest |x| seen: nothing is clipped."""

    name = "max"

    def __init__(self) -> None:
        self.amax: float | None = None

    def observe(self, x: torch.Tensor) -> None:
        m = float(x.detach().abs().amax()) if x.numel() else 0.0
        self.amax = m if self.amax is None else max(self.amax, m)

    def threshold(self) -> float:
        if self.amax is None:
            raise ValueError("MaxObserver: no activations observed")
        return self.amax


class _SampleObserver(Observer):
    """Keeps |x| samples (every element up to ``max_samples`` per call, else an even stride) on the CPU."""

    def __init__(self, max_samples: int = 1 << 20) -> None:
        self.max_samples = max_samples
        self.samples: list[torch.Tensor] = []

    def observe(self, x: torch.Tensor) -> None:
        v = x.detach().reshape(-1).abs().float()
        if v.numel() > self.max_samples:
            v = v[:: math.ceil(v.numel() / self.max_samples)]
        self.samples.append(v.cpu())

    def _values(self) -> torch.Tensor:
        if not self.samples:
            raise ValueError(f"{type(self).__name__}: no activations observed")
        return torch.cat(self.samples)


class PercentileObserver(_SampleObserver):
    """The p-th percentile of |x| (p in (0, 100]): rare outliers above it are clipped."""

    name = "percentile"

    def __init__(self, p: float = 99.99, max_samples: int = 1 << 20) -> None:
        if not 0 < p <= 100:
            raise ValueError(f"p: expected a percentile in (0, 100], got {p}")
        super().__init__(max_samples)
        self.p = p

    def threshold(self) -> float:
        v = self._values()
        k = max(1, math.ceil(self.p / 100 * v.numel()))  # nearest-rank percentile
        return float(torch.kthvalue(v, k).values)


class MSEObserver(_SampleObserver):
    """The clipping threshold t in a grid over (0, max|x|] minimizing E[(x - Q_t(x))^2], with Q_t the
    int8 round-trip at scale t / levels (clipped values included)."""

    name = "mse"

    def __init__(self, num_thresholds: int = 100, min_fraction: float = 0.05, max_samples: int = 1 << 20) -> None:
        super().__init__(max_samples)
        self.num_thresholds, self.min_fraction = num_thresholds, min_fraction
        self.errors: torch.Tensor | None = None  # MSE per candidate threshold (after threshold())

    def threshold(self) -> float:
        v = self._values()
        amax = float(v.max())
        if amax == 0.0:
            return 0.0
        grid = torch.linspace(self.min_fraction * amax, amax, self.num_thresholds)
        errs = []
        for t in grid.tolist():  # |x| suffices: the quantizer is symmetric (or x >= 0 on the unsigned grid)
            s = t / self.levels
            errs.append(float(((v / s).round().clamp(max=self.levels) * s - v).square().mean()))
        self.errors = torch.tensor(errs)
        return float(grid[int(self.errors.argmin())])


OBSERVERS = {"max": MaxObserver, "percentile": PercentileObserver, "mse": MSEObserver}


def make_observer(observer) -> Observer:
    """``observer``: "max" | "percentile" | "mse", or a zero-argument callable returning an Observer."""
    if isinstance(observer, str):
        if observer not in OBSERVERS:
            raise ValueError(f"observer: expected one of {list(OBSERVERS)} or an Observer factory, got {observer!r}")
        return OBSERVERS[observer]()
    if callable(observer):
        obs = observer()
        if isinstance(obs, Observer):
            return obs
    raise ValueError(f"observer: expected one of {list(OBSERVERS)} or an Observer factory, got {observer!r}")


# ---- module -------------------------------------------------------------------------------------
def linear_repr(layer: nn.Module, **more: object) -> str:
    """The ``extra_repr`` of a layer standing in for an ``nn.Linear``: nn.Linear's fields, then ``more``."""
    return ", ".join([f"in_features={layer.in_features}", f"out_features={layer.out_features}",
                      f"bias={layer.bias is not None}", *(f"{k}={v}" for k, v in more.items())])


class QuantLinearW8A8(nn.Module):
    """``x [..., K] -> [..., N]``: int8 input (static per-tensor scale), int8 weight (per output channel)."""

    def __init__(self, linear: nn.Linear, act_scale: float) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"linear: expected an nn.Linear, got {type(linear).__name__}")
        if not (math.isfinite(act_scale) and act_scale > 0):
            raise ValueError(f"act_scale: expected a finite positive scale, got {act_scale}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()  # [N, K]
        w_scale = w.abs().amax(1).clamp_min(MIN_AMAX) / INT8_MAX  # [N]
        self.register_buffer("weight_q", torch.round(w / w_scale[:, None]).clamp(-INT8_MAX, INT8_MAX)
                             .to(torch.int8).contiguous())  # [N, K]
        self.register_buffer("weight_scale", w_scale.contiguous())  # [N] fp32
        self.register_buffer("act_scale", torch.tensor(float(act_scale), dtype=torch.float32, device=w.device))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected [..., {self.in_features}], got {tuple(x.shape)}")
        out_dtype = x.dtype if x.dtype in FLOAT_DTYPES else torch.float32
        x2 = x.reshape(-1, self.in_features)
        # A device-side scale and a Triton quantizer: no host sync, so the layer captures in a CUDA graph.
        q = quantize_int8((x2 if x2.dtype in QUANT_DTYPES else x2.float()).contiguous(), self.act_scale)  # [M, K]
        y = matmul_int8(q, self.weight_q.t(), self.act_scale, self.weight_scale, bias=self.bias,
                        out_dtype=out_dtype)  # [M, N]
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return linear_repr(self, act_scale=f"{float(self.act_scale):.4g}")


class QuantizeInput(nn.Module):
    """``x [N, C, H, W] float -> int8`` at the scale of the int8 layers that read it (quantize_int8): a
    tensor that several int8 layers read, quantized once for all of them."""

    def __init__(self, scale: torch.Tensor, zero_point: int) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().clone().reshape(1).float())
        self.zero_point = zero_point

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x.contiguous()
        return quantize_int8(x if x.dtype in QUANT_DTYPES else x.float(), self.scale, zero_point=self.zero_point)


class QuantConv2d(nn.Module):
    """``x [N, C, H, W] -> act(conv(x) + bias + residual)`` [N, Cout, OH, OW] channels_last on int8 tensor cores.

    Built from an nn.Conv2d or a FusedConv2d (whose activation and residual add it keeps in the epilogue).
    x is a float tensor, quantized here at ``act_scale``, or int8 already quantized at ``act_scale`` by the
    producing layer's epilogue. ``unsigned``: x is never negative (a ReLU's output), quantized on the
    unsigned grid (zero point -128, 255 steps of act_scale); a negative value would clamp to 0. The output
    is float (x's dtype; ``float_dtype`` for int8 or fp32 x), or int8 at ``out_scale`` / ``out_zero_point`` once
    :func:`quantize_model` has fused the next layer's quantizer into this epilogue.
    """

    def __init__(self, conv: nn.Module, act_scale: float, unsigned: bool = False,
                 float_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if isinstance(conv, FusedConv2d):
            self.activation, self.has_residual = conv.activation, conv.has_residual
        elif isinstance(conv, nn.Conv2d):
            if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
                raise ValueError(f"conv: needs zero padding given as numbers, got padding={conv.padding!r}, "
                                 f"padding_mode={conv.padding_mode!r}")
            self.activation, self.has_residual = None, False
        else:
            raise ValueError(f"conv: expected an nn.Conv2d or a FusedConv2d, got {type(conv).__name__}")
        if not (math.isfinite(act_scale) and act_scale > 0):
            raise ValueError(f"act_scale: expected a finite positive scale, got {act_scale}")
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        self.float_dtype = float_dtype or (conv.weight.dtype if conv.weight.dtype in FLOAT_DTYPES else torch.float32)
        w = conv.weight.detach().float()  # [Cout, C/groups, KH, KW]
        w_scale = w.abs().amax((1, 2, 3)).clamp_min(MIN_AMAX) / INT8_MAX  # [Cout]
        w_q = torch.round(w / w_scale[:, None, None, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.register_buffer("weight_q", w_q.contiguous(memory_format=torch.channels_last))  # the kernel's layout
        self.register_buffer("weight_scale", w_scale.contiguous())  # [Cout] fp32
        self.register_buffer("act_scale", torch.tensor([float(act_scale)], dtype=torch.float32, device=w.device))
        self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().float().clone())
        self.act_zero_point = -128 if unsigned else 0
        self.register_buffer("weight_sum", w_q.sum((1, 2, 3), dtype=torch.int32) if unsigned else None)  # [Cout]
        self.register_buffer("out_scale", None)  # [1] fp32 once the next layer's quantizer is fused here
        self.out_zero_point = 0
        self.dual_out = False  # with out_scale: return (float y, int8 y) for float and int8 users both
        # An int8 residual (its producer stores int8 only, quantize_model(int8_residual=True)): its scale
        # and zero point; the residual's own calibrated scale, for a producer nothing else quantizes for.
        self.register_buffer("residual_scale", None)
        self.residual_zero_point = 0
        self.residual_calib: tuple[float, bool] | None = None  # (scale, unsigned) observed on the float model

    def _out_shape(self, x: torch.Tensor) -> tuple[int, int, int, int]:
        kh, kw = self.weight_q.shape[2:]
        hw = [(size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, p, d in
              zip(x.shape[2:], (kh, kw), self.stride, self.padding, self.dilation)]
        return (x.shape[0], self.weight_q.shape[0], *hw)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # -> y [N, Cout, OH, OW] channels_last, or (y float, y int8) with dual_out
        cl = torch.channels_last
        if x.dtype == torch.int8:  # quantized at act_scale by the producer's epilogue
            x_q, out_dtype = x.contiguous(memory_format=cl), self.float_dtype
        else:
            x = x.contiguous(memory_format=cl)
            out_dtype = x.dtype if x.dtype in FLOAT_DTYPES else torch.float32
            if x.dtype == torch.float32:  # (a 16-bit layer's fp32 input: an image handed on, passes/image_input.py)
                out_dtype = self.float_dtype
            x_q = quantize_int8(x if x.dtype in QUANT_DTYPES else x.float(), self.act_scale,
                                zero_point=self.act_zero_point)
        res_scale, res_zero = None, 0
        if residual is not None:
            residual = residual.contiguous(memory_format=cl)
            if residual.dtype == torch.int8:
                res_scale, res_zero = getattr(self, "residual_scale", None), getattr(self, "residual_zero_point", 0)
                if res_scale is None:
                    raise ValueError("residual: an int8 residual reached a QuantConv2d with no residual_scale")
        dual = self.out_scale is not None and getattr(self, "dual_out", False)
        out_q = torch.empty(self._out_shape(x_q), dtype=torch.int8, device=x.device, memory_format=cl) if dual else None
        y = conv2d_int8(x_q, self.weight_q, self.act_scale, self.weight_scale, self.bias, stride=self.stride,
                        padding=self.padding, dilation=self.dilation, groups=self.groups,
                        activation=self.activation, residual=residual, out_scale=self.out_scale,
                        out_dtype=None if self.out_scale is not None and not dual else out_dtype,
                        x_zero_point=self.act_zero_point, w_sum=self.weight_sum,
                        out_zero_point=self.out_zero_point, out_q=out_q, residual_scale=res_scale,
                        residual_zero_point=res_zero)
        return (y, out_q) if dual else y

    def extra_repr(self) -> str:
        out = "" if self.out_scale is None else (f", out_scale={float(self.out_scale):.4g} "
                                                 + ("(float and int8 out)" if getattr(self, "dual_out", False)
                                                    else "(int8 out)"))
        out += ", unsigned x" if self.act_zero_point else ""
        if getattr(self, "residual_scale", None) is not None:
            out += f", int8 residual at {float(self.residual_scale):.4g}"
        return (f"{tuple(self.weight_q.shape)}, stride={self.stride}, padding={self.padding}, groups={self.groups}, "
                f"activation={self.activation}, residual={self.has_residual}, act_scale={float(self.act_scale):.4g}"
                + out)


def swap(model: nn.Module, new: dict[nn.Module, nn.Module]) -> nn.Module:
    """Replace each key module by its value wherever it is held (in place); a bare key comes back replaced.
    Shared by the int8, fp8 and weight-only passes."""
    if model in new:
        return new[model]
    for parent in model.modules():
        for child_name, child in list(parent._modules.items()):
            if child in new:
                parent._modules[child_name] = new[child]
    return model


# ---- reports ------------------------------------------------------------------------------------
@dataclass
class LayerQuantReport:
    name: str  # qualified module name ("" for a bare layer)
    act_scale: float
    threshold: float  # the observer's clipping threshold (act_scale * 127)
    observer: str
    rel_err: float  # ||y_int8 - y_fp32|| / ||y_fp32|| of the layer over the calibration set
    cosine: float
    max_abs_err: float
    type: str = "Linear"  # the float layer it replaced: Linear, Conv2d or FusedConv2d
    unsigned: bool = False  # input never negative in calibration: the unsigned grid (zero point -128)
    int8_out: bool = False  # stores int8 for the next layer (its quantizer fused into this epilogue)
    dual_out: bool = False  # ... beside its float output, which other users (a residual add) read


@dataclass
class KeptLayer:
    """A layer left in float precision, and why."""

    name: str
    type: str
    reason: str
    int8_out: bool = False  # a float conv that stores int8 for the int8 layer it feeds


@dataclass
class QuantReport:
    layers: list[LayerQuantReport] = field(default_factory=list)
    kept: list[KeptLayer] = field(default_factory=list)
    output_rel_err: float | None = None  # whole-model output vs the float model (tensor outputs only)
    output_cosine: float | None = None

    def __str__(self) -> str:
        rows = [f"{'layer':<30} {'type':<12} {'observer':<10} {'scale':>10} {'rel_err':>9} {'cosine':>9}"]
        rows += [f"{r.name or '<model>':<30} {r.type:<12} {r.observer:<10} {r.act_scale:>10.4g} {r.rel_err:>9.2e} "
                 f"{r.cosine:>9.6f}{'  unsigned' if r.unsigned else ''}"
                 f"{'  -> float + int8 out' if r.dual_out else '  -> int8 out' if r.int8_out else ''}"
                 for r in self.layers]
        rows += [f"{k.name or '<model>':<30} {k.type:<12} kept float: {k.reason}"
                 f"{'  -> int8 out' if k.int8_out else ''}" for k in self.kept]
        if self.output_rel_err is not None:
            rows.append(f"model output: rel_err {self.output_rel_err:.2e}, cosine {self.output_cosine:.6f}")
        return "\n".join(rows)

    def as_dict(self) -> dict[str, Any]:
        return {"layers": [{"decision": "int8", **asdict(r)} for r in self.layers],
                "kept": [{"decision": "float", **asdict(k)} for k in self.kept],
                "output_rel_err": self.output_rel_err, "output_cosine": self.output_cosine}


class _ErrorStats:
    """Running sums for rel_err / cosine / max |err| between a quantized and an fp32 output."""

    def __init__(self) -> None:
        self.dot = self.qq = self.rr = self.ee = self.max_abs = 0.0

    def add(self, y: torch.Tensor, ref: torch.Tensor) -> None:
        y, ref = y.detach().float(), ref.detach().float()  # fp32 products, float64 sums
        e = y - ref
        f64 = torch.float64
        self.dot += float((y * ref).sum(dtype=f64))
        self.qq += float((y * y).sum(dtype=f64))
        self.rr += float((ref * ref).sum(dtype=f64))
        self.ee += float((e * e).sum(dtype=f64))
        self.max_abs = max(self.max_abs, float(e.abs().max()) if e.numel() else 0.0)

    def rel_err(self) -> float:
        return math.sqrt(self.ee / self.rr) if self.rr > 0 else math.sqrt(self.ee)

    def cosine(self) -> float:
        return self.dot / math.sqrt(self.qq * self.rr) if self.qq > 0 and self.rr > 0 else float(self.ee == 0)


# ---- which layers, and how ----------------------------------------------------------------------
_QUANTIZED = (QuantLinearW8A8, QuantConv2d)


def _kind(m: nn.Module) -> str | None:
    if isinstance(m, _QUANTIZED):
        return None
    if isinstance(m, nn.Linear):
        return "linear"
    if isinstance(m, (nn.Conv2d, FusedConv2d)):
        return "conv"
    return None


def _why_float(m: nn.Module, parent: nn.Module | None, min_channels: int) -> str | None:
    """Why layer ``m`` must stay float, or None when it can run int8."""
    if not m.weight.is_floating_point():
        return f"weight dtype {m.weight.dtype} is not floating point"
    if isinstance(parent, nn.MultiheadAttention):
        return "inside nn.MultiheadAttention, which reads its weight directly instead of calling it"
    if isinstance(m, nn.Linear):
        return None
    if isinstance(m, nn.Conv2d) and (m.padding_mode != "zeros" or isinstance(m.padding, str)):
        return f"padding={m.padding!r}, padding_mode={m.padding_mode!r} (the int8 kernel takes explicit zero padding)"
    cout, cin_g, kh, kw = m.weight.shape
    if m.groups > 1 and cin_g == 1:
        return (f"depthwise ({m.groups} groups): memory-bound at {kh * kw} MACs per loaded value, int8 tensor "
                "cores gain it little; stays on the float conv kernel")
    if cin_g < min_channels:
        # MobileNetV2 (ImageNet weights): int8 on the stem's input alone moved the logits by 5% (relative),
        # as much as any other single layer, for a conv with K = 27 that tensor cores barely serve. An int8
        # ResNet-50 stem was faster, but the accuracy fallback put it back to fp16 in the suite's INT8 row
        # anyway (benchmarks/notes/optimize.md): it stays float.
        return (f"C/groups = {cin_g} < {min_channels} (an image stem): too few channels for int8 tensor cores to "
                "pay, and quantizing the network's input costs accuracy")
    if cin_g * kh * kw > MAX_K:
        return f"K = {cin_g * kh * kw} > {MAX_K}: the int32 accumulator could overflow"
    return None


def _quantized(m: nn.Module, scale: float, unsigned: bool) -> nn.Module:
    return QuantLinearW8A8(m, scale) if isinstance(m, nn.Linear) else QuantConv2d(m, scale, unsigned)


def _layer_input(name: str, m: nn.Module, args: tuple, index: int) -> torch.Tensor:
    x = args[0] if args else None
    if isinstance(m, nn.Linear):
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != m.in_features:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"calib_inputs[{index}]: Linear {name or '<model>'!r} expects an input [..., "
                             f"{m.in_features}], got {got}")
        return x
    cin = m.weight.shape[1] * m.groups
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or x.shape[1] != cin or not x.is_floating_point():
        got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"calib_inputs[{index}]: {type(m).__name__} {name or '<model>'!r} expects a float input "
                         f"[N, {cin}, H, W], got {got}")
    return x


def _float_reference(m: nn.Module, q: nn.Module, args: tuple) -> torch.Tensor:
    """The float layer's fp32 output on q's input (an int8 input dequantized at q's scale)."""
    x = args[0]
    if isinstance(m, nn.Linear):
        return nn.functional.linear(x.float(), m.weight.float(), None if m.bias is None else m.bias.float())
    xf = (x.float() - q.act_zero_point) * q.act_scale if x.dtype == torch.int8 else x.float()
    r = args[1] if len(args) > 1 else None
    if r is not None and r.dtype == torch.int8:  # an int8 residual stream: dequantized, as the kernel reads it
        r = (r.float() - q.residual_zero_point) * q.residual_scale
    return reference.conv2d_reference(xf, m.weight.float(), None if m.bias is None else m.bias.float(),
                                      stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups,
                                      activation=q.activation, residual=r)


def _int8_input_user(user: fx.Node, n: fx.Node, modules: dict) -> QuantConv2d | None:
    """The QuantConv2d that ``user`` calls with n as its input x (and nowhere else), else None."""
    b = modules.get(user.target) if user.op == "call_module" else None
    if isinstance(b, QuantConv2d) and user.args and user.args[0] is n and n not in user.args[1:] and not user.kwargs:
        return b
    return None


def _residual_reader(user: fx.Node, n: fx.Node, modules: dict) -> QuantConv2d | None:
    """The QuantConv2d that ``user`` calls with n as its residual (and nowhere else), else None."""
    b = modules.get(user.target) if user.op == "call_module" else None
    if (isinstance(b, QuantConv2d) and b.has_residual and len(user.args) == 2 and user.args[1] is n
            and user.args[0] is not n and not user.kwargs):
        return b
    return None


def _pool_int8(gm: fx.GraphModule, n: fx.Node, pool: nn.Module | None, readers: list[fx.Node], modules: dict,
               calls: dict[int, int]) -> bool:
    """n = a max pool (called once) of a conv's output (called once, read by the pool alone) and read only
    by int8 layers at one scale (``readers``): the conv stores int8 at their scale, the pool runs on the
    codes (passes.pool.MaxPool2d: exactly the quantized float pool, quantization being monotone), the
    readers take them; no quantize kernel, half the fp16 pool's bytes. The conv is a QuantConv2d (an int8
    stem) or a float FusedConv2d (a float stem: fp16 MMA, its epilogue quantizing what the quantize kernel
    after the pool would have, the same values but for fp16's rounding before the quantizer). Returns
    whether it rewrote the graph."""
    if not (n.op == "call_module" and (isinstance(pool, MaxPool2d) or poolable(pool)) and calls[id(pool)] == 1
            and len(n.args) == 1 and not n.kwargs and set(n.users) == set(readers)):
        return False
    p = n.args[0]
    conv = modules.get(p.target) if isinstance(p, fx.Node) and p.op == "call_module" else None
    if (not isinstance(conv, (QuantConv2d, FusedConv2d)) or calls[id(conv)] != 1 or conv.out_scale is not None
            or set(p.users) != {n}):
        return False
    b = modules[readers[0].target]
    conv.out_scale, conv.out_zero_point = b.act_scale.clone(), b.act_zero_point
    if not isinstance(pool, MaxPool2d):  # torch's pool has no int8 kernel on CUDA
        modules[n.target] = _fx.replace_module(gm, n.target, MaxPool2d(pool))
    return True


def _fuse_requant(gm: fx.GraphModule, int8_residual: bool = False) -> tuple[set[nn.Module], set[nn.Module]]:
    """Fuse the int8 layers' input quantizers into the epilogue of the conv that produces their input.

    For each conv (QuantConv2d, or a float FusedConv2d such as a depthwise conv) called from one place,
    the QuantConv2d users that take its output as input x are grouped by input scale (the same tensor
    observed the same way: one group) and the largest group gets int8 at its scale straight from the
    producer (``out_scale``): one int8 tensor however many layers read it (a ResNet downsample block's
    conv1 and shortcut conv). When other users read the output too (a residual add, a pool), a
    QuantConv2d producer stores both (``dual_out``: float for them, int8 for the group: one epilogue
    instead of a float store, a re-read and a quantize kernel); a float producer then keeps its float
    output. A max pool between a conv and int8 readers (ResNet's stem, int8 or float, then its first block)
    runs on the conv's int8 codes (:func:`_pool_int8`). Any other node read by several int8 layers at one
    scale (an average pool before a downsample block) is quantized once for all of them.
    ``int8_residual``: where the other users are all int8 layers reading the output as their residual, the
    producer stores int8 only and they read it (dequantized in their epilogue): a residual block's output
    written and read as 1 byte per element, not as fp16 plus an int8 copy; a conv output read only as
    residuals (a downsample shortcut, int8 or kept float) goes int8 at its readers' calibrated scale.
    Returns (producers storing int8 only, producers storing both)."""
    modules = dict(gm.named_modules())
    calls: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[id(modules[n.target])] = calls.get(id(modules[n.target]), 0) + 1
    fused, dual = set(), set()
    changed = False
    for n in list(gm.graph.nodes):
        groups: dict[tuple[float, int], list[fx.Node]] = {}
        for user in n.users:
            b = _int8_input_user(user, n, modules)
            if b is not None:
                groups.setdefault((float(b.act_scale), b.act_zero_point), []).append(user)
        a = modules.get(n.target) if n.op == "call_module" else None
        if not groups:
            # int8_residual: a conv read only as int8 layers' residual (a downsample shortcut), int8 or kept
            # float (by the accuracy fallback, say): it stores int8 at the readers' residual scale, which they
            # read at half an fp16 residual's bytes
            res = [_residual_reader(u, n, modules) for u in n.users] if int8_residual else []
            if (res and all(b is not None for b in res) and res[0].residual_calib is not None
                    and isinstance(a, (QuantConv2d, FusedConv2d)) and calls[id(a)] == 1 and a.out_scale is None):
                scale, unsigned = res[0].residual_calib
                a.out_scale = torch.tensor([scale], dtype=torch.float32, device=res[0].act_scale.device)
                a.out_zero_point = -128 if unsigned else 0
                for b in res:
                    b.residual_scale, b.residual_zero_point = a.out_scale.clone(), a.out_zero_point
                fused.add(a)
            continue
        key, readers = max(groups.items(), key=lambda kv: len(kv[1]))  # first largest: graph order
        if _pool_int8(gm, n, a, readers, modules, calls):  # int8-out conv -> max pool -> int8 readers
            fused.add(modules[n.args[0].target])
            changed = True
            continue
        if not isinstance(a, (QuantConv2d, FusedConv2d)) or calls[id(a)] != 1 or a.out_scale is not None:
            if len(readers) > 1 and n.op != "placeholder" and all(
                    isinstance(modules[u.target], QuantConv2d) for u in readers):
                # Any other producer (a max pool): one quantize kernel for all the readers, not one each.
                # A module, not a call_function node: a pickled GraphModule is re-traced on load, through
                # functions but not into modules.
                b = modules[readers[0].target]
                name = f"{n.name}_quantize"
                gm.add_submodule(name, QuantizeInput(b.act_scale, b.act_zero_point))
                with gm.graph.inserting_after(n):
                    q = gm.graph.call_module(name, (n,))
                for user in readers:
                    user.replace_input_with(n, q)
                changed = True
            continue
        others = [u for u in n.users if u not in readers]
        if others and not isinstance(a, QuantConv2d):
            continue
        b = modules[readers[0].target]
        a.out_scale, a.out_zero_point = b.act_scale.clone(), b.act_zero_point
        res = [_residual_reader(u, n, modules) for u in others] if int8_residual else []
        res_only = bool(res) and all(b is not None for b in res)
        if res_only:  # the int8 residual stream: the residual readers take the same int8 tensor
            for r in res:
                r.residual_scale, r.residual_zero_point = a.out_scale.clone(), a.out_zero_point
        if not others or res_only:
            fused.add(a)
            continue
        a.dual_out = True
        dual.add(a)
        with gm.graph.inserting_after(n):
            q = gm.graph.call_function(operator.getitem, (n, 1))
        with gm.graph.inserting_after(n):
            f = gm.graph.call_function(operator.getitem, (n, 0))
        for user in readers:
            user.replace_input_with(n, q)
        for user in others:
            user.replace_input_with(n, f)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return fused, dual


# ---- calibration and swap -----------------------------------------------------------------------
def _check_calib_inputs(calib_inputs) -> list[tuple]:
    if not isinstance(calib_inputs, (list, tuple)) or len(calib_inputs) == 0:
        got = "an empty list" if isinstance(calib_inputs, (list, tuple)) else type(calib_inputs).__name__
        raise ValueError(f"calib_inputs: expected a non-empty list of argument tuples, got {got}")
    for i, args in enumerate(calib_inputs):
        if not isinstance(args, tuple):
            raise ValueError(f"calib_inputs[{i}]: expected a tuple of model arguments, got {type(args).__name__} "
                             "(wrap a single tensor as (x,))")
    return list(calib_inputs)


def plan_layers(candidates: Iterable[tuple[str, nn.Module, Any]], skip: Collection[str],
                why_float: Callable[[nn.Module, Any], str | None], kept: list[KeptLayer]) -> dict[nn.Module, str]:
    """module -> name of the layers to quantize among ``candidates`` (name, module, its parent): each one not
    named in ``skip`` and for which ``why_float(module, parent)`` gives no reason; the others go to ``kept``
    with their reason."""
    plan: dict[nn.Module, str] = {}
    for name, m, parent in candidates:
        reason = "skipped by request" if name in skip else why_float(m, parent)
        if reason is None:
            plan[m] = name
        else:
            kept.append(KeptLayer(name, type(m).__name__, reason))
    return plan


@contextlib.contextmanager
def calibrating(model: nn.Module) -> Iterator[list]:
    """Calibration of ``model``: eval mode and no_grad; yields a list for the hook handles registered meanwhile.
    Afterwards (also on an error) those hooks are removed and every module's training flag is restored."""
    modes = {m: m.training for m in model.modules()}
    model.eval()
    hooks: list = []
    try:
        with torch.no_grad():
            yield hooks
    finally:
        for h in hooks:
            h.remove()  # one already removed: a no-op
        for m, training in modes.items():
            m.training = training


def _run(model: nn.Module, calib_inputs: list[tuple], at: list[int]) -> list:
    """Forward every calibration input (``at[0]`` = the index being run, for error messages); the outputs."""
    outputs = []
    for i, args in enumerate(calib_inputs):
        at[0] = i
        outputs.append(model(*args))
    return outputs


def quantize_model(model: nn.Module, calib_inputs: list[tuple], observer="max", *, convs: bool = True,
                   linears: bool = True, skip=(), requant: bool = True, unsigned: bool = True,
                   min_channels: int = 16, int8_residual: bool = True,
                   bias_correction: bool = False) -> tuple[nn.Module, QuantReport]:
    """Calibrate the convs (nn.Conv2d, FusedConv2d) and nn.Linear layers of ``model`` on ``calib_inputs``
    (each a tuple of model arguments) and replace each by its int8 layer, in place.

    Layers that must stay float (depthwise convs, convs with fewer than ``min_channels`` input channels
    per group such as an RGB stem, layers named in ``skip``, layers no calibration input reaches, ...) are
    listed in ``report.kept`` with the reason. ``unsigned``: a conv whose input was never negative during
    calibration quantizes it on the unsigned grid (one more bit). ``requant`` (FX graphs): a quantized conv
    feeding only another quantized conv's input stores int8 at that layer's scale. ``int8_residual`` (FX
    graphs with ``requant``): residual adds read int8 too, so a residual block's output is stored once, as
    int8 (see :func:`_fuse_requant`); the residual then carries that quantization's error, for fewer bytes a
    block at the same top-1 (benchmarks/notes/optimize.md). ``bias_correction``: each int8 layer's bias
    absorbs the mean output shift of its weight rounding on the calibration inputs
    (:func:`weight_bias_correction`; the int8 accuracy fallback tries it on the layers its search keeps
    float, optimize.api.int8_fallback).
    Returns (model, report); a bare layer ``model`` comes back as its new quantized module. Calibration
    runs in eval mode under no_grad; each module's mode is restored.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected an nn.Module, got {type(model).__name__}")
    calib_inputs = _check_calib_inputs(calib_inputs)
    make_observer(observer)  # validate before running anything
    report = QuantReport()
    parents = {child: parent for parent in model.modules() for child in parent.children()}

    def candidates():
        seen: set[nn.Module] = set()
        for name, m in model.named_modules():  # named_modules yields a shared module once, under its first name
            kind = _kind(m)
            if kind is None or m in seen or (kind == "conv" and not convs) or (kind == "linear" and not linears):
                continue
            seen.add(m)
            yield name, m, parents.get(m)

    plan = plan_layers(candidates(), skip, lambda m, parent: _why_float(m, parent, min_channels), report.kept)
    if not plan:
        return model, report

    at = [0]  # the calibration input being run
    with calibrating(model) as hooks:
        # 1. Observe the float model's layer inputs; keep its outputs for the end-to-end error.
        observers = {m: make_observer(observer) for m in plan}
        called: set[nn.Module] = set()
        nonneg: dict[nn.Module, bool] = {}
        # the residual inputs too (int8_residual): a shortcut conv's output gets its scale from these
        res_obs = {m: make_observer(observer) for m in plan if int8_residual and getattr(m, "has_residual", False)}
        res_nonneg: dict[nn.Module, bool] = {}

        x_sums: dict[nn.Module, list] = {}  # bias_correction: per input channel [sum, count]

        def observe_hook(m, args):
            x = _layer_input(plan[m], m, args, at[0])
            observers[m].observe(x)
            called.add(m)
            if bias_correction:
                xf = x.detach().float()
                part = (xf.reshape(-1, xf.shape[-1]).sum(0), xf.numel() // xf.shape[-1]) if isinstance(
                    m, nn.Linear) else (xf.sum((0, 2, 3)), xf.numel() // xf.shape[1])
                acc = x_sums.setdefault(m, [0.0, 0])
                acc[0], acc[1] = acc[0] + part[0], acc[1] + part[1]
            if unsigned and not isinstance(m, nn.Linear):
                nonneg[m] = nonneg.get(m, True) and bool((x >= 0).all())
            if m in res_obs and len(args) > 1 and isinstance(args[1], torch.Tensor):
                res_obs[m].observe(args[1])
                res_nonneg[m] = res_nonneg.get(m, True) and bool((args[1] >= 0).all())

        hooks += [m.register_forward_pre_hook(observe_hook) for m in plan]
        ref_outputs = _run(model, calib_inputs, at)
        for h in hooks:
            h.remove()
        for m in [m for m in plan if m not in called]:
            report.kept.append(KeptLayer(plan.pop(m), type(m).__name__, "not called on the calibration inputs"))

        # 2. Build the int8 layers; swap them in wherever each layer is held; fuse requantization.
        for m in plan:
            if nonneg.get(m, False):
                observers[m].levels = 2 * INT8_MAX + 1  # 255 steps over [0, threshold]
        quant = {m: _quantized(m, observers[m].scale(), nonneg.get(m, False)) for m in plan}
        for m, (total, count) in x_sums.items():
            q = quant[m]
            corr = weight_bias_correction(q, m.weight, getattr(m, "groups", 1), total / max(count, 1))
            q.bias = corr if q.bias is None else q.bias + corr
        for m, o in res_obs.items():
            if m in res_nonneg:
                if unsigned and res_nonneg[m]:
                    o.levels = 2 * INT8_MAX + 1
                quant[m].residual_calib = (o.scale(), bool(unsigned and res_nonneg[m]))
        new_model: nn.Module = swap(model, quant)
        int8_out, dual_out = (_fuse_requant(new_model, int8_residual)
                              if requant and isinstance(new_model, fx.GraphModule) else (set(), set()))

        # 3. Per-layer error: each int8 layer against its float layer in fp32 on the same input (that of
        #    the quantized model, so earlier layers' errors are not counted again). An int8 output is
        #    compared dequantized: its requantization counts as this layer's error.
        stats = {q: _ErrorStats() for q in quant.values()}
        floats = {q: m for m, q in quant.items()}

        def error_hook(q, args, out):
            if isinstance(out, tuple):  # dual_out: (float, int8) of the same y; judge the float one
                out = out[0]
            ref = _float_reference(floats[q], q, args)
            y = (out.float() - q.out_zero_point) * q.out_scale if out.dtype == torch.int8 else out
            stats[q].add(y, ref)

        hooks += [q.register_forward_hook(error_hook) for q in quant.values()]
        q_outputs = _run(new_model, calib_inputs, at)
    if new_model is not model:
        new_model.train(model.training)

    for k in report.kept:
        k.int8_out = bool(k.name) and new_model.get_submodule(k.name) in int8_out
    for m, name in plan.items():
        q, obs = quant[m], observers[m]
        report.layers.append(LayerQuantReport(
            name=name, act_scale=float(q.act_scale), threshold=float(q.act_scale) * obs.levels, observer=obs.name,
            rel_err=stats[q].rel_err(), cosine=stats[q].cosine(), max_abs_err=stats[q].max_abs,
            type=type(m).__name__, unsigned=obs.levels != INT8_MAX, int8_out=q in int8_out or q in dual_out,
            dual_out=q in dual_out))
    if all(isinstance(o, torch.Tensor) for o in ref_outputs):
        total = _ErrorStats()
        for y, ref in zip(q_outputs, ref_outputs):
            total.add(y, ref)
        report.output_rel_err, report.output_cosine = total.rel_err(), total.cosine()
    return new_model, report


def quantize_linears(model: nn.Module, calib_inputs: list[tuple], observer="max") -> tuple[nn.Module, QuantReport]:
    """Calibrate every nn.Linear of ``model`` on ``calib_inputs`` (each a tuple of model arguments) and
    replace it by QuantLinearW8A8, in place: :func:`quantize_model` with the convs left alone. Returns
    (model, report); a bare nn.Linear ``model`` comes back as a new QuantLinearW8A8.
    """
    return quantize_model(model, calib_inputs, observer, convs=False)
