"""INT8 post-training quantization (W8A8) of nn.Linear, executing on real int8 kernels.

    model, report = quantize_linears(model, calib_inputs, observer="max")

Calibration runs the model on ``calib_inputs`` with a forward pre-hook on every nn.Linear that
feeds its input to an observer (max, percentile or MSE-optimal clipping); each Linear is then
replaced by :class:`QuantLinearW8A8`: weights quantized per output channel (symmetric, at build
time), the input quantized with the calibrated static per-tensor scale, ``matmul_int8`` (int32
accumulation, dequantizing epilogue with bias), output in the input's dtype. No fake quant: on CUDA
the GEMM is the int8 tensor-core kernel; on CPU ``matmul_int8`` runs its exact reference.

Not wired into ``optimize()``'s candidates or passes yet.
"""

from __future__ import annotations

import abc

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from warpforge.kernels.matmul import FLOAT_DTYPES
from warpforge.kernels.matmul_int8 import INT8_MAX, matmul_int8, quantize_rows_int8

__all__ = ["LayerQuantReport", "MSEObserver", "MaxObserver", "Observer", "PercentileObserver", "QuantLinearW8A8",
           "QuantReport", "make_observer", "quantize_linears"]

MIN_AMAX = 1e-8  # an all-zero activation still gets a usable (tiny) scale


