"""Suite ``attention``: flash prefill, varlen prefill, paged decode (bf16 and fp8 pages) against SDPA.

Rows: prefill bf16 B=2 H=32 S=4096 D=128 and B=8 H=16 S=2048 D=64, each non-causal and
causal, against SDPA's flash and cuDNN backends (separate peers); a packed batch of 64 sequences
(lengths 100-2000) against SDPA on the padded batch and a loop of SDPA calls; paged decode (page 16,
32 query / 8 KV heads, D=128) against SDPA with ``enable_gqa`` over a dense contiguous cache, as the
headline B=16 x 8192 and a sweep B x context; fp8-page decode against our own bf16 decode.

Figures: prefill TFLOP/s from 4*B*H*S*S*D (halved when causal); decode GB/s of the K+V bytes the
kernel reads. Decode is timed through CUDA-graph replay (one decode step of an engine is a graph).
References are float32 (``kernels.reference``), chunked over query rows / per sequence so S x S
scores never exist at once. On a CPU machine the sizes are tiny and ours runs its torch reference.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

from warpforge.bench.suite import Case, Suite
from warpforge.kernels.attention import PagedKVCache, flash_attention, num_decode_splits, paged_decode
from warpforge.kernels.attention.decode import default_decode_config
from warpforge.kernels.reference import flash_attention_ref, paged_decode_ref

BF16 = torch.bfloat16
MiB = 1 << 20
PAGE = 16
HQ, HKV, HEAD_DIM = 32, 8, 128  # decode rows: Llama-3-8B-like heads
SWEEP_B = (1, 8, 64, 256)
SWEEP_CTX = (512, 4096, 32768, 131072)
# B=256 x 128k is 137 GB of bf16 K+V, before the dense copy the SDPA peer needs: beyond 141 GB.
SWEEP_SKIP = {(256, 131072)}


# ---- prefill ------------------------------------------------------------------------------------

def _sdpa_backend(backend: SDPBackend, causal: bool, q, k, v):
    with sdpa_kernel(backend):
        return sdpa(q, k, v, is_causal=causal)


def _ours_prefill(causal: bool, q, k, v):
    # [B, H, S, D] in and out: the transposes are views, the kernel reads SDPA's layout in place.
    t = partial(torch.transpose, dim0=1, dim1=2)
    return flash_attention(t(q), t(k), t(v), causal=causal).transpose(1, 2)


def _ref_prefill(causal: bool, q, k, v):
    t = partial(torch.transpose, dim0=1, dim1=2)
    return flash_attention_ref(t(q), t(k), t(v), causal=causal).transpose(1, 2)


def _prefill_case(B: int, H: int, S: int, D: int, causal: bool, gpu: bool) -> Case:
    def make_inputs(gen, device):
        return tuple(torch.randn(B, H, S, D, generator=gen, device=device, dtype=BF16) for _ in range(3))

    peers = {"sdpa flash": partial(_sdpa_backend, SDPBackend.FLASH_ATTENTION, causal)}
    if gpu:  # cuDNN attention exists only on CUDA
        peers["sdpa cudnn"] = partial(_sdpa_backend, SDPBackend.CUDNN_ATTENTION, causal)
    mask = "causal" if causal else "non-causal"
    return Case(
        name=f"prefill bf16 B{B} H{H} S{S} D{D} {mask}",
        params={"op": "prefill", "B": B, "H": H, "S": S, "D": D, "causal": causal, "dtype": "bfloat16"},
        make_inputs=make_inputs, ours=partial(_ours_prefill, causal), peers=peers,
        reference=partial(_ref_prefill, causal),
        flops=4 * B * H * S * S * D / (2 if causal else 1), bytes=4 * B * H * S * D * 2,
        dtype=BF16, metric="tflops",
    )


# ---- varlen prefill -----------------------------------------------------------------------------

def _varlen_case(n: int, lo: int, hi: int, H: int, Hkv: int, D: int) -> Case:
    # Lengths are part of the case (fixed seed), not of the input draw: every run sees the same batch.
    lens = torch.randint(lo, hi + 1, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
    T, longest, group = bounds[-1], max(lens), H // Hkv

    def make_inputs(gen, device):
        q = torch.randn(T, H, D, generator=gen, device=device, dtype=BF16)
        k = torch.randn(T, Hkv, D, generator=gen, device=device, dtype=BF16)
        v = torch.randn(T, Hkv, D, generator=gen, device=device, dtype=BF16)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        # The peers get K/V already expanded to H heads (untimed), so GQA costs them nothing.
        k_rep, v_rep = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        valid = torch.arange(longest, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        pads = []
        for x in (q, k_rep, v_rep):
            p = x.new_zeros(n, longest, H, D)  # right padding: not data, causal keeps it unseen
            p[valid] = x
            pads.append(p)
        return (q, k, v, cu, k_rep, v_rep, *pads, valid)

    def ours(q, k, v, cu, *_):
        return flash_attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest)

    def sdpa_padded(q, k, v, cu, k_rep, v_rep, q_pad, k_pad, v_pad, valid):
        out = sdpa(q_pad.transpose(1, 2), k_pad.transpose(1, 2), v_pad.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)[valid]  # back to packed [T, H, D] for the check

    def sdpa_loop(q, k, v, cu, k_rep, v_rep, *_):
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            qs, ks, vs = (x[a:b].transpose(0, 1)[None] for x in (q, k_rep, v_rep))
            outs.append(sdpa(qs, ks, vs, is_causal=True)[0].transpose(0, 1))
        return torch.cat(outs)

    def reference(q, k, v, cu, *_):
        return flash_attention_ref(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)

    sq = sum(L * L for L in lens)
    return Case(
        name=f"prefill varlen bf16 {n} seqs {lo}-{hi} H{H}/{Hkv} D{D} causal",
        params={"op": "prefill_varlen", "seqs": n, "min_len": lo, "max_len": hi, "total_tokens": T,
                "H": H, "Hkv": Hkv, "D": D, "causal": True, "dtype": "bfloat16"},
        make_inputs=make_inputs, ours=ours, peers={"sdpa padded": sdpa_padded, "sdpa loop": sdpa_loop},
        reference=reference, flops=2 * H * D * sq, bytes=2 * T * (2 * H + 2 * Hkv) * D,
        dtype=BF16, metric="tflops",
    )


# ---- paged decode -------------------------------------------------------------------------------

def _random_pages(n_pages: int, gen, device, fp8_scale: torch.Tensor | None):
    """bf16 pages [n, HKV, PAGE, D]; with fp8_scale also their e4m3 form, bf16 = dequantized e4m3.

    Power-of-two scales make e4m3 * scale exact in bf16, so both decodes see identical values and the
    check measures only each kernel's rounding.
    """
    shape = (n_pages, HKV, PAGE, HEAD_DIM)
    x = torch.randn(shape, generator=gen, device=device, dtype=BF16)
    if fp8_scale is None:
        return x, None
    f8 = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    s = fp8_scale[None, :, None, None]
    for i in range(0, n_pages, 1 << 14):  # chunks: an fp32 copy of 34 GB of pages would not fit
        f8[i:i + (1 << 14)] = (x[i:i + (1 << 14)].float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
        x[i:i + (1 << 14)] = (f8[i:i + (1 << 14)].float() * s).to(BF16)
    return x, f8


def _dense_copy(pages: torch.Tensor, table: torch.Tensor, ctx: int) -> torch.Tensor:
    """The same K (or V) as SDPA's contiguous [B, HKV, ctx, D], gathered one sequence at a time."""
    B, n = table.shape
    out = torch.empty(B, HKV, ctx, HEAD_DIM, dtype=pages.dtype, device=pages.device)
    for b in range(B):
        out[b] = pages[table[b].long()].transpose(0, 1).reshape(HKV, n * PAGE, HEAD_DIM)[:, :ctx]
    return out


