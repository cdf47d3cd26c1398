"""Graph optimization: capture, passes, then the fastest backend that keeps the accuracy budget.

    opt = warpforge.optimize(model, (x,))      # the module is callable: same as optimize(...)
    opt(x); opt.report; opt.save("out/model")  # later: warpforge.optimize.load("out/model")

Parts: capture (torch.export raised back to module calls; FX with untraceable submodules kept eager when
export fails), passes fold_bn / channels_last / fuse_conv and
``optimize_graph``; ``gate`` (accuracy against the fp32 reference), ``latency`` (single-stream and offline
protocol), ``backends`` (the candidates), ``api`` (the search), ``saved`` (save/load), ``report``.
"""

import sys
import types

from warpforge.optimize.api import BadInputError, NoCandidateError, OptimizeError, Optimized, optimize
from warpforge.optimize.backends import Built, Candidate, candidate_names
from warpforge.optimize.capture import Captured, capture
from warpforge.optimize.gate import Accuracy, Budget, compare
from warpforge.optimize.latency import Latency, Throughput, offline, single_stream
from warpforge.optimize.passes import (Change, ChannelsLast, FoldBatchNorm, FuseConvEpilogue, FusedConv2d, FusedLinear,
                                       FuseLinear, Pass, PassContext, PassResult)
from warpforge.optimize.pipeline import Pipeline, default_passes, float_passes, optimize_graph
from warpforge.optimize.saved import Loaded, load
from warpforge.optimize.shapes import ShapeError

__all__ = ["Accuracy", "BadInputError", "Budget", "Built", "Candidate", "Captured", "Change", "ChannelsLast",
           "FoldBatchNorm", "FuseConvEpilogue", "FuseLinear", "FusedConv2d", "FusedLinear", "Latency", "Loaded",
           "NoCandidateError", "OptimizeError", "Optimized", "Pass", "PassContext", "PassResult", "Pipeline",
           "ShapeError", "Throughput", "candidate_names", "capture", "compare", "default_passes", "float_passes",
           "load", "offline", "optimize", "optimize_graph", "single_stream"]


class _CallableModule(types.ModuleType):
    """Lets ``warpforge.optimize(model, inputs)`` call :func:`optimize` while ``warpforge.optimize.load``
    and the rest stay module attributes."""

    def __call__(self, *args, **kwargs):
        return optimize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
