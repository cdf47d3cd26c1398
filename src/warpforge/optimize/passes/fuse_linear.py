"""Linears onto ``warpforge.kernels.matmul``: sibling projections merged, epilogues fused.

Two rewrites, in this order:

* **merge**: Linear modules that read the same input node (a transformer's q, k and v projections of one
  normalized stream) become one matmul over their concatenated weights, whose output is split back into
  the original widths (views, no copy). One launch instead of three, the input read once, and a wider N
  that fills the last wave of tiles: on ViT-B/16 at batch 32 (M = 6304 tokens) a 768-wide projection is
  50 x 6 = 300 tiles of 128 x 128 on 132 SMs (2.3 waves), the merged 2304-wide one 900 tiles (6.8 waves).
* **fuse**: Linear [-> activation] [-> + residual] becomes one matmul whose epilogue applies
  ``activation(x @ W^T + b) + residual`` in registers (the MLP's fc1 + GELU; fc2 and the attention output
  projection + the residual stream), so the activation and the add cost no extra pass over memory.

On CUDA each resulting :class:`FusedLinear` is then timed at its input shape both ways, this kernel and
cuBLAS with torch's epilogue ops, and keeps the faster (``select_impl``; a "timed" line per layer in the
report): like a TensorRT tactic choice, since neither wins at every shape.

:class:`FusedLinear` runs the Triton kernel for 16-bit inputs on CUDA (and on CPU tensors under the kernel
tests' ``force_triton``, through the interpreter). fp32 inputs take torch's ops
(cuBLAS; the kernel's fp32 path is exact FMA, slower than cuBLAS), and so does CPU: the graph is the same
at every precision, so a per-layer fp32 fallback (``optimize.precision``) finds each layer under the same
name. Run after ``attention``: it matches its own patterns on matmul ops, not on Linear modules.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from warpforge.kernels import use_triton
from warpforge.kernels.matmul import matmul
from warpforge.optimize.passes import _fx
from warpforge.optimize.passes.base import PassContext
from warpforge.optimize.passes.fuse_conv import _only_user, _residual

_ACT_MODULES = {nn.ReLU: "relu", nn.SiLU: "silu"}
_ACT_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", F.silu: "silu", F.gelu: "gelu"}
_TORCH_ACT = {"relu": F.relu, "silu": F.silu, "gelu": F.gelu,
              "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
KERNEL_DTYPES = (torch.float16, torch.bfloat16)


class FusedLinear(nn.Module):
    """``activation(x @ weight^T + bias) + residual`` over the last dim of x, as one matmul kernel.

    ``splits``: the output widths of merged linears; the call then returns a tuple of views, one per
    original linear, in order.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, activation: str | None = None,
                 has_residual: bool = False, splits: tuple[int, ...] | None = None) -> None:
        super().__init__()
        if splits is not None and (activation is not None or has_residual):
            raise ValueError("FusedLinear: merged linears (splits) take no activation or residual")
        self.weight = weight  # [N, K]
        self.bias = bias      # [N] or None
        self.activation = activation
        self.has_residual = has_residual
        self.splits = tuple(splits) if splits is not None else None
        self.impl = "triton"  # or "torch": the pass times both on CUDA and keeps the faster (``select_impl``)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        n, k = self.weight.shape
        if (getattr(self, "impl", "triton") == "triton" and x.dtype in KERNEL_DTYPES and x.dtype == self.weight.dtype
                and use_triton(x, self.weight)):
            lead = x.shape[:-1]
            res = residual.reshape(-1, n) if residual is not None else None
            y = matmul(x.reshape(-1, k), self.weight.t(), bias=self.bias, activation=self.activation,
                       residual=res).reshape(*lead, n)
        else:
            y = F.linear(x, self.weight, self.bias)
            if self.activation is not None:
                y = _TORCH_ACT[self.activation](y)
            if residual is not None:
                y = y + residual
        return y.split(self.splits, dim=-1) if self.splits is not None else y

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, bias={self.bias is not None}, activation={self.activation}, "
                f"residual={self.has_residual}, impl={getattr(self, 'impl', 'triton')}"
                + (f", splits={self.splits}" if self.splits else ""))


