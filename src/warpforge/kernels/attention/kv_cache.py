"""Paged KV cache: fixed-size pages, one block table per sequence, fp16/bf16 or fp8 e4m3 pages.

Layout (head-major pages):

    k_cache, v_cache: [num_pages, num_kv_heads, page_size, head_dim]

so one KV head's page is ``page_size * head_dim`` contiguous elements (4 KiB for 16 x 128 bf16): a
decode program, which owns one (sequence, KV head), streams whole contiguous pages. Token ``pos`` of a
sequence lives in page ``block_table[pos // page_size]`` at row ``pos % page_size``; its *slot* is
``page * page_size + row``. Sequences may share pages (a cached prefix) since kernels only read them.

fp8 pages hold e4m3 values with one fp32 scale per KV head (``k_scale``, ``v_scale`` [num_kv_heads]):
``stored = saturate(x / scale)``, quantized on write by :func:`store_kv`. A per-head scale is a scalar
per decode program, so it is folded into the logit scale and the output normalization instead of
being applied to every loaded element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from warpforge.kernels._checks import resolve_check_values
from warpforge.kernels._dispatch import pdl, pdl_enter, pdl_release, use_triton
from warpforge.kernels.reference import store_kv_ref

import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == FP8


def _check_pages(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """Layout, dtype and scale checks of a K/V page pair (no host sync: runs on every store)."""
    for name, t in (("k_cache", k), ("v_cache", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name}: expected a tensor [num_pages, num_kv_heads, page_size, head_dim]")
        if t.dtype not in CACHE_DTYPES:
            raise ValueError(f"{name}: expected dtype in {CACHE_DTYPES}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a unit stride on head_dim, got strides {t.stride()}")
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v_cache: expected k_cache's {tuple(k.shape)} {k.dtype} on {k.device}, "
                         f"got {tuple(v.shape)} {v.dtype} on {v.device}")
    head_dim, num_kv_heads = k.shape[3], k.shape[1]
    if head_dim % 8 or not 8 <= head_dim <= 256:
        raise ValueError(f"k_cache: head_dim must be a multiple of 8 in [8, 256], got {head_dim}")
    if _is_fp8(k):
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if (not isinstance(s, torch.Tensor) or s.shape != (num_kv_heads,) or s.dtype != torch.float32
                    or s.device != k.device):
                got = f"{s.dtype} {tuple(s.shape)} on {s.device}" if isinstance(s, torch.Tensor) else repr(s)
                raise ValueError(f"{name}: fp8 pages need float32 [{num_kv_heads}] scales on {k.device}, got {got}")
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale, v_scale: only fp8 pages carry scales, these pages are {k.dtype}")


@dataclass
class PagedKVCache:
    """One attention layer's paged K and V (see the module docstring for the layout)."""

    k_cache: torch.Tensor  # [num_pages, num_kv_heads, page_size, head_dim]
    v_cache: torch.Tensor  # [num_pages, num_kv_heads, page_size, head_dim]
    k_scale: torch.Tensor | None = None  # [num_kv_heads] fp32, fp8 pages only
    v_scale: torch.Tensor | None = None  # [num_kv_heads] fp32, fp8 pages only

    def __post_init__(self) -> None:
        if _is_fp8(self.k_cache) and self.k_cache.dim() == 4:  # missing scales default to 1.0
            n, dev = self.k_cache.shape[1], self.k_cache.device
            if self.k_scale is None:
                self.k_scale = torch.ones(n, dtype=torch.float32, device=dev)
            if self.v_scale is None:
                self.v_scale = torch.ones(n, dtype=torch.float32, device=dev)
        _check_pages(self.k_cache, self.v_cache, self.k_scale, self.v_scale)
        # Once per cache (one sync): the kernels fold k_scale into a logit scale that must stay > 0.
        if self.is_fp8 and not (bool((self.k_scale > 0).all()) and bool((self.v_scale > 0).all())):
            raise ValueError("k_scale, v_scale: expected positive per-head scales")

    @classmethod
    def allocate(cls, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> PagedKVCache:
        """Zero-filled pages (fp8: scales default to 1.0, fine for activations within +-448) on ``device``
        (default: the current CUDA device when there is one, else the CPU)."""
        for name, val in (("num_pages", num_pages), ("page_size", page_size), ("num_kv_heads", num_kv_heads)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} requested but CUDA is not available on this machine")
        shape = (num_pages, num_kv_heads, page_size, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   k_scale, v_scale)

    @property
    def num_pages(self) -> int:
        return self.k_cache.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k_cache.dtype

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    @property
    def is_fp8(self) -> bool:
        return self.k_cache.dtype == FP8

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new tokens' K/V (k, v [T, num_kv_heads, head_dim]) at their slots (-1 skips)."""
        store_kv(k, v, self.k_cache, self.v_cache, slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)


def fp8_scales(x: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """Per-head fp8 scales from calibration data x [T, num_kv_heads, D]: amax * margin / 448."""
    amax = x.detach().float().abs().amax(dim=(0, 2))
    return (amax * margin / FP8_MAX).clamp_min(1e-12)


@triton.jit
def store_token_rows(K, V, KC, VC, k_scale, v_scale, t, slot, offs_h, num_kv_heads, head_dim,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcp, stride_kch, stride_kcs,
                     stride_vcp, stride_vch, stride_vcs,
                     PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr):
    """Token t's K and V rows of heads ``offs_h`` [BLOCK_H] into page row ``slot`` (>= 0) of the caches,
    quantized to e4m3 with the per-head scales when QUANT. Shared by store_kv and rope's fused store."""
    page = slot // PAGE_SIZE
    row = slot % PAGE_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    src = t.to(tl.int64)
    k = tl.load(K + src * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + src * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if QUANT:
        h_ok = offs_h < num_kv_heads
        ks = tl.load(k_scale + offs_h, mask=h_ok, other=1.0)
        vs = tl.load(v_scale + offs_h, mask=h_ok, other=1.0)
        # IEEE division (Triton's "/" is approximate) so pages match torch's quantization bit for
        # bit; saturate explicitly: e4m3 has no inf, an overflow would otherwise become NaN.
        shape: tl.constexpr = (BLOCK_H, BLOCK_D)
        k = tl.math.div_rn(k.to(tl.float32), tl.broadcast_to(ks[:, None], shape))
        v = tl.math.div_rn(v.to(tl.float32), tl.broadcast_to(vs[:, None], shape))
        k = tl.clamp(k, -448.0, 448.0)
        v = tl.clamp(v, -448.0, 448.0)
    kc = KC + page * stride_kcp + row * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    vc = VC + page * stride_vcp + row * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]
    tl.store(kc, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(VC.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(K, V, KC, VC, slots, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcp, stride_kch, stride_kcs,
                     stride_vcp, stride_vch, stride_vcs,
                     num_kv_heads,
                     PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr = 0):
    # One program per token, all its KV heads: K and V rows in, one page row per head out.
    pdl_enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    pdl_release(PDL)  # one row copy per program: nothing to keep the next grid waiting for
    if slot < 0:
        return
    store_token_rows(K, V, KC, VC, k_scale, v_scale, t, slot, tl.arange(0, BLOCK_H), num_kv_heads, HEAD_DIM,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_kcp, stride_kch, stride_kcs,
                     stride_vcp, stride_vch, stride_vcs, PAGE_SIZE, BLOCK_H, BLOCK_D, QUANT)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """One kernel: k, v [T, num_kv_heads, head_dim] into the paged caches at ``slot_mapping`` [T].

    ``slot_mapping`` (int32 or int64): page * page_size + row per token; -1 skips the token (padding).
    fp8 caches need ``k_scale``/``v_scale`` [num_kv_heads] fp32 and are quantized here.
    """
    num_kv_heads, page_size, head_dim, fp8 = check_store(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if k.shape[0] == 0:
        return
    if not use_triton(k, v, k_cache, v_cache, slot_mapping):
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        PAGE_SIZE=page_size, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=fp8, PDL=pdl(k), launch_pdl=pdl(k) > 0, num_warps=4,
    )


def check_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
                ) -> tuple[int, int, int, bool]:
    """store_kv's argument checks; (num_kv_heads, page_size, head_dim, fp8 pages)."""
    _check_pages(k_cache, v_cache, k_scale, v_scale)
    num_pages, num_kv_heads, page_size, head_dim = k_cache.shape
    fp8, device = _is_fp8(k_cache), k_cache.device
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name}: expected a tensor [T, num_kv_heads, head_dim]")
        if t.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(f"{name}: expected [T, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}")
        if t.dtype not in QUERY_DTYPES or (not fp8 and t.dtype != k_cache.dtype):
            want = "float16/bfloat16/float32" if fp8 else str(k_cache.dtype)
            raise ValueError(f"{name}: expected dtype {want} for {k_cache.dtype} pages, got {t.dtype}")
        if t.stride(-1) != 1 or t.device != device:
            raise ValueError(f"{name}: expected unit last stride on {device}, got {t.stride()} on {t.device}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if (not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dtype not in (torch.int32, torch.int64)
            or slot_mapping.shape != (k.shape[0],) or slot_mapping.device != device):
        raise ValueError(f"slot_mapping: expected int32/int64 [{k.shape[0]}] on {device}")
    if not slot_mapping.is_cuda:  # free on CPU; on the GPU it would cost a sync per step
        bad = (slot_mapping < -1) | (slot_mapping >= num_pages * page_size)
        if bad.any():
            raise ValueError(f"slot_mapping: expected -1 or slots in [0, {num_pages * page_size}), "
                             f"got {slot_mapping[bad][:4].tolist()}")
    return num_kv_heads, page_size, head_dim, fp8


def check_paged_inputs(q: torch.Tensor, cache: PagedKVCache, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, *, check_values: bool | None = None) -> None:
    """Shape/dtype/device checks shared by the paged attention launchers.

    q [.., Hq, D]; block_tables int32 [B, max_pages]; seq_lens int32 [B]. ``check_values`` also checks
    seq_lens <= max_pages * page_size and that every used page index is a page of the cache: the
    kernels read K/V at those indices (clamped into the cache, so an unchecked bad index gives wrong
    values, not a crash; a length past the table's width still reads past its row). Default: checked,
    except while a CUDA graph is being captured (one host sync on the GPU). The LLM engine passes
    False on the GPU: it builds the tables from its own block manager, tested against these checks on CPU.
    """
    if not isinstance(cache, PagedKVCache):
        raise ValueError(f"cache: expected a PagedKVCache, got {type(cache).__name__}")
    if not isinstance(q, torch.Tensor) or q.dtype not in QUERY_DTYPES:
        raise ValueError(f"q: expected a float16/bfloat16/float32 tensor, got {getattr(q, 'dtype', type(q))}")
    if q.stride(-1) != 1 or q.device != cache.device:
        raise ValueError(f"q: expected unit last stride on {cache.device}, got {q.stride()} on {q.device}")
    if not cache.is_fp8 and cache.dtype != q.dtype:
        raise ValueError(f"cache: expected pages of q's dtype {q.dtype} (or fp8 e4m3), got {cache.dtype}")
    if cache.is_fp8 and q.dtype == torch.float32:
        raise ValueError("q: fp8 pages need float16 or bfloat16 queries, got float32")
    if q.shape[-1] != cache.head_dim:
        raise ValueError(f"q: expected head_dim {cache.head_dim} (the cache's), got {q.shape[-1]}")
    if q.shape[-2] % cache.num_kv_heads:
        raise ValueError(f"q: query heads ({q.shape[-2]}) must be a multiple of the cache's KV heads "
                         f"({cache.num_kv_heads})")
    if (not isinstance(block_tables, torch.Tensor) or block_tables.dtype != torch.int32
            or block_tables.dim() != 2 or block_tables.device != cache.device):
        raise ValueError(f"block_tables: expected int32 [B, max_pages] on {cache.device}")
    B = block_tables.shape[0]
    if (not isinstance(seq_lens, torch.Tensor) or seq_lens.dtype != torch.int32 or seq_lens.shape != (B,)
            or seq_lens.device != cache.device):
        raise ValueError(f"seq_lens: expected int32 [{B}] (one per block-table row) on {cache.device}")
    if resolve_check_values(check_values, cache.device):
        check_page_tables(block_tables, seq_lens, cache.num_pages, cache.page_size)


def check_page_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_pages: int, page_size: int) -> None:
    """Value checks (one host sync): lengths fit the table, used page indices are valid pages."""
    max_pages = block_tables.shape[1]
    if B := seq_lens.numel():
        lens = seq_lens.tolist()
        if min(lens) < 0 or max(lens) > max_pages * page_size:
            raise ValueError(f"seq_lens: expected values in [0, {max_pages * page_size}] "
                             f"(max_pages {max_pages} x page_size {page_size}), got min {min(lens)} max {max(lens)}")
        used = torch.arange(max_pages, device=block_tables.device)[None, :] * page_size < seq_lens[:, None]
        pages = block_tables[used]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
            raise ValueError(f"block_tables: used entries must be page indices in [0, {num_pages}), "
                             f"got [{int(pages.min())}, {int(pages.max())}] over {B} sequences")
