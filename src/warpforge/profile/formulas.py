"""FLOP formulas per aten operator, and the precision whose compute ceiling each one runs against.

One multiply-add is 2 FLOPs. Matmul, convolution and attention follow ``torch.utils.flop_counter``
(bias adds are not counted: under 1/K of the work). The rest are this module's conventions:

* pointwise ops: 1 FLOP per output element, transcendentals (exp, gelu, silu, tanh, ...) included:
  they cost a few SFU instructions each, but pointwise ops sit orders of magnitude left of the
  ridge point, so no convention changes where they land on the roofline. Fused multiply-adds
  (addcmul, addcdiv, lerp) count 2.
* reductions: 1 per input element (sum, mean, max, argmax, any); var/std 3 (subtract, square,
  accumulate); norm 2; logsumexp 4 (max, subtract, exp, accumulate).
* softmax / log_softmax: 5 per element (max, subtract, exp, sum, divide or log-subtract).
* layer_norm / group_norm: 5 per element (mean, subtract, square-accumulate, scale) + 1 each for
  weight and bias; rms_norm: 3 (square-accumulate, scale) + 1 for weight; batch_norm in inference
  4 (subtract, scale, weight, bias), in training 3 more for the statistics.
* pooling: one compare or add per window element; adaptive pools 1 per input element.
* data movement (copy, cat, gather, pad, ...): 0 FLOPs, bytes only.

Both the composite form (``aten::linear``, ``aten::conv2d``, ``aten::layer_norm``, seen under
``torch.inference_mode``) and the decomposed form (``aten::addmm``, ``aten::convolution``,
``aten::native_layer_norm``, seen under ``no_grad``) have a formula.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

KINDS = ("matmul", "conv", "attention", "pointwise", "reduction", "softmax", "norm", "pool", "movement")
TENSOR_CORE_KINDS = frozenset({"matmul", "conv", "attention"})


def bind(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _first_out(out: Any) -> torch.Tensor:
    return next(t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))


def _prod(xs) -> int:
    return math.prod(int(x) for x in xs)


# ---- matmul ------------------------------------------------------------------------------------------

def _matmul(a: torch.Tensor, out: torch.Tensor) -> int:
    """2 * outputs * K for every product form: out [..., M, N] from a [..., M, K] (mv, dot: K = a[-1])."""
    return 2 * out.numel() * a.shape[-1]


MATMUL: dict[str, Callable[[dict, Any], int]] = {
    "mm": lambda b, o: _matmul(b["self"], _first_out(o)),
    "bmm": lambda b, o: _matmul(b["self"], _first_out(o)),
    "matmul": lambda b, o: _matmul(b["self"], _first_out(o)),
    "mv": lambda b, o: _matmul(b["self"], _first_out(o)),
    "dot": lambda b, o: 2 * b["self"].numel(),
    "vdot": lambda b, o: 2 * b["self"].numel(),
    "addmm": lambda b, o: _matmul(b["mat1"], _first_out(o)),
    "baddbmm": lambda b, o: _matmul(b["batch1"], _first_out(o)),
    "addmv": lambda b, o: _matmul(b["mat"], _first_out(o)),
    "addbmm": lambda b, o: 2 * _prod(b["batch1"].shape) * b["batch2"].shape[-1],
    "linear": lambda b, o: _matmul(b["input"], _first_out(o)),
    "_scaled_mm": lambda b, o: _matmul(b["self"], _first_out(o)),
    "_int_mm": lambda b, o: _matmul(b["self"], _first_out(o)),
}


def _einsum(b: dict, o: Any) -> int:
    """Two operands: 2 * product of every index's size (one multiply-add per index combination)."""
    eq, ops = b["equation"].replace(" ", ""), b["tensors"]
    lhs = eq.split("->")[0].split(",")
    if len(ops) != 2 or "." in eq:
        raise NotImplementedError("einsum FLOPs are counted for two operands without ellipsis")
    sizes: dict[str, int] = {}
    for letters, t in zip(lhs, ops):
        sizes.update(zip(letters, t.shape))
    return 2 * _prod(sizes.values())


# ---- convolution -------------------------------------------------------------------------------------

def _conv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, transposed: bool) -> int:
    """weight [Cout, Cin/g, k...] (transposed: [Cin, Cout/g, k...]); each output element (each input
    element when transposed) takes Cin/g * prod(k) multiply-adds (Cout/g * prod(k) when transposed)."""
    per = w.shape[1] * _prod(w.shape[2:])
    return 2 * (x.numel() if transposed else out.numel()) * per


