"""Channel equalization along linear residual streams, before INT8 quantization (exact in float).

MobileNetV2's inverted-residual blocks write a *linear* stream: each block's projection (a 1x1 conv with no
activation) adds onto the stream, and the next blocks' expansions (1x1 convs) read it. Nothing nonlinear
touches the stream between writers and readers, so dividing stream channel c by ``s_c`` everywhere it is
written (row c of every projection's weight and bias) and multiplying it back where it is read (input
channel c of every reader's weight) leaves the float function unchanged, to rounding.

Why: an int8 reader quantizes its input with one scale per tensor, set by the widest channel; a stream
whose channels span very different ranges loses the narrow ones to rounding. On the real MobileNetV2 the
per-layer fallback keeps 21-22 of 35 layers float to hold 99% top-1, most of them expansions reading the
stream. ``s_c = r_c^alpha / w_c^(1 - alpha)`` (SmoothQuant's migration, r_c the stream channel's range on the
calibration inputs, w_c the readers' largest weight on that channel) moves range from the activation into
the readers' weights, whose scales are per output channel. The writers' int8 weights are unaffected: a
per-output-channel scale absorbs a row's scaling exactly.

A stream is a group of conv outputs joined by residual adds (FusedConv2d with ``has_residual`` and no
activation, taking the stream as its residual); it qualifies only when every use of every node is a
FusedConv2d reading it as its input x (groups == 1) or as such a residual. Anything else reading it (a
pool, a function, an activation) leaves that stream alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from warpforge.optimize.passes.fuse_conv import FusedConv2d


@dataclass
class Stream:
    nodes: list[fx.Node]  # the stream's tensors, in graph order
    writers: list[FusedConv2d]  # convs whose outputs are those tensors (rows scaled by 1 / s)
    readers: list[FusedConv2d]  # convs reading one as their input x (input channels scaled by s)


def _module(gm: fx.GraphModule, n: fx.Node) -> nn.Module | None:
    return gm.get_submodule(n.target) if n.op == "call_module" else None


def find_streams(gm: fx.GraphModule) -> list[Stream]:
    """The linear residual streams of ``gm`` (see the module docstring), each with >= 1 reader."""
    calls: dict[int, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            calls[id(_module(gm, n))] = calls.get(id(_module(gm, n)), 0) + 1
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    seen: set[fx.Node] = set()
    streams = []
    for n in gm.graph.nodes:
        m = _module(gm, n)
        if n in seen or not isinstance(m, FusedConv2d) or m.activation is not None or m.groups != 1:
            continue
        nodes, writers, readers, ok, todo = [], [], [], True, [n]
        while todo:
            cur = todo.pop()
            w = _module(gm, cur)
            if cur in nodes:
                continue
            if not isinstance(w, FusedConv2d) or w.activation is not None or calls[id(w)] != 1:
                ok = False
                break
            nodes.append(cur)
            writers.append(w)
            for u in cur.users:
                b = _module(gm, u)
                if not isinstance(b, FusedConv2d) or u.kwargs or calls[id(b)] != 1:
                    ok = False
                    break
                if u.args[0] is cur and cur not in u.args[1:] and b.groups == 1:
                    readers.append(b)
                elif len(u.args) == 2 and u.args[1] is cur and u.args[0] is not cur and b.has_residual:
                    todo.append(u)  # the residual add writes the stream on
                else:
                    ok = False
                    break
            if not ok:
                break
        seen.update(nodes)
        # every residual a writer adds must be the stream itself (scaled alike), never an outside tensor
        ok = ok and all(not _module(gm, x).has_residual or (len(x.args) == 2 and x.args[1] in nodes) for x in nodes)
        if ok and readers and all(w.weight.shape[0] == writers[0].weight.shape[0] for w in writers):
            nodes.sort(key=order.__getitem__)
            streams.append(Stream(nodes, writers, readers))
    return streams


def equalize_streams(gm: fx.GraphModule, calib_inputs: list[tuple], alpha: float = 0.5,
                     max_factor: float = 32.0) -> list[dict]:
    """Rescale every linear residual stream's channels in place (new Parameters: the weights the graph
    shared with the source model are not touched). ``s_c`` is clamped to [1 / max_factor, max_factor].
    Returns one entry per stream: its tensors, writers, readers and the spread of channel ranges before
    and after (max / median)."""
    if not isinstance(gm, fx.GraphModule):
        raise ValueError(f"equalize_streams needs a torch.fx.GraphModule, got {type(gm).__name__}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha: expected a value in [0, 1], got {alpha}")
    streams = find_streams(gm)
    if not streams:
        return []
    ranges: dict[int, torch.Tensor] = {}
    hooks = []
    for i, st in enumerate(streams):
        for w in st.writers:
            def hook(_m, _args, out, i=i):
                r = out.detach().float().abs().amax((0, 2, 3))
                ranges[i] = r if i not in ranges else torch.maximum(ranges[i], r)
            hooks.append(w.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for args in calib_inputs:
                gm(*args)
    finally:
        for h in hooks:
            h.remove()
    report = []
    with torch.no_grad():
        for i, st in enumerate(streams):
            if i not in ranges:
                continue
            r = ranges[i].clamp_min(1e-8)
            wmax = torch.stack([b.weight.detach().float().abs().amax((0, 2, 3)) for b in st.readers]).amax(0)
            s = (r ** alpha / wmax.clamp_min(1e-8) ** (1 - alpha))
            s = (s / s.median()).clamp(1 / max_factor, max_factor)  # only the channels' relative scale matters
            for w in st.writers:
                w.weight = nn.Parameter((w.weight.detach().float() / s[:, None, None, None]).to(w.weight.dtype),
                                        requires_grad=w.weight.requires_grad)
                if w.bias is not None:
                    w.bias = nn.Parameter((w.bias.detach().float() / s).to(w.bias.dtype),
                                          requires_grad=w.bias.requires_grad)
            for b in st.readers:
                b.weight = nn.Parameter((b.weight.detach().float() * s[None, :, None, None]).to(b.weight.dtype),
                                        requires_grad=b.weight.requires_grad)
            after = r / s
            report.append({"nodes": [n.name for n in st.nodes], "writers": len(st.writers),
                           "readers": len(st.readers), "channels": int(r.numel()),
                           "spread_before": float(r.max() / r.median()),
                           "spread_after": float(after.max() / after.median())})
    return report


__all__ = ["Stream", "equalize_streams", "find_streams"]