# ---- observers ----------------------------------------------------------------------------------
class Observer(abc.ABC):
    """Sees activations (``observe``) and chooses a clipping threshold; scale = threshold / 127."""

    name = "observer"

    @abc.abstractmethod
    def observe(self, x: torch.Tensor) -> None: ...

    @abc.abstractmethod
    def threshold(self) -> float: ...

    def scale(self) -> float:
        return max(self.threshold(), MIN_AMAX) / INT8_MAX


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
    symmetric int8 round-trip at scale t / 127 (clipped values included)."""

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
        for t in grid.tolist():  # |x| suffices: the quantizer is symmetric
            s = t / INT8_MAX
            errs.append(float(((v / s).round().clamp(max=INT8_MAX) * s - v).square().mean()))
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
        q, _ = quantize_rows_int8(x.reshape(-1, self.in_features), self.act_scale)  # [M, K] int8
        y = matmul_int8(q, self.weight_q.t(), self.act_scale, self.weight_scale, bias=self.bias,
                        out_dtype=out_dtype)  # [M, N]
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, act_scale={float(self.act_scale):.4g}")


# ---- calibration and swap -----------------------------------------------------------------------
@dataclass
class LayerQuantReport:
    name: str  # qualified module name ("" for a bare Linear)
    act_scale: float
    threshold: float  # the observer's clipping threshold (act_scale * 127)
    observer: str
    rel_err: float  # ||y_int8 - y_fp32|| / ||y_fp32|| of the layer over the calibration set
    cosine: float
    max_abs_err: float


@dataclass
class QuantReport:
    layers: list[LayerQuantReport] = field(default_factory=list)
    output_rel_err: float | None = None  # whole-model output vs the fp32 model (tensor outputs only)
    output_cosine: float | None = None

    def __str__(self) -> str:
        rows = [f"{'layer':<30} {'observer':<10} {'scale':>10} {'rel_err':>9} {'cosine':>9}"]
        rows += [f"{r.name or '<model>':<30} {r.observer:<10} {r.act_scale:>10.4g} {r.rel_err:>9.2e} {r.cosine:>9.6f}"
                 for r in self.layers]
        if self.output_rel_err is not None:
            rows.append(f"model output: rel_err {self.output_rel_err:.2e}, cosine {self.output_cosine:.6f}")
        return "\n".join(rows)


class _ErrorStats:
    """Running sums for rel_err / cosine / max |err| between a quantized and an fp32 output."""

    def __init__(self) -> None:
        self.dot = self.qq = self.rr = self.ee = self.max_abs = 0.0

    def add(self, y: torch.Tensor, ref: torch.Tensor) -> None:
        y, ref = y.detach().double(), ref.detach().double()
        e = y - ref
        self.dot += float((y * ref).sum())
        self.qq += float((y * y).sum())
        self.rr += float((ref * ref).sum())
        self.ee += float((e * e).sum())
        self.max_abs = max(self.max_abs, float(e.abs().max()) if e.numel() else 0.0)

    def rel_err(self) -> float:
        return math.sqrt(self.ee / self.rr) if self.rr > 0 else math.sqrt(self.ee)

    def cosine(self) -> float:
        return self.dot / math.sqrt(self.qq * self.rr) if self.qq > 0 and self.rr > 0 else float(self.ee == 0)


def _check_calib_inputs(calib_inputs) -> list[tuple]:
    if not isinstance(calib_inputs, (list, tuple)) or len(calib_inputs) == 0:
        got = "an empty list" if isinstance(calib_inputs, (list, tuple)) else type(calib_inputs).__name__
        raise ValueError(f"calib_inputs: expected a non-empty list of argument tuples, got {got}")
    for i, args in enumerate(calib_inputs):
        if not isinstance(args, tuple):
            raise ValueError(f"calib_inputs[{i}]: expected a tuple of model arguments, got {type(args).__name__} "
                             "(wrap a single tensor as (x,))")
    return list(calib_inputs)


def _run(model: nn.Module, calib_inputs: list[tuple], at: list[int]) -> list:
    """Forward every calibration input (``at[0]`` = the index being run, for error messages); the outputs."""
    outputs = []
    for i, args in enumerate(calib_inputs):
        at[0] = i
        outputs.append(model(*args))
    return outputs


def _linear_input(name: str, linear: nn.Linear, args: tuple, index: int) -> torch.Tensor:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != linear.in_features:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"calib_inputs[{index}]: Linear {name or '<model>'!r} expects an input [..., "
                         f"{linear.in_features}], got {got}")
    return x


def quantize_linears(model: nn.Module, calib_inputs: list[tuple], observer="max") -> tuple[nn.Module, QuantReport]:
    """Calibrate every nn.Linear of ``model`` on ``calib_inputs`` (each a tuple of model arguments) and
    replace it by QuantLinearW8A8, in place. Returns (model, report); a bare nn.Linear ``model`` comes
    back as a new QuantLinearW8A8. Calibration runs in eval mode under no_grad; each module's mode is
    restored.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected an nn.Module, got {type(model).__name__}")
    calib_inputs = _check_calib_inputs(calib_inputs)
    make_observer(observer)  # validate before running anything
    linears: dict[nn.Module, str] = {}
    for name, m in model.named_modules():  # named_modules yields a shared module once, under its first name
        if isinstance(m, nn.Linear):
            linears[m] = name
    report = QuantReport()
    if not linears:
        return model, report

    at = [0]  # the calibration input being run
    modes = {m: m.training for m in model.modules()}  # restored module by module afterwards
    model.eval()
    handles = []
    try:
        with torch.no_grad():
            # 1. Observe the original model's Linear inputs; keep its outputs for the end-to-end error.
            observers = {m: make_observer(observer) for m in linears}

            def observe_hook(m, args):
                observers[m].observe(_linear_input(linears[m], m, args, at[0]))

            handles = [m.register_forward_pre_hook(observe_hook) for m in linears]
            ref_outputs = _run(model, calib_inputs, at)
            for h in handles:
                h.remove()

            # 2. Build the quantized layers; swap them in wherever each Linear is held.
            quant = {m: QuantLinearW8A8(m, observers[m].scale()) for m in linears}
            if isinstance(model, nn.Linear):
                new_model: nn.Module = quant[model]
            else:
                new_model = model
                for parent in model.modules():
                    for child_name, child in list(parent._modules.items()):
                        if child in quant:
                            parent._modules[child_name] = quant[child]

            # 3. Per-layer error: each int8 layer against its fp32 Linear on the same input (that of the
            #    quantized model, so earlier layers' errors are not counted again).
            stats = {q: _ErrorStats() for q in quant.values()}
            fp32 = {q: m for m, q in quant.items()}

            def error_hook(q, args, out):
                m = fp32[q]
                ref = nn.functional.linear(args[0].float(), m.weight.float(),
                                           None if m.bias is None else m.bias.float())
                stats[q].add(out, ref)

            handles = [q.register_forward_hook(error_hook) for q in quant.values()]
            q_outputs = _run(new_model, calib_inputs, at)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    if new_model is not model:
        new_model.train(model.training)

    for m, name in linears.items():
        q, obs = quant[m], observers[m]
        report.layers.append(LayerQuantReport(
            name=name, act_scale=float(q.act_scale), threshold=float(q.act_scale) * INT8_MAX, observer=obs.name,
            rel_err=stats[q].rel_err(), cosine=stats[q].cosine(), max_abs_err=stats[q].max_abs))
    if all(isinstance(o, torch.Tensor) for o in ref_outputs):
        total = _ErrorStats()
        for y, ref in zip(q_outputs, ref_outputs):
            total.add(y, ref)
        report.output_rel_err, report.output_cosine = total.rel_err(), total.cosine()
    return new_model, report