def _conv_any(b: dict, o: Any, transposed: bool | None = None) -> int:
    x = b.get("input", b.get("self"))
    t = bool(b.get("transposed", False)) if transposed is None else transposed
    return _conv(x, b["weight"], _first_out(o), t)


CONV: dict[str, Callable[[dict, Any], int]] = {
    **{n: (lambda b, o: _conv_any(b, o)) for n in (
        "convolution", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution",
        "mkldnn_convolution", "convolution_overrideable", "_slow_conv2d_forward", "thnn_conv2d")},
    **{n: (lambda b, o: _conv_any(b, o, True)) for n in (
        "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "cudnn_convolution_transpose",
        "slow_conv_transpose2d")},
}


# ---- attention ---------------------------------------------------------------------------------------

def attention_pairs(sq: int, sk: int, causal: bool) -> int:
    """Query-key pairs computed: Sq*Sk, or with torch's causal mask (top-left aligned tril) the
    pairs kept: sum over rows i of min(i + 1, Sk), about half of Sq*Sk when Sq == Sk."""
    if not causal:
        return sq * sk
    if sq <= sk:
        return sq * (sq + 1) // 2
    return sk * (sk + 1) // 2 + (sq - sk) * sk


def _attention(b: dict, o: Any) -> int:
    """q [..., Sq, D], k [..., Sk, D], v [..., Sk, Dv]: 2 * pairs * D for QK^T plus 2 * pairs * Dv
    for PV, per (batch, head) of q (grouped-query K/V are shared, the work is not)."""
    q, k, v = b["query"], b["key"], b["value"]
    sq, d = q.shape[-2], q.shape[-1]
    sk, dv = k.shape[-2], v.shape[-1]
    bh = q.numel() // (sq * d) if sq * d else 0
    pairs = attention_pairs(sq, sk, bool(b.get("is_causal", False)))
    return 2 * bh * pairs * (d + dv)


ATTENTION_OPS = ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable")


# ---- per-element families ----------------------------------------------------------------------------

def _numel_in(b: dict) -> int:
    x = b.get("self", b.get("input"))
    return x.numel() if isinstance(x, torch.Tensor) else 0


POINTWISE_COST = {"addcmul": 2, "addcdiv": 2, "lerp": 2}
# Pointwise ops missing the `pointwise` tag in some torch versions.
POINTWISE_EXTRA = frozenset({
    "where", "eq", "ne", "lt", "le", "gt", "ge", "hardswish", "hardsigmoid", "gelu_", "silu_", "relu_", "hardtanh",
    "leaky_relu", "elu", "glu", "tril", "triu", "masked_fill", "clamp_min", "clamp_max", "threshold",
    "logical_not", "logical_and", "logical_or", "isnan", "isinf", "sign", "softplus", "mish", "square"})
REDUCTION_COST = {"var": 3, "std": 3, "var_mean": 3, "std_mean": 3, "norm": 2, "linalg_vector_norm": 2,
                  "logsumexp": 4}
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"})
SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"})
MOVEMENT = frozenset({
    "copy_", "_to_copy", "to", "clone", "contiguous", "cat", "stack", "index_select", "gather", "scatter",
    "scatter_add", "index", "index_put", "index_put_", "embedding", "take", "constant_pad_nd", "pad",
    "reflection_pad2d", "replicate_pad2d", "repeat", "repeat_interleave", "flip", "roll", "fill_", "zero_",
    "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "arange", "rand", "randn", "randint",
    "rand_like", "randn_like", "normal_", "uniform_", "random_", "bernoulli_", "masked_select", "nonzero",
    "slice_scatter", "select_scatter", "narrow_copy", "_local_scalar_dense", "masked_scatter",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "pixel_shuffle", "pixel_unshuffle",
    "split_with_sizes_copy", "unbind_copy", "lift_fresh_copy", "tensor", "scalar_tensor", "_unsafe_index",
    "sort", "topk", "argsort"})


def _norm(b: dict, per: int) -> int:
    n = _numel_in(b)
    affine = sum(1 for k in ("weight", "bias") if isinstance(b.get(k), torch.Tensor))
    return n * (per + affine)


def _batch_norm(b: dict) -> int:
    n = _numel_in(b)
    return n * (4 + (3 if bool(b.get("training", False)) else 0))


NORM: dict[str, Callable[[dict], int]] = {
    "layer_norm": lambda b: _norm(b, 5), "native_layer_norm": lambda b: _norm(b, 5),
    "group_norm": lambda b: _norm(b, 5), "native_group_norm": lambda b: _norm(b, 5),
    "rms_norm": lambda b: _norm(b, 3), "_fused_rms_norm": lambda b: _norm(b, 3),
    **{n: _batch_norm for n in ("batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                                "_native_batch_norm_legit_no_training", "cudnn_batch_norm",
                                "_batch_norm_impl_index", "miopen_batch_norm", "_batch_norm_with_update",
                                "_batch_norm_no_update", "instance_norm")},
}


