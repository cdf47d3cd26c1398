"""Graph optimization (issue 6): capture a model with torch.fx, rewrite it with passes, report each change.

Built so far: capture (FX, untraceable submodules kept eager), passes fold_bn / channels_last / fuse_conv,
and ``optimize_graph``. Not yet: the accuracy gate, backend choice (torch.compile, ...) and the report.
"""

from warpforge.optimize.capture import Captured, capture
from warpforge.optimize.passes import (Change, ChannelsLast, FoldBatchNorm, FuseConvEpilogue, FusedConv2d, Pass,
                                       PassContext, PassResult)
from warpforge.optimize.pipeline import Pipeline, default_passes, optimize_graph

__all__ = ["Captured", "Change", "ChannelsLast", "FoldBatchNorm", "FuseConvEpilogue", "FusedConv2d", "Pass",
           "PassContext", "PassResult", "Pipeline", "capture", "default_passes", "optimize_graph"]
