"""The building blocks of every decoder: linear, RMSNorm, rotary, paged attention, gated MLP, embedding.

Each runs on warpforge.kernels (Triton on CUDA tensors, the torch references on CPU). Parameters are
created empty in the config's dtype on the current default device (``with torch.device(...)``) and
filled by the loader, so building a model allocates its weights once, where they will live.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from warpforge.kernels.attention import PagedKVCache, chunked_prefill, flash_attention, paged_decode
from warpforge.kernels.gemv import InputNorm, linear
from warpforge.kernels.norm import rms_norm
from warpforge.kernels.rope import rope, rope_inv_freq
from warpforge.llm.config import ModelConfig
from warpforge.llm.context import get_context


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x @ W.T (+ b) by ``kernels.linear``. Fused projections (q|k|v, gate|up) keep one weight whose
    row blocks are the checkpoint's separate tensors: ``shards`` names them and gives their row counts."""

    def __init__(self, in_features: int, out_features: int | list[int], *, bias: bool = False,
                 dtype: torch.dtype = torch.float32, shard_names: tuple[str, ...] = ()):
        super().__init__()
        sizes = list(out_features) if isinstance(out_features, (list, tuple)) else [out_features]
        if shard_names and len(shard_names) != len(sizes):
            raise ValueError(f"shard_names: expected {len(sizes)} names, got {shard_names}")
        self.shards = tuple(zip(shard_names, sizes))
        self.weight = _param(sum(sizes), in_features, dtype=dtype)  # [N, K]
        self.bias = _param(sum(sizes), dtype=dtype) if bias else None  # [N]

    def forward(self, x: torch.Tensor | NormedInput, gated_input: str | None = None) -> torch.Tensor:  # [T, N]
        if isinstance(x, NormedInput):  # the RMSNorm before this projection, computed in its x loads
            n = x.norm
            y = linear(x.x, self.weight, self.bias, norm=InputNorm(n.weight, n.eps, n.offset), residual=x.residual,
                       residual_out=x.residual_out)
            return y[0] if x.residual is not None else y  # y[1] is x.residual_out, which the layer holds
        return linear(x, self.weight, self.bias, gated_input=gated_input)  # gated: x is [..., 2K], see linear


class NormedInput(NamedTuple):
    """``norm(x (+ residual))`` not computed yet: the Linear it feeds computes it in its GEMV's loads
    (``kernels.linear(norm=...)``, fused at decode sizes) and writes x + residual to ``residual_out``."""

    x: torch.Tensor  # [T, K]
    norm: RMSNorm
    residual: torch.Tensor | None  # [T, K]
    residual_out: torch.Tensor | None  # [T, K], allocated by RMSNorm.prenorm


class RMSNorm(nn.Module):
    """``s / rms(s) * (weight + offset)`` in fp32, s = x (+ residual); Gemma uses offset 1.

    With a residual it returns ``(out, s)``: the fused add that carries the residual stream.
    """

    def __init__(self, dim: int, eps: float, *, offset: float = 0.0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = _param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, weight_offset=self.offset)
        return rms_norm(x, self.weight, self.eps, residual=residual, weight_offset=self.offset)

    def prenorm(self, x: torch.Tensor, residual: torch.Tensor | None, *, fused: bool):
        """A pre-norm block's (input of the next projection, new residual stream): x's norm and x itself
        without a residual, else the fused add. ``fused``: the input is a NormedInput, computed by the
        projection it feeds (one kernel and one round trip of the normalized row fewer)."""
        if fused:
            if residual is None:
                return NormedInput(x, self, None, None), x
            h = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # written by the projection
            return NormedInput(x, self, residual, h), h
        if residual is None:
            return self(x), x
        return self(x, residual)