def _pool(name: str, b: dict, o: Any) -> int:
    """Output elements x window elements; kernel_size=3 means 3x3 for a 2-d pool."""
    k = b.get("kernel_size")
    k = [k] if isinstance(k, int) else list(k)
    dims = 3 if "3d" in name else 2 if "2d" in name else 1
    if len(k) == 1:
        k = k * dims
    return _first_out(o).numel() * _prod(k)


POOLS = frozenset({"max_pool1d", "max_pool2d", "max_pool3d", "max_pool2d_with_indices", "max_pool3d_with_indices",
                   "avg_pool1d", "avg_pool2d", "avg_pool3d"})
ADAPTIVE_POOLS = frozenset({"adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d",
                            "_adaptive_avg_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
                            "adaptive_max_pool3d"})


# ---- entry points ------------------------------------------------------------------------------------

def _has_tag(func, tag: str) -> bool:
    t = getattr(torch.Tag, tag, None)
    return t is not None and t in func.tags


def flops(func, args: tuple, kwargs: dict, out: Any) -> tuple[int, str]:
    """(FLOPs, kind) of one operator call; kind "unknown" when there is no formula (0 FLOPs)."""
    name = func.overloadpacket.__name__
    base = name.rstrip("_") if name.endswith("_") and not name.startswith("_") else name
    b = bind(func, args, kwargs)
    if name in MATMUL:
        return MATMUL[name](b, out), "matmul"
    if name == "einsum":
        return _einsum(b, out), "matmul"
    if name in CONV:
        return CONV[name](b, out), "conv"
    if name in ATTENTION_OPS:
        return _attention(b, out), "attention"
    if name in SOFTMAX:
        return 5 * _numel_in(b), "softmax"
    if name in NORM:
        return NORM[name](b), "norm"
    if name in POOLS:
        return _pool(name, b, out), "pool"
    if name in ADAPTIVE_POOLS:
        return _numel_in(b), "pool"
    if name in MOVEMENT:
        return 0, "movement"
    if name in CUMULATIVE:
        return _numel_in(b), "reduction"
    if _has_tag(func, "reduction") or name in REDUCTION_COST or name in ("mean", "sum", "amax", "amin"):
        return REDUCTION_COST.get(name, 1) * _numel_in(b), "reduction"
    if _has_tag(func, "pointwise") or name in POINTWISE_EXTRA or base in POINTWISE_EXTRA:
        o = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        n = o[0].numel() if o else _numel_in(b)
        return POINTWISE_COST.get(base, 1) * n, "pointwise"
    return 0, "unknown"


def _tf32(kind: str) -> bool:
    """Whether fp32 work of this kind may run on TF32 tensor cores under the current torch settings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy flags warn about the newer fp32_precision API
        if kind == "conv":
            return bool(torch.backends.cudnn.allow_tf32)
        return bool(torch.backends.cuda.matmul.allow_tf32)


def dtype_ceiling(dtype: torch.dtype, *, tensor_core: bool, kind: str = "matmul") -> str | None:
    """The roofline precision key for work in ``dtype``. Non-tensor-core work (pointwise, norms,
    reductions) runs on the CUDA cores at the fp32 FMA rate whatever its dtype."""
    if not tensor_core:
        return "fp32"
    if dtype == torch.float32:
        return "tf32" if _tf32(kind) else "fp32"
    if dtype in (torch.float16, torch.bfloat16):
        return "fp16" if dtype == torch.float16 else "bf16"
    if dtype in (torch.int8, torch.uint8):
        return "int8"
    if "float8" in str(dtype):
        return "fp8"
    return None  # float64, complex: no ceiling in the probe's table


def ceiling_key(kind: str, args: tuple, kwargs: dict) -> str | None:
    """Precision key of the compute roof for this call: the first floating (or int8) input's dtype
    for tensor-core kinds on a GPU; "fp32" otherwise (CUDA cores, or a CPU, which has no TF32)."""
    if kind not in TENSOR_CORE_KINDS:
        return "fp32"
    t = next((x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)
              and (x.is_floating_point() or x.dtype in (torch.int8, torch.uint8))), None)
    if t is None:
        return "fp32"
    if t.device.type != "cuda" and t.dtype == torch.float32:
        return "fp32"
    return dtype_ceiling(t.dtype, tensor_core=True, kind=kind)
