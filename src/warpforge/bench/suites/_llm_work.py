"""The llm suite's work counts: the bytes a generation reads and the flops it computes, from a model's shape.

MBU and MFU divide these by the wall time and the device's ceilings (bench.e2e). Every row that runs a model's
forward steps counts them here, from the requests' prompt and output lengths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def shape_of(c: dict[str, Any]) -> dict[str, int]:
    """The sizes the counts need, from an HF config dict (Llama family)."""
    nh = c["num_attention_heads"]
    return {"L": c["num_hidden_layers"], "d": c["hidden_size"], "f": c["intermediate_size"], "nh": nh,
            "nkv": c.get("num_key_value_heads", nh), "hd": c.get("head_dim") or c["hidden_size"] // nh,
            "vocab": c["vocab_size"]}


def matmul_params(s: dict[str, int]) -> int:
    """Weights every token multiplies through: attention and MLP projections and the LM head."""
    per_layer = s["d"] * (s["nh"] + 2 * s["nkv"]) * s["hd"] + s["nh"] * s["hd"] * s["d"] + 3 * s["d"] * s["f"]
    return s["L"] * per_layer + s["vocab"] * s["d"]


def weight_bytes(s: dict[str, int], elt: int) -> int:
    """Bytes one forward step reads in weights: the matmuls and the norms (one embedding row is noise)."""
    return elt * (matmul_params(s) + (2 * s["L"] + 1) * s["d"])


def kv_bytes_per_token(s: dict[str, int], elt: int) -> int:
    """K and V of one token in every layer."""
    return 2 * s["L"] * s["nkv"] * s["hd"] * elt


def generation_work(s: dict[str, int], elt: int, prompt_lens: Sequence[int], out_lens: Sequence[int],
                    kv_elt: int | None = None, cached: Sequence[int] | None = None) -> dict:
    """{"flops", "bytes"} of generating ``out_lens[i]`` tokens after ``prompt_lens[i]`` for every request.

    Bytes: ``max(out_lens)`` steps each read the weights (exact at batch 1: one prefill + n - 1 decode
    steps; a lower bound for a batch), and each decode step of a request reads its whole KV so far.
    Flops: 2 x matmul params per token processed, plus causal attention (QK^T and PV, 2 flops a MAC).
    ``kv_elt``: bytes per cached K/V element when the cache is not in the weights' dtype (fp8: 1).
    ``cached[i]``: prompt tokens of request i served from the prefix cache: never computed, so never
    counted (counted, a 2000-token shared prompt over 256 requests read as "mfu 9.73").
    """
    attn = 4 * s["L"] * s["nh"] * s["hd"]  # flops per (query, key) pair
    flops = bytes_ = 0.0
    for i, (p, n) in enumerate(zip(prompt_lens, out_lens)):
        c = min(cached[i], p) if cached is not None else 0
        flops += 2.0 * matmul_params(s) * (p - c + n - 1)
        flops += attn * (p * (p + 1) - c * (c + 1)) / 2  # the prompt's computed rows, causal
        ctx = sum(p + t for t in range(1, n))  # decode steps 1..n-1 see p + t keys
        flops += attn * ctx
        bytes_ += kv_bytes_per_token(s, elt if kv_elt is None else kv_elt) * ctx
    bytes_ += weight_bytes(s, elt) * max(out_lens)
    return {"flops": flops, "bytes": bytes_}


def _shape(preset: str) -> dict[str, int]:
    """The sizes of a row's model: Gemma 3 270M's, or a random-weight preset's (from its HF config)."""
    if preset == "gemma3-270m":  # Gemma 3 270M (HF config): 18 layers, d 640, 4/1 heads of 256, MLP 2048
        return {"L": 18, "d": 640, "f": 2048, "nh": 4, "nkv": 1, "hd": 256, "vocab": 262144}
    from warpforge.llm.random_weights import preset as hf_config

    return shape_of(hf_config(preset))


__all__ = ["generation_work", "kv_bytes_per_token", "matmul_params", "shape_of", "weight_bytes"]
