"""A config.json that leaves keys out must mean what it means to transformers: every default, per
architecture, equals the one transformers' config class fills in (AutoConfig.for_model)."""

from __future__ import annotations

import json

import pytest
import torch

from warpforge.llm.config import FULL, HF_DEFAULTS, HF_MODEL_TYPES, SLIDING, ModelConfig

transformers = pytest.importorskip("transformers")

# Sizes where every derived default differs from every literal one: hidden // heads = 32 is neither
# Qwen3's head_dim 128 nor Gemma 3's 256; 32 heads hold Mistral's 8 and Qwen's 32 KV heads; 7 layers
# show Gemma 3's every-6th-layer-global pattern.
SIZES = dict(vocab_size=100, hidden_size=1024, intermediate_size=64, num_hidden_layers=7, num_attention_heads=32)


def _theirs(model_type: str):
    return transformers.AutoConfig.for_model(model_type, **SIZES)


@pytest.mark.parametrize("arch", sorted(HF_MODEL_TYPES))
def test_every_left_out_key_takes_transformers_default(arch):
    mtype = HF_MODEL_TYPES[arch]
    ours = ModelConfig.from_hf({"architectures": [arch], "model_type": mtype, **SIZES})
    hf = _theirs(mtype)
    gemma = mtype == "gemma3_text"
    rope = hf.rope_parameters[FULL] if gemma else hf.rope_parameters
    want = {
        "num_kv_heads": hf.num_key_value_heads,
        "head_dim": getattr(hf, "head_dim", None) or SIZES["hidden_size"] // SIZES["num_attention_heads"],
        "hidden_act": hf.hidden_activation if gemma else hf.hidden_act,
        "max_position_embeddings": hf.max_position_embeddings,
        "rms_norm_eps": hf.rms_norm_eps,
        "rope_theta": rope["rope_theta"],
        "rope_local_theta": hf.rope_parameters[SLIDING]["rope_theta"] if gemma else None,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "sliding_window": getattr(hf, "sliding_window", None),
        "query_pre_attn_scalar": hf.query_pre_attn_scalar if gemma else None,
        "final_logit_softcapping": getattr(hf, "final_logit_softcapping", None),
        "bos_token_id": hf.bos_token_id,
        "eos_token_ids": [] if hf.eos_token_id is None else [hf.eos_token_id],
        "pad_token_id": hf.pad_token_id,
        "qkv_bias": True if mtype == "qwen2" else getattr(hf, "attention_bias", False),
        "mlp_bias": getattr(hf, "mlp_bias", False),
    }
    got = {k: getattr(ours, k) for k in want}
    assert got == want
    # Per-layer attention: transformers' layer_types where the class has them; Mistral windows every layer.
    every = SLIDING if getattr(hf, "sliding_window", None) else FULL
    layers = tuple(getattr(hf, "layer_types", None) or (every,) * 7)
    assert ours.layer_types == layers
    assert set(HF_DEFAULTS[mtype]) >= {"max_position_embeddings", "rope_theta", "head_dim", "num_key_value_heads"}


def test_model_type_left_out_follows_the_architecture():
    c = ModelConfig.from_hf({"architectures": ["Qwen3ForCausalLM"], **SIZES})
    assert c.head_dim == 128 and c.qk_norm and c.num_kv_heads == 32


def test_explicit_values_and_nulls_are_kept():
    c = ModelConfig.from_hf({"architectures": ["MistralForCausalLM"], "model_type": "mistral", **SIZES,
                             "sliding_window": None, "num_key_value_heads": 4, "head_dim": None})
    assert c.sliding_window is None and c.layer_types == (FULL,) * 7  # null: no window (Mistral 7B v0.2+)
    assert c.num_kv_heads == 4 and c.head_dim == 32  # null head_dim: derived, as transformers derives it


def test_gemma3_without_scale_and_activation_generates_what_transformers_does(tmp_path):
    """The newcomer's case: a Gemma 3 config.json without query_pre_attn_scalar and hidden_activation."""
    from warpforge.llm.loader import load
    from warpforge.llm.testing import PagedDriver, tiny_checkpoint

    path = tiny_checkpoint("gemma3", tmp_path / "g")  # its own query_pre_attn_scalar is 24, not the default 256
    cfg = json.loads((path / "config.json").read_text())
    for key in ("query_pre_attn_scalar", "hidden_activation", "hidden_act"):
        cfg.pop(key, None)
    (path / "config.json").write_text(json.dumps(cfg))
    ours = load(path, dtype=torch.float32)
    assert ours.config.attn_scale == 256 ** -0.5 and ours.config.hidden_act == "gelu_pytorch_tanh"
    ids = list(range(5, 29))
    got = PagedDriver(ours.model, num_pages=16, page_size=4).greedy([ids], 6)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    x = torch.tensor([ids])
    with torch.no_grad():
        want = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=gen)[0, len(ids):].tolist()
    assert got == want
