"""The implicit GEMM's tilings (ConvConfig) and how one is chosen per conv: the candidate lists, the three
tuners (main, residual, narrow) with their caches, and the rule that drops tilings far from a problem
(``_fits``). conv_int8.py keeps the int8 lists beside its launcher and uses the same chooser.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import triton

from warpforge.kernels._autotune import Tuner, pow2_bucket
from warpforge.kernels._checks import check_num_warps, check_pow2, check_range
from warpforge.kernels._dispatch import INTERPRET
from warpforge.kernels.conv_common import MODE_TAPS, _Geometry, _shares_storage, pointwise_ok


@dataclass(frozen=True, repr=False)
class ConvConfig:
    """Implicit-GEMM tiling: BM output pixels x BN output channels, K in BK steps, K split ``split_k`` ways."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # > 1: partial sums in an fp32 workspace, then a small epilogue kernel
    f16_mma: bool = False  # conv2d_int8 only: int8 operands on fp16 tensor cores (an MMA kept in flight)
    # > 0: the persistent pointwise kernel (1x1 convs without padding, C <= block_k: the whole K in one
    # tile), ``persistent`` programs per SM each walking many M tiles, the next tiles' loads in flight
    # during this one's epilogue. 0: one program per output tile.
    persistent: int = 0
    # > 0: cap registers per thread (ptxas .maxnreg) so more blocks share an SM: 128 lets two 8-warp blocks
    # sit on one SM, one block's MMA running while the other waits (an int32-accumulator MMA is never kept
    # in flight across K steps by Triton 3.6, so each block alone idles the tensor cores between steps).
    # 0: no cap. The repr names it only when set, so the tuner's hash of a candidate list without caps stays
    # what it was before the field existed (the shipped winners stay valid).
    maxnreg: int = 0
    # persistent tilings with a residual add: the residual through an MMA with the identity (RES_DOT in
    # _conv_pointwise_persistent_kernel: prefetched by the pipeliner). Offered by the residual tuner only
    # (residual_candidates); named in the repr only when set, as maxnreg.
    res_dot: bool = False

    def __repr__(self) -> str:
        names = [f.name for f in fields(self) if f.name not in ("maxnreg", "res_dot") or getattr(self, f.name)]
        return f"ConvConfig({', '.join(f'{n}={getattr(self, n)!r}' for n in names)})"

    def __post_init__(self) -> None:
        check_pow2(self, "block_m", "block_n", "block_k", lo=16)
        check_pow2(self, "group_m")
        check_num_warps(self)
        check_range(self, "num_stages", 1, 8)
        check_range(self, "split_k", 1, 32)
        if self.f16_mma and self.split_k != 1:
            raise ValueError("ConvConfig.f16_mma takes split_k=1 (its partial sums would be fp32, the int8 split-K "
                             f"workspace is int32), got split_k={self.split_k}")
        if not 0 <= self.persistent <= 8:
            raise ValueError(f"ConvConfig.persistent must be in [0, 8] (programs per SM), got {self.persistent}")
        if self.maxnreg and not 32 <= self.maxnreg <= 255:
            raise ValueError(f"ConvConfig.maxnreg must be 0 (no cap) or in [32, 255], got {self.maxnreg}")
        if self.res_dot and not self.persistent:
            raise ValueError("ConvConfig.res_dot is a persistent pointwise tiling's option (persistent >= 1)")
        if self.persistent and self.split_k != 1:
            raise ValueError(f"ConvConfig.persistent takes split_k=1 (one program owns each tile's whole K), got "
                             f"split_k={self.split_k}")


# Candidates for sm_90 fp16/bf16 (first = default when tuning is off). The lead sweeps by editing this.
# Offline sm_90 compiles (tests/kernels/sm90_compile.py --all; fp16, bias + residual + silu epilogue): all fit
# shared memory; all but (128, 256, 64) and (32, 64, 64, split 8) are spill-free; the latter runs mma.sync
# (BM 32 is below wgmma's 64 rows), the rest wgmma.
CONV_CONFIGS = [
    ConvConfig(128, 128, 64, 8, 8, 3),
    ConvConfig(128, 64, 64, 8, 4, 4),
    ConvConfig(64, 128, 64, 8, 4, 4),
    ConvConfig(128, 256, 64, 8, 8, 3),
    ConvConfig(64, 64, 64, 8, 4, 4),
    ConvConfig(64, 64, 32, 8, 4, 5),  # small Cout (stem) and short K
    # Batch-1 late layers (7x7 and 14x14 outputs, long K): too few output tiles to fill 132 SMs.
    ConvConfig(64, 64, 64, 8, 4, 4, split_k=4),
    ConvConfig(32, 64, 64, 4, 4, 4, split_k=8),
    # Persistent pointwise tilings (1x1, C <= block_k), ``persistent`` = the blocks one SM holds (offline
    # sm_90, sm90_compile.py --all: the weights stay in shared memory, x is prefetched num_stages - 1 tiles
    # ahead, no spills; the 128-row and 256-deep tiles fit one block per SM, (64, 128, 64) two).
    ConvConfig(128, 128, 64, 8, 8, 3, persistent=1),
    ConvConfig(64, 128, 64, 8, 4, 3, persistent=2),
    ConvConfig(128, 128, 128, 8, 8, 2, persistent=1),
    ConvConfig(64, 128, 256, 8, 4, 2, persistent=1),
]
SPLIT_K_MAX_TILES = 66  # split K only when the output tiles fill at most half of the H200's 132 SMs
PERSISTENT_MIN_TILES = 264  # persistent tilings only where the output tiles fill the H200's 132 SMs twice over
INTERPRET_CONFIG = ConvConfig(32, 32, 16, 4, 4, 1)  # CPU interpreter: small tiles, odd sizes exercise masks


