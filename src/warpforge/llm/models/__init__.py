"""Model registry: HF architecture name (config.json ``architectures[0]``) -> model class.

``build_model(config)`` makes the model with empty parameters on the current default device; the
loader fills them. The names themselves (and ``GGUF_ARCHITECTURES``, llama.cpp's names for them) are in
llm/architectures.py, below the config parsers that check them.
"""

from __future__ import annotations

import torch
from torch import nn

from warpforge.llm.architectures import GGUF_ARCHITECTURES, check_architecture
from warpforge.llm.config import ModelConfig
from warpforge.llm.models.decoder import CausalLM
from warpforge.llm.models.gemma3 import Gemma3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}


def resolve(architecture: str) -> type[nn.Module]:
    """The model class for an HF architecture name, or a ValueError naming it and the supported ones."""
    check_architecture(architecture)
    return MODEL_REGISTRY[architecture]


def build_model(config: ModelConfig, device: torch.device | str | None = None) -> nn.Module:
    """The model for ``config`` with uninitialized parameters in ``config.dtype`` on ``device``."""
    cls = resolve(config.architecture)
    if device is None:  # the caller's default device (e.g. inside `with torch.device("cuda")`)
        return cls(config).eval()
    with torch.device(device):
        return cls(config).eval()


__all__ = ["GGUF_ARCHITECTURES", "MODEL_REGISTRY", "build_model", "resolve"]
