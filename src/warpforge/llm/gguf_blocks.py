"""GGUF weights run as shipped: every projection whose GGUF tensor is a block type the kernels read
(Q8_0, Q5_0, Q4_K, Q6_K) becomes a :class:`GGUFLinear` over the file's own bytes.

``load(path.gguf, gguf_blocks=True)`` fills the model as usual, then :func:`attach_blocks` swaps each
``Linear`` for a ``GGUFLinear`` and drops its dense weight. A fused projection (q|k|v, gate|up) keeps
one part per run of checkpoint tensors of the same block type (rows are independent, so same-type
neighbours concatenate into one weight and one kernel call); a tensor of any other type (F16, F32,
other quantizations) stays a dense part. A tied head reads the embedding's blocks; the embedding
lookup itself keeps the dense table (one row per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from warpforge.kernels.activation import gelu_and_mul, silu_and_mul
from warpforge.kernels.gemv import linear
from warpforge.kernels.gguf import BLOCKS, GGUFWeight, gguf_linear
from warpforge.llm.layers import Linear, NormedInput


class GGUFLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with W's row blocks as GGUF blocks (or dense rows where the file's type is
    not a block type). Takes what ``Linear`` takes: a NormedInput, a gated input."""

    def __init__(self, parts: list[GGUFWeight | torch.Tensor],  # each [rows_i, K]
                 bias: torch.Tensor | None = None):  # [N]
        super().__init__()
        ks = {p.shape[1] for p in parts}
        if not parts or len(ks) != 1:
            raise ValueError(f"parts: expected one or more weights of one K, got shapes {[p.shape for p in parts]}")
        self.parts = parts
        self.in_features = ks.pop()
        self.out_features = sum(p.shape[0] for p in parts)
        for i, p in enumerate(parts):  # buffers: the module's memory and state_dict see the bytes
            self.register_buffer(f"part{i}", p.raw if isinstance(p, GGUFWeight) else p, persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor | NormedInput, gated_input: str | None = None) -> torch.Tensor:  # [T, N]
        if isinstance(x, NormedInput):  # what Linear's fused-norm GEMV computes, as two steps
            n = x
            if n.residual is None:
                x = n.norm(n.x)
            else:
                x, s = n.norm(n.x, n.residual)
                n.residual_out.copy_(s)  # the layer holds residual_out as the residual stream
        if gated_input is not None:
            x = silu_and_mul(x) if gated_input == "silu" else gelu_and_mul(
                x, approximate="tanh" if gated_input == "gelu_tanh" else "none")
        out = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype, device=x.device)
        row = 0
        for p in self.parts:
            n = p.shape[0]
            view = out[..., row:row + n]
            if isinstance(p, GGUFWeight):
                gguf_linear(x, p, out=view)
            else:
                view.copy_(linear(x, p))
            row += n
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        kinds = [p.name if isinstance(p, GGUFWeight) else str(p.dtype).replace("torch.", "") for p in self.parts]
        return f"in_features={self.in_features}, out_features={self.out_features}, parts={kinds}"


@dataclass(frozen=True)
class BlockReport:
    """What :func:`attach_blocks` swapped: the bytes one decoded token reads from the projections."""

    block_bytes: int  # GGUF blocks, as stored in the file
    dense_bytes: int  # projections left dense (types the kernels do not read)
    tensors: dict[str, int]  # block type name -> number of checkpoint tensors run from blocks

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes + self.dense_bytes


def projection_bytes_per_token(model: nn.Module) -> int:
    """Bytes of every projection weight (and the head) one decode step reads, in whichever form the
    model holds them: dense parameters, or GGUF blocks. Norms, biases and the embedding row are left out
    (under 0.1% of a decoder's bytes)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.weight.nbytes
        elif isinstance(module, GGUFLinear):
            total += sum(p.nbytes for p in module.parts)
    if getattr(model, "lm_head", "absent") is None:  # tied: the head reads the embedding table
        total += model.model.embed_tokens.weight.nbytes
    return total


def _raw_rows(gf, name: str):
    """(ggml type id, uint8 [N, row bytes] view of the file) of tensor ``name``."""
    qtype, shape, off, nbytes = gf._extent(name)
    raw = np.frombuffer(gf._buf, dtype=np.uint8, count=nbytes, offset=off).reshape(shape[0], -1)
    return int(qtype), raw


def attach_blocks(model: nn.Module, gf, hf_to_gguf: dict[str, str], row_fix) -> BlockReport:
    """Swap every ``Linear`` of ``model`` (filled from ``gf``) for a ``GGUFLinear`` over the file's blocks.

    ``hf_to_gguf``: our checkpoint names -> the file's tensor names. ``row_fix(gguf_name, rows)``: the
    loader's row permutation for that tensor (Llama's q/k), applied to the rows of blocks alike.
    """
    device = next(model.parameters()).device
    counts: dict[str, int] = {}
    block_bytes = dense_bytes = 0

    def parts_for(module: Linear, names: list[tuple[str, int]]) -> list[GGUFWeight | torch.Tensor]:
        nonlocal block_bytes, dense_bytes
        parts: list[GGUFWeight | torch.Tensor] = []
        row = 0
        for hf_name, rows in names:
            gname = hf_to_gguf[hf_name]
            qtype, raw = _raw_rows(gf, gname)
            if qtype not in BLOCKS:
                dense = module.weight.data[row:row + rows]
                dense_bytes += dense.nbytes
                parts.append(dense)
            else:
                data = row_fix(gname, torch.from_numpy(raw.copy())).contiguous().to(device)
                w = GGUFWeight(data, qtype, (rows, module.weight.shape[1]))
                counts[w.name] = counts.get(w.name, 0) + 1
                block_bytes += w.nbytes
                prev = parts[-1] if parts else None
                if isinstance(prev, GGUFWeight) and prev.qtype == qtype:  # same type: one weight, one call
                    w = GGUFWeight(torch.cat([prev.raw, w.raw]), qtype, (prev.shape[0] + rows, prev.shape[1]))
                    parts[-1] = w
                else:
                    parts.append(w)
            row += rows
        return parts

    for owner, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        if module.shards:
            parent = owner.rsplit(".", 1)[0]
            names = [(f"{parent}.{shard}.weight", rows) for shard, rows in module.shards]
        else:
            names = [(f"{owner}.weight", module.weight.shape[0])]
        new = GGUFLinear(parts_for(module, names), module.bias)
        parent_name, _, leaf = owner.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)
    embed = "model.embed_tokens.weight"
    if getattr(model, "lm_head", "absent") is None and embed in hf_to_gguf:  # tied head: the embedding's blocks
        qtype, raw = _raw_rows(gf, hf_to_gguf[embed])
        if qtype in BLOCKS:
            table = model.model.embed_tokens.weight
            w = GGUFWeight(torch.from_numpy(raw.copy()).to(device), qtype, tuple(table.shape))
            counts[w.name] = counts.get(w.name, 0) + 1
            block_bytes += w.nbytes
            model.lm_head = GGUFLinear([w])
        else:
            dense_bytes += model.model.embed_tokens.weight.nbytes
    return BlockReport(block_bytes, dense_bytes, counts)