class Rotary(nn.Module):
    """Neox-style rotary embedding over the whole head_dim, cos|sin cached for every position."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None = None,
                 freq_factors: tuple[float, ...] | None = None):
        super().__init__()
        inv = rope_inv_freq(head_dim, theta, scaling)  # [D/2] float64
        if freq_factors is not None:
            inv = inv / torch.tensor(freq_factors, dtype=torch.float64)
        # Angles rounded to fp32 as HF transformers computes them (the reference the weights were
        # trained and checked with): at position p an fp32 angle is off by ~p * 6e-8 rad, and we
        # want the same error, not a smaller one.
        angles = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv.float()[None, :]  # [P, D/2]
        cache = torch.cat([angles.double().cos(), angles.double().sin()], dim=-1).float()  # [P, D]
        self.register_buffer("cos_sin", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, **store) -> None:
        """q [T, Hq, D], k [T, Hkv, D] rotated in place; ``store`` (v=, cache=, slot_mapping=): the same
        launch writes the rotated k and v into the paged KV cache (see kernels.rope.rope)."""
        # The runner builds positions from lengths bounded by max_model_len <= the cache's rows: checked on
        # CPU (where tests run the engine), trusted on the GPU where a check is a host sync per layer.
        rope(q, k, positions, self.cos_sin, check_values=not q.is_cuda, **store)


class Attention(nn.Module):
    """Paged self-attention of one layer: qkv projection, optional q/k RMSNorm, rope, KV store, attend."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary):
        super().__init__()
        c, dt = config, config.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(c.hidden_size, self.sizes, bias=c.qkv_bias, dtype=dt,
                               shard_names=("q_proj", "k_proj", "v_proj"))
        self.o_proj = Linear(q_size, c.hidden_size, bias=c.o_bias, dtype=dt)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, offset=c.norm_weight_offset, dtype=dt)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, offset=c.norm_weight_offset, dtype=dt)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.scale, self.window, self.softcap = c.attn_scale, c.window(layer), c.attn_logit_softcapping
        self.cache: PagedKVCache | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor | NormedInput) -> torch.Tensor:  # x [T, hidden]
        T = positions.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)  # views of one [T, (Hq + 2 Hkv) D] buffer
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # the norm needs whole rows: contiguous copies
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.cache is not None:  # rotate q and k, and store k and v into the cache, in one launch
            self.rotary(positions, q, k, v=v, cache=self.cache, slot_mapping=get_context().slot_mapping)
        else:
            self.rotary(positions, q, k)
        out = self._attend(q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_context()
        kw = {"scale": self.scale, "window": self.window, "softcap": self.softcap}
        # The block manager's page tables: checked on CPU (engine tests), trusted on the GPU (a host sync).
        checked = {"check_values": not q.is_cuda}
        if self.cache is None:
            # No KV cache bound yet (a profiling run before the cache is sized): causal attention over
            # this step's tokens alone, which is right only when nothing is cached.
            return flash_attention(q, k, v, causal=True, cu_seqlens_q=ctx.cu_seqlens_q,
                                   cu_seqlens_k=ctx.cu_seqlens_q, max_seqlen_q=ctx.max_seqlen_q, **kw)
        # This step's k and v are in the cache already: forward stored them with the rotation.
        if ctx.decode_only:
            return paged_decode(q, self.cache, ctx.block_tables, ctx.seq_lens, max_seq_len=ctx.max_seq_len,
                                **kw, **checked)
        return chunked_prefill(q, self.cache, ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q,
                               max_seqlen_q=ctx.max_seqlen_q, **kw, **checked)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate|up fused in one projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.gate_up_proj = Linear(c.hidden_size, [c.intermediate_size] * 2, bias=c.mlp_bias, dtype=c.dtype,
                                   shard_names=("gate_proj", "up_proj"))
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, dtype=c.dtype)
        self.act = c.hidden_act
        self.gated = "silu" if c.hidden_act == "silu" else ("gelu_tanh" if c.hidden_act == "gelu_pytorch_tanh"
                                                            else "gelu")

    def forward(self, x: torch.Tensor | NormedInput) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        h = self.gate_up_proj(x)  # [T, 2 I]
        # act(gate) * up is fused into down_proj's loads where it streams its weight (decode sizes);
        # linear() runs silu_and_mul / gelu_and_mul first otherwise. Same roundings either way.
        return self.down_proj(h, gated_input=self.gated)


class Embedding(nn.Module):
    """Token embedding [vocab, hidden]; Gemma scales it by sqrt(hidden) rounded to the model dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, *, scale: float | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = _param(vocab_size, hidden_size, dtype=dtype)
        self.register_buffer("scale", None if scale is None else torch.tensor(scale, dtype=dtype), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        x = nn.functional.embedding(ids, self.weight)
        return x if self.scale is None else x * self.scale


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor | nn.Module, softcap: float | None) -> torch.Tensor:
    """float32 logits [N, vocab] from hidden [N, H]; ``softcap * tanh(logits / softcap)`` when given.
    ``weight``: [vocab, H], or a module that computes ``hidden @ W.T`` (a head run from GGUF blocks)."""
    logits = (weight(hidden) if isinstance(weight, nn.Module) else linear(hidden, weight)).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits
