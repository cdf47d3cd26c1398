"""The decoder-only LLM: Llama 2/3, Mistral, Qwen2 (qkv bias) and Qwen3 (qk norm) through config switches.

Module names follow the HF checkpoints (``model.layers.3.self_attn.qkv_proj``) so the loader's only
translation is the fused projections: ``weight_slots()`` maps every checkpoint tensor name
(``...q_proj.weight``) to the block of our parameter it fills.
"""

from __future__ import annotations

import torch
from torch import nn

from warpforge.kernels.attention import PagedKVCache
from warpforge.llm.config import SLIDING, ModelConfig
from warpforge.llm.layers import Attention, Embedding, GatedMLP, Linear, RMSNorm, Rotary, lm_logits


def norm(config: ModelConfig, dim: int | None = None) -> RMSNorm:
    return RMSNorm(dim or config.hidden_size, config.rms_norm_eps, offset=config.norm_weight_offset,
                   dtype=config.dtype)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.)); the residual add is fused into the norms."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary):
        super().__init__()
        self.self_attn = Attention(config, layer, rotary)
        self.mlp = GatedMLP(config)
        self.input_layernorm = norm(config)
        self.post_attention_layernorm = norm(config)
        self.fused_norm = False  # CausalLM.fuse_norms: the two norms computed inside qkv_proj / gate_up_proj

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        # x [T, H]: the previous layer's output, not yet added to the residual stream
        x, residual = self.input_layernorm.prenorm(x, residual, fused=self.fused_norm)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm.prenorm(x, residual, fused=self.fused_norm)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """Embedding, the layers, the final norm: input_ids [T], positions [T] -> hidden [T, H]."""

    def __init__(self, config: ModelConfig, layer_cls: type[nn.Module]):
        super().__init__()
        c = config
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size, scale=c.embed_scale, dtype=c.dtype)
        rotary = Rotary(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, c.rope_freq_factors)
        local = rotary
        if c.rope_local_theta is not None and SLIDING in c.layer_types:  # Gemma 3: own base, no scaling
            local = Rotary(c.head_dim, c.max_position_embeddings, c.rope_local_theta)
        self.layers = nn.ModuleList(
            layer_cls(c, i, local if c.layer_types[i] == SLIDING else rotary) for i in range(c.num_layers))
        self.norm = norm(c)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        return self.norm(x, residual)[0]


class CausalLM(nn.Module):
    """The engine's model contract: ``forward(input_ids [T], positions [T]) -> hidden [T, H]`` (reads the
    step context), ``compute_logits(hidden [N, H]) -> float32 [N, vocab]``, ``bind_kv_caches``,
    ``fuse_norms``."""

    def __init__(self, config: ModelConfig, layer_cls: type[nn.Module] = DecoderLayer):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, layer_cls)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size,
                                                                      dtype=config.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head  # a Linear, None (tied), or a module that computes x @ W.T itself (GGUF blocks)
        weight = self.model.embed_tokens.weight if head is None else head.weight if isinstance(head, Linear) else head
        return lm_logits(hidden, weight, self.config.final_logit_softcapping)

    def bind_kv_caches(self, caches: list[PagedKVCache]) -> None:
        """One cache per layer, in layer order (``None`` unbinds: attention over the step's tokens only)."""
        if len(caches) != len(self.model.layers):
            raise ValueError(f"caches: expected one per layer ({len(self.model.layers)}), got {len(caches)}")
        for layer, cache in zip(self.model.layers, caches):
            layer.self_attn.cache = cache

    def fuse_norms(self, enabled: bool) -> None:
        """Compute the RMSNorms that feed a projection (before qkv and gate_up) inside that projection's
        GEMV (``kernels.linear(norm=...)``; fused at decode sizes, the separate kernel otherwise). The same
        values either way: bit for bit on CPU, within fp32 summation order of the mean square on a GPU."""
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled: expected a bool, got {enabled!r}")
        for layer in self.model.layers:
            layer.fused_norm = enabled

    def weight_slots(self) -> dict[str, torch.Tensor]:
        """Checkpoint tensor name -> the tensor (a view into our parameters) it must be copied into."""
        slots: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():
            owner, leaf = name.rsplit(".", 1)
            module = self.get_submodule(owner)
            if isinstance(module, Linear) and module.shards:
                parent, offset = owner.rsplit(".", 1)[0], 0
                for shard, rows in module.shards:
                    slots[f"{parent}.{shard}.{leaf}"] = param.data.narrow(0, offset, rows)
                    offset += rows
            else:
                slots[name] = param.data
        return slots

    def ignored_weight(self, name: str) -> bool:
        """Checkpoint tensors we do not need: a tied head's copy, old checkpoints' rotary tables."""
        return (name == "lm_head.weight" and self.lm_head is None) or name.endswith("rotary_emb.inv_freq")
