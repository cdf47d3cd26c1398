"""The model families the engine runs, by name: Hugging Face architecture names (config.json's
``architectures[0]``) and the GGUF names llama.cpp writes (``general.architecture``).

Names only, no model code: the config parsers (llm/config.py) check a checkpoint against them, and the
registry (llm/models) maps each to its class.
"""

from __future__ import annotations

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "Gemma3ForCausalLM")

# GGUF name -> HF name (llama.cpp files Mistral under "llama")
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def check_architecture(architecture: str) -> None:
    """A ValueError naming ``architecture`` and the supported ones, unless it is one of them."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(ARCHITECTURES))}")


__all__ = ["ARCHITECTURES", "GGUF_ARCHITECTURES", "check_architecture"]
