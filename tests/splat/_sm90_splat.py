"""Compile the splat kernels for sm_90 without a GPU (Triton's bundled ptxas); print one JSON line of
registers and spills per kernel. Run with TRITON_INTERPRET=0 (see tests/kernels/attention/_sm90_compile.py)."""

from __future__ import annotations

import json
import sys

from tests.kernels.attention._sm90_compile import compile_one
from warpforge.splat import blend, tiles
from warpforge.splat import reference as ref


def main() -> None:
    ptrs = {n: "*fp32" for n in ("means_ptr", "conics_ptr", "colors_ptr", "opac_ptr", "bg_ptr", "out_ptr",
                                 "alpha_ptr", "T_ptr", "v_out_ptr", "v_alpha_ptr", "v_means_ptr", "v_conics_ptr",
                                 "v_colors_ptr", "v_opac_ptr", "v_abs_ptr", "depths_ptr")}
    ptrs.update(offsets_ptr="*i32", ids_ptr="*i32", last_ptr="*i32", radii_ptr="*i32", counts_ptr="*i32",
                cum_ptr="*i64", keys_ptr="*i64")

    def types(fn):
        return {k: v for k, v in ptrs.items() if k in fn.arg_names}

    res = {}
    for D in (3, 4):
        meta = dict(D=D, DB=4, TILE=16, PB=256, HAS_BG=True, ALPHA_MIN=ref.ALPHA_MIN,
                    ALPHA_MAX=ref.ALPHA_MAX)
        res[f"blend_fwd D{D}"] = compile_one(blend._blend_fwd_kernel, types(blend._blend_fwd_kernel),
                                             dict(meta, T_MIN=ref.T_MIN, UNROLL=blend.FWD_UNROLL), blend.FWD_WARPS, 1)
        res[f"blend_bwd D{D}"] = compile_one(blend._blend_bwd_kernel, types(blend._blend_bwd_kernel),
                                             dict(meta, ABSGRAD=True, ALPHA_GRAD=True, UNROLL=blend.BWD_UNROLL),
                                             blend.BWD_WARPS, 1)
    cut = dict(TILE=16, CUT_REL=ref.CUTOFF_REL, CUT_ABS=ref.CUTOFF_ABS, MIN_DET=ref.MIN_DET_RATIO,
               BLOCK=tiles.BLOCK_GAUSS)
    for name, fn in (("isect_count", tiles._isect_count_kernel), ("isect_emit", tiles._isect_emit_kernel)):
        res[name] = compile_one(fn, types(fn), cut, 4, 1)
    res["tile_offsets"] = compile_one(tiles._tile_offsets_kernel, types(tiles._tile_offsets_kernel),
                                      dict(BLOCK=tiles.BLOCK_TILES), 4, 1)
    json.dump(res, sys.stdout)


if __name__ == "__main__":
    main()
