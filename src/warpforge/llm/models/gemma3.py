"""Gemma 3 (text): the shared decoder with Gemma's sandwich norms.

What differs from Llama lives in the config (``ModelConfig.from_hf``/``from_gguf`` set it): embeddings
scaled by sqrt(hidden), RMSNorm scaling by (1 + weight), q/k norms, softmax scale
``query_pre_attn_scalar ** -0.5``, sliding layers with their own rope base between global ones, a
gelu-tanh gated MLP, optional final logit softcapping. What differs in the block is here: the attention
and the MLP outputs are normalized again before they join the residual stream.
"""

from __future__ import annotations

import torch

from warpforge.llm.config import ModelConfig
from warpforge.llm.layers import Rotary
from warpforge.llm.models.decoder import CausalLM, DecoderLayer, norm


class Gemma3DecoderLayer(DecoderLayer):
    """x + post_attn_norm(attn(input_norm(x))), then + post_ff_norm(mlp(pre_ff_norm(.))). With
    CausalLM.fuse_norms the input and pre-ff norms run inside qkv_proj / gate_up_proj."""

    def __init__(self, config: ModelConfig, layer: int, rotary: Rotary):
        super().__init__(config, layer, rotary)
        self.pre_feedforward_layernorm = norm(config)
        self.post_feedforward_layernorm = norm(config)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None):
        # x [T, H]: the previous layer's (post-normed) output, not yet added to the residual stream. The
        # post-attention and post-ff norms normalize outputs (no projection follows them): never fused.
        x, residual = self.input_layernorm.prenorm(x, residual, fused=self.fused_norm)
        x = self.post_attention_layernorm(self.self_attn(positions, x))
        x, residual = self.pre_feedforward_layernorm.prenorm(x, residual, fused=self.fused_norm)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, Gemma3DecoderLayer)
