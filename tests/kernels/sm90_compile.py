"""Compile the matmul-family, conv and row-wise kernels for sm_90 without a GPU: shared memory, registers, spills.

Triton compiles for any target offline (its wheel bundles ptxas), so a CPU machine can tell whether
a config fits Hopper's 227 KB of shared memory, spills registers, reaches wgmma (HGMMA), or gets
warp-specialized. Kernels are compiled as the JIT would for aligned tensors and sizes/strides that
are multiples of 16 (``tt.divisibility`` on every pointer and integer argument).

    python tests/kernels/sm90_compile.py            # the default (first) config of each family
    python tests/kernels/sm90_compile.py --all      # every autotune candidate (~1 minute)
    python tests/kernels/sm90_compile.py --all --only softmax,gated   # labels starting with these
    python tests/kernels/sm90_compile.py --norm     # every config the GEMV's input-RMSNorm fusion may use
                                                    # (139 compiles, ~3 CPU-minutes; --norm-class=16: one class)
    python tests/kernels/sm90_compile.py --all --only=conv    # the conv candidates alone
    python tests/kernels/sm90_compile.py --shard=0/2          # every other job from the first (tests run
                                                              # the shards side by side: sm90_shards.py)

GEMMs compile with the heaviest epilogue (bias + erf gelu), so a candidate meant for plain GEMMs
may report a small spill here that it does not have without an epilogue. Convs (fp16 and int8, the
implicit-GEMM kernel) compile with bias + residual + silu.

Must run in its own process: the interpreter (TRITON_INTERPRET=1) must be off before kernels load.
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
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
try:
    from triton import knobs  # noqa: E402
except ImportError:  # a Triton before its knobs (the GPU box brings its own): ptxas runs a second time, as before
    knobs = None
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from warpforge.kernels import activation, conv, conv_int8, gemv, matmul, matmul_fp8, matmul_int8  # noqa: E402
from warpforge.kernels import conv_depthwise as dw_mod  # noqa: E402
from warpforge.kernels import conv_gemm as gemm_mod  # noqa: E402
from warpforge.kernels import conv_pointwise as pw_mod  # noqa: E402
from warpforge.kernels import conv_tuning  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90
_PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def compile_sm90(fn, sig: dict, consts: dict, num_warps: int, num_stages: int, odd: tuple = ()) -> dict:
    """``odd``: integer arguments not assumed divisible by 16 (image sizes, padding)."""
    defaults = {n: q.default for n, q in inspect.signature(fn.fn).parameters.items()
                if q.default is not inspect.Parameter.empty}
    for n in fn.arg_names:  # constexpr parameters left out take their defaults (e.g. PDL=False)
        if n not in sig and n in defaults:
            sig[n], consts[n] = "constexpr", defaults[n]
    sig = {n: sig[n] for n in fn.arg_names}  # in parameter order
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
             if (t.startswith("*") or t == "i32") and n not in odd}
    k, report = compile_with_ptxas_report(ASTSource(fn, sig, consts, attrs), target=TARGET,
                                          options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = k.asm["ptx"]
    if report is None:  # a Triton cache hit built no cubin: ptxas -v once more on the cached PTX
        report = ptxas_report(ptx)
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    ttgir = k.asm["ttgir"]
    if os.environ.get("SM90_DUMP"):  # a folder: each compile's TTGIR and PTX there, for reading layouts
        stem = Path(os.environ["SM90_DUMP"]) / f"{fn.fn.__name__}-{abs(hash(str(sorted(consts.items())))):x}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".ttgir").write_text(ttgir)
        stem.with_suffix(".ptx").write_text(ptx)
    n_regs = int(regs.group(1)) if regs else None
    return {"shared": k.metadata.shared, "regs": n_regs,
            "spill": int(spill.group(1)) if spill else 0, "wgmma": "wgmma" in ptx,
            "pdl": "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx,
            "l2_hints": "L2::cache_hint" in ptx,
            "warp_specialized": "ttg.warp_specialize" in ttgir,
            # wgmma left in flight across K steps (pendings >= 1); Triton 3.6 waits for it at once
            # (pendings = 0) when the accumulator is not fp32, i.e. for every int8 x int8 -> int32 GEMM.
            "mma_async": bool(re.search(r"warp_group_dot_wait .*pendings = [1-9]", ttgir)),
            # register round trips of a loaded tile (smem -> registers -> smem): a masked load with a
            # non-zero ``other`` compiles to this; the conv main loops should have none.
            "local_loads": ttgir.count("ttg.local_load"),
            "blocks_per_sm": blocks_per_sm(n_regs, k.metadata.shared, num_warps)}


def compile_with_ptxas_report(src, **kwargs) -> tuple:
    """``triton.compile`` and the ``ptxas -v`` report (registers, spills) of the cubin it built. Triton builds the
    cubin with ``ptxas -v`` (sm_90a) and prints that report under the dump_ptxas_log knob: read here, so each
    kernel goes through ptxas once, not a second time on its PTX (Triton's run adds -lineinfo: checked against
    the second run it replaces, the same registers and spills for the 56 default jobs and 36 of --norm's). None
    when Triton built nothing (a hit in TRITON_CACHE_DIR)."""
    if knobs is None:
        return triton.compile(src, **kwargs), None
    buf = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(buf):
        knobs.nvidia.dump_ptxas_log = True
        k = triton.compile(src, **kwargs)
    report = buf.getvalue()
    return k, report if "Used " in report and " registers" in report else None


def ptxas_report(ptx: str) -> str:
    """``ptxas -v`` for sm_90a on ``ptx``: its stderr (the resource report)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        return subprocess.run([_PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)


def blocks_per_sm(regs: int | None, shared: int, num_warps: int) -> int | None:
    """Resident blocks per sm_90 SM: 64K registers (allocated per warp in units of 256), 228 KB of shared
    memory (1 KB reserved per block), 64 warps."""
    if regs is None:
        return None
    per_warp = -(-regs * 32 // 256) * 256
    return min(65536 // (per_warp * num_warps), 233472 // (shared + 1024), 64 // num_warps, 32)


def _flags(sig: dict, consts: dict, **flags) -> None:
    for k, v in flags.items():
        sig[k], consts[k] = "constexpr", v


def matmul_tma(cfg, dt="bf16", out="bf16", fp8=False, b_kmajor=True, epilogue=True, int8=False) -> dict:
    """fp8=True: per-row/column scales (fp8 and int8); int8=True: int8 operands, int32 accumulator."""
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    c_tma = not cfg.warp_specialize  # as launch_gemm: warp-specialized configs store through pointers
    cbn = bn // 2 if cfg.epilogue_subtile else bn
    sig = {"a_desc": f"tensordesc<{dt}[{bm},{bk}]>",
           "b_desc": f"tensordesc<{dt}[{bn},{bk}]>" if b_kmajor else f"tensordesc<{dt}[{bk},{bn}]>",
           "c_desc": f"tensordesc<{out}[{bm},{cbn}]>", "c_ptr": f"*{out}", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
           "bias_ptr": f"*{out}", "res_ptr": "constexpr", "M": "i32", "N": "i32", "K": "i32", "stride_cm": "i32",
           "stride_cn": "constexpr", "stride_bias": "constexpr", "stride_rm": "constexpr", "stride_rn": "constexpr"}
    consts = {"res_ptr": None, "stride_cn": 1, "stride_bias": 1, "stride_rm": 0, "stride_rn": 0}
    for name, keep in (("c_desc", c_tma), ("sa_ptr", fp8), ("sb_ptr", fp8), ("bias_ptr", epilogue)):
        if not keep:
            sig[name], consts[name] = "constexpr", None
    _flags(sig, consts, A_KMAJOR=True, B_KMAJOR=b_kmajor, C_TMA=c_tma, SCALE_A=2 * fp8, SCALE_B=2 * fp8,
           HAS_BIAS=epilogue, ACTIVATION=2 if epilogue else 0, HAS_RES=False, DOT_PRECISION="tf32",
           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, NUM_SMS=132,
           WARP_SPECIALIZE=cfg.warp_specialize, FLATTEN=cfg.flatten, EPILOGUE_SUBTILE=cfg.epilogue_subtile,
           INT_ACC=int8)
    return compile_sm90(matmul._matmul_tma_kernel, sig, consts, cfg.num_warps, cfg.num_stages)


def matmul_ptr(cfg, dt="bf16", out="bf16", fp8=False, epilogue=True, int8=False) -> dict:
    ints = ["M", "N", "K", "stride_am", "stride_bk", "stride_bn", "stride_cm"]
    sig = {"a_ptr": f"*{dt}", "b_ptr": f"*{dt}", "c_ptr": f"*{out}", "sa_ptr": "*fp32", "sb_ptr": "*fp32",
           "bias_ptr": f"*{out}", **{n: "i32" for n in ints}}
    consts = {"res_ptr": None, "stride_ak": 1, "stride_cn": 1, "stride_bias": 1, "stride_rm": 0, "stride_rn": 0}
    for name, keep in (("sa_ptr", fp8), ("sb_ptr", fp8), ("bias_ptr", epilogue)):
        if not keep:
            consts[name] = None
    consts["stride_bk" if fp8 else "stride_bn"] = 1  # fp8: b column-major, as matmul_fp8 requires
    for n in consts:
        sig[n] = "constexpr"
    _flags(sig, consts, SCALE_A=2 * fp8, SCALE_B=2 * fp8, HAS_BIAS=epilogue, ACTIVATION=2 if epilogue else 0,
           HAS_RES=False, DOT_PRECISION="tf32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
           GROUP_M=cfg.group_m, INT_ACC=int8)
    return compile_sm90(matmul._matmul_ptr_kernel, sig, consts, cfg.num_warps, cfg.num_stages)


def linear(cfg, fmt: int, group: int | None, dt="bf16", pdl: int = 0, gate: int = 0, norm: int = 0,
           gamma="fp32", K: int = 4096) -> dict:
    """``norm``: gemv.NORM_RMS / NORM_RMS_RES (the input RMSNorm fusion; ``gamma`` its weight's dtype, ``K``
    the row width that sets the statistics pass's tile, gemv._norm_block_k)."""
    wdt = {0: dt, 1: "i8", 2: "u8", 3: "u8"}[fmt]
    ints = ["M", "N", "K", "K_w", "stride_xm", "stride_wn", "stride_sn", "stride_om", "k_per_split", "gate_off"]
    sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{wdt}", "ws_ptr": f"*{dt}" if fmt == 2 else "*fp32", "wm_ptr": f"*{dt}",
           "out_ptr": f"*{dt}", "part_ptr": "*fp32", **{n: "i32" for n in ints}}
    consts = {"bias_ptr": None, "stride_xk": 1, "stride_bias": 0, "stride_on": 1, "stride_rk": 1}
    if norm:
        sig.update(g_ptr=f"*{gamma}", eps="fp32", norm_offset="fp32")
    else:
        consts.update(g_ptr=None, eps=0.0, norm_offset=0.0)
    if norm == 2:
        sig.update(res_ptr=f"*{dt}", res_out_ptr=f"*{dt}", stride_rm="i32", stride_rom="i32")
    else:
        consts.update(res_ptr=None, res_out_ptr=None, stride_rm=0, stride_rom=0)
    if fmt == 0:
        consts["ws_ptr"] = None
    if fmt != 2:
        consts.update(wm_ptr=None, stride_sn=0)
    if cfg.split_k == 1:
        consts["part_ptr"] = None
    for n in consts:
        sig[n] = "constexpr"
    _flags(sig, consts, FORMAT=fmt, GROUP=group or 1, SCALE_B=2 if fmt in (1, 3) else 0, HAS_BIAS=False,
           ACTIVATION=0, SPLIT_K=cfg.split_k, EVEN_K=True, USE_DOT=cfg.use_dot, DOT_PRECISION="tf32",
           LOOP_STAGES=cfg.num_stages, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PDL=pdl,
           GATE=gate, NORM=norm, NORM_BK=gemv._norm_block_k(cfg, K))
    return compile_sm90(gemv._linear_kernel, sig, consts, cfg.num_warps, cfg.num_stages)


def norm_jobs(every: bool, classes: tuple[int, ...] | None = None) -> list[tuple[str, object]]:
    """The input-RMSNorm fusion (LLM decode: the qkv and gate_up projections): the first config of each GEMV
    M class with a residual in bf16; ``every``: each config ``gemv._fits`` admits for it, bf16 and fp32 x,
    with and without a residual (the configs the autotuner may pick for a fused call). ``classes``: only these
    M classes (block_m keys of gemv.LINEAR_CONFIGS)."""
    out = []
    variants = [("bf16", 2, 2), ("bf16", 2, 1), ("fp32", 4, 2), ("fp32", 4, 1)] if every else [("bf16", 2, 2)]
    for bm, cfgs in gemv.LINEAR_CONFIGS.items():
        if bm > gemv.GEMV_MAX_M or (classes is not None and bm not in classes):
            continue
        for dt, nbytes, norm in variants:
            admitted = [c for c in cfgs if gemv._fits(c, None, False, 0, nbytes, norm=norm)]
            for cfg in admitted if every else admitted[:1]:
                out.append((f"linear norm={norm} {dt} {cfg}",
                            lambda cfg=cfg, dt=dt, norm=norm: linear(cfg, 0, None, dt=dt, norm=norm)))
    return out


def linear_words(cfg, fmt: int, group: int | None, dt="bf16") -> dict:
    """The M=1 int8/int4 word kernel (weights as int32 words)."""
    ints = ["N", "K", "K_w", "stride_wn", "stride_sn", "k_per_split"]
    sig = {"x_ptr": f"*{dt}", "w_ptr": "*i32", "ws_ptr": f"*{dt}" if fmt == 2 else "*fp32", "wm_ptr": f"*{dt}",
           "out_ptr": f"*{dt}", "part_ptr": "*fp32", **{n: "i32" for n in ints}}
    consts = {"bias_ptr": None, "stride_xk": 1, "stride_bias": 0, "stride_on": 1}
    if fmt != 2:
        consts.update(wm_ptr=None, stride_sn=0)
    if cfg.split_k == 1:
        consts["part_ptr"] = None
    for n in consts:
        sig[n] = "constexpr"
    _flags(sig, consts, FORMAT=fmt, GROUP=group or 1, SCALE_B=2 if fmt == 1 else 0, HAS_BIAS=False, ACTIVATION=0,
           SPLIT_K=cfg.split_k, EVEN_K=True, LOOP_STAGES=cfg.num_stages, ASM=True,
           BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    return compile_sm90(gemv._linear_words_kernel, sig, consts, cfg.num_warps, cfg.num_stages)


def conv_gemm(cfg, mode: int, dt="fp16", out="fp16", int8=False, quant_out=False, zero=0, dual=False,
              res_int8=False) -> dict:
    """The implicit-GEMM conv with the heaviest epilogue (bias + residual + silu) on channels_last tensors
    (unit channel strides, as the launcher passes them); int8=True: conv2d_int8's launch (int8 x and w,
    int32 accumulator, per-channel dequantization), quant_out=True: int8 out (out_scale=); zero=-128:
    unsigned x and out (zero points, weight sums); dual=True: float out and its int8 copy (out_q=);
    res_int8=True: an int8 residual at residual_scale (zero point ``zero``), the int8 residual stream."""
    if cfg.persistent:  # the persistent pointwise kernel (1x1 convs, the whole K in one block_k tile)
        return conv_pointwise(cfg, dt, out, int8, quant_out, zero, dual, res_int8)
    sig = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": "*fp32", "r_ptr": "*fp16", "o_ptr": f"*{out}",
           "ws_ptr": "*i32" if int8 else "*fp32", "xs_ptr": "*fp32", "wsc_ptr": "*fp32", "wsum_ptr": "*i32",
           "os_ptr": "*fp32", "xpad_ptr": "*i8", "q_ptr": "*i8",
           **{n: "i32" for n in ("M", "OH", "OW", "H", "W", "CIN_G", "COUT_G", "COUT", "SPLIT_STRIDE", "s_xn",
                                 "s_xh", "s_xw", "s_wo", "s_wh", "s_ww", "stride_h", "stride_w", "pad_h", "pad_w",
                                 "dil_h", "dil_w")}}
    consts = {"s_xc": 1, "s_wc": 1}
    if res_int8:
        sig.update(r_ptr="*i8", rs_ptr="*fp32")
    else:
        consts["rs_ptr"] = None
    if cfg.f16_mma:  # conv2d_int8 passes the int8 weights' values in fp16
        sig["w_ptr"] = "*fp16"
    if not int8:
        consts.update(xs_ptr=None, wsc_ptr=None, os_ptr=None)
    if not dual:
        consts["q_ptr"] = None
    if not zero or mode != conv.MODE_TAPS:
        consts["xpad_ptr"] = None  # the launcher passes the padding row for unsigned x in the taps loop only
    if not zero:
        consts["wsum_ptr"] = None
    elif not quant_out and not dual:
        consts["os_ptr"] = None
    if cfg.split_k == 1:
        consts["ws_ptr"] = None
    for n in consts:
        sig[n] = "constexpr"
    k = 1 if mode == conv.MODE_PLAIN else 3
    _flags(sig, consts, KH=k, KW=k, MODE=mode, EVEN_C=mode != conv.MODE_FLAT, HAS_BIAS=True, HAS_RES=True, ACT=2,
           DOT_PRECISION="tf32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
           GROUP_M=cfg.group_m, SPLIT_K=cfg.split_k, INT_ACC=int8, QUANT_OUT=quant_out, X_ZERO=zero,
           OUT_ZERO=zero if quant_out or dual else 0, DUAL_OUT=dual, F16_MMA=cfg.f16_mma, RES_INT8=res_int8,
           RES_ZERO=zero if res_int8 else 0)
    odd = ("M", "OH", "OW", "H", "W", "SPLIT_STRIDE", "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w")
    return compile_sm90(gemm_mod._conv_gemm_kernel, sig, consts, cfg.num_warps, cfg.num_stages, odd)


def conv_pointwise(cfg, dt="fp16", out="fp16", int8=False, quant_out=False, zero=0, dual=False,
                   res_int8=False, fold=False, res_dot=False) -> dict:
    """The persistent pointwise conv (``cfg.persistent``) at K = block_k, with conv_gemm's epilogue options;
    res_dot: the residual through an MMA with the identity (RES_DOT), fold: ReLU (ResNet's block output: with
    int8 in and out, the folded epilogue) instead of silu. Pointer stores (the TMA epilogue's descriptors are
    host objects)."""
    sig = {"x_ptr": f"*{dt}", "w_ptr": "*fp16" if cfg.f16_mma else f"*{dt}", "b_ptr": "*fp32",
           "r_ptr": "*i8" if res_int8 else "*fp16", "o_ptr": f"*{out}", "xs_ptr": "*fp32", "wsc_ptr": "*fp32",
           "wsum_ptr": "*i32", "os_ptr": "*fp32", "q_ptr": "*i8",
           **{n: "i32" for n in ("M", "OH", "OW", "CIN", "COUT", "PROGS_M", "s_xn", "s_xh", "s_xw", "s_wo",
                                 "stride_h", "stride_w")}}
    consts = {"s_xc": 1, "s_wc": 1}
    if res_int8:
        sig["rs_ptr"] = "*fp32"
    else:
        consts["rs_ptr"] = None
    if not int8:
        consts.update(xs_ptr=None, wsc_ptr=None, os_ptr=None)
    if not dual:
        consts["q_ptr"] = None
    if not zero:
        consts["wsum_ptr"] = None
    elif not quant_out and not dual:
        consts["os_ptr"] = None
    for n in consts:
        sig[n] = "constexpr"
    _flags(sig, consts, EVEN_C=True, HAS_BIAS=True, HAS_RES=True, ACT=1 if fold else 2, DOT_PRECISION="tf32",
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, INT_ACC=int8, QUANT_OUT=quant_out,
           X_ZERO=zero, OUT_ZERO=zero if quant_out or dual else 0, DUAL_OUT=dual, F16_MMA=cfg.f16_mma,
           RES_INT8=res_int8, RES_ZERO=zero if res_int8 else 0, RES_DOT=res_dot)
    return compile_sm90(pw_mod._conv_pointwise_persistent_kernel, sig, consts, cfg.num_warps, cfg.num_stages,
                        ("M", "OH", "OW", "stride_h", "stride_w"))


def conv_depthwise(cout: int, k: int = 3, quant_out: bool = False) -> dict:
    """The depthwise conv (fp16, bias + relu6) at dw_mod.depthwise_config(cout); quant_out: int8 out, unsigned
    (a depthwise conv feeding an int8 projection, as in MobileNetV2's int8 candidate)."""
    cfg = dw_mod.depthwise_config(cout)
    sig = {"x_ptr": "*fp16", "w_ptr": "*fp32" if dw_mod._dw_fp32_weights(quant_out) else "*fp16", "b_ptr": "*fp32",
           "r_ptr": "*fp16", "o_ptr": "*i8" if quant_out else "*fp16", "os_ptr": "*fp32", "q_ptr": "*i8",
           **{n: "i32" for n in ("M", "OH", "OW", "H", "W", "COUT", "MULT", "s_xn", "s_xh", "s_xw", "s_wh", "s_ww",
                                 "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w")}}
    # MULT (output channels per input channel) is 1 in every depthwise conv of the zoo, and the JIT specializes
    # an integer argument equal to 1: as a runtime value the channel index co // MULT hides the channels'
    # contiguity and every load compiles to 2-byte scalars (144 ld.global.b16 a thread, 96 registers and a
    # 328 B spill, fp16 out); specialized, as on the GPU, 20 ld.global.v4.b32, 66 registers, no spill.
    consts = {"s_xc": 1, "s_wo": 1, "r_ptr": None, "q_ptr": None, "MULT": 1}
    if not quant_out:
        consts["os_ptr"] = None
    for n in consts:
        sig[n] = "constexpr"
    _flags(sig, consts, KH=k, KW=k, HAS_BIAS=True, HAS_RES=False, ACT=5, BLOCK_P=cfg.block_p, BLOCK_C=cfg.block_c,
           QUANT_OUT=quant_out, OUT_ZERO=-128 if quant_out else 0)
    odd = ("M", "OH", "OW", "H", "W", "stride_h", "stride_w", "pad_h", "pad_w", "dil_h", "dil_w")
    return compile_sm90(dw_mod._conv_depthwise_kernel, sig, consts, cfg.num_warps, 3, odd)  # the launch default


def rowwise(cfg, op: str, dt: str = "bf16") -> dict:
    """softmax (the kernel its launcher picks for ``cfg``) or a gated activation (op "silu" / "gelu")."""
    sig = {"x_ptr": f"*{dt}", "out_ptr": f"*{dt}", "M": "i32", "N" if op == "softmax" else "D": "i32",
           "stride_xm": "i32", "stride_om": "i32"}
    consts: dict = {}
    if op != "softmax":
        fn = activation._gated_kernel
        _flags(sig, consts, ACT=activation.ACTIVATIONS[op], BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    elif cfg.looped and cfg.persistent:
        fn = activation._softmax_persistent_kernel
        vec = min(cfg.block_n, 16 // {"bf16": 2, "fp16": 2, "fp32": 4}[dt])
        _flags(sig, consts, BLOCK_N=cfg.block_n, VEC=vec, **({"KEEP": "evict_last", "DROP": "evict_first"}
                                                             if cfg.l2_hints else {}))
    elif cfg.looped:
        fn = activation._softmax_looped_kernel
        _flags(sig, consts, BLOCK_N=cfg.block_n)
    else:
        fn = activation._softmax_rows_persistent_kernel if cfg.persistent else activation._softmax_kernel
        _flags(sig, consts, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    return compile_sm90(fn, sig, consts, cfg.num_warps, 3)  # num_stages: the launch default


# The kernels suite's row-wise shapes (H200 kernels.jsonl), as the launchers bucket them.
SOFTMAX_SHAPES = ((4096, 32768), (131072, 4096), (512, 131072), (4096, 1024))
GATED_SHAPE = (4096, 16384)  # [M, d] bucket of silu_and_mul 4096x28672 (and the suite's 4096x14336)


def jobs(every: bool) -> list[tuple[str, object]]:
    """(label, thunk) per kernel/config: the first candidate of each family, or all of them."""
    pick = (lambda cfgs: cfgs) if every else (lambda cfgs: cfgs[:1])
    out = []
    for cfg in pick([c for c in matmul.MATMUL_CONFIGS if c.tma]):
        out.append((f"matmul tma {cfg}", lambda cfg=cfg: matmul_tma(cfg)))
    for cfg in pick([c for c in matmul.MATMUL_CONFIGS if not c.tma]):
        out.append((f"matmul ptr {cfg}", lambda cfg=cfg: matmul_ptr(cfg)))
    for cfg in pick([c for c in matmul_fp8.FP8_CONFIGS if c.tma]):
        out.append((f"fp8 tma {cfg}", lambda cfg=cfg: matmul_tma(cfg, "fp8e4nv", fp8=True)))
    for cfg in pick([c for c in matmul_fp8.FP8_CONFIGS if not c.tma]):
        out.append((f"fp8 ptr {cfg}", lambda cfg=cfg: matmul_ptr(cfg, "fp8e4nv", fp8=True)))
    # int8: per-row activation and per-channel weight scales, fp16 out (QuantLinearW8A8's launch).
    for cfg in pick([c for c in matmul_int8.INT8_CONFIGS if c.tma]):
        out.append((f"int8 tma {cfg}", lambda cfg=cfg: matmul_tma(cfg, "i8", "fp16", fp8=True, int8=True)))
    for cfg in pick([c for c in matmul_int8.INT8_CONFIGS if not c.tma]):
        out.append((f"int8 ptr {cfg}", lambda cfg=cfg: matmul_ptr(cfg, "i8", "fp16", fp8=True, int8=True)))
    # conv: fp16 and int8 (fp16 out with residual; int8 out as with out_scale) in the taps and plain modes.
    for cfg in pick(conv.CONV_CONFIGS):
        out.append((f"conv fp16 taps {cfg}", lambda cfg=cfg: conv_gemm(cfg, conv.MODE_TAPS)))
    for cfg in pick(conv_int8.INT8_CONV_CONFIGS):
        out.append((f"conv int8 taps {cfg}", lambda cfg=cfg: conv_gemm(cfg, conv.MODE_TAPS, "i8", int8=True)))
        out.append((f"conv int8 plain int8-out {cfg}",
                    lambda cfg=cfg: conv_gemm(cfg, conv.MODE_PLAIN, "i8", "i8", int8=True, quant_out=True)))
        out.append((f"conv int8 taps unsigned int8-out {cfg}", lambda cfg=cfg: conv_gemm(
            cfg, conv.MODE_TAPS, "i8", "i8", int8=True, quant_out=True, zero=-128)))
        # A ResNet block's last conv: unsigned x, residual, fp16 out and its int8 copy for the next block.
        out.append((f"conv int8 plain unsigned fp16+int8-out {cfg}", lambda cfg=cfg: conv_gemm(
            cfg, conv.MODE_PLAIN, "i8", "fp16", int8=True, zero=-128, dual=True)))
    # The fp16-out depthwise kernel "spilled 310 B" here (2026-12-01) only because MULT was compiled as a
    # runtime value (see conv_depthwise): listed with --all only, as before.
    for quant_out in ((False, True) if every else (True,)):
        out.append((f"depthwise fp16 3x3{' int8-out' if quant_out else ''}",
                    lambda q=quant_out: conv_depthwise(384, quant_out=q)))
    if every:
        # The int8 residual stream (quantize_model's int8_residual): int8 residual in, int8 out.
        for cfg in conv_int8.INT8_CONV_CONFIGS:
            out.append((f"conv int8 plain unsigned int8-res int8-out {cfg}", lambda cfg=cfg: conv_gemm(
                cfg, conv.MODE_PLAIN, "i8", "i8", int8=True, quant_out=True, zero=-128, res_int8=True)))
        # The persistent pointwise kernel on a ResNet block output (int8 residual, folded int8 out, ReLU).
        for cfg in (c for c in conv_int8.INT8_CONV_CONFIGS if c.persistent):
            out.append((f"conv int8 pointwise int8-res fold {cfg}", lambda cfg=cfg:
                        conv_pointwise(cfg, "i8", "i8", int8=True, quant_out=True, zero=-128, res_int8=True,
                                       fold=True)))
        # The residual tuner's extra candidates (conv_tuning.residual_candidates): the 16-warps-per-SM tilings and the
        # res_dot twins, with the int8 residual and the folded int8 out (int8) or the fp16 residual.
        for cfg in (c for c in conv_int8._RES_TUNER.configs if c.persistent and (c.res_dot or
                                                                                 c in conv_int8.INT8_RESIDUAL_TILINGS)):
            out.append((f"conv int8 pointwise int8-res fold residual-tuner {cfg}", lambda cfg=cfg: conv_pointwise(
                cfg, "i8", "i8", int8=True, quant_out=True, zero=-128, res_int8=True, fold=True, res_dot=cfg.res_dot)))
        for cfg in (c for c in conv_tuning._RES_TUNER.configs
                    if c.persistent and (c.res_dot or c in conv_tuning.RESIDUAL_TILINGS)):
            out.append((f"conv fp16 pointwise residual-tuner {cfg}",
                        lambda cfg=cfg: conv_pointwise(cfg, res_dot=cfg.res_dot)))
        for cfg in (c for c in conv.CONV_CONFIGS if c.persistent):
            out.append((f"conv fp16 pointwise {cfg}", lambda cfg=cfg: conv_pointwise(cfg)))
        # The narrow tuners' tilings (MobileNetV2's projections, with the skip; its space-to-depth stem).
        for cfg in conv.NARROW_TILINGS:
            kind = "pointwise" if cfg.persistent else "taps"
            out.append((f"conv fp16 narrow {kind} {cfg}", lambda cfg=cfg: conv_pointwise(cfg) if cfg.persistent
                        else conv_gemm(cfg, conv.MODE_TAPS)))
        for cfg in conv_int8.INT8_NARROW_TILINGS:
            out.append((f"conv int8 narrow {cfg}", lambda cfg=cfg: conv_pointwise(
                cfg, "i8", "i8", int8=True, quant_out=True, zero=-128, res_int8=True, fold=True) if cfg.persistent
                else conv_gemm(cfg, conv.MODE_PLAIN, "i8", "i8", int8=True, quant_out=True, zero=-128)))
        out.append(("conv int8 flat (stem)", lambda: conv_gemm(conv_int8.INT8_CONV_CONFIGS[5], conv.MODE_FLAT, "i8",
                                                               int8=True)))
    for cfgs in gemv.LINEAR_CONFIGS.values():
        for cfg in pick([c for c in cfgs if not c.words]):
            for fmt, group in ((0, None), (1, None), (2, 128), (3, None)):
                if group is None or cfg.block_k % group == 0:
                    out.append((f"linear fmt={fmt} {cfg}", lambda cfg=cfg, fmt=fmt, g=group: linear(cfg, fmt, g)))
        for cfg in pick([c for c in cfgs if c.words]):
            for fmt, group in ((1, None), (2, 128)):
                out.append((f"linear words fmt={fmt} {cfg}",
                            lambda cfg=cfg, fmt=fmt, g=group: linear_words(cfg, fmt, g)))
    # Programmatic dependent launch (the LLM decode graphs): griddepcontrol wait + launch_dependents.
    cfg = next(c for c in gemv.LINEAR_CONFIGS[min(gemv.LINEAR_CONFIGS)] if not c.words)
    out.append((f"linear pdl {cfg}", lambda cfg=cfg: linear(cfg, 0, None, pdl=1)))  # trigger after the loop
    out.append((f"linear gated silu {cfg}", lambda cfg=cfg: linear(cfg, 0, None, gate=2)))  # the MLP's down proj
    out.append((f"linear pdl norm {cfg}", lambda cfg=cfg: linear(cfg, 0, None, pdl=1, norm=2)))
    # Row-wise: every tuning candidate of the suite's shapes with --all; else each kernel variant once.
    seen: set = set()
    for m, n in SOFTMAX_SHAPES:
        for cfg in activation.softmax_candidates(m, n):
            kind = (cfg.looped, cfg.persistent)
            if cfg not in seen and (every or kind not in {(c.looped, c.persistent) for c in seen}):
                seen.add(cfg)
                out.append((f"softmax {cfg}", lambda cfg=cfg: rowwise(cfg, "softmax")))
    out.append(("softmax fp32 persistent streamed", lambda: rowwise(activation.SOFTMAX_STREAMED[0], "softmax", "fp32")))
    for cfg in pick(list(activation.gated_candidates(*GATED_SHAPE))):
        out.append((f"gated silu {cfg}", lambda cfg=cfg: rowwise(cfg, "silu")))
        if every:
            out.append((f"gated gelu {cfg}", lambda cfg=cfg: rowwise(cfg, "gelu")))
    return out + norm_jobs(every)


def main(argv: list[str]) -> int:
    bad = 0
    # --only a,b or --only=a,b: labels starting with one of these
    only = tuple(argv[argv.index("--only") + 1].split(",")) if "--only" in argv else ()
    only += tuple(x for a in argv if a.startswith("--only=") for x in a.split("=", 1)[1].split(","))
    picked = tuple(int(a.split("=")[1]) for a in argv if a.startswith("--norm-class="))
    if "--norm" in argv or picked:  # --norm-class=16: one M class of the norm fusion (tests run them apart)
        todo = norm_jobs(True, picked or None)
    else:
        todo = jobs("--all" in argv)
    todo = [(label, thunk) for label, thunk in todo if not only or label.startswith(only)]
    for a in argv:  # --shard=I/N: jobs I, I + N, I + 2N, ... of the list (the same list in every shard)
        if a.startswith("--shard="):
            i, n = (int(v) for v in a.split("=", 1)[1].split("/"))
            if not 0 <= i < n:
                raise SystemExit(f"--shard={i}/{n}: expected 0 <= I < N")
            todo = todo[i::n]
    for label, thunk in todo:
        try:
            info = thunk()
        except Exception as e:  # noqa: BLE001 - report and go on
            info = {"error": str(e).strip().splitlines()[-1][:300]}
        ok = "error" not in info and info["shared"] <= SMEM_LIMIT and info["spill"] == 0
        bad += not ok
        print(json.dumps({"kernel": label, "ok": ok, **info}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