def _time_impls(mod: FusedLinear, x: torch.Tensor, res: torch.Tensor | None) -> dict[str, float]:
    """{"triton": us, "torch": us} per call of ``mod(x, res)`` each way: GPU time with the host hidden, as the
    optimized model runs (one CUDA graph). Each way is captured in a graph of back-to-back calls and the two
    replay interleaved. Timing single eager calls between two events measured the Python launch path
    instead, which made cuBLAS win every layer."""
    from warpforge.timing import time_interleaved

    def run(impl: str):
        def call():
            mod.impl = impl  # set at warm-up and capture: each graph holds one implementation's kernels
            return mod(x, res)
        return call

    with torch.no_grad():
        t = time_interleaved({"triton": run("triton"), "torch": run("torch")}, warmup=3, rep=20, cuda_graph=True,
                             device=x.device)
    return {impl: t[impl].median_ms * 1e3 for impl in ("triton", "torch")}


def _can_time(w: torch.Tensor) -> bool:
    return w.is_cuda and w.dtype in KERNEL_DTYPES and torch.cuda.is_available()


def select_impl(mod: FusedLinear, x_shape: tuple[int, ...], ctx: PassContext) -> tuple[str, float, float] | None:
    """Time ``mod`` at its input shape both ways on the GPU (this kernel, or cuBLAS + torch's epilogue ops)
    and keep the faster in ``mod.impl``; (choice, triton us, torch us), or None when not on a CUDA 16-bit
    model. Measured because neither wins everywhere: on ViT-B/16 cuBLAS was faster at batch 32 (M = 6304
    tokens) and this kernel at batch 1 (benchmarks/notes/optimize.md)."""
    w = mod.weight
    if not _can_time(w):
        return None
    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(x_shape, device=w.device, dtype=w.dtype, generator=g)
    res = (torch.randn((*x_shape[:-1], w.shape[0]), device=w.device, dtype=w.dtype, generator=g)
           if mod.has_residual else None)
    us = _time_impls(mod, x, res)
    mod.impl = min(us, key=us.__getitem__)
    return mod.impl, us["triton"], us["torch"]


def _activation(gm: fx.GraphModule, node: fx.Node, src: fx.Node) -> str | None:
    """The kernel's name for node's activation when node is exactly act(src), else None."""
    if not node.args or node.args[0] is not src or len(node.args) != 1:
        return None
    mod = _fx.called_module(gm, node)
    if mod is not None:
        if isinstance(mod, nn.GELU):
            return "gelu" if mod.approximate == "none" else "gelu_tanh" if mod.approximate == "tanh" else None
        return _ACT_MODULES.get(type(mod))
    if node.op == "call_function" and node.target in _ACT_FUNCTIONS:
        name, kw = _ACT_FUNCTIONS[node.target], dict(node.kwargs)
        if kw.pop("inplace", False):
            return None  # in place on the linear's output: the node's input is not kept anyway, but keep it exact
        if name == "gelu":
            approx = kw.pop("approximate", "none")
            name = "gelu" if approx == "none" else "gelu_tanh" if approx == "tanh" else None
        return None if kw else name
    return None


