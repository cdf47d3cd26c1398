"""Graph passes: each is ``apply(model, ctx) -> model`` in its own file and records what it changed."""

from warpforge.optimize.passes.attention import FlashAttention, ReplaceAttention
from warpforge.optimize.passes.base import Change, Pass, PassContext, PassResult
from warpforge.optimize.passes.channels_last import ChannelsLast
from warpforge.optimize.passes.fold_bn import FoldBatchNorm
from warpforge.optimize.passes.fuse_conv import FuseConvEpilogue, FusedConv2d
from warpforge.optimize.passes.fuse_linear import FusedLinear, FuseLinear
from warpforge.optimize.passes.fuse_norm import FusedLayerNorm, FuseNorm

__all__ = ["Change", "ChannelsLast", "FlashAttention", "FoldBatchNorm", "FuseConvEpilogue", "FuseLinear", "FuseNorm",
           "FusedConv2d", "FusedLayerNorm", "FusedLinear", "Pass", "PassContext", "PassResult", "ReplaceAttention"]