def _decode_inputs(B: int, ctx: int, fp8: bool):
    def make_inputs(gen, device):
        n = math.ceil(ctx / PAGE)
        # Shuffled pages: the block tables point all over the pool, as in a long-running engine.
        table = torch.argsort(torch.rand(B * n, generator=gen, device=device)).view(B, n).to(torch.int32)
        scale = None
        if fp8:  # per-head power-of-two scales: 1/8, 1/16 alternating
            scale = torch.tensor([2.0 ** -(3 + h % 2) for h in range(HKV)], device=device)
        k, k8 = _random_pages(B * n, gen, device, scale)
        v, v8 = _random_pages(B * n, gen, device, scale)
        seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(B, HQ, HEAD_DIM, generator=gen, device=device, dtype=BF16)
        if fp8:
            return q, PagedKVCache(k8, v8, scale, scale.clone()), PagedKVCache(k, v), table, seq_lens
        return q, PagedKVCache(k, v), _dense_copy(k, table, ctx), _dense_copy(v, table, ctx), table, seq_lens
    return make_inputs


def _ours_decode(q, cache, *rest):
    table, seq_lens = rest[-2], rest[-1]
    return paged_decode(q, cache, table, seq_lens, check_values=False)  # the kernel alone: tables built valid


def _ours_decode_bf16_pages(q, cache_fp8, cache_bf16, table, seq_lens):
    return paged_decode(q, cache_bf16, table, seq_lens, check_values=False)


