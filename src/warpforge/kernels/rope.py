"""Rotary position embedding applied in place to q and k, and the cos/sin cache it reads.

Shapes: q [T, Hq, D], k [T, Hk, D] (tokens, heads, head_dim), any token/head strides (so views into a
fused qkv buffer work), unit stride along D; positions [T] int32/int64. Only the first R = rotary_dim
dims of each head rotate (partial rotary when R < D); the rest are left untouched.

The cache is vLLM's layout: ``cos_sin_cache`` [max_pos, R], cos in the first R/2 columns and sin in
the last R/2; or pass ``(cos, sin)``, each [max_pos, R/2]. ``neox`` layout rotates pairs
(i, i + R/2) (GPT-NeoX, Llama); ``interleaved`` rotates pairs (2i, 2i + 1) (GPT-J). Positions must
be in [0, max_pos): the kernel reads the cache row at each, so :func:`rope` checks them
(``check_values``; one host sync on the GPU, skipped during CUDA-graph capture). The LLM engine
passes ``check_values=False`` on the GPU: its positions come from sequence lengths it has already
bounded by max_model_len <= max_pos.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from warpforge.kernels import _dispatch  # noqa: F401  (chooses the interpreter before any @jit)
from warpforge.kernels import reference as ref
from warpforge.kernels._checks import check_num_warps, check_pow2, resolve_check_values
from warpforge.kernels._dispatch import pdl, pdl_enter, pdl_release, use_triton
from warpforge.kernels.attention.kv_cache import check_store, store_token_rows

LAYOUTS = ("neox", "interleaved")


@dataclass(frozen=True)
class RopeConfig:
    """``block_h`` heads per program (one token per program row of the grid)."""

    block_h: int
    num_warps: int

    def __post_init__(self) -> None:
        check_pow2(self, "block_h")
        check_num_warps(self)


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def rope_config(hq: int, hk: int, rotary_dim: int) -> RopeConfig:
    """Default: up to ~2K elements per program, heads per block no more than the smaller head count
    (no masked-off k heads), and ~8 elements per thread in each half tile (16-byte bf16 accesses)."""
    half = _pow2(rotary_dim // 2)
    heads = _pow2(min(hq, hk) if hk else hq)
    block_h = max(1, min(heads, 1024 // half))
    warps = max(1, min(8, block_h * half // 256))
    return RopeConfig(block_h=block_h, num_warps=_pow2(warps))


@triton.jit
def _rotate_heads(base, stride_h, nh, h0, cos, sin, i, imask, HALF,
                  INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # Rotate heads [h0, h0 + BLOCK_H) of one token in place; cos/sin [BLOCK_HALF] fp32.
    h = h0 + tl.arange(0, BLOCK_H)
    hmask = h < nh
    if INTERLEAVED:
        # Rows of 2 * BLOCK_HALF contiguous elements (wide loads), viewed as pairs (2i, 2i + 1) and
        # split into even/odd lanes in registers.
        d = tl.arange(0, 2 * BLOCK_HALF)
        offs = h[:, None] * stride_h + d[None, :]
        mask = hmask[:, None] & (d < 2 * HALF)[None, :]
        x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_HALF, 2)))
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        o = tl.reshape(tl.join(o1, o2), (BLOCK_H, 2 * BLOCK_HALF))
        tl.store(base + offs, o.to(base.dtype.element_ty), mask=mask)
    else:
        offs = h[:, None] * stride_h + i[None, :]
        mask = hmask[:, None] & imask[None, :]
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + offs + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(base + offs, o1.to(base.dtype.element_ty), mask=mask)
        tl.store(base + offs + HALF, o2.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
                 HQ, HK, stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
                 HALF, NUM_QB,
                 v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, HEAD_DIM, stride_vt, stride_vh,
                 stride_kcp, stride_kch, stride_kcs, stride_vcp, stride_vch, stride_vcs,
                 INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 STORE: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 1, BLOCK_D: tl.constexpr = 16,
                 QUANT: tl.constexpr = False, PDL: tl.constexpr = 0):
    # grid (T, NUM_QB + NUM_KB): program (t, b) rotates head block b of q (b < NUM_QB) or of k.
    # One launch for q and k (decode is launch-bound); the cos/sin row is read once per program.
    # STORE: a k program then also writes its heads' rotated K rows and V rows into the paged cache
    # (store_kv's work, one launch fewer per layer).
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    imask = i < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + i, mask=imask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + i, mask=imask, other=0.0).to(tl.float32)
    pdl_release(PDL)
    if b < NUM_QB:
        _rotate_heads(q_ptr + t * stride_qt, stride_qh, HQ, b * BLOCK_H, cos, sin, i, imask, HALF,
                      INTERLEAVED, BLOCK_H, BLOCK_HALF)
    else:
        h0 = (b - NUM_QB) * BLOCK_H
        _rotate_heads(k_ptr + t * stride_kt, stride_kh, HK, h0, cos, sin, i, imask, HALF,
                      INTERLEAVED, BLOCK_H, BLOCK_HALF)
        if STORE:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:
                tl.debug_barrier()  # the rotated k this program just stored, visible to all its threads
                store_token_rows(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, t, slot, h0 + tl.arange(0, BLOCK_H),
                                 HK, HEAD_DIM, stride_kt, stride_kh, stride_vt, stride_vh,
                                 stride_kcp, stride_kch, stride_kcs, stride_vcp, stride_vch, stride_vcs,
                                 PAGE_SIZE, BLOCK_H, BLOCK_D, QUANT)


def _check_qk(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name} must be contiguous along head_dim (stride 1), got strides {tuple(t.stride())}")


def _split_cache(cache, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) views, each [max_pos, R/2], from either accepted cache form."""
    if isinstance(cache, torch.Tensor):
        if cache.dim() != 2 or cache.shape[1] % 2:
            raise ValueError(f"cos_sin_cache must be [max_pos, rotary_dim] with rotary_dim even, "
                             f"got shape {tuple(cache.shape)}")
        half = cache.shape[1] // 2
        cos, sin = cache[:, :half], cache[:, half:]
    elif isinstance(cache, (tuple, list)) and len(cache) == 2:
        cos, sin = cache
        for t, nm in ((cos, "cos"), (sin, "sin")):
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"{nm} must be a 2-D tensor [max_pos, rotary_dim/2]")
        if cos.shape != sin.shape:
            raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    else:
        raise ValueError("cos_sin_cache must be a tensor [max_pos, rotary_dim] or a (cos, sin) pair")
    for t, nm in ((cos, "cos_sin_cache"), (sin, "cos_sin_cache")):
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise ValueError(f"{nm} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{nm} must be on {device} like q, got {t.device}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{nm} must be contiguous along its last dim")
    return cos, sin