class FuseLinear:
    """Pass: merge sibling Linears, then fuse each Linear's activation and residual add (module docstring)."""

    name = "fuse_linear"

    def __init__(self, *, merge: bool = True, select: bool = True) -> None:
        self.merge = merge
        self.select = select  # on CUDA: time each fused linear both ways, keep the faster (select_impl)

    def apply(self, model: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        sites, aliases = _fx.prepare(model, self.name, ctx)
        ok: list[fx.Node] = []
        for node, lin in _fx.calls_to(model, nn.Linear):
            reason = self._why_not(lin, node, sites, aliases)
            if reason is not None:
                ctx.record(self.name, "skipped", node.target, reason)
            else:
                ok.append(node)
        if self.merge:
            ok = self._merge(model, ok, ctx)
        for node in ok:
            self._fuse(model, node, ctx)
        if self.select and ctx.device.type == "cuda":
            self._select(model, ctx)
        return _fx.finish(model)

    def _select(self, gm: fx.GraphModule, ctx: PassContext) -> None:
        for node in gm.graph.nodes:
            mod = _fx.called_module(gm, node)
            if not isinstance(mod, FusedLinear) or not node.args or not isinstance(node.args[0], fx.Node):
                continue
            shape = _fx.shape_of(node.args[0])
            if shape is None:
                continue
            picked = select_impl(mod, shape, ctx)
            if picked is not None:
                choice, t_triton, t_torch = picked
                ctx.record(self.name, "timed", node.target,
                           f"warpforge matmul {t_triton:.1f} us, cuBLAS + torch epilogue {t_torch:.1f} us at "
                           f"input {tuple(shape)}: {'warpforge' if choice == 'triton' else 'cuBLAS'}")

    @staticmethod
    def _why_not(lin: nn.Linear, node: fx.Node, sites: dict, aliases: dict) -> str | None:
        if not lin.weight.dtype.is_floating_point:
            return f"weight dtype {lin.weight.dtype}"
        if sites.get(node.target, 0) != 1 or aliases.get(id(lin), 0) != 1:
            return "the linear module is shared or called more than once"
        if len(node.args) != 1 or node.kwargs or not isinstance(node.args[0], fx.Node):
            return "unexpected call signature"
        return None

    def _merge(self, gm: fx.GraphModule, nodes: list[fx.Node], ctx: PassContext) -> list[fx.Node]:
        """Group the linears by input node; each group of 2+ alike becomes one split FusedLinear."""
        groups: dict[fx.Node, list[fx.Node]] = {}
        for n in nodes:
            groups.setdefault(n.args[0], []).append(n)
        rest = []
        for src, group in groups.items():
            mods = [gm.get_submodule(n.target) for n in group]
            alike = (len(group) > 1 and len({(m.in_features, m.weight.dtype, m.weight.device, m.bias is None)
                                             for m in mods}) == 1)
            if not alike:
                rest += group
                continue
            order = {n: i for i, n in enumerate(gm.graph.nodes)}
            group.sort(key=order.__getitem__)
            weight = nn.Parameter(torch.cat([m.weight.detach() for m in mods]), requires_grad=False)
            bias = (None if mods[0].bias is None else
                    nn.Parameter(torch.cat([m.bias.detach() for m in mods]), requires_grad=False))
            merged_name = group[0].target.replace(".", "_") + "_merged"
            gm.add_submodule(merged_name, FusedLinear(weight, bias, splits=tuple(m.out_features for m in mods)))
            with gm.graph.inserting_before(group[0]):
                new = gm.graph.call_module(merged_name, (src,))
                parts = [gm.graph.call_function(operator.getitem, (new, i)) for i in range(len(group))]
            for old, part in zip(group, parts):
                part.meta = dict(old.meta)
                old.replace_all_uses_with(part)
                gm.graph.erase_node(old)
            ctx.record(self.name, "merged", " + ".join(n.target for n in group),
                       f"{len(group)} linears on {src.name} into {merged_name} "
                       f"({weight.shape[1]} -> {weight.shape[0]}, split {tuple(m.out_features for m in mods)})")
        return rest

    def _fuse(self, gm: fx.GraphModule, node: fx.Node, ctx: PassContext) -> None:
        lin = gm.get_submodule(node.target)
        chain, last, act, residual = [node], node, None, None
        nxt = _only_user(last)
        if nxt is not None and (a := _activation(gm, nxt, last)) is not None:
            chain, last, act = chain + [nxt], nxt, a
            nxt = _only_user(last)
        if nxt is not None and (res := _residual(nxt, last)) is not None:
            chain, last, residual = chain + [nxt], nxt, res
        fused_name = node.target.replace(".", "_") + "_fused"
        gm.add_submodule(fused_name, FusedLinear(lin.weight, lin.bias, act, residual is not None))
        with gm.graph.inserting_before(last):
            args = (node.args[0],) + ((residual,) if residual is not None else ())
            new = gm.graph.call_module(fused_name, args)
        new.meta = dict(last.meta)
        last.replace_all_uses_with(new)
        for n in reversed(chain):
            gm.graph.erase_node(n)
        parts = [node.target] + ([act] if act else []) + ([f"+ {residual.name}"] if residual is not None else [])
        ctx.record(self.name, "fused" if len(chain) > 1 else "replaced", " -> ".join(parts),
                   f"{len(chain)} op(s) into {fused_name}")


__all__ = ["FuseLinear", "FusedLinear"]