def residual_candidates(configs: list[ConvConfig], extra: list[ConvConfig],
                        no_dot: tuple[ConvConfig, ...] = ()) -> list[ConvConfig]:
    """The residual tuner's list: ``configs`` (so every base is among them), the ``extra`` persistent
    tilings, and a res_dot twin of every persistent tiling but those in ``no_dot`` (they spill with it)."""
    persistent = [c for c in configs if c.persistent] + list(extra)
    return list(configs) + list(extra) + [replace(c, res_dot=True) for c in persistent if c not in no_dot]


_TUNER: Tuner[ConvConfig] = Tuner("conv2d_gemm", CONV_CONFIGS, ConvConfig)
# Persistent tilings holding 16 warps per SM (offline sm_90: no spills), for the residual tuner only: more
# warps hide the residual's epilogue load, a gain seen with the residual only (benchmarks/notes/optimize.md).
# In the main list they would void the shipped winners (the tuner's candidate hash).
RESIDUAL_TILINGS = [ConvConfig(64, 64, bk, 8, 4, st, persistent=4) for bk, st in ((64, 3), (128, 2))] + [
    ConvConfig(64, 128, bk, 8, 8, st, persistent=2) for bk, st in ((64, 3), (128, 2))] + [
    ConvConfig(128, 64, bk, 8, 8, st, persistent=2) for bk, st in ((64, 3), (128, 2))]
_RES_TUNER: Tuner[ConvConfig] = Tuner("conv2d_gemm_residual", residual_candidates(CONV_CONFIGS, RESIDUAL_TILINGS),
                                      ConvConfig)
# Narrow convs (Cout/groups <= NARROW_COUT: MobileNetV2's projections and 3->32 stem) passed _fits only on the
# default 128x128x64 tile, 4-8x wider than their output, so they ran far above their HBM traffic. A third
# tuner (its own cache: the main list's shipped winners stay valid) picks among the base and these 32-wide
# tilings, the four that won a bucket on MobileNetV2 b32; the 16-deep K tile serves the space-to-depth stem.
# Only from NARROW_MIN_M output pixels: at batch 1 the forward is launch-bound and the tuning's compiles
# would only lengthen a cold optimize run (figures: benchmarks/notes/optimize.md).
NARROW_COUT = 32
NARROW_MIN_M = 16384
NARROW_TILINGS = [
    ConvConfig(128, 32, 32, 8, 4, 5),
    ConvConfig(128, 32, 16, 8, 4, 6),
    ConvConfig(64, 32, 64, 8, 4, 4),
    ConvConfig(128, 32, 64, 8, 4, 3, persistent=4),
]
_NARROW_TUNER: Tuner[ConvConfig] = Tuner("conv2d_gemm_narrow", [CONV_CONFIGS[0]] + NARROW_TILINGS, ConvConfig)
# Winners seen by this process: the Tuner answers its default during CUDA-graph capture, but a graph
# captured after a warm-up call should replay the tuned tiling.
_CHOSEN: dict[tuple, ConvConfig] = {}


def tune_bucket(x: torch.Tensor, g: _Geometry, mode: int) -> tuple:
    """The tuner's key for a conv: dtype, mode, M (power-of-two bucket), channels, kernel, stride, groups."""
    m, cout_g = g.n * g.oh * g.ow, g.cout // g.groups
    return (str(x.dtype), mode, pow2_bucket(m, 16), cout_g, g.cin_g, g.kh, g.kw, g.stride[0], g.groups)


# A 1x1 conv with a residual add (a ResNet block's last conv, MobileNetV2's projection + skip) reads one more
# [M, Cout] tensor than the same conv without it, in the epilogue of every tile: its best tiling differs
# (benchmarks/sweeps/residual_epilogue.py). Such convs take the tuning without the residual (the base: shipped
# winners serve it), then a second tuner (_RES_TUNER here, conv_int8._RES_TUNER for int8; their own caches)
# picks among the base and the persistent tilings, each also with res_dot, under the key plus the residual's
# dtype and the base.


def _tag(cfg: ConvConfig) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}w{cfg.num_warps}s{cfg.num_stages}k{cfg.split_k}"
            f"{'h' if cfg.f16_mma else ''}p{cfg.persistent}r{cfg.maxnreg}")


