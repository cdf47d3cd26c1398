"""Pass: LayerNorm onto warpforge's norm kernel, with the residual add that feeds it fused in.

A pre-norm transformer block (ViT, the planner) computes ``s = x + branch(x)`` and then ``ln(s)``, and
keeps ``s`` for the next residual. Eager runs that as two memory passes (the add, then torch's layer
norm); this pass makes it one kernel (kernels/norm.py ``layer_norm`` with ``residual``): s and ln(s)
from one read of x and of the branch, s stored for its other users, rounded to the input dtype first
so they and the norm see the same values (torch's order: the add rounds, the norm reads the rounded s).

Why: in warpforge's own profile of the optimized ViT-B/16, torch's ``vectorized_layer_norm_kernel`` ran at a
fraction of the memory roof and the residual adds before it were separate passes over the same tensors
(benchmarks/notes/optimize.md).

Rewrites ``nn.LayerNorm`` modules over the last dim (any ``normalized_shape`` of one int); an
``operator.add`` / ``torch.add`` (no alpha) of two same-shape tensors directly before it becomes the
norm's residual. The module falls back to torch (``F.layer_norm`` after the add) for fp32, CPU tensors
or any dtype the kernel does not take, so the rewritten model computes the same function everywhere.
Run before ``fuse_linear``, which would otherwise move those adds into matmul epilogues.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from warpforge.kernels import use_triton
from warpforge.kernels.norm import layer_norm
from warpforge.optimize.passes import _fx
from warpforge.optimize.passes.base import PassContext

_ADDS = (operator.add, torch.add)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


class FusedLayerNorm(nn.Module):
    """``layer_norm(x)``, or with ``residual``: ``s = x + r`` and ``(layer_norm(s), s)``, one kernel on the GPU."""

    def __init__(self, ln: nn.LayerNorm, residual: bool) -> None:
        super().__init__()
        self.eps = ln.eps
        self.width = ln.normalized_shape[0]
        self.weight = ln.weight  # None without elementwise_affine
        self.bias = ln.bias
        self.residual = residual

    def _kernel_ok(self, *ts: torch.Tensor) -> bool:
        params = [p for p in (self.weight, self.bias) if p is not None]
        return (all(t.dtype in KERNEL_DTYPES and t.dtype == ts[0].dtype and t.is_contiguous() for t in ts)
                and all(p.dtype == ts[0].dtype for p in params) and use_triton(*ts, *params))

    def forward(self, x: torch.Tensor, r: torch.Tensor | None = None):
        if self.residual:
            if self._kernel_ok(x, r):
                y, s = layer_norm(x, self.weight, self.bias, self.eps, residual=r)
                return y, s
            s = x + r
            return F.layer_norm(s, (self.width,), self.weight, self.bias, self.eps), s
        if self._kernel_ok(x):
            return layer_norm(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, (self.width,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.width}, eps={self.eps}, residual={self.residual}"


class FuseNorm:
    """Pass: nn.LayerNorm -> FusedLayerNorm, taking in a same-shape add right before it (module docstring)."""

    name = "fuse_norm"

    def apply(self, model: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        sites, aliases = _fx.prepare(model, self.name, ctx)
        for node, ln in _fx.calls_to(model, nn.LayerNorm):
            if len(ln.normalized_shape) != 1:
                ctx.record(self.name, "skipped", node.target, f"normalized_shape {tuple(ln.normalized_shape)}: over "
                           "more than the last dim")
                continue
            if sites.get(node.target, 0) != 1 or aliases.get(id(ln), 0) != 1:
                ctx.record(self.name, "skipped", node.target, "the norm module is shared or called more than once")
                continue
            if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
                ctx.record(self.name, "skipped", node.target, "unexpected call signature")
                continue
            self._rewrite(model, node, ln, ctx)
        return _fx.finish(model)

    @staticmethod
    def _fusable_add(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
        """(a, b) when node is a plain add of two tensors of one shape (no broadcast, no alpha)."""
        if node.op != "call_function" or node.target not in _ADDS or node.kwargs or len(node.args) != 2:
            return None
        a, b = node.args
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            return None
        sa, sb, so = _fx.shape_of(a), _fx.shape_of(b), _fx.shape_of(node)
        if sa is None or sa != sb or sa != so:
            return None
        return a, b

    def _rewrite(self, gm: fx.GraphModule, node: fx.Node, ln: nn.LayerNorm, ctx: PassContext) -> None:
        src = node.args[0]
        pair = self._fusable_add(src)
        name = node.target.replace(".", "_") + "_fused"
        gm.add_submodule(name, FusedLayerNorm(ln, residual=pair is not None))
        if pair is None:
            with gm.graph.inserting_before(node):
                new = gm.graph.call_module(name, (src,))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            ctx.record(self.name, "fused", node.target, f"layer norm over {ln.normalized_shape[0]} on the norm kernel")
            return
        # The fused call sits where the add was: the add's other users may come before the norm.
        with gm.graph.inserting_after(src):
            new = gm.graph.call_module(name, pair)
        with gm.graph.inserting_after(new):
            y = gm.graph.call_function(operator.getitem, (new, 0))
        with gm.graph.inserting_after(y):
            s = gm.graph.call_function(operator.getitem, (new, 1))
        y.meta, s.meta = dict(node.meta), dict(src.meta)
        node.replace_all_uses_with(y)
        gm.graph.erase_node(node)
        src.replace_all_uses_with(s)
        gm.graph.erase_node(src)
        ctx.record(self.name, "fused", node.target,
                   f"{src.name} ({pair[0].name} + {pair[1].name}) and the layer norm over {ln.normalized_shape[0]} "
                   "in one norm kernel (the sum kept for its other users)")


__all__ = ["FuseNorm", "FusedLayerNorm"]
