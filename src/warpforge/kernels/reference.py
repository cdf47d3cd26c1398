"""Torch references for every Triton kernel in warpforge.kernels.

Each function's docstring names the kernel it checks. References compute in float32 or float64 and
return the kernel's output dtype only when asked; tests compare against them with the tolerances
in :mod:`warpforge.kernels.tolerance`. On CPU tensors the public launchers run these directly.

Sections below belong to kernel families; keep each family's functions inside its section.
"""

from __future__ import annotations

import torch

# ---- memory (copy, fill, sum): kernels/memory.py --------------------------------------------


def copy_ref(src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for ``memory.copy`` (kernel ``_copy_kernel``): ``out[...] = src``, bit-exact."""
    if out is None:
        return src.clone(memory_format=torch.contiguous_format)
    return out.copy_(src)


def fill_ref(out: torch.Tensor, value: float) -> torch.Tensor:
    """Reference for ``memory.fill`` (kernel ``_fill_kernel``): every element set to ``value`` rounded to
    out's dtype."""
    return out.fill_(value)


def sum_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference for ``memory.sum`` (kernels ``_sum_partials_kernel`` + ``_sum_finish_kernel``).

    Accumulates in float64 (so it is the "higher precision" side of a check) and returns a 0-d
    float32 tensor like the kernel.
    """
    return x.detach().to(torch.float64).sum().to(torch.float32)


# ---- matmul family (matmul, matmul_fp8, gemv/linear, quant_linear): kernels/{matmul,gemv,quant_linear}.py

_MATMUL_ACTIVATIONS = {
    None: lambda y: y,
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda y: torch.nn.functional.gelu(y, approximate="tanh"),
    "silu": torch.nn.functional.silu,
}


def _matmul_epilogue(y, bias, activation, residual, out_dtype):
    if bias is not None:
        y = y + bias.to(y.dtype)
    y = _MATMUL_ACTIVATIONS[activation](y)
    if residual is not None:
        y = y + residual.to(y.dtype)
    return y.to(out_dtype) if out_dtype is not None else y


def matmul_ref(a, b, bias=None, activation=None, residual=None, out_dtype=None, *, acc_dtype=torch.float32):
    """Reference for ``matmul.matmul`` (kernels ``_matmul_tma_kernel``, ``_matmul_ptr_kernel``).

    ``activation(a @ b + bias) + residual`` computed in ``acc_dtype``; a [M, K], b [K, N], bias [N],
    residual [M, N]; activation None|"relu"|"gelu"|"gelu_tanh"|"silu".
    """
    y = a.to(acc_dtype) @ b.to(acc_dtype)
    return _matmul_epilogue(y, bias, activation, residual, out_dtype)


def matmul_fp8_ref(a, b, scale_a, scale_b, bias=None, activation=None, residual=None, out_dtype=None, *,
                   acc_dtype=torch.float32):
    """Reference for ``matmul_fp8.matmul_fp8`` (the matmul kernels with e4m3 operands and scaled epilogue).

    ``activation((a @ b) * scale_a * scale_b + bias) + residual``; scale_a is one value or one per row
    of a ([M] or [M, 1]), scale_b one value or one per column of b ([N] or [1, N]).
    """
    y = a.to(acc_dtype) @ b.to(acc_dtype)
    sa, sb = scale_a.to(acc_dtype), scale_b.to(acc_dtype)
    y = y * (sa.reshape(()) if sa.numel() == 1 else sa.reshape(-1, 1))
    y = y * (sb.reshape(()) if sb.numel() == 1 else sb.reshape(1, -1))
    return _matmul_epilogue(y, bias, activation, residual, out_dtype)


def matmul_int8_ref(a, b, scale_a, scale_b, bias=None, activation=None, residual=None, out_dtype=None, *,
                    acc_dtype=torch.float32):
    """Reference for ``matmul_int8.matmul_int8`` (the matmul kernels with int8 operands, INT_ACC=True).

    The int8 product is exact (float64 holds every int32 sum of K int8 products), then, as the kernel
    does, converted to ``acc_dtype`` before ``activation(y * scale_a * scale_b + bias) + residual``.
    Scales as in :func:`matmul_fp8_ref`.
    """
    y = (a.to(torch.float64) @ b.to(torch.float64)).to(acc_dtype)
    sa, sb = scale_a.to(acc_dtype), scale_b.to(acc_dtype)
    y = y * (sa.reshape(()) if sa.numel() == 1 else sa.reshape(-1, 1))
    y = y * (sb.reshape(()) if sb.numel() == 1 else sb.reshape(1, -1))
    return _matmul_epilogue(y, bias, activation, residual, out_dtype)


def linear_ref(x, weight, bias=None, activation=None, out_dtype=None, *, acc_dtype=torch.float32):
    """Reference for ``gemv.linear``/``gemv.gemv`` (kernel ``_linear_kernel`` + ``_splitk_reduce_kernel``).

    ``activation(x @ weight.T + bias)``; x [..., K], weight [N, K] (dequantize a packed weight first
    with ``QuantizedWeight.dequantize()``, which is :func:`dequantize_ref`). With ``norm=`` (the fused
    input RMSNorm, ``_norm_rstd`` and the NORM branch of ``_linear_step``) x is
    :func:`rms_norm_reference`'s output rounded to x's dtype, its ``s`` (rounded) the new residual.
    """
    y = x.to(acc_dtype) @ weight.to(acc_dtype).T
    return _matmul_epilogue(y, bias, activation, None, out_dtype)


def dequantize_ref(scheme, data, scales, mins, group, shape, dtype):
    """Reference for the in-register dequantization of ``quant_linear._load_weight_tile``.

    int8: data int8 [N, K] * scales fp32 [N]; fp8: data e4m3 [N, K] * scales fp32 [N];
    int4_g{32,64,128}: data uint8 [N, Kp/2] (k even in the low nibble, k odd in the high one),
    ``q * scales + mins`` per group of ``group`` columns (scales and mins [N, Kp/group] in the weight's
    dtype); Kp is K rounded up to the group, padding cut off. Computed in float32, returned as [N, K]
    in ``dtype``.
    """
    n, k = shape
    if scheme in ("int8", "fp8"):
        w = data.to(torch.float32) * scales.to(torch.float32)[:, None]
    elif scheme.startswith("int4"):
        q = torch.stack([data & 0xF, data >> 4], dim=-1).reshape(n, -1).to(torch.float32)
        m = mins.to(torch.float32).repeat_interleave(group, dim=1)
        s = scales.to(torch.float32).repeat_interleave(group, dim=1)
        w = (q * s + m)[:, :k]
    else:
        raise ValueError(f"scheme: unknown quantization scheme {scheme!r}")
    return w.to(dtype)


# ---- fused ops (conv2d, norms, rope, activations, softmax): kernels/{conv,norm,rope,activation}.py

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MIN_AMAX = 1e-12  # floor on a row's absmax so an all-zero row gets a finite scale


def activation_reference(y: torch.Tensor, activation: str | None, *, inplace: bool = False) -> torch.Tensor:
    """Reference for ``apply_activation`` in kernels/activation.py (used by the conv epilogue). ``inplace``:
    relu / relu6 overwrite y (a caller's fresh intermediate: the same values, no second large buffer)."""
    fn = torch.nn.functional
    if activation is None:
        return y
    if activation == "relu":
        return torch.relu_(y) if inplace else torch.relu(y)
    if activation == "silu":
        return fn.silu(y)
    if activation == "gelu":
        return fn.gelu(y)
    if activation == "gelu_tanh":
        return fn.gelu(y, approximate="tanh")
    if activation == "relu6":
        return y.clamp_(0.0, 6.0) if inplace else y.clamp(0.0, 6.0)
    raise ValueError(f"unknown activation {activation!r}")


def conv2d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     stride=1, padding=0, dilation=1, groups: int = 1, activation: str | None = None,
                     residual: torch.Tensor | None = None, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference for ``_conv_gemm_kernel`` and ``_conv_depthwise_kernel`` (kernels/conv_gemm.py, conv_depthwise.py).

    ``act(conv2d(x, weight) + bias + residual)`` in ``compute_dtype`` (x [N, C, H, W], weight
    [Cout, C/groups, KH, KW], residual [N, Cout, OH, OW]).
    """
    cd = compute_dtype
    y = torch.nn.functional.conv2d(x.to(cd), weight.to(cd), None if bias is None else bias.to(cd),
                                   stride, padding, dilation, groups)
    if residual is not None:
        y = y + residual.to(cd)
    return activation_reference(y, activation, inplace=True)  # y is this function's own


# float32 holds every integer up to 2^24 exactly. One product |(x_q - zero_point) * w_q| <= 255 * 128, so in a
# 1x1 conv (a matrix product over the input channels: every CPU backend sums the products themselves, no
# Winograd / FFT transform) of at most F32_EXACT_TAPS input channels every partial sum, in whatever order it
# is added, is an integer below 2^24: float32 gives the exact sums, as float64 does, several times faster
# on CPU (float64 conv has no oneDNN path). 2^24 // (255 * 128) = 513 channels. Larger kernels stay float64.
F32_EXACT_TAPS = 2 ** 24 // (255 * 128)


def _int8_conv_exact(x_q: torch.Tensor, w_q: torch.Tensor, stride, padding, dilation, groups: int,
                     x_zero_point: int) -> torch.Tensor:
    """The exact conv of (x_q - x_zero_point) and w_q: float32 (its values the exact integers) for a 1x1
    conv of <= F32_EXACT_TAPS channels per group, int32 for a larger 1x1 conv without groups (the sum of
    exact float32 convs of channel chunks within that bound), otherwise int32 from one float64 conv."""
    f = torch.nn.functional
    one_by_one = w_q.shape[2] == 1 and w_q.shape[3] == 1
    if one_by_one and w_q.shape[1] <= F32_EXACT_TAPS:
        return f.conv2d(x_q.to(torch.float32) - x_zero_point, w_q.to(torch.float32), None, stride, padding,
                        dilation, groups)
    if not one_by_one or groups != 1:  # float64 holds every sum exactly (|sum| <= K * 255 * 128 < 2^53)
        y = f.conv2d(x_q.to(torch.float64) - x_zero_point, w_q.to(torch.float64), None, stride, padding, dilation,
                     groups)
        return y.to(torch.int32)
    acc = None
    for c in range(0, w_q.shape[1], F32_EXACT_TAPS):  # chunks of input channels, each exact in float32
        part = f.conv2d(x_q[:, c:c + F32_EXACT_TAPS].to(torch.float32) - x_zero_point,
                        w_q[:, c:c + F32_EXACT_TAPS].to(torch.float32), None, stride, padding, dilation)
        part = part.to(torch.int32)  # exact integers; int32 sums them exactly (the launcher bounds K)
        acc = part if acc is None else acc.add_(part)
    return acc


def conv2d_int8_acc_reference(x_q: torch.Tensor, w_q: torch.Tensor, *, stride=1, padding=0, dilation=1,
                              groups: int = 1, x_zero_point: int = 0) -> torch.Tensor:
    """The exact int32 accumulator of ``_conv_gemm_kernel`` with INT_ACC (kernels/conv_gemm.py): conv2d of
    (x_q - x_zero_point) [N, C, H, W] (zero padding: the padded x is 0) and int8 w_q [Cout, C/groups, KH, KW]
    as int32 [N, Cout, OH, OW]. Computed exactly by :func:`_int8_conv_exact` (1x1: float32 convs of at most
    F32_EXACT_TAPS channels; else float64; the launcher bounds K so that the sum fits int32)."""
    return _int8_conv_exact(x_q, w_q, stride, padding, dilation, groups, x_zero_point).to(torch.int32)


def conv2d_int8_reference(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                          bias: torch.Tensor | None = None, *, stride=1, padding=0, dilation=1, groups: int = 1,
                          activation: str | None = None, residual: torch.Tensor | None = None,
                          out_scale: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float16,
                          x_zero_point: int = 0, out_zero_point: int = 0) -> torch.Tensor:
    """Reference for ``_conv_gemm_kernel`` with INT_ACC (kernels/conv_gemm.py), launched by ``conv2d_int8``
    (kernels/conv_int8.py), in the kernel's order of fp32 operations:

    y = act(fp32(acc) * (x_scale * w_scale[co]) + bias + residual), acc the exact int32 conv of
    (x_q - x_zero_point) and w_q; returns y in ``out_dtype``, or with ``out_scale`` int8 quantized as
    :func:`quantize_int8_reference` does with ``out_zero_point``.
    """
    # float32 already (exact integers < 2^24, so fp32(acc) itself) or int32
    acc = _int8_conv_exact(x_q, w_q, stride, padding, dilation, groups, x_zero_point)
    scale = x_scale.float().reshape(()) * w_scale.float().reshape(-1)  # [Cout]
    y = acc.float().mul_(scale.view(1, -1, 1, 1))  # acc is ours (fresh): in place, the same values
    if bias is not None:
        y.add_(bias.float().view(1, -1, 1, 1))
    if residual is not None:
        y.add_(residual.float())
    y = activation_reference(y, activation, inplace=True)
    if out_scale is not None:
        return quantize_int8_reference(y, out_scale, out_zero_point)
    return y.to(out_dtype)


def quantize_int8_reference(x: torch.Tensor, scale: torch.Tensor, zero_point: int = 0) -> torch.Tensor:
    """Reference for ``_quantize_int8_kernel`` (kernels/quantize.py) and the conv epilogue's int8 out:
    clamp(round(x * (1 / scale)) + zero_point, -127 (zero_point 0) or -128, 127) in fp32 (the reciprocal an
    IEEE division, then one multiply; round half to even), x's layout kept."""
    q = torch.round(x.float() * torch.reciprocal(scale.float().reshape(()))) + zero_point
    return q.clamp_(-127 if zero_point == 0 else -128, 127).to(torch.int8)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, *,
                       residual: torch.Tensor | None = None, weight_offset: float = 0.0,
                       compute_dtype: torch.dtype = torch.float32):
    """Reference for ``_norm_kernel`` (IS_RMS) in kernels/norm.py.

    s = x + residual (or x); y = s / sqrt(mean(s^2) + eps) * (weight + weight_offset) over the last dim.
    Returns y, or (y, s) when ``residual`` is given.
    """
    s = x.to(compute_dtype) if residual is None else x.to(compute_dtype) + residual.to(compute_dtype)
    y = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (weight.to(compute_dtype) + weight_offset)
    return y if residual is None else (y, s)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                         eps: float = 1e-5, *, residual: torch.Tensor | None = None, weight_offset: float = 0.0,
                         compute_dtype: torch.dtype = torch.float32):
    """Reference for ``_norm_kernel`` (not IS_RMS) in kernels/norm.py.

    s = x + residual (or x); y = (s - mean) / sqrt(var + eps) * (weight + weight_offset) + bias.
    Returns y, or (y, s) when ``residual`` is given.
    """
    s = x.to(compute_dtype) if residual is None else x.to(compute_dtype) + residual.to(compute_dtype)
    mean = s.mean(-1, keepdim=True)
    var = (s - mean).square().mean(-1, keepdim=True)
    y = (s - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * (weight.to(compute_dtype) + weight_offset)
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y if residual is None else (y, s)


def quant_fp8_rows_reference(y: torch.Tensor, scale: torch.Tensor | None = None):
    """Reference for the fp8 epilogue of ``_norm_kernel``: e4m3 values and a float32 scale.

    Dynamic (``scale`` None): one scale per row, scale = max(absmax(row), 1e-12) / 448, shape [..., 1].
    Static: the given scalar scale. In both, q = clamp(y / scale, -448, 448) rounded to e4m3, and
    y ~= q.float() * scale.
    """
    y = y.float()
    if scale is None:
        scale = y.abs().amax(-1, keepdim=True).clamp_min(FP8_MIN_AMAX) / FP8_E4M3_MAX
    q = (y / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.float()


def rope_reference(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, *, layout: str = "neox", compute_dtype: torch.dtype = torch.float32):
    """Reference for ``_rope_kernel`` (kernels/rope.py); returns rotated copies (q', k').

    q [T, Hq, D], k [T, Hk, D] (or None), positions [T], cos/sin [max_pos, R/2] with R = rotary dim.
    neox pairs dims (i, i + R/2); interleaved pairs (2i, 2i + 1); dims >= R pass through.
    """
    half = cos.shape[-1]
    c = cos[positions.long()].to(compute_dtype)[:, None, :]  # [T, 1, R/2]
    s = sin[positions.long()].to(compute_dtype)[:, None, :]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        t = t.to(compute_dtype).clone()
        if layout == "neox":
            x1, x2 = t[..., :half].clone(), t[..., half:2 * half].clone()
            t[..., :half] = x1 * c - x2 * s
            t[..., half:2 * half] = x2 * c + x1 * s
        elif layout == "interleaved":
            x1, x2 = t[..., 0:2 * half:2].clone(), t[..., 1:2 * half:2].clone()
            t[..., 0:2 * half:2] = x1 * c - x2 * s
            t[..., 1:2 * half:2] = x2 * c + x1 * s
        else:
            raise ValueError(f"unknown rope layout {layout!r}")
        return t

    return rotate(q), (None if k is None else rotate(k))


def silu_and_mul_reference(x: torch.Tensor, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference for ``_gated_kernel`` (silu) in kernels/activation.py: silu(x[..., :d]) * x[..., d:]."""
    d = x.shape[-1] // 2
    xc = x.to(compute_dtype)
    return torch.nn.functional.silu(xc[..., :d]) * xc[..., d:]


def gelu_and_mul_reference(x: torch.Tensor, approximate: str = "none",
                           compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference for ``_gated_kernel`` (gelu) in kernels/activation.py: gelu(x[..., :d]) * x[..., d:]."""
    d = x.shape[-1] // 2
    xc = x.to(compute_dtype)
    return torch.nn.functional.gelu(xc[..., :d], approximate=approximate) * xc[..., d:]


def softmax_reference(x: torch.Tensor, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Reference for ``_softmax_kernel``, ``_softmax_looped_kernel`` and their persistent-grid forms
    ``_softmax_rows_persistent_kernel`` / ``_softmax_persistent_kernel`` in kernels/activation.py."""
    return torch.softmax(x.to(compute_dtype), dim=-1)


# ---- attention (flash prefill, paged decode, kv cache): kernels/attention/ --------------------


def attention_window(window, causal: bool) -> tuple[int, int]:
    """(left, right) key bounds of the attention kernels' ``window`` argument; -1 means unbounded.

    A query at key-coordinate position p sees key j iff ``p - left <= j <= p + right``. ``window`` is
    None (no limit), an int w (w keys each side, FlashAttention's ``window_size=(w, w)``) or a pair
    (left, right) with -1 for unbounded. ``causal`` forces right = 0. Shared by the launchers and the
    references below so both read the argument the same way.
    """
    if window is None:
        left, right = -1, -1
    elif isinstance(window, int) and not isinstance(window, bool):
        if window < 0:
            raise ValueError(f"window: expected an int >= 0 or a (left, right) pair, got {window}")
        left, right = window, window
    elif isinstance(window, tuple | list) and len(window) == 2 and all(
        isinstance(w, int) and not isinstance(w, bool) for w in window
    ):
        left, right = int(window[0]), int(window[1])
        if left < -1 or right < -1:
            raise ValueError(f"window: expected (left, right) with each >= -1 (-1 = unbounded), got {window}")
    else:
        raise ValueError(f"window: expected None, an int or a (left, right) pair of ints, got {window!r}")
    if causal:
        right = 0
    return left, right


def _attend_ref(q, k, v, *, scale, left, right, softcap, q_offset):
    """fp32 attention of one sequence: q [Sq, H, D], k/v [Sk, Hkv, D] -> (out [Sq, H, D], lse [H, Sq]).

    Query i sits at key position ``q_offset + i``. Rows that see no key give out 0 and lse -inf.
    Query rows are processed in chunks so an S x S score matrix never has to fit at once.
    """
    Sq, H, D = q.shape
    Sk, Hkv = k.shape[0], k.shape[1]
    group = H // Hkv
    qf = q.float().transpose(0, 1)  # [H, Sq, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, Sk, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    out = torch.empty(H, Sq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(H, Sq, dtype=torch.float32, device=q.device)
    kpos = torch.arange(Sk, device=q.device)
    rows = max(1, (256 << 20) // max(1, 4 * H * Sk))  # ~256 MiB of scores per chunk
    for i in range(0, Sq, rows):
        s = (qf[:, i:i + rows] @ kf.transpose(1, 2)) * scale  # [H, r, Sk]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        qpos = q_offset + torch.arange(i, min(Sq, i + rows), device=q.device)
        keep = torch.ones(qpos.shape[0], Sk, dtype=torch.bool, device=q.device)
        if right >= 0:
            keep &= kpos[None, :] <= qpos[:, None] + right
        if left >= 0:
            keep &= kpos[None, :] >= qpos[:, None] - left
        s = s.masked_fill(~keep, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)  # [H, r]; -inf where no key is visible
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[:, i:i + rows] = p @ vf
        lse[:, i:i + rows] = row_lse
    return out.transpose(0, 1), lse


def flash_attention_ref(q, k, v, *, causal: bool, scale=None, window=None, softcap=None,
                        cu_seqlens_q=None, cu_seqlens_k=None, return_lse: bool = False):
    """Reference for ``flash_attention`` (kernel ``_flash_fwd_kernel`` in kernels/attention/prefill.py).

    Same arguments and layouts: q [B, Sq, H, D] / k, v [B, Sk, Hkv, D], or packed q [Tq, H, D] /
    k, v [Tk, Hkv, D] with int32 ``cu_seqlens_q/k`` [B + 1]. Causal masking is bottom-right aligned
    (query i of Sq sits at key position Sk - Sq + i). Returns float32 out in q's shape, and with
    ``return_lse`` the natural-log log-sum-exp, [B, H, Sq] (batched) or [H, Tq] (packed).
    """
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    left, right = attention_window(window, causal)
    if cu_seqlens_q is None:
        outs, lses = [], []
        for b in range(q.shape[0]):
            o, lse = _attend_ref(q[b], k[b], v[b], scale=scale, left=left, right=right, softcap=softcap,
                                 q_offset=k.shape[1] - q.shape[1])
            outs.append(o)
            lses.append(lse)
        out, lse = torch.stack(outs), torch.stack(lses)
    else:
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            (q0, q1), (k0, k1) = (cq[b], cq[b + 1]), (ck[b], ck[b + 1])
            o, s = _attend_ref(q[q0:q1], k[k0:k1], v[k0:k1], scale=scale, left=left, right=right,
                               softcap=softcap, q_offset=(k1 - k0) - (q1 - q0))
            out[q0:q1] = o
            lse[:, q0:q1] = s
    return (out, lse) if return_lse else out


def quantize_kv_ref(x, scale):
    """e4m3 quantization of ``store_kv`` (kernels/attention/kv_cache.py ``_store_kv_kernel``).

    x [T, Hkv, D], scale [Hkv] fp32: round(x / scale) saturated to +-448 (e4m3's largest finite value).
    """
    y = x.float() / scale.float()[None, :, None]
    return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Reference for ``store_kv`` (kernel ``_store_kv_kernel`` in kernels/attention/kv_cache.py).

    In place: token t goes to page ``slot // page_size``, row ``slot % page_size`` of the head-major
    caches [num_pages, Hkv, page_size, D]; slot -1 skips the token. fp8 caches quantize with the
    per-head scales.
    """
    page_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    pages, rows = slots // page_size, slots % page_size
    for x, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = x[keep]
        x = quantize_kv_ref(x, sc) if cache.dtype == torch.float8_e4m3fn else x.to(cache.dtype)
        cache[pages, :, rows] = x


def gather_kv_ref(cache, block_row, length: int, scale=None):
    """fp32 [length, Hkv, D] of one sequence read through its block-table row (dequantized if fp8)."""
    page_size = cache.shape[2]
    n_pages = -(-length // page_size)
    pages = block_row[:n_pages].long()
    x = cache[pages].float()  # [n_pages, Hkv, P, D]
    if scale is not None:
        x = x * scale.float()[None, :, None, None]
    return x.transpose(1, 2).reshape(n_pages * page_size, cache.shape[1], cache.shape[3])[:length]


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, *, scale=None,
                        softcap=None, window=None, k_scale=None, v_scale=None):
    """Reference for ``chunked_prefill`` (kernel ``_chunked_kernel``, kernels/attention/chunked.py).

    q [T, Hq, D] packs each sequence's newest tokens (cu_seqlens_q [B + 1]); sequence b has
    seq_lens[b] tokens in the paged cache, its queries are the last ones, attention is causal.
    Returns float32 [T, Hq, D].
    """
    D = q.shape[-1]
    scale = D ** -0.5 if scale is None else scale
    left, right = attention_window(window, causal=True)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cq, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b in range(len(lens)):
        q0, q1, L = cq[b], cq[b + 1], lens[b]
        if q1 == q0:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], L, k_scale)
        v = gather_kv_ref(v_cache, block_tables[b], L, v_scale)
        out[q0:q1] = _attend_ref(q[q0:q1], k, v, scale=scale, left=left, right=right, softcap=softcap,
                                 q_offset=L - (q1 - q0))[0]
    return out


def paged_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, softcap=None,
                     window=None, k_scale=None, v_scale=None):
    """Reference for ``paged_decode`` (kernels ``_decode_kernel`` + ``_decode_reduce_kernel``,
    kernels/attention/decode.py): one query per sequence, q [B, Hq, D] at position seq_lens[b] - 1.
    Sequences of length 0 give zeros. Returns float32 [B, Hq, D].
    """
    B = q.shape[0]
    cu = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, cu, scale=scale,
                               softcap=softcap, window=window, k_scale=k_scale, v_scale=v_scale)


def quantize_q_e4m3_ref(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for the query quantization of ``paged_decode`` with ``DecodeConfig(qk_fp8=True)``
    (``quantize_rows_e4m3`` in kernels/attention/_qk_fp8.py): q [..., D] -> (e4m3 [..., D], fp32 scale
    [...]) with q ~= q8 * scale, one power-of-two scale per head putting its max |q| in (224, 448]."""
    x = q.float()
    amax = x.abs().amax(-1)
    e = torch.frexp(amax).exponent.float() - 1  # floor(log2(amax)), exact
    s = e - 8
    s = torch.where(amax * torch.exp2(-s) > 448.0, s + 1, s)
    s = torch.where(amax >= 2.0 ** -126, s.clamp(-120, 120), torch.zeros_like(s))  # zero (or fp32-subnormal) rows: 1
    scale = torch.exp2(s)
    return (x / scale[..., None]).to(torch.float8_e4m3fn), scale


# ---- GGUF blocks (Q8_0, Q5_0, Q4_K, Q6_K as llama.cpp stores them): kernels/gguf.py ---------------

# ggml type id -> (values per block, bytes per block); the ids are ggml's own.
GGUF_BLOCKS = {8: (32, 34), 6: (32, 22), 12: (256, 144), 14: (256, 210)}
GGUF_NAMES = {8: "Q8_0", 6: "Q5_0", 12: "Q4_K", 14: "Q6_K"}


def _f16_at(b: torch.Tensor, i: int) -> torch.Tensor:  # [..., nb, bytes] -> fp32 [..., nb, 1]
    return b[..., i:i + 2].contiguous().view(torch.float16).float()


def _low_high(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return b & 15, b >> 4


def gguf_dequantize_ref(raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Reference for ``gguf.gguf_dequantize`` (kernel ``_dequant_kernel``) and the block GEMV's in-register
    dequantization: raw uint8 [N, K / QK * bytes] in the file's block layout -> float32 [N, K]."""
    qk, nbytes = GGUF_BLOCKS[qtype]
    blocks = raw.reshape(raw.shape[0], k // qk, nbytes)  # [N, nb, bytes]
    if qtype == 8:  # Q8_0: fp16 d, 32 int8
        return (_f16_at(blocks, 0) * blocks[..., 2:].view(torch.int8)).reshape(raw.shape[0], k)
    b = blocks.to(torch.int32)
    if qtype == 6:  # Q5_0: fp16 d, 32 high bits (uint32 LE), 16 bytes of nibbles (first 16 low, last 16 high)
        bits = (b[..., 2:6, None] >> torch.arange(8)) & 1  # [N, nb, 4, 8]: value j is byte j // 8, bit j % 8
        lo, hi = _low_high(b[..., 6:22])
        q = torch.cat([lo, hi], -1) | (bits.reshape(*b.shape[:2], 32) << 4)
        w = _f16_at(raw.reshape(b.shape), 0) * (q - 16)
    elif qtype == 12:  # Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) x 8, 128 bytes of nibbles
        s = b[..., 4:16]
        sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)  # [N, nb, 8]
        mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
        lo, hi = _low_high(b[..., 16:].reshape(*b.shape[:2], 4, 32))  # 64 values per 32 bytes: low, then high
        q = torch.stack([lo, hi], -2).reshape(*b.shape[:2], 8, 32)
        r = raw.reshape(b.shape)
        w = _f16_at(r, 0)[..., None] * sc[..., None] * q - _f16_at(r, 2)[..., None] * mn[..., None]
    elif qtype == 14:  # Q6_K: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales (one per 16), fp16 d
        ql = b[..., :128].reshape(*b.shape[:2], 2, 2, 32)  # [half, first/second 32 bytes, l]
        qh = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32)
        lo, hi = _low_high(ql)  # values 0..63 of a half from the low nibbles, 64..127 from the high
        q = torch.stack([lo | ((qh >> torch.tensor([[0], [2]])) & 3) << 4,
                         hi | ((qh >> torch.tensor([[4], [6]])) & 3) << 4], -3)  # [N, nb, 2, 2, 2, 32]
        q = q.reshape(*b.shape[:2], 16, 16) - 32
        sc = b[..., 192:208] - ((b[..., 192:208] >> 7) << 8)
        w = _f16_at(raw.reshape(b.shape), 208)[..., None] * sc[..., None] * q
    else:
        raise ValueError(f"qtype: expected one of {GGUF_NAMES}, got {qtype}")
    return w.reshape(raw.shape[0], k)


def gguf_linear_ref(x: torch.Tensor, raw: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Reference for ``gguf.gguf_linear`` (kernel ``_gemv_kernel``, and the prefill path's dequantize + matmul):
    x [M, K] @ dequantize(raw).T in float32 -> [M, N] float32. In chunks of rows, so that a 262k-row
    head's dense copy never exists whole."""
    x, rows = x.float(), max(1, (1 << 22) // k)
    return torch.cat([x @ gguf_dequantize_ref(raw[i:i + rows], qtype, k).T for i in range(0, raw.shape[0], rows)], -1)