def choose_gemm_config(config: ConvConfig | None, tuner: Tuner[ConvConfig],
                       interpret_config: ConvConfig, x: torch.Tensor, g: _Geometry, mode: int, out: torch.Tensor,
                       residual: torch.Tensor | None, launch,
                       res_tuner: Tuner[ConvConfig] | None = None,
                       narrow_tuner: Tuner[ConvConfig] | None = None) -> ConvConfig:
    """``config`` when given, the interpreter's tiling, or the tuned one for this shape bucket
    (``launch(cfg, dst)`` runs a trial; the first candidate of ``tuner`` is always allowed); with a
    residual, a pointwise conv and ``res_tuner``, that tuner's choice among the base and the persistent
    tilings (see RESIDUAL_TILINGS); for a narrow conv (Cout/groups <= NARROW_COUT, NARROW_MIN_M output
    pixels or more) and ``narrow_tuner``, that tuner's choice among the base and its narrow tilings instead
    (see NARROW_TILINGS)."""
    if isinstance(config, ConvConfig):
        return config
    if INTERPRET:
        return interpret_config
    m, cout_g = g.n * g.oh * g.ow, g.cout // g.groups
    bucket = tune_bucket(x, g, mode)
    narrow = narrow_tuner is not None and cout_g <= NARROW_COUT and m >= NARROW_MIN_M
    by_res = not narrow and residual is not None and res_tuner is not None and pointwise_ok(g)
    res_dtype = str(residual.dtype).removeprefix("torch.") if residual is not None else None
    memo = (tuner.kernel, str(x.device), bucket, res_dtype if by_res or narrow else None, narrow)
    cfg = _CHOSEN.get(memo)
    if cfg is None:
        # Tuning runs the kernel many times: with out == residual (in-place add) it must write elsewhere.
        scratch = torch.empty_like(out) if residual is not None and _shares_storage(out, residual) else out

        def fits(c: ConvConfig) -> bool:
            return _fits(c, m, cout_g, g.cin_g * g.kh * g.kw, g.groups, tuner.configs[0],
                         k_tile=g.cin_g if mode == MODE_TAPS else None, pointwise=pointwise_ok(g))

        cfg = tuner.choose(bucket, x.device, lambda c: launch(c, scratch), valid=fits)
        base, key = cfg, bucket + (f"res:{res_dtype}", f"base:{_tag(cfg)}")  # the second tuner's key
        if narrow:
            cfg = narrow_tuner.choose(key, x.device, lambda c: launch(c, scratch),
                                      valid=lambda c: c == base or fits(c))
        elif by_res:
            dot_ok = residual.dtype in (torch.float16, torch.bfloat16, torch.int8)
            cfg = res_tuner.choose(key, x.device, lambda c: launch(c, scratch),
                                   valid=lambda c: c == base or (c.persistent > 0 and (dot_ok or not c.res_dot)
                                                                 and fits(replace(c, res_dot=False))))
        if not torch.cuda.is_current_stream_capturing():
            _CHOSEN[memo] = cfg
    return cfg


def _fits(cfg: ConvConfig, m: int, cout_g: int, k: int, groups: int, default: ConvConfig | None = None,
          k_tile: int | None = None, pointwise: bool = False) -> bool:
    """Drop tiles far larger than the problem (all-masked work) and split-K where the output tiles
    already fill the GPU or K is too short to share; always keeps the default (CONV_CONFIGS[0]).
    ``k_tile``: the most channels one K step can hold (MODE_TAPS: C/groups, a step never straddles two
    taps), so a wider block_k only multiplies zeros in the same number of steps. ``pointwise``: a 1x1 conv
    without padding in one group (:func:`pointwise_ok`), the only kind a persistent tiling serves, and only
    while its whole K fits one tile (block_k >= C) but not a tile half as deep (the next narrower
    persistent candidate serves that), and with enough output tiles (PERSISTENT_MIN_TILES) for a program to
    walk several: at batch 1 a one-shot grid is as good, and each candidate costs a compile."""
    if cfg == (CONV_CONFIGS[0] if default is None else default):
        return True
    if cfg.persistent:
        if not pointwise or k > cfg.block_k or (k <= cfg.block_k // 2 and cfg.block_k > 64):
            return False
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(cout_g, cfg.block_n)
        return tiles >= PERSISTENT_MIN_TILES and cfg.block_n <= max(32, triton.next_power_of_2(cout_g))
    if cfg.split_k > 1:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(cout_g, cfg.block_n) * groups
        if tiles > SPLIT_K_MAX_TILES or triton.cdiv(k, cfg.block_k) < 4 * cfg.split_k:
            return False
    return (cfg.block_n <= max(32, triton.next_power_of_2(cout_g))
            and cfg.block_m <= max(32, triton.next_power_of_2(m))
            and cfg.block_k <= max(16, triton.next_power_of_2(k if k_tile is None else k_tile)))


__all__ = ["CONV_CONFIGS", "NARROW_TILINGS", "RESIDUAL_TILINGS", "ConvConfig", "choose_gemm_config",
           "residual_candidates"]
