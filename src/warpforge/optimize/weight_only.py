"""Weight-only quantization of nn.Linear layers (int8 per channel, int4 in groups of 128), no calibration.

    model, report = quantize_weights(model, "w8")   # int8 weights, one fp32 scale per output channel
    model, report = quantize_weights(model, "w4")   # int4 weights, a scale and minimum per 128 columns

Each nn.Linear becomes a :class:`WeightOnlyLinear` holding ``kernels.quant_linear.quantize_weight`` of its
weight (packed once, here) and calling ``kernels.gemv.linear`` with it: the kernel streams the packed
weight and dequantizes each tile in registers, so a layer reads 1/2 (w8) or about 1/4 (w4) of the bytes of
its fp16 weight. Activations stay in the float dtype (fp16 on the GPU); nothing is calibrated. This pays
where the weights dominate the bytes moved (planners and decoders run at small batch); the optimizer
keeps it only when it measures faster. On CPU ``linear`` runs its torch reference (dequantize, then the
float product), so the pass and its accuracy are testable without a GPU.

Layers that stay float are listed in ``report.kept`` with the reason: too small to pay (in or out features
below ``min_features``, such as a planner's 10-feature input layer, whose weight is a few hundred bytes and
whose input is the raw scene), weights that are not floating point, layers inside nn.MultiheadAttention
(which reads ``.weight`` directly) and layers named in ``skip``. ``warpforge.optimize`` builds its
``warpforge-w8`` / ``warpforge-w4`` candidates with :func:`quantize_weights` (optimize/backends.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from warpforge.kernels.gemv import linear
from warpforge.kernels.matmul import FLOAT_DTYPES
from warpforge.kernels.quant_linear import QuantizedWeight, packed_view, quantize_weight
from warpforge.optimize.quant import KeptLayer, linear_repr, plan_layers, swap

__all__ = ["SCHEMES", "LayerWeightReport", "WeightOnlyLinear", "WeightOnlyReport", "quantize_weights"]

SCHEMES = {"w8": "int8", "w4": "int4_g128"}  # optimizer precision -> kernels.quant_linear scheme
MIN_FEATURES = 16


class WeightOnlyLinear(nn.Module):
    """``x [..., K] -> [..., N]`` in x's float dtype, against a packed int8 / int4 weight.

    ``dtype`` is the float dtype the weight is quantized from (its int4 group scales are stored in it, as
    the kernel reads them); default: the linear's weight dtype.
    """

    def __init__(self, linear_: nn.Linear, scheme: str, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if not isinstance(linear_, nn.Linear):
            raise ValueError(f"linear: expected an nn.Linear, got {type(linear_).__name__}")
        if scheme not in SCHEMES.values():
            raise ValueError(f"scheme: expected one of {sorted(SCHEMES.values())}, got {scheme!r}")
        dtype = dtype or linear_.weight.dtype
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
        qw = quantize_weight(linear_.weight.detach().to(dtype), scheme)
        self.in_features, self.out_features = linear_.in_features, linear_.out_features
        self.scheme, self.group, self.dtype = scheme, qw.group, dtype
        self.register_buffer("weight_q", qw.data)  # int8 [N, K], or uint8 [N, Kp/2] (two int4 codes a byte)
        self.register_buffer("weight_scale", qw.scales)  # fp32 [N], or dtype [N, Kp/128]
        self.register_buffer("weight_min", qw.mins)  # None, or dtype [N, Kp/128]: each group's lowest level
        self.register_buffer("bias", None if linear_.bias is None else linear_.bias.detach().to(dtype).clone())
        self._packed: QuantizedWeight | None = None

    @property
    def weight_format(self) -> str:
        """What ``layer_precisions`` reports for this layer (the packed dtype alone would say uint8)."""
        return self.scheme

    def packed(self) -> QuantizedWeight:
        """The buffers as the kernel's QuantizedWeight; rebuilt (and validated) only after .to() or a load
        replaced them, so a call costs no validation."""
        self._packed = packed_view(self._packed, self.scheme, self.weight_q, self.weight_scale, self.weight_min,
                                   self.group, (self.out_features, self.in_features), self.dtype)
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: expected [..., {self.in_features}], got {tuple(x.shape)}")
        bias = self.bias if self.bias is None or self.bias.dtype == x.dtype else self.bias.to(x.dtype)
        return linear(x, self.packed(), bias=bias)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_packed"] = None  # rebuilt from the buffers on first use
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Layers pickled before the int4 group minimum replaced the integer zero point hold ``weight_zero``:
        # None for int8 (renamed, nothing else changed), uint8 codes for int4, which today's kernel would
        # read wrongly, so those are refused.
        buffers = state.get("_buffers", {})
        if "weight_zero" in buffers:
            if buffers["weight_zero"] is not None:
                raise ValueError("WeightOnlyLinear: saved in the older int4 format (an integer zero point per "
                                 "group); this version stores a float group minimum: run `warpforge optimize` "
                                 "again to re-quantize the model")
            buffers["weight_min"] = buffers.pop("weight_zero")
        super().__setstate__(state)

    def extra_repr(self) -> str:
        return linear_repr(self, scheme=self.scheme, dtype=str(self.dtype).removeprefix('torch.'))


# ---- reports ------------------------------------------------------------------------------------
@dataclass
class LayerWeightReport:
    name: str  # qualified module name ("" for a bare layer)
    scheme: str  # int8 or int4_g128
    in_features: int
    out_features: int
    weight_rel_err: float  # ||dequantize(q) - W|| / ||W|| (W in the float dtype it was quantized from)
    bytes_float: int  # the weight in its float dtype
    bytes_packed: int  # data + scales + group minimums the kernel streams
    type: str = "Linear"


@dataclass
class WeightOnlyReport:
    precision: str  # w8 or w4
    scheme: str
    float_dtype: str
    layers: list[LayerWeightReport] = field(default_factory=list)
    kept: list[KeptLayer] = field(default_factory=list)

    @property
    def bytes_float(self) -> int:
        return sum(r.bytes_float for r in self.layers)

    @property
    def bytes_packed(self) -> int:
        return sum(r.bytes_packed for r in self.layers)

    def __str__(self) -> str:
        rows = [f"{'layer':<30} {'scheme':<10} {'K':>6} {'N':>6} {'w rel_err':>10} {'bytes':>18}"]
        rows += [f"{r.name or '<model>':<30} {r.scheme:<10} {r.in_features:>6} {r.out_features:>6} "
                 f"{r.weight_rel_err:>10.2e} {r.bytes_float:>8} -> {r.bytes_packed:<8}" for r in self.layers]
        rows += [f"{k.name or '<model>':<30} {k.type:<10} kept {self.float_dtype}: {k.reason}" for k in self.kept]
        if self.layers:
            rows.append(f"quantized weights: {self.bytes_float} -> {self.bytes_packed} bytes "
                        f"({self.bytes_packed / self.bytes_float:.2f}x)")
        return "\n".join(rows)

    def as_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "scheme": self.scheme, "float_dtype": self.float_dtype,
                "layers": [{"decision": self.scheme, **asdict(r)} for r in self.layers],
                "kept": [{"decision": "float", **asdict(k)} for k in self.kept],
                "bytes_float": self.bytes_float, "bytes_packed": self.bytes_packed}


# ---- the pass -----------------------------------------------------------------------------------
def why_float(m: nn.Linear, parent: nn.Module | None, min_features: int) -> str | None:
    """Why linear ``m`` stays float under a linear-replacing pass, or None when it can be replaced."""
    if not m.weight.is_floating_point():
        return f"weight dtype {m.weight.dtype} is not floating point"
    if isinstance(parent, nn.MultiheadAttention):
        return "inside nn.MultiheadAttention, which reads its weight directly instead of calling it"
    if m.in_features < min_features or m.out_features < min_features:
        return (f"K = {m.in_features}, N = {m.out_features}: below {min_features} features the weight is a few "
                "hundred bytes, too small for a quantized kernel to pay (and a network's input layer is the most "
                "sensitive to quantization)")
    return None


def linears(model: nn.Module) -> list[tuple[str, nn.Linear, nn.Module | None]]:
    """(name, layer, parent) of every distinct nn.Linear (subclasses included), in module order."""
    parents = {child: parent for parent in model.modules() for child in parent.children()}
    seen: set[nn.Module] = set()
    out = []
    for name, m in model.named_modules():  # a shared module comes once, under its first name
        if isinstance(m, nn.Linear) and m not in seen:
            seen.add(m)
            out.append((name, m, parents.get(m)))
    return out


def quantize_weights(model: nn.Module, precision: str = "w8", *, dtype: torch.dtype | None = None, skip=(),
                     min_features: int = MIN_FEATURES) -> tuple[nn.Module, WeightOnlyReport]:
    """Replace every nn.Linear of ``model`` by a :class:`WeightOnlyLinear` of ``precision`` ("w8": int8 per
    output channel, "w4": int4 in groups of 128), in place; the layers kept float are in ``report.kept``.

    ``dtype``: the float dtype the weights are quantized from and the activations run in (default: each
    layer's weight dtype). Returns (model, report); a bare nn.Linear ``model`` comes back as its new module.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected an nn.Module, got {type(model).__name__}")
    if precision not in SCHEMES:
        raise ValueError(f"precision: expected one of {list(SCHEMES)}, got {precision!r}")
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected float16, bfloat16 or float32, got {dtype}")
    if not isinstance(min_features, int) or min_features < 1:
        raise ValueError(f"min_features: expected an integer >= 1, got {min_features!r}")
    scheme = SCHEMES[precision]
    found = linears(model)
    float_dtype = dtype or (found[0][1].weight.dtype if found else torch.float32)
    report = WeightOnlyReport(precision, scheme, str(float_dtype).removeprefix("torch."))
    new: dict[nn.Module, nn.Module] = {}
    plan = plan_layers(found, skip, lambda m, parent: why_float(m, parent, min_features), report.kept)
    for m, name in plan.items():
        q = WeightOnlyLinear(m, scheme, dtype)
        w = m.weight.detach().to(q.dtype)
        err = (q.packed().dequantize().float() - w.float()).norm() / w.float().norm().clamp_min(1e-30)
        new[m] = q
        report.layers.append(LayerWeightReport(
            name=name, scheme=scheme, in_features=m.in_features, out_features=m.out_features,
            weight_rel_err=float(err), bytes_float=w.numel() * w.element_size(), bytes_packed=q.packed().nbytes,
            type=type(m).__name__))
    return swap(model, new), report
