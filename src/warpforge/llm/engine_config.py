"""EngineConfig: the serving knobs (batching, paging, memory, graphs), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from warpforge import settings
from warpforge._validate import check_int
from warpforge.llm.speculative import speculative_config

# Decode batch sizes captured as CUDA graphs by default (nano-vllm's set): small sizes one by one
# because padding 3 -> 4 costs little but 1 -> 16 would waste most of the step, then every 16.
_GRAPH_SIZES = [1, 2, 4, 8, *range(16, 513, 16)]
KV_CACHE_DTYPES = ("auto", "fp8")
QUANTIZATION_MODES = ("int8", "int4", "int4-awq", "int4-gptq", "fp8")  # see llm/quantize.py


@dataclass
class EngineConfig:
    """How the engine batches, pages and captures. Every field is checked in ``__post_init__``.

    max_model_len           longest sequence (prompt + output) in tokens; None: the model's
                            max_position_embeddings, filled in by :meth:`for_model`
    max_num_seqs            most sequences running at once (and the largest decode batch)
    max_num_batched_tokens  token budget of one step (decodes + prefill chunks); longer prompts are
                            prefilled in chunks across steps
    page_size               tokens per KV page
    num_pages               KV pages; None: sized from the free GPU memory after a profiling run
    gpu_memory_utilization  fraction of the GPU's memory the engine may use (weights + activations + KV)
    enable_prefix_caching   reuse KV pages of full-page prompt prefixes seen before
    enforce_eager           never capture CUDA graphs
    cuda_graph_batch_sizes  decode batch sizes to capture (sorted); a batch pads to the next one.
                            Default: 1, 2, 4, 8, 16, 32, 48, ... 512, cut at max_num_seqs (which is
                            added when it is not in the list and <= 512)
    kv_cache_dtype          "auto" (the model's dtype) or "fp8" (e4m3 pages with per-head scales)
    async_scheduling        queue decode step n + 1 before reading step n's tokens (see LLMEngine.step)
    speculative             speculative decoding: None (off), a SpeculativeConfig, a method name ("ngram",
                            "self") or a dict of its fields (see warpforge.llm.speculative)
    pdl                     programmatic dependent launch inside the decode CUDA graphs (Hopper and newer:
                            each kernel launches while the one before it drains, once every program of
                            that one is past its main loop; kernels/_dispatch.py). None: the WARPFORGE_PDL
                            setting, off by default until measured on the H200
    fused_norm              compute the RMSNorms before the qkv and gate_up projections inside those
                            projections' GEMVs (decode sizes; CausalLM.fuse_norms): two norm kernels per
                            layer fewer. None: the WARPFORGE_FUSED_NORM setting, off by default until
                            measured on the H200
    seed                    seed of the unseeded sampling rows' random stream
    tensor_parallel_size    ranks the model is split over (one per GPU; gloo processes on the CPU); see
                            warpforge.llm.parallel. The engine spawns the other ranks, or joins torchrun's
                            process group when started under torchrun
    quantization            None (the model dtype), "int8", "int4", "int4-awq", "int4-gptq" or "fp8": the decoder
                            layers' weights quantized on load (llm/quantize.py)
    """

    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    page_size: int = 16
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    cuda_graph_batch_sizes: list[int] | None = field(default=None)
    kv_cache_dtype: str = "auto"
    async_scheduling: bool = True
    speculative: Any = None  # SpeculativeConfig | str | dict | None, normalized in __post_init__
    pdl: bool | None = None
    fused_norm: bool | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 2)  # at least one prompt token + one new token
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("page_size", self.page_size, 1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.pdl is None:
            self.pdl = settings.current().pdl
        if self.fused_norm is None:
            self.fused_norm = settings.current().fused_norm
        if self.num_pages is not None:
            check_int("num_pages", self.num_pages, 1)
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization: expected 0 < x <= 1, got {u!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling", "pdl", "fused_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization: expected None or one of {QUANTIZATION_MODES}, got {self.quantization!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed: expected an integer, got {self.seed!r}")
        self.speculative = speculative_config(self.speculative)
        if self.quantization is not None and self.tensor_parallel_size > 1:
            # Each rank loads and shards its own copy; the quantizer runs on the engine's rank only.
            raise ValueError(f"quantization: not available with tensor_parallel_size > 1 (got "
                             f"{self.tensor_parallel_size}); use one or the other")
        if self.speculative is not None and self.tensor_parallel_size > 1:
            # The verification forward runs outside the step the other ranks follow.
            raise ValueError(f"speculative: not available with tensor_parallel_size > 1 (got "
                             f"{self.tensor_parallel_size}); use one or the other")
        if self.cuda_graph_batch_sizes is None:
            sizes = [s for s in _GRAPH_SIZES if s <= self.max_num_seqs]
            if self.max_num_seqs <= _GRAPH_SIZES[-1] and self.max_num_seqs not in sizes:
                sizes.append(self.max_num_seqs)
            self.cuda_graph_batch_sizes = sizes
        else:
            sizes = list(self.cuda_graph_batch_sizes)
            for s in sizes:
                check_int("cuda_graph_batch_sizes", s, 1)
            self.cuda_graph_batch_sizes = sorted(set(sizes))

    def for_model(self, max_position_embeddings: int) -> EngineConfig:
        """A copy with ``max_model_len`` resolved against the model's context (None: take the model's).

        Raises ValueError when an explicit max_model_len is longer than the model supports.
        """
        if self.max_model_len is None:
            return replace(self, max_model_len=max_position_embeddings)
        if self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len: expected <= the model's max_position_embeddings "
                             f"({max_position_embeddings}), got {self.max_model_len}")
        return replace(self)