def rope(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, cos_sin_cache, *,
         layout: str = "neox", rotary_dim: int | None = None,
         config: RopeConfig | None = None, v: torch.Tensor | None = None, cache=None,
         slot_mapping: torch.Tensor | None = None,
         check_values: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place by ``positions`` [T]; returns (q, k).

    ``cos_sin_cache``: [max_pos, R] (cos | sin halves, as :func:`rope_cache` builds) or ``(cos, sin)``
    each [max_pos, R/2]. ``rotary_dim`` defaults to R and, if given, must equal it. k may be None.
    With ``cache`` (an attention ``PagedKVCache``), ``v`` [T, Hk, D] and ``slot_mapping`` [T], the same
    launch also stores the rotated k and v at their slots, exactly as ``cache.store(k, v, slot_mapping)``
    would after the rotation (-1 skips a token; fp8 pages quantized with the cache's scales).
    ``check_values`` (default: yes, except during CUDA-graph capture): positions in [0, max_pos).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    _check_qk(q, "q")
    T, hq, d = q.shape
    hk = 0
    if k is not None:
        _check_qk(k, "k")
        if k.shape[0] != T or k.shape[2] != d or k.dtype != q.dtype or k.device != q.device:
            raise ValueError(f"k must be [{T}, Hk, {d}] with q's dtype {q.dtype} and device {q.device}; "
                             f"got {tuple(k.shape)} {k.dtype} {k.device}")
        hk = k.shape[1]
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be an int32 or int64 tensor, got {getattr(positions, 'dtype', positions)}")
    if positions.shape != (T,) or positions.device != q.device:
        raise ValueError(f"positions must be [{T}] on {q.device}, got {tuple(positions.shape)} on {positions.device}")
    cos, sin = _split_cache(cos_sin_cache, q.device)
    half = cos.shape[1]
    rot = 2 * half
    if rotary_dim is not None and rotary_dim != rot:
        raise ValueError(f"rotary_dim={rotary_dim} does not match the cache's rotary dim {rot}")
    if rot < 2 or rot > d:
        raise ValueError(f"rotary dim {rot} must be in [2, head_dim={d}]")
    if cache is not None:
        if k is None or v is None or slot_mapping is None:
            raise ValueError("cache: storing into the KV cache needs k, v and slot_mapping")
        check_store(k, v, cache.k_cache, cache.v_cache, slot_mapping, cache.k_scale, cache.v_scale)
    elif v is not None or slot_mapping is not None:
        raise ValueError("v and slot_mapping are only used with cache= (the fused KV store)")

    if resolve_check_values(check_values, q.device) and positions.numel():
        lo, hi = torch.aminmax(positions)
        if int(lo) < 0 or int(hi) >= cos.shape[0]:
            raise ValueError(f"positions must be in [0, max_pos={cos.shape[0]}), got min {int(lo)} max {int(hi)}")
    if not use_triton(q):
        q_rot, k_rot = ref.rope_reference(q[..., :rot], None if k is None else k[..., :rot], positions, cos, sin,
                                          layout=layout)
        q[..., :rot].copy_(q_rot)
        if k is not None:
            k[..., :rot].copy_(k_rot)
        if cache is not None:
            cache.store(k, v, slot_mapping)
        return q, k
    if T == 0:
        return q, k
    cfg = config or rope_config(hq, hk, rot)
    nqb = triton.cdiv(hq, cfg.block_h)
    nkb = triton.cdiv(hk, cfg.block_h) if k is not None else 0
    kk = k if k is not None else q
    if cache is not None:
        kc, vc = cache.k_cache, cache.v_cache
        store_args = (v, kc, vc, slot_mapping, cache.k_scale, cache.v_scale, d, v.stride(0), v.stride(1),
                      kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2))
        store_kw = dict(STORE=True, PAGE_SIZE=kc.shape[2], BLOCK_D=_pow2(d), QUANT=cache.is_fp8)
    else:  # STORE off: the store's pointers and strides are never read; any valid tensors/zeros fill them
        store_args, store_kw = (q, q, q, positions, cos, cos, d) + (0,) * 8, {}
    _rope_kernel[(T, nqb + nkb)](
        q, kk, positions, cos, sin, hq, hk, q.stride(0), q.stride(1), kk.stride(0), kk.stride(1),
        cos.stride(0), sin.stride(0), half, nqb, *store_args,
        INTERLEAVED=layout == "interleaved", BLOCK_H=cfg.block_h, BLOCK_HALF=_pow2(half), **store_kw,
        PDL=pdl(q), launch_pdl=pdl(q) > 0, num_warps=cfg.num_warps)
    return q, k


def rope_inv_freq(rotary_dim: int, base: float = 10000.0, scaling: dict | None = None) -> torch.Tensor:
    """Inverse frequencies [R/2] in float64, with HF-style ``rope_scaling`` ("default", "linear", "llama3")."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be an even number >= 2, got {rotary_dim}")
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        try:
            factor = float(scaling["factor"])
            low = float(scaling["low_freq_factor"])
            high = float(scaling["high_freq_factor"])
            old_ctx = float(scaling["original_max_position_embeddings"])
        except KeyError as e:
            raise ValueError(f"llama3 rope scaling needs {e.args[0]!r}") from None
        if high <= low:
            raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}")
        wavelen = 2 * math.pi / inv
        # Long wavelengths (low frequencies) are slowed by `factor`; short ones kept; a smooth blend between.
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


def rope_cache(max_pos: int, rotary_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None, scaling: dict | None = None) -> torch.Tensor:
    """The cos/sin cache [max_pos, rotary_dim]: cos(p * f) in the first half, sin(p * f) in the second.

    Computed in float64, stored in ``dtype`` (float32 keeps the angle error of long contexts small).
    """
    if max_pos < 1:
        raise ValueError(f"max_pos must be >= 1, got {max_pos}")
    inv = rope_inv_freq(rotary_dim, base, scaling)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]  # [max_pos, R/2]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)


__all__ = ["LAYOUTS", "RopeConfig", "rope", "rope_cache", "rope_config", "rope_inv_freq"]
