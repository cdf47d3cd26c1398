"""warpforge: fast neural-network inference on NVIDIA GPUs, measured against the machine's ceilings.

Parts (see DESIGN.md): ``hw`` measures ceilings, ``bench`` times ours against peers and keeps
records, ``kernels`` holds the Triton kernels; ``llm``, ``optimize``, ``profile`` and ``splat``
are the products built on them. Import is cheap: nothing heavy loads until a part is used.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
