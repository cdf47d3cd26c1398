"""FP8 (e4m3) quantization of nn.Linear layers, executing on the library's fp8 tensor-core GEMM.

    model, report = quantize_fp8(model, calib_inputs)                      # static per-tensor input scales
    model, report = quantize_fp8(model, activations="dynamic")             # a scale per input row, no calib

Each nn.Linear becomes an :class:`FP8Linear`: its weight quantized to e4m3 once, here, with one fp32 scale
per output channel (absmax / 448); its input quantized to e4m3 on every call, either at a static
per-tensor scale calibrated on ``calib_inputs`` with the int8 pass's observers (optimize/quant.py: max or
percentile clipping, threshold / 448), or at a dynamic scale per row (per token: the row's absmax / 448).
The product runs on ``kernels.matmul_fp8.matmul_fp8`` (e4m3 x e4m3 -> fp32 accumulators, both scales and
the bias applied in the epilogue); the output is the input's float dtype. No fake quantization: the
operands the GEMM reads are e4m3 bytes. On CPU ``matmul_fp8`` runs its torch reference (the same e4m3
operands, an fp32 product), which is how the pass is tested without a GPU; the optimizer's
``warpforge-fp8`` candidates run only on GPUs of compute capability >= 8.9.

A layer stays in the float dtype, listed in ``report.kept`` with the reason, when the fp8 GEMM cannot take
it or it cannot pay: K or N below ``min_features`` (16), K not a multiple of 16 or N not a multiple of 8
(the e4m3 operand rows and the 16-bit output rows must be 16-byte aligned for the TMA loads and stores of
the Hopper GEMM), weights that are not
floating point, layers inside nn.MultiheadAttention (it reads ``.weight`` directly), layers named in
``skip`` and, for static scales, layers no calibration input reaches.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from warpforge.kernels.matmul import FLOAT_DTYPES
from warpforge.kernels.matmul_fp8 import FP8_DTYPE, K_ALIGN, N_ALIGN, matmul_fp8, to_e4m3
from warpforge.kernels.reference import FP8_E4M3_MAX, FP8_MIN_AMAX
from warpforge.optimize.quant import (
    KeptLayer, MSEObserver, _check_calib_inputs, _ErrorStats, _run, calibrating, linear_repr, make_observer,
    plan_layers, swap,
)
from warpforge.optimize.weight_only import linears, why_float

__all__ = ["ACTIVATIONS", "FP8Linear", "FP8Report", "LayerFP8Report", "quantize_fp8"]

ACTIVATIONS = ("static", "dynamic")
class FP8Linear(nn.Module):
    """``x [..., K] -> [..., N]`` on the e4m3 GEMM: e4m3 weight (per output channel), e4m3 input at a static
    per-tensor ``act_scale`` (None: a dynamic scale per row)."""

    def __init__(self, linear_: nn.Linear, act_scale: float | None) -> None:
        super().__init__()
        if not isinstance(linear_, nn.Linear):
            raise ValueError(f"linear: expected an nn.Linear, got {type(linear_).__name__}")
        if act_scale is not None and not (math.isfinite(act_scale) and act_scale > 0):
            raise ValueError(f"act_scale: expected a finite positive scale or None (dynamic), got {act_scale}")
        self.in_features, self.out_features = linear_.in_features, linear_.out_features
        w = linear_.weight.detach().float()  # [N, K]
        w_scale = w.abs().amax(1).clamp_min(FP8_MIN_AMAX) / FP8_E4M3_MAX  # [N]
        # row-major [N, K]: weight_q.t() is the column-major [K, N] operand matmul_fp8 reads K-major
        self.register_buffer("weight_q", (w / w_scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
                             .to(FP8_DTYPE).contiguous())
        self.register_buffer("weight_scale", w_scale.contiguous())  # [N] fp32
        self.register_buffer("act_scale", None if act_scale is None else
                             torch.tensor([float(act_scale)], dtype=torch.float32, device=w.device))
        self.register_buffer("bias", None if linear_.bias is None else linear_.bias.detach().float().clone())

    @property
    def weight_format(self) -> str:
        return "float8_e4m3fn"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected [..., {self.in_features}], got {tuple(x.shape)}")
        out_dtype = x.dtype if x.dtype in FLOAT_DTYPES else torch.float32
        q, scale = to_e4m3(x.reshape(-1, self.in_features), self.act_scale)  # [M, K], [1] or [M, 1]
        y = matmul_fp8(q, self.weight_q.t(), scale, self.weight_scale, bias=self.bias, out_dtype=out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        act = "dynamic per row" if self.act_scale is None else f"{float(self.act_scale):.4g}"
        return linear_repr(self, act_scale=act)


# ---- reports ------------------------------------------------------------------------------------
@dataclass
class LayerFP8Report:
    name: str  # qualified module name ("" for a bare layer)
    activations: str  # static or dynamic
    act_scale: float | None  # static: the calibrated input scale (threshold / 448); dynamic: None
    threshold: float | None  # static: the observer's clipping threshold
    observer: str | None
    rel_err: float | None  # ||y_fp8 - y_fp32|| / ||y_fp32|| of the layer over the calibration set (None: no calib)
    cosine: float | None
    max_abs_err: float | None
    in_features: int = 0
    out_features: int = 0
    type: str = "Linear"


@dataclass
class FP8Report:
    activations: str
    layers: list[LayerFP8Report] = field(default_factory=list)
    kept: list[KeptLayer] = field(default_factory=list)
    output_rel_err: float | None = None  # whole-model output vs the float model (its float tensors, calib set)
    output_cosine: float | None = None

    def __str__(self) -> str:
        rows = [f"{'layer':<30} {'K':>6} {'N':>6} {'input scale':>16} {'rel_err':>9} {'cosine':>9}"]
        for r in self.layers:
            scale = "per row" if r.act_scale is None else f"{r.act_scale:.4g} ({r.observer})"
            err = "" if r.rel_err is None else f"{r.rel_err:>9.2e} {r.cosine:>9.6f}"
            rows.append(f"{r.name or '<model>':<30} {r.in_features:>6} {r.out_features:>6} {scale:>16} {err}")
        rows += [f"{k.name or '<model>':<30} {k.type:<12} kept float: {k.reason}" for k in self.kept]
        if self.output_rel_err is not None:
            rows.append(f"model output: rel_err {self.output_rel_err:.2e}, cosine {self.output_cosine:.6f}")
        return "\n".join(rows)

    def as_dict(self) -> dict[str, Any]:
        return {"activations": self.activations,
                "layers": [{"decision": "fp8", **asdict(r)} for r in self.layers],
                "kept": [{"decision": "float", **asdict(k)} for k in self.kept],
                "output_rel_err": self.output_rel_err, "output_cosine": self.output_cosine}


# ---- the pass -----------------------------------------------------------------------------------
def why_float_fp8(m: nn.Linear, parent: nn.Module | None, min_features: int) -> str | None:
    """Why linear ``m`` cannot run on the e4m3 GEMM (or cannot pay there), or None."""
    reason = why_float(m, parent, min_features)
    if reason is not None:
        return reason
    if m.in_features % K_ALIGN:
        return (f"K = {m.in_features} not a multiple of {K_ALIGN}: the e4m3 rows of both GEMM operands would not "
                "be 16-byte aligned for the tensor-memory-accelerator (TMA) loads")
    if m.out_features % N_ALIGN:
        return (f"N = {m.out_features} not a multiple of {N_ALIGN}: the 16-bit output rows would not be 16-byte "
                "aligned for the TMA store")
    return None


def quantize_fp8(model: nn.Module, calib_inputs: list[tuple] | None = None, *, activations: str = "static",
                 observer="max", skip=(), min_features: int = 16) -> tuple[nn.Module, FP8Report]:
    """Replace the nn.Linear layers of ``model`` by :class:`FP8Linear`, in place (see the module docstring).

    ``activations="static"``: calibrate one input scale per layer on ``calib_inputs`` (each a tuple of model
    arguments) with ``observer`` ("max", "percentile" or an Observer factory; "mse" models the int8 grid and
    is refused). ``"dynamic"``: a scale per input row at run time; ``calib_inputs`` are optional and, when
    given, only measure each layer's error for the report. Returns (model, report); a bare nn.Linear
    ``model`` comes back as its new module. Calibration runs in eval mode under no_grad; modes are restored.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected an nn.Module, got {type(model).__name__}")
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations: expected one of {ACTIVATIONS}, got {activations!r}")
    if activations == "static" and calib_inputs is None:
        raise ValueError("calib_inputs: static fp8 input scales need calibration batches (or activations='dynamic')")
    if calib_inputs is not None:
        calib_inputs = _check_calib_inputs(calib_inputs)
    if activations == "static":
        if observer == "mse" or isinstance(make_observer(observer), MSEObserver):
            raise ValueError("observer: 'mse' searches thresholds on the uniform int8 grid, not e4m3's; use 'max' "
                             "or 'percentile' for fp8")
    if not isinstance(min_features, int) or min_features < 1:
        raise ValueError(f"min_features: expected an integer >= 1, got {min_features!r}")

    report = FP8Report(activations)
    plan = plan_layers(linears(model), skip, lambda m, parent: why_float_fp8(m, parent, min_features), report.kept)
    if not plan:
        return model, report

    at = [0]  # the calibration input being run (for error messages)
    ref_outputs = q_outputs = None
    with calibrating(model) as hooks:
        observers = {}
        if calib_inputs is not None:
            # 1. The float model's outputs (for the end-to-end error) and, for static scales, its layer inputs.
            called: set[nn.Module] = set()
            observers = {m: make_observer(observer) for m in plan} if activations == "static" else {}

            def observe_hook(m, args):
                x = args[0] if args else None
                if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != m.in_features:
                    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise ValueError(f"calib_inputs[{at[0]}]: Linear {plan[m] or '<model>'!r} expects an input "
                                     f"[..., {m.in_features}], got {got}")
                if m in observers:
                    observers[m].observe(x)
                called.add(m)

            hooks += [m.register_forward_pre_hook(observe_hook) for m in plan]
            ref_outputs = _run(model, calib_inputs, at)
            for h in hooks:
                h.remove()
            if activations == "static":
                for m in [m for m in plan if m not in called]:
                    report.kept.append(KeptLayer(plan.pop(m), type(m).__name__,
                                                 "not called on the calibration inputs (no input scale)"))

        # 2. Build the fp8 layers and swap them in wherever each layer is held.
        scales = {m: max(observers[m].threshold(), FP8_MIN_AMAX) / FP8_E4M3_MAX for m in observers if m in plan}
        quant = {m: FP8Linear(m, scales.get(m)) for m in plan}
        new_model = swap(model, quant)

        # 3. Per-layer error against the float layer in fp32 on the quantized model's own layer inputs.
        stats = {q: _ErrorStats() for q in quant.values()}
        if calib_inputs is not None:
            floats = {q: m for m, q in quant.items()}

            def error_hook(q, args, out):
                m = floats[q]
                ref = nn.functional.linear(args[0].float(), m.weight.float(),
                                           None if m.bias is None else m.bias.float())
                stats[q].add(out, ref)

            hooks += [q.register_forward_hook(error_hook) for q in quant.values()]
            q_outputs = _run(new_model, calib_inputs, at)
    if new_model is not model:
        new_model.train(model.training)

    for m, name in plan.items():
        q, measured = quant[m], calib_inputs is not None
        obs = observers.get(m)
        report.layers.append(LayerFP8Report(
            name=name, activations=activations, act_scale=None if q.act_scale is None else float(q.act_scale),
            threshold=None if obs is None else float(q.act_scale) * FP8_E4M3_MAX,
            observer=None if obs is None else obs.name,
            rel_err=stats[q].rel_err() if measured else None, cosine=stats[q].cosine() if measured else None,
            max_abs_err=stats[q].max_abs if measured else None, in_features=m.in_features,
            out_features=m.out_features, type=type(m).__name__))
    if ref_outputs is not None:  # over every floating tensor the model returns (a planner returns a tuple)
        pairs = [(y, ref) for q_out, r_out in zip(q_outputs, ref_outputs)
                 for y, ref in zip(tree_leaves(q_out), tree_leaves(r_out))
                 if isinstance(ref, torch.Tensor) and ref.is_floating_point() and isinstance(y, torch.Tensor)]
        if pairs:
            total = _ErrorStats()
            for y, ref in pairs:
                total.add(y, ref)
            report.output_rel_err, report.output_cosine = total.rel_err(), total.cosine()
    return new_model, report
