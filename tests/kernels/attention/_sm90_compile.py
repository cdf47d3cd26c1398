"""Compile the attention kernels for sm_90 without a GPU (Triton's bundled ptxas); print one JSON line.

Run as a script with TRITON_INTERPRET=0 (the interpreter accepts code the compiler rejects, e.g. a
non-constexpr global inside @jit). Pointers and strides are marked divisible by 16, as the launcher
specializes them at run time; without that hint the pipeliner emits no cp.async.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import re
import subprocess
import sys

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from warpforge.kernels.attention.chunked import DEFAULT_CHUNKED_CONFIG, _chunked_kernel
from warpforge.kernels.attention.decode import (_decode_kernel, _decode_reduce_kernel, _merge_splits_per_step,
                                                default_decode_config)
from warpforge.kernels.attention.kv_cache import _store_kv_kernel
from warpforge.kernels.attention.prefill import _flash_fwd_kernel, default_config

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
CUOBJDUMP = os.path.join(os.path.dirname(PTXAS), "cuobjdump")
FLOATS = {"qk_scale", "cap_scale", "cap_log2", "sm_scale", "softcap"}


def first_loop_instructions(cubin: str) -> int:
    """SASS instructions (per thread) in the first loop of a cubin, found as the first branch back to
    a lower address: decode's interior (unmasked) key loop, the hot one."""
    sass = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    ins = [(int(a, 16), text) for a, text in re.findall(r"^\s+/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass, re.M)]
    for addr, text in ins:
        back = re.match(r"(?:@!?U?P[0-9T]\s+)?BRA\s+0x([0-9a-f]+)", text)
        if back and int(back.group(1), 16) < addr:
            lo = int(back.group(1), 16)
            return sum(1 for a, _ in ins if lo <= a <= addr)
    return 0


def compile_one(fn, types: dict, const: dict, num_warps: int, num_stages: int, loop_tokens: int = 0) -> dict:
    sig, attrs = {}, {}
    # constexpr parameters left out take their defaults (e.g. PDL=False)
    const = {**{n: q.default for n, q in inspect.signature(fn.fn).parameters.items()
                if q.default is not inspect.Parameter.empty and n not in types}, **const}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
        if sig[name].startswith("*") or name.startswith("stride"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    # Triton builds the cubin with ``ptxas -v`` (sm_90a) and prints that report under the dump_ptxas_log knob:
    # read here with the cubin it built, so each kernel goes through ptxas once, not again on its PTX.
    report = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(report):
        knobs.nvidia.dump_ptxas_log = True
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = k.asm["ptx"]
    res = {"shared": k.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
           "mma": len(re.findall(r"\bmma\.sync", ptx)), "cp_async": ptx.count("cp.async"),
           "atom_acq_rel_gpu": len(re.findall(r"\batom\.(?=[\w.]*\bacq_rel\b)(?=[\w.]*\bgpu\b)[\w.]+", ptx)),
           "mma_e4m3": len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)[\w.]*\.e4m3\.e4m3", ptx))}
    if os.path.exists(PTXAS):  # registers and spills as ptxas reports them
        path = os.path.join(os.environ["TRITON_CACHE_DIR"], "kernel.ptx")
        out = report.getvalue()
        if re.search(r"Used \d+ registers", out):  # Triton's own build: its report and its cubin
            with open(path + ".cubin", "wb") as f:
                f.write(k.asm["cubin"])
        else:  # a Triton cache hit built nothing: ptxas once more on the PTX
            with open(path, "w") as f:
                f.write(ptx)
            out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                                 capture_output=True, text=True, check=True).stderr
        res["regs"] = int(re.search(r"Used (\d+) registers", out).group(1))
        res["spill_bytes"] = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", out))
        if loop_tokens and os.path.exists(CUOBJDUMP):  # issue cost of the hot loop, per key token
            res["loop_warp_instr_per_token"] = round(
                first_loop_instructions(path + ".cubin") * num_warps / loop_tokens, 1)
    return res


def main() -> None:
    """argv: name prefixes to compile (default: all), e.g. ``decode`` for the decode kernels alone."""
    jobs = {}
    prefill = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "cu_q": "*i32", "cu_k": "*i32"}
    for D, causal, tma, varlen in ((128, False, False, False), (128, True, False, True), (64, True, False, False),
                                   (256, False, False, False), (128, True, True, True)):
        cfg = default_config(D, causal)
        types = dict(prefill)
        const = dict(HEAD_DIM=D, BLOCK_D=D, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, MASK_LEFT=False,
                     MASK_RIGHT=causal, SOFTCAP=False, VARLEN=varlen, STORE_LSE=True, TMA=tma, DOT_PRECISION="tf32")
        if tma:
            for name, rows in (("q_desc", cfg.block_m), ("k_desc", cfg.block_n), ("v_desc", cfg.block_n)):
                types[name] = f"tensordesc<bf16[1, {rows}, 1, {D}]>"
        else:
            const.update(q_desc=None, k_desc=None, v_desc=None)
        jobs[f"prefill D{D} causal={causal} tma={tma} varlen={varlen}"] = (
            _flash_fwd_kernel, types, const, cfg.num_warps, cfg.num_stages)
    for kv in ("bf16", "fp8e4nv"):
        cfg = default_decode_config(128, kv != "bf16")
        types = {"Q": "*bf16", "KC": f"*{kv}", "VC": f"*{kv}", "block_tables": "*i32", "seq_lens": "*i32",
                 "k_scale": "*fp32", "v_scale": "*fp32", "O": "*bf16", "O_part": "*fp32", "LSE_part": "*fp32"}
        const = dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, BLOCK_N=cfg.block_n, SPLIT=True,
                     MASK_LEFT=False, SOFTCAP=False, FP8=kv != "bf16", DOT_PRECISION="tf32")
        jobs[f"decode {kv}"] = (_decode_kernel, types, const, cfg.num_warps, cfg.num_stages, cfg.block_n)
        # the single-launch split-KV path: partials, an acq_rel ticket, the last program merges
        fused = dict(const, FUSED_REDUCE=True, G_P2=4, MERGE_S=_merge_splits_per_step(4, 128, cfg.num_warps))
        jobs[f"decode {kv} fused"] = (_decode_kernel, dict(types, counters="*i32"), fused, cfg.num_warps,
                                      cfg.num_stages, cfg.block_n)
        if kv != "bf16":  # q quantized to e4m3, QK^T as an e4m3 x e4m3 dot (keys-major: a wgmma)
            qc = default_decode_config(128, True, qk_fp8=True)
            qk8 = dict(const, BLOCK_N=qc.block_n, QK_FP8=True)
            jobs[f"decode {kv} qk8"] = (_decode_kernel, types, qk8, qc.num_warps, qc.num_stages, qc.block_n)
            qk8 = dict(qk8, FUSED_REDUCE=True, G_P2=4, MERGE_S=_merge_splits_per_step(4, 128, qc.num_warps))
            jobs[f"decode {kv} qk8 fused"] = (_decode_kernel, dict(types, counters="*i32"), qk8, qc.num_warps,
                                              qc.num_stages, qc.block_n)
        types = {"Q": "*bf16", "KC": f"*{kv}", "VC": f"*{kv}", "block_tables": "*i32", "seq_lens": "*i32",
                 "cu_q": "*i32", "k_scale": "*fp32", "v_scale": "*fp32", "O": "*bf16"}
        cc = DEFAULT_CHUNKED_CONFIG
        const = dict(GROUP=4, BLOCK_M=cc.block_m, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, BLOCK_N=cc.block_n,
                     MASK_LEFT=True, SOFTCAP=True, FP8=kv != "bf16", DOT_PRECISION="tf32")
        jobs[f"chunked {kv}"] = (_chunked_kernel, types, const, cc.num_warps, cc.num_stages)
        types = {"K": "*bf16", "V": "*bf16", "KC": f"*{kv}", "VC": f"*{kv}", "slots": "*i64",
                 "k_scale": "*fp32", "v_scale": "*fp32"}
        const = dict(PAGE_SIZE=16, HEAD_DIM=128, BLOCK_H=8, BLOCK_D=128, QUANT=kv != "bf16")
        jobs[f"store {kv}"] = (_store_kv_kernel, types, const, 4, 1)
    # A padded head dim (BLOCK_D 128 > D) with 16-bit pages, no window, no softcap (the engine's usual
    # call): this once crashed ptxas (SIGSEGV), so chunked_prefill failed on the GPU for D = 80, 96.
    for D, dt in ((80, "bf16"), (96, "fp16")):
        types = {"Q": f"*{dt}", "KC": f"*{dt}", "VC": f"*{dt}", "block_tables": "*i32", "seq_lens": "*i32",
                 "cu_q": "*i32", "k_scale": "*fp32", "v_scale": "*fp32", "O": f"*{dt}"}
        cc = DEFAULT_CHUNKED_CONFIG
        const = dict(GROUP=4, BLOCK_M=cc.block_m, HEAD_DIM=D, BLOCK_D=128, PAGE_SIZE=16, BLOCK_N=cc.block_n,
                     MASK_LEFT=False, SOFTCAP=False, FP8=False, DOT_PRECISION="tf32")
        jobs[f"chunked {dt} D{D}"] = (_chunked_kernel, types, const, cc.num_warps, cc.num_stages)
    types = {"O_part": "*fp32", "LSE_part": "*fp32", "O": "*bf16"}
    jobs["reduce"] = (_decode_reduce_kernel, types, dict(BLOCK_S=8, HEAD_DIM=128, BLOCK_D=128), 4, 1)
    only = tuple(sys.argv[1:])
    results = {name: compile_one(*job) for name, job in jobs.items() if not only or name.startswith(only)}
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