def _sdpa_dense_decode(q, cache, k_dense, v_dense, table, seq_lens):
    return sdpa(q[:, :, None], k_dense, v_dense, enable_gqa=True)[:, :, 0]


def _ref_decode(q, cache, *rest):
    table, seq_lens = rest[-2], rest[-1]
    return paged_decode_ref(q, cache.k_cache, cache.v_cache, table, seq_lens, k_scale=cache.k_scale,
                            v_scale=cache.v_scale)


def _decode_case(B: int, ctx: int, fp8: bool, tag: str) -> Case:
    kv_bytes = 2 * B * ctx * HKV * HEAD_DIM * (1 if fp8 else 2)
    params = {"op": "decode", "B": B, "context": ctx, "Hq": HQ, "Hkv": HKV, "D": HEAD_DIM, "page_size": PAGE,
              "kv_dtype": "float8_e4m3fn" if fp8 else "bfloat16", "kv_bytes": kv_bytes,
              "kv_bytes_over_64MiB": kv_bytes > 64 * MiB}
    if torch.cuda.is_available():
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        params["num_splits"] = num_decode_splits(B, HKV, ctx, num_sms=sms, config=default_decode_config(HEAD_DIM, fp8))
    if fp8:
        peers = {"warpforge bf16 decode": _ours_decode_bf16_pages}
    else:
        peers = {"sdpa dense gqa": _sdpa_dense_decode}
    return Case(
        name=f"decode {tag}{'fp8' if fp8 else 'bf16'} pages B{B} ctx{ctx} H{HQ}/{HKV} D{HEAD_DIM}",
        params=params, make_inputs=_decode_inputs(B, ctx, fp8), ours=_ours_decode, peers=peers,
        reference=_ref_decode, flops=4 * B * HQ * ctx * HEAD_DIM, bytes=kv_bytes,
        # bf16 even for fp8 pages: both decodes see the same (dequantized) values, so the check
        # measures the kernels' bf16 rounding, not the quantization chosen by the case.
        dtype=BF16, metric="GBps", cuda_graph=True,
    )


# ---- the suite ----------------------------------------------------------------------------------

def _gpu_cases(quick: bool) -> list[Case]:
    """The issue's rows at full size; --quick keeps one of each kind at smaller sizes."""
    if quick:
        return [
            _prefill_case(2, 32, 1024, 128, False, True), _prefill_case(2, 32, 1024, 128, True, True),
            _varlen_case(16, 100, 2000, 32, 8, 128),
            _decode_case(16, 8192, False, "headline "), _decode_case(16, 8192, True, "headline "),
            _decode_case(1, 32768, False, "sweep "), _decode_case(64, 4096, False, "sweep "),
        ]
    cases = [
        _prefill_case(2, 32, 4096, 128, False, True), _prefill_case(2, 32, 4096, 128, True, True),
        _prefill_case(8, 16, 2048, 64, False, True), _prefill_case(8, 16, 2048, 64, True, True),
        _varlen_case(64, 100, 2000, 32, 8, 128),
        _decode_case(16, 8192, False, "headline "), _decode_case(16, 8192, True, "headline "),
    ]
    for fp8 in (False, True):
        cases += [_decode_case(B, ctx, fp8, "sweep ") for B in SWEEP_B for ctx in SWEEP_CTX
                  if (B, ctx) not in SWEEP_SKIP]
    return cases


def _cases(quick: bool) -> list[Case]:
    if torch.cuda.is_available():
        return _gpu_cases(quick)
    # CPU: wiring only, tiny shapes; ours runs its torch reference (docs/design.md, "Dispatch").
    return [
        _prefill_case(1, 2, 64, 64, False, False), _prefill_case(1, 2, 64, 64, True, False),
        _varlen_case(4, 5, 40, 4, 2, 64),
        _decode_case(2, 64, False, ""), _decode_case(2, 64, True, ""),
    ]


SUITE = Suite(
    name="attention",
    description="flash prefill (fixed and varlen), paged decode bf16/fp8 vs SDPA flash/cuDNN/dense GQA",
    cases=_cases,
)
