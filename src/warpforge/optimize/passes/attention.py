"""Replace attention with one ``warpforge.kernels.attention.flash_attention`` call per site.

Two forms are matched, the two real code is written in (see models/layers.py):

* ``F.scaled_dot_product_attention(q, k, v)``: ``is_causal``, ``scale`` and ``enable_gqa`` carry over;
* the explicit ``softmax(q @ k^T * scale) @ v``: ``@`` / ``torch.matmul`` / ``bmm``, the key transposed by
  ``.transpose(-2, -1)`` / ``.mT`` / ``.permute``, any chain of multiplications and divisions by constants
  on the scores or on q (``* scale``, ``/ math.sqrt(d)``), softmax as ``torch.softmax`` / ``F.softmax`` /
  ``.softmax`` / ``nn.Softmax`` over the key dim, an eval-mode dropout on the weights.

A site is rewritten only when the graph and the example-input shapes prove the kernel computes the same
function; anything else (a mask or bias on the scores, dropout that is active, softmax over another dim, a
head dim or dtype the kernel is not tested for, weights used elsewhere, causal with Sq != Sk) is left as it
is and recorded as skipped with the reason. Layouts: SDPA's [B, H, S, D] goes to the kernel as
``x.transpose(1, 2)`` views ([B, S, H, D], no copies) and the output comes back the same way.

In ``default_passes()`` as ``ReplaceAttention(cuda_only=True)``: a model built for CUDA gets the kernel
(its GPU tests check exactness and speed against torch SDPA); on the CPU the
kernel would run in Triton's interpreter, so there the pass leaves attention to torch. Tests and users
that want the rewrite anywhere pass ``ReplaceAttention()``.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from warpforge.kernels.attention.prefill import DTYPES, TESTED_HEAD_DIMS, flash_attention
from warpforge.optimize.passes import _fx
from warpforge.optimize.passes.base import PassContext

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MATMULS = (operator.matmul, torch.matmul, torch.bmm)
_MULS = (operator.mul, operator.imul, torch.mul)
_DIVS = (operator.truediv, operator.itruediv, torch.div, torch.true_divide)
_ADDS = (operator.add, operator.iadd, torch.add, operator.sub, operator.isub, torch.sub)
_MASKS = ("masked_fill", "masked_fill_", "where")
_CASTS = ("float", "to", "type_as", "type")
_SEARCH_DEPTH = 8  # ops between the q @ k^T matmul and the softmax that are still looked through


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()  # the kernel reads the head dim with unit stride


class FlashAttention(nn.Module):
    """``softmax(q k^T * scale) v`` on SDPA's layout through warpforge's flash kernel (torch reference on CPU).

    q [B, H, Sq, D] or [N, Sq, D]; k, v [B, Hkv, Sk, D] or [N, Sk, D] (Hkv divides H when ``gqa``, q head h
    reading KV head h // (H / Hkv), as SDPA's ``enable_gqa``) -> out shaped like q.
    """

    def __init__(self, *, causal: bool, scale: float | None, gqa: bool = False) -> None:
        super().__init__()
        self.causal, self.scale, self.gqa = causal, scale, gqa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.causal and q.shape[-2] != k.shape[-2]:
            # SDPA's is_causal aligns the mask top-left, the kernel bottom-right: they agree only when Sq == Sk.
            # The pass checked the example shapes; this keeps other input shapes correct.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.gqa)
        three = q.dim() == 3
        if three:  # [N, S, D] is N sequences of one head
            q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
        out = flash_attention(_unit(q.transpose(1, 2)), _unit(k.transpose(1, 2)), _unit(v.transpose(1, 2)),
                              causal=self.causal, scale=self.scale)  # [B, Sq, H, D]
        out = out.transpose(1, 2)  # [B, H, Sq, D]
        return out.squeeze(1) if three else out

    def extra_repr(self) -> str:
        return f"causal={self.causal}, scale={self.scale}, gqa={self.gqa}"


@dataclass
class _Site:
    """One attention call: its operands, what the kernel needs to know, the nodes it replaces, why not (reasons)."""

    form: str                 # "sdpa" or "explicit"
    q: fx.Node
    k: fx.Node                # [.., Sk, D]; for the explicit form possibly k^T still to transpose (k_t)
    v: fx.Node
    causal: bool
    scale: float | None       # None: the kernel's default D^-0.5
    gqa: bool
    anchor: fx.Node           # the node whose output the kernel call replaces
    erase: list[fx.Node] = field(default_factory=list)  # anchor first, then its now-dead producers
    k_t: fx.Node | None = None  # explicit form: k^T [.., D, Sk] that is not a transpose node
    reasons: list[str] = field(default_factory=list)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _op(n: fx.Node) -> str:
    return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))


def _matmul_operands(n: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    if n.op == "call_function" and n.target in _MATMULS and len(n.args) == 2 and not n.kwargs:
        a, b = n.args
    elif n.op == "call_method" and n.target in ("matmul", "bmm") and len(n.args) == 2 and not n.kwargs:
        a, b = n.args
    else:
        return None
    return (a, b) if isinstance(a, fx.Node) and isinstance(b, fx.Node) else None


def _scaled(n: fx.Node) -> tuple[fx.Node, float] | None:
    """(x, c) when n is x * c or x / c (as x * 1/c) with c a Python number, else None."""
    if n.op not in ("call_function", "call_method") or len(n.args) != 2:
        return None
    a, b = n.args
    mul = n.target in _MULS or n.target in ("mul", "mul_", "__mul__")
    div = n.target in _DIVS or n.target in ("div", "div_", "true_divide", "__truediv__")
    if n.kwargs or not (mul or div):  # torch.div(..., rounding_mode=) is not a plain division
        return None
    if isinstance(a, fx.Node) and _number(b):
        return (a, float(b)) if mul else ((a, 1.0 / b) if b != 0 else None)
    if mul and isinstance(b, fx.Node) and _number(a):
        return b, float(a)
    return None


def _meta(n: object) -> tuple[tuple[int, ...], torch.dtype] | None:
    tm = n.meta.get("tensor_meta") if isinstance(n, fx.Node) else None
    return (tuple(tm.shape), tm.dtype) if tm is not None and hasattr(tm, "shape") else None


def _noop_cast(n: fx.Node) -> bool:
    """``x.float()`` / ``x.to(dtype)`` / ``x.type_as(y)`` that keeps x's dtype (shape propagation says so)."""
    if n.op != "call_method" or n.target not in _CASTS or not n.args or not isinstance(n.args[0], fx.Node):
        return False
    src, out = _meta(n.args[0]), _meta(n)
    return src is not None and out is not None and src == out


def _reaches_matmul(n: object, depth: int) -> bool:
    # Not through modules: softmax(linear(...)) is a learned map, not attention scores.
    if not isinstance(n, fx.Node) or depth < 0 or n.op not in ("call_function", "call_method"):
        return False
    if _matmul_operands(n) is not None:
        return True
    return any(_reaches_matmul(a, depth - 1) for a in n.all_input_nodes)


def _blocker(n: fx.Node) -> str:
    """Why an op between the scores matmul and the softmax stops the rewrite."""
    if n.op == "call_function" and n.target in _ADDS or n.op == "call_method" and n.target in (
            "add", "add_", "sub", "sub_", "__add__", "__sub__"):
        return f"{n.name}: additive term on the scores (a bias or mask)"
    if _op(n) in _MASKS:
        return f"{n.name}: {_op(n)} on the scores (a mask)"
    if n.op == "call_function" and (n.target in _MULS or n.target in _DIVS) or n.op == "call_method" and n.target in (
            "mul", "mul_", "div", "div_"):
        return f"{n.name}: scores scaled by a tensor, not a constant"
    if n.op == "call_method" and n.target in _CASTS:
        return f"{n.name}: dtype cast on the scores"
    return f"{n.name}: {_op(n)} on the scores"


def _softmax(gm: fx.GraphModule, n: fx.Node) -> tuple[fx.Node, object, object] | None:
    """(input, dim, dtype) when n is a softmax, else None."""
    args, kw = n.args, n.kwargs
    if n.op == "call_function" and n.target is F.softmax:  # (input, dim=None, _stacklevel=3, dtype=None)
        dim = args[1] if len(args) > 1 else kw.get("dim")
        dtype = args[3] if len(args) > 3 else kw.get("dtype")
    elif n.op == "call_function" and n.target is torch.softmax or n.op == "call_method" and n.target == "softmax":
        dim = args[1] if len(args) > 1 else kw.get("dim")
        dtype = args[2] if len(args) > 2 else kw.get("dtype")
    elif n.op == "call_module" and type(gm.get_submodule(n.target)) is nn.Softmax:
        dim, dtype = gm.get_submodule(n.target).dim, None
    else:
        return None
    return (args[0], dim, dtype) if args and isinstance(args[0], fx.Node) else None


def _dropout(gm: fx.GraphModule, n: fx.Node) -> tuple[bool, str] | None:
    """(active, description) when n is a dropout, else None."""
    if n.op == "call_module":
        mod = gm.get_submodule(n.target)
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            return mod.training and mod.p > 0, f"{type(mod).__name__}(p={mod.p}) {n.target}"
        return None
    if n.op == "call_function" and n.target is F.dropout:  # (input, p=0.5, training=True, inplace=False)
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        training = n.args[2] if len(n.args) > 2 else n.kwargs.get("training", True)
        return not (training is False or p == 0), f"F.dropout(p={p}, training={training})"
    return None


def _transposed(n: fx.Node) -> fx.Node | None:
    """k when n is k with its last two dims swapped (k's rank from shape propagation), else None."""
    src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
    if src is None or _meta(src) is None:
        return None
    rank = len(_meta(src)[0])
    last_two = {rank - 2, rank - 1}
    if n.op == "call_function" and n.target is getattr and n.args[1:] == ("mT",):
        return src
    if n.op == "call_method" and n.target in ("transpose", "swapaxes", "swapdims") or \
            n.op == "call_function" and n.target in (torch.transpose, torch.swapaxes):
        dims = n.args[1:]
        ok = len(dims) == 2 and all(isinstance(d, int) for d in dims) and {d % rank for d in dims} == last_two
        return src if ok else None
    if n.op == "call_method" and n.target == "permute" or n.op == "call_function" and n.target is torch.permute:
        perm = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else n.args[1:]
        want = list(range(rank - 2)) + [rank - 1, rank - 2]
        if all(isinstance(d, int) for d in perm) and [d % rank for d in perm] == want:
            return src
    return None


def _module_path(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    return next(reversed(stack), "") if stack else ""


class ReplaceAttention:
    """Pass: each provably equivalent attention call becomes one :class:`FlashAttention` call.

    ``head_dims``: the head dims rewritten (default: the ones the kernel is tested for on the GPU).
    ``cuda_only``: leave every site to torch unless the model runs on CUDA (one "skipped" line says so).
    """

    name = "attention"

    def __init__(self, head_dims: tuple[int, ...] = TESTED_HEAD_DIMS, *, cuda_only: bool = False) -> None:
        self.head_dims = tuple(head_dims)
        self.cuda_only = cuda_only

    def apply(self, model: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
        _fx.require_graph(model, self.name)
        candidates = [n for n in model.graph.nodes
                      if n.target is F.scaled_dot_product_attention or _softmax(model, n) is not None]
        if not candidates:
            return model
        if self.cuda_only and ctx.device.type != "cuda":
            ctx.record(self.name, "skipped", "(model)", f"{len(candidates)} attention candidate(s) left to torch: "
                       f"the model runs on {ctx.device.type}, where flash attention would run in Triton's interpreter")
            return model
        if ctx.example_inputs:
            _fx.propagate_shapes(model, ctx.example_inputs)  # head dims, sequence lengths, dtypes
        erased: set[fx.Node] = set()
        for node in candidates:
            if node in erased:
                continue
            site = self._sdpa(node) if node.target is F.scaled_dot_product_attention else self._explicit(model, node)
            if site is None:
                continue  # a softmax that is not attention
            where = _module_path(site.anchor) or site.anchor.name
            operands = all(isinstance(t, fx.Node) for t in (site.q, site.k, site.v))
            reasons = site.reasons + (self._shape_reasons(site) if operands else [])
            if reasons:
                what = site.form if where == site.anchor.name else f"{site.form} ({site.anchor.name})"
                ctx.record(self.name, "skipped", where, f"{what}: " + "; ".join(reasons))
                continue
            ctx.record(self.name, "replaced", where, self._rewrite(model, site, where))
            erased.update(site.erase)
        return _fx.finish(model)

    # --- matching -------------------------------------------------------------------------------------

    @staticmethod
    def _sdpa(node: fx.Node) -> _Site:
        a = dict(zip(_SDPA_ARGS, node.args)) | dict(node.kwargs)
        q, k, v = a.get("query"), a.get("key"), a.get("value")
        causal, scale, gqa = a.get("is_causal", False), a.get("scale"), a.get("enable_gqa", False)
        site = _Site("sdpa", q, k, v, causal is True, scale, gqa is True, node, [node])
        if not all(isinstance(t, fx.Node) for t in (q, k, v)):
            site.reasons.append("q, k, v are not all tensors of the graph")
        if a.get("attn_mask") is not None:
            site.reasons.append("attn_mask given")
        dropout = a.get("dropout_p", 0.0)
        if not (_number(dropout) and dropout == 0):
            site.reasons.append(f"dropout_p={dropout} (dropout is applied)")
        if not isinstance(causal, bool):
            site.reasons.append("is_causal is not a constant bool")
        if not isinstance(gqa, bool):
            site.reasons.append("enable_gqa is not a constant bool")
        if scale is not None and not _number(scale):
            site.reasons.append("scale is not a constant number")
        extra = set(a) - set(_SDPA_ARGS)
        if extra:
            site.reasons.append(f"unknown arguments {sorted(extra)}")
        return site

    def _explicit(self, gm: fx.GraphModule, soft: fx.Node) -> _Site | None:
        """The site around softmax node ``soft`` when it is softmax(f(q @ k^T)) @ v, else None."""
        src, dim, dtype = _softmax(gm, soft)
        reasons: list[str] = []
        # Backward from the softmax to the scores matmul: constant scalings pass, anything else blocks.
        chain, x, scale = [], src, 1.0
        for _ in range(_SEARCH_DEPTH + 1):
            if _matmul_operands(x) is not None:
                break
            if (s := _scaled(x)) is not None:
                chain.append(x)
                x, scale = s[0], scale * s[1]
            elif _noop_cast(x):
                chain.append(x)
                x = x.args[0]
            else:
                nxt = [a for a in x.all_input_nodes if _reaches_matmul(a, _SEARCH_DEPTH)]
                if not nxt or x.op not in ("call_function", "call_method"):
                    return None
                reasons.append(_blocker(x))
                chain.append(x)
                x = nxt[0]
        else:
            return None
        scores = x
        q, k_t = _matmul_operands(scores)
        # Forward from the softmax to the matmul with v: an inactive dropout and no-op casts pass.
        post, p = [], soft
        while len(p.users) == 1:
            user = next(iter(p.users))
            drop = _dropout(gm, user)
            if drop is not None:
                if drop[0]:
                    reasons.append(f"{drop[1]} is active (training mode) on the attention weights")
                post.append(user)
                p = user
            elif _noop_cast(user):
                post.append(user)
                p = user
            else:
                break
        out = next((u for u in p.users if (m := _matmul_operands(u)) is not None and m[0] is p), None)
        if out is None:
            return None  # softmax(x @ y) not multiplied by a value matrix: not attention
        v = out.args[1]
        for n in [scores, *chain]:  # soft and post have one user each by construction
            if len(n.users) != 1:
                reasons.append(f"{n.name} is also used elsewhere ({len(n.users)} users)")
        if len(p.users) != 1:
            reasons.append(f"the attention weights {p.name} are also used elsewhere ({len(p.users)} users)")
        if dtype is not None:
            reasons.append(f"softmax with dtype={dtype}")
        rank = len(_meta(src)[0]) if _meta(src) is not None else None
        if not (dim == -1 or isinstance(dim, int) and rank is not None and dim % rank == rank - 1):
            reasons.append(f"softmax over dim {dim}, not the key dim (-1)")
        while (s := _scaled(q)) is not None:  # (q * scale) @ k^T: fold the scale into the kernel's
            q, scale = s[0], scale * s[1]
        k = _transposed(k_t)
        site = _Site("explicit", q, k if k is not None else k_t, v, False, scale, False, out,
                     [out, *reversed(post), soft, *chain, scores], k_t=None if k is not None else k_t)
        site.reasons = reasons
        return site

    def _shape_reasons(self, site: _Site) -> list[str]:
        """What in the shapes / dtypes keeps the kernel from computing exactly this attention."""
        metas = [_meta(t) for t in (site.q, site.k, site.v)]
        if any(m is None for m in metas):
            return ["shapes unknown (no example inputs to propagate)"]
        (qs, qd), (ks, kd), (vs, vd) = metas
        if site.k_t is not None:
            ks = ks[:-2] + (ks[-1], ks[-2])  # k^T [.., D, Sk] -> k [.., Sk, D]
        reasons = []
        if len(qs) not in (3, 4) or len(ks) != len(qs) or len(vs) != len(qs):
            return [f"ranks {len(qs)}, {len(ks)}, {len(vs)} (the kernel takes [B, H, S, D] or [N, S, D])"]
        D, Sq, Sk = qs[-1], qs[-2], ks[-2]
        if ks[-1] != D or vs[-1] != D:
            reasons.append(f"head dims q {D}, k {ks[-1]}, v {vs[-1]} differ")
        elif D not in self.head_dims:
            reasons.append(f"head dim {D} (the kernel is tested for {self.head_dims})")
        if vs[-2] != Sk:
            reasons.append(f"k has {Sk} keys, v {vs[-2]}")
        if qs[0] != ks[0] or ks[:-2] != vs[:-2]:
            reasons.append(f"batch dims q {qs[:-2]}, k {ks[:-2]}, v {vs[:-2]} (broadcast)")
        elif len(qs) == 4 and qs[1] != ks[1] and not (site.gqa and ks[1] and qs[1] % ks[1] == 0):
            reasons.append(f"{qs[1]} query heads, {ks[1]} KV heads" + ("" if site.gqa else " without enable_gqa"))
        if not (qd == kd == vd and qd in DTYPES):
            reasons.append(f"dtypes {qd}, {kd}, {vd} (the kernel takes one of fp16/bf16/fp32)")
        if site.causal and Sq != Sk:
            reasons.append(f"is_causal with Sq={Sq} != Sk={Sk} (SDPA masks top-left, the kernel bottom-right)")
        if site.scale is not None and not (math.isfinite(site.scale) and site.scale > 0):
            reasons.append(f"scale {site.scale} (the kernel takes a finite scale > 0)")
        return reasons

    # --- rewriting ------------------------------------------------------------------------------------

    @staticmethod
    def _rewrite(gm: fx.GraphModule, site: _Site, where: str) -> str:
        base = (where.replace(".", "_") or site.anchor.name) + "_flash"
        name, i = base, 1
        while hasattr(gm, name):
            name, i = f"{base}{i}", i + 1
        gm.add_submodule(name, FlashAttention(causal=site.causal, scale=site.scale, gqa=site.gqa))
        graph = gm.graph
        with graph.inserting_before(site.anchor):
            k = site.k if site.k_t is None else graph.call_method("transpose", (site.k_t, -2, -1))
            new = graph.call_module(name, (site.q, k, site.v))
        new.meta = dict(site.anchor.meta)
        site.anchor.replace_all_uses_with(new)
        for n in site.erase:
            graph.erase_node(n)
        qs, ks = _meta(site.q)[0], _meta(site.k)[0]
        ks = ks if site.k_t is None else ks[:-2] + (ks[-1], ks[-2])
        heads = f"B={qs[0]}, H={qs[1]}" + (f"/{ks[1]}" if ks[1] != qs[1] else "") if len(qs) == 4 else f"N={qs[0]}"
        scale = "default" if site.scale is None else f"{site.scale:.6g}"
        return (f"{site.form} [{heads}, Sq={qs[-2]}, Sk={ks[-2]}, D={qs[-1]}, causal={site.causal}, scale={scale}] "
                f"({len(site.erase)} op(s)) into {name}")


__all__ = ["FlashAttention", "ReplaceAttention"]
