"""Random-weight HF checkpoints at the shapes of public models: the cost of a step depends on the shapes only.

``random_checkpoint(dir, "llama-8b")`` writes config.json, safetensors shards (with an index when there
is more than one), a small byte-level BPE tokenizer and tokenizer_config.json: what the engine (and HF
transformers) load, made without network or HF transformers. ``cached_checkpoint(preset)`` writes one
once under ``warpforge.settings.cache_dir()/bench-models/<preset>`` and reuses it (the bench cannot download).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# Shapes of public checkpoints, for random-weight stand-ins.
PRESETS: dict[str, dict[str, Any]] = {
    # Llama 3.2 1B: 16 layers, d 2048, GQA 32/8 heads of 64, SwiGLU 8192, vocab 128256, tied embeddings.
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Llama 3.1 8B: 32 layers, d 4096, GQA 32/8 heads of 128, SwiGLU 14336, vocab 128256, untied head.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                     rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # The same family at toy sizes, for tests and `bench --quick` on CPU.
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=True,
                       rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=512),
    "llama-tiny-untied": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=3, num_attention_heads=6,
                              num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=False,
                              rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=2048),
    # Every projection's input a whole number of int4 groups of 128 (the quantized rows of `bench --quick`).
    "llama-tiny-g128": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=1024, tie_word_embeddings=False,
                            rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=2048),
}

SHARD_BYTES = 4 << 30  # HF's default shard size: no single file above ~4 GiB


def preset(name: str) -> dict[str, Any]:
    """A copy of the preset's HF config fields (ValueError for an unknown name)."""
    if name not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {name!r}")
    return dict(PRESETS[name])


def _tensor_shapes(c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint with its shape, in file order."""
    d, f, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nh, nkv, v = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (nh * hd, d), p + "self_attn.k_proj.weight": (nkv * hd, d),
                   p + "self_attn.v_proj.weight": (nkv * hd, d), p + "self_attn.o_proj.weight": (d, nh * hd),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f), p + "input_layernorm.weight": (d,),
                   p + "post_attention_layernorm.weight": (d,)}
    shapes["model.norm.weight"] = (d,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    return shapes


def random_checkpoint(path: str | Path, preset_name: str = "llama-1b", *, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write an HF-format Llama checkpoint with random weights and the shapes of ``preset_name``.

    Weights ~ N(0, 0.02), norms 1. Shards of at most ``shard_bytes`` (a tensor is never split), with
    model.safetensors.index.json when there are several. Llama-1B in bfloat16 is 2.5 GB, Llama-8B 16 GB.
    """
    from safetensors.torch import save_file

    from warpforge.llm.testing import BOS_ID, CHAT_TEMPLATE, EOS_ID, tiny_tokenizer_json

    c = preset(preset_name)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    elt = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in _tensor_shapes(c).items():
        n = elt * int(torch.Size(shape).numel())
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map = {}
    for fname, shard in zip(names, shards):
        tensors = {}
        for name, shape in shard:  # one shard in memory at a time (8B: 4 GiB, not 16)
            tensors[name] = (torch.ones(shape, dtype=dtype) if len(shape) == 1
                             else (torch.randn(*shape, generator=gen) * 0.02).to(dtype))
            weight_map[name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        total = sum(elt * int(torch.Size(s).numel()) for s in _tensor_shapes(c).values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "attention_bias": False, "mlp_bias": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
              "torch_dtype": str(dtype).removeprefix("torch."), **c}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer.json").write_text(tiny_tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}, indent=1))
    return out


def cached_checkpoint(preset_name: str, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                      root: str | Path | None = None) -> Path:
    """``random_checkpoint`` written once under ``<root>/<preset>-<dtype>`` (root: cache_dir()/bench-models)
    and reused. A "complete" marker is written last, so an interrupted write is redone, not loaded."""
    from warpforge.settings import cache_dir

    preset(preset_name)
    base = Path(root) if root is not None else cache_dir() / "bench-models"
    out = base / f"{preset_name}-{str(dtype).removeprefix('torch.')}-seed{seed}"
    marker = out / ".complete"
    if not marker.is_file():
        random_checkpoint(out, preset_name, dtype=dtype, seed=seed)
        marker.write_text("ok\n")
    return out
