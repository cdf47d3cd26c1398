"""warpforge.llm: serve decoder-only LLMs (Llama, Mistral, Qwen2/3, Gemma 3) on warpforge's Triton kernels.

>>> from warpforge.llm import LLM, SamplingParams
>>> llm = LLM("path/to/hf-dir-or.gguf", max_model_len=4096)
>>> llm.generate(["To be, or not to be"], SamplingParams(temperature=0, max_tokens=32))[0].text

``LLM`` generates offline batches, ``AsyncLLM`` streams per-request outputs for servers, ``LLMEngine``
is the step-by-step core both drive. Names load on first use, so ``import warpforge.llm`` stays cheap.
"""

from __future__ import annotations

from warpforge._lazy import lazy_exports

_LAZY = {
    "LLM": "engine", "LLMEngine": "engine",
    "AsyncLLM": "async_engine",
    "EngineConfig": "engine_config",
    "SpeculativeConfig": "speculative",
    "SamplingParams": "sampling", "StructuredOutputsParams": "structured",
    "RequestOutput": "outputs", "RequestMetrics": "outputs",
    "ModelConfig": "config",
    "load": "loader", "Loaded": "loader",
    "Tokenizer": "tokenizer",
    "save_quantized": "quantize",
}

__all__ = list(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
