"""Pure-torch references for every stage of the Gaussian-splatting pipeline, written for clarity.

On CPU tensors the public splat functions run these (as ``warpforge.kernels`` dispatches); the tests
compare each Triton kernel with the reference of its stage, and the whole tiled pipeline with
``render_reference``, which blends every Gaussian at every pixel with no tiles at all.
"""

from __future__ import annotations

import torch

# ---- projection, spherical harmonics, dense whole-pipeline render -----------------------------------


# ---- tile intersection, key sort, per-tile blending ------------------------------------------------
