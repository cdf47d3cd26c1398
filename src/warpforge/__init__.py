"""warpforge: fast neural-network inference on NVIDIA GPUs, measured against the machine's ceilings.

Parts (docs/design.md): ``hw`` measures ceilings, ``bench`` times ours against peers, ``results`` keeps
and reads the records, ``kernels`` holds the Triton kernels; ``llm``, ``optimize``, ``profile`` and
``splat`` are the products built on them, ``zoo`` the vision models they are measured on. Import is
cheap: nothing heavy loads until a part is used; ``warpforge.optimize(model, inputs)`` imports the
optimizer on first use.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "optimize"]


def __getattr__(name: str):
    if name == "optimize":  # a callable module (see warpforge.optimize), imported on first use
        import importlib

        return importlib.import_module("warpforge.optimize")
    raise AttributeError(f"module 'warpforge' has no attribute {name!r}")
