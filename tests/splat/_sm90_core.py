"""Compile the projection, SH and input-check kernels for sm_90 without a GPU (Triton's bundled ptxas); print one
JSON line of registers and spills per kernel. Run with TRITON_INTERPRET=0 and a TRITON_CACHE_DIR (see
_sm90_splat.py)."""

from __future__ import annotations

import json
import sys

import tests.kernels.attention._sm90_compile as sm90
from warpforge.splat import checks as K
from warpforge.splat import project as P
from warpforge.splat import reference as ref
from warpforge.splat import sh as S


def main() -> None:
    # the projection's float scalars and the check kernel's bounds
    sm90.FLOATS = set(sm90.FLOATS) | {"near", "far", "eps2d"} | {f"{b}{i}" for b in ("lo", "hi") for i in range(6)}

    def types(fn):
        ptrs = {n: ("*i32" if n == "radii_ptr" else "*i64" if n == "flag_ptr" else "*fp32") for n in fn.arg_names
                if n.endswith("_ptr")}
        return ptrs | {f"p{i}": "*fp32" for i in range(6) if f"p{i}" in fn.arg_names}

    res = {}
    for cam, name in enumerate(("pinhole", "fisheye")):
        base = dict(CAMERA=cam, CLAMP=ref.CLAMP_FOV, EPS=ref.FISHEYE_EPS, ANTIALIAS=False, BLOCK=P.BLOCK)
        res[f"project_fwd {name}"] = sm90.compile_one(
            P._project_fwd_kernel, types(P._project_fwd_kernel),
            dict(base, CUT_REL=ref.CUTOFF_REL, CUT_ABS=ref.CUTOFF_ABS, ALPHA_MIN=ref.ALPHA_MIN, MAX_R=ref.MAX_RADIUS),
            P.NUM_WARPS, 1)
        res[f"project_bwd {name}"] = sm90.compile_one(P._project_bwd_kernel, types(P._project_bwd_kernel),
                                                      dict(base, VIEW_GRAD=False, DEPTH_GRAD=True), P.NUM_WARPS, 1)
        res[f"project_bwd {name} poses"] = sm90.compile_one(P._project_bwd_kernel, types(P._project_bwd_kernel),
                                                            dict(base, VIEW_GRAD=True, DEPTH_GRAD=True), P.NUM_WARPS, 1)
    res["project_bwd pinhole rgb"] = sm90.compile_one(  # an RGB render: the depths take no gradient
        P._project_bwd_kernel, types(P._project_bwd_kernel),
        dict(CAMERA=0, CLAMP=ref.CLAMP_FOV, EPS=ref.FISHEYE_EPS, ANTIALIAS=False, BLOCK=P.BLOCK, VIEW_GRAD=False,
             DEPTH_GRAD=False), P.NUM_WARPS, 1)
    aa = dict(CAMERA=0, CLAMP=ref.CLAMP_FOV, EPS=ref.FISHEYE_EPS, ANTIALIAS=True, BLOCK=P.BLOCK)
    res["project_fwd pinhole antialiased"] = sm90.compile_one(
        P._project_fwd_kernel, types(P._project_fwd_kernel),
        dict(aa, CUT_REL=ref.CUTOFF_REL, CUT_ABS=ref.CUTOFF_ABS, ALPHA_MIN=ref.ALPHA_MIN, MAX_R=ref.MAX_RADIUS),
        P.NUM_WARPS, 1)
    res["project_bwd pinhole antialiased"] = sm90.compile_one(
        P._project_bwd_kernel, types(P._project_bwd_kernel), dict(aa, VIEW_GRAD=False, DEPTH_GRAD=True), P.NUM_WARPS, 1)
    res["sh_fwd d3"] = sm90.compile_one(S._sh_fwd_kernel, types(S._sh_fwd_kernel),
                                        dict(DEGREE=3, KB=16, BLOCK=S.BLOCK, RENDER=False, COEF_SHARED=True),
                                        S.NUM_WARPS, 1)
    res["sh_bwd d3"] = sm90.compile_one(S._sh_bwd_kernel, types(S._sh_bwd_kernel),
                                        dict(DEGREE=3, KB=16, BLOCK=S.BWD_BLOCK, RENDER=False, COEF_SHARED=True,
                                             CENTRE_GRAD=False), S.NUM_WARPS, 1)
    for shared in (True, False):
        tag = "" if shared else " per-camera coeffs"
        res[f"sh_fwd d3 render{tag}"] = sm90.compile_one(
            S._sh_fwd_kernel, types(S._sh_fwd_kernel), dict(DEGREE=3, KB=16, BLOCK=S.BLOCK, RENDER=True,
                                                            COEF_SHARED=shared), S.NUM_WARPS, 1)
    res["sh_bwd d3 render"] = sm90.compile_one(
        S._sh_bwd_kernel, types(S._sh_bwd_kernel), dict(DEGREE=3, KB=16, BLOCK=S.BWD_BLOCK, RENDER=True,
                                                        COEF_SHARED=True, CENTRE_GRAD=False), S.NUM_WARPS, 1)
    res["sh_bwd d3 render poses"] = sm90.compile_one(
        S._sh_bwd_kernel, types(S._sh_bwd_kernel), dict(DEGREE=3, KB=16, BLOCK=S.BWD_BLOCK, RENDER=True,
                                                        COEF_SHARED=False, CENTRE_GRAD=True), S.NUM_WARPS, 1)
    res["input checks"] = sm90.compile_one(K._check_kernel, types(K._check_kernel),
                                           dict(NT=6, CAMERAS=True, BLOCK=K.BLOCK, CB=K.CAM_BLOCK), K.NUM_WARPS, 1)
    json.dump(res, sys.stdout)


if __name__ == "__main__":
    main()
