"""ModelConfig: one validated description of a decoder-only LLM, read from HF config.json or GGUF metadata.

Every family the engine serves (Llama, Mistral, Qwen2, Qwen3, Gemma 3) is the same decoder with a few
switches; the switches live here so the model code reads as one path. ``EngineConfig`` (serving knobs)
lives in ``engine_config.py``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from warpforge import dtypes
from warpforge.llm.architectures import GGUF_ARCHITECTURES, check_architecture

FULL, SLIDING = "full_attention", "sliding_attention"
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
ROPE_TYPES = ("default", "linear", "llama3")


def read_json(path: Path) -> Any:
    """A JSON file, or a ValueError naming the file and where it stops being JSON."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not valid JSON (not UTF-8 text)") from None


def to_dtype(dtype: torch.dtype | str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """A torch dtype from a dtype, any spelling of warpforge.dtypes ("bf16", "bfloat16", "torch.float16",
    "half") or None/"auto" (-> ``default``)."""
    if dtype is None or dtype == "auto":
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype: expected one of {list(dtypes.ALIASES)}, got {dtype}")
        return dtype
    return getattr(torch, dtypes.TORCH_NAMES[dtypes.short_name(str(dtype))])


@dataclass
class ModelConfig:
    architecture: str                      # HF class name, the model registry's key ("LlamaForCausalLM")
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None       # HF rope scaling of full-attention layers: linear | llama3
    rope_local_theta: float | None = None  # rope base of sliding layers (Gemma 3); None: rope_theta
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF rope_freqs: inv_freq / factors (Llama 3.1)
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False                  # RMSNorm over head_dim on q and k before rope (Qwen3, Gemma 3)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None      # HF meaning: a query sees itself and the W - 1 keys before it
    layer_types: tuple[str, ...] = ()      # per layer FULL | SLIDING; () -> all FULL
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (Gemma); else head_dim ** -0.5
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    norm_weight_offset: float = 0.0        # Gemma's RMSNorm scales by (1 + weight)
    embed_scale: float | None = None       # Gemma multiplies embeddings by sqrt(hidden) (in the model dtype)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim: rope needs an even head_dim, got {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act: expected one of {ACTIVATIONS}, got {self.hidden_act!r}")
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_scaling: unsupported rope type {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors: expected head_dim/2 = {self.head_dim // 2} factors, "
                             f"got {len(self.rope_freq_factors)}")
        self.layer_types = tuple(self.layer_types) or (FULL,) * self.num_layers
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {FULL, SLIDING}:
            raise ValueError(f"layer_types: expected {self.num_layers} entries of {FULL!r}/{SLIDING!r}, "
                             f"got {self.layer_types}")
        if SLIDING in self.layer_types and (self.sliding_window is None or self.sliding_window < 1):
            raise ValueError(f"sliding_window: sliding layers need a window >= 1, got {self.sliding_window}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "embed_scale"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: expected a finite float > 0 or None, got {value}")
        self.dtype = to_dtype(self.dtype)
        self.eos_token_ids = [int(t) for t in self.eos_token_ids]

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int | None:
        """The attention kernels' ``window`` for a layer: keys before the query it sees (HF W -> W - 1)."""
        if self.layer_types[layer] != SLIDING:
            return None
        assert self.sliding_window is not None  # __post_init__ refuses sliding layers without a window
        return self.sliding_window - 1

    # ---- Hugging Face config.json -----------------------------------------------------------

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], *, dtype: torch.dtype | str | None = None) -> ModelConfig:
        """From a parsed config.json (transformers 4.x ``rope_theta``/``rope_scaling`` or 5.x ``rope_parameters``)."""
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json: no 'architectures' entry, cannot tell which model this is")
        arch = archs[0]
        check_architecture(arch)  # unsupported: ValueError naming it and the supported ones
        missing = [k for k in _HF_REQUIRED if cfg.get(k) is None]
        if missing:
            raise ValueError(f"config.json: missing {', '.join(missing)}")
        mtype = cfg.get("model_type") or HF_MODEL_TYPES[arch]
        mtype = "gemma3_text" if mtype == "gemma3" else mtype
        if mtype not in HF_DEFAULTS:
            raise ValueError(f"config.json: model_type {mtype!r} does not match {arch} "
                             f"(expected one of {sorted(HF_DEFAULTS)})")
        defaults = HF_DEFAULTS[mtype]

        def get(key: str):  # a key left out takes transformers' default for this model type
            return cfg[key] if key in cfg else defaults[key]

        gemma = mtype == "gemma3_text"
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention is not a causal LM; not supported")
        heads = cfg["num_attention_heads"]
        head_dim = get("head_dim") or cfg["hidden_size"] // heads  # null: derived, as transformers does
        theta, scaling, local = _hf_rope(cfg, defaults)
        window = get("sliding_window")
        if mtype in ("qwen2", "qwen3") and not get("use_sliding_window"):
            window = None
        eos = get("eos_token_id")
        attention_bias = bool(get("attention_bias"))
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=get("max_position_embeddings"),
            rms_norm_eps=get("rms_norm_eps"),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local,
            hidden_act=get("hidden_activation") if gemma else get("hidden_act"),
            qkv_bias=True if mtype == "qwen2" else attention_bias,
            o_bias=False if mtype == "qwen2" else attention_bias,
            mlp_bias=bool(get("mlp_bias")),
            qk_norm=mtype in ("qwen3", "gemma3_text"),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            sliding_window=window,
            layer_types=_hf_layer_types(cfg, mtype, window, defaults),
            query_pre_attn_scalar=get("query_pre_attn_scalar") if gemma else None,
            attn_logit_softcapping=None,  # HF's Gemma 3 ignores it; no supported family uses it
            final_logit_softcapping=get("final_logit_softcapping"),
            norm_weight_offset=1.0 if gemma else 0.0,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else None,
            bos_token_id=get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            pad_token_id=get("pad_token_id"),
            dtype=to_dtype(dtype, to_dtype(cfg.get("dtype") or cfg.get("torch_dtype"))),
        )

    # ---- GGUF metadata -----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tensor_names: Collection[str], *,
                  dtype: torch.dtype | str | None = None) -> ModelConfig:
        """From GGUF key/values (``general.architecture`` = llama | qwen2 | qwen3 | gemma3) and tensor names.

        What llama.cpp leaves out of the metadata is what its own loader hard-codes: Gemma 3's local rope
        base 10000, its sliding pattern (every 6th layer global) and its softmax scale.
        """
        name = meta.get("general.architecture")
        if name not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF architecture {name!r} is not supported (supported: {sorted(GGUF_ARCHITECTURES)})")
        arch = GGUF_ARCHITECTURES[name]
        check_architecture(arch)

        def key(suffix, default=None):
            return meta.get(f"{name}.{suffix}", default)

        missing = [f"{name}.{k}" for k in _GGUF_REQUIRED if key(k) is None]
        if missing:
            raise ValueError(f"GGUF: missing metadata {', '.join(missing)}")
        if key("rope.scaling.type") not in (None, "none", "linear"):
            raise ValueError(f"GGUF: unsupported rope scaling {key('rope.scaling.type')!r} (supported: none, linear)")
        hidden, heads = key("embedding_length"), key("attention.head_count")
        layers = key("block_count")
        head_dim = key("attention.key_length") or hidden // heads
        vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
        if not vocab:
            raise ValueError(f"GGUF: no {name}.vocab_size and no tokenizer.ggml.tokens to size the vocabulary")
        gemma = name == "gemma3"
        scaling = None
        if key("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
        window = key("attention.sliding_window") if gemma else None
        eos = [meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else []
        if gemma and "tokenizer.ggml.tokens" in meta and "<end_of_turn>" in meta["tokenizer.ggml.tokens"]:
            eos.append(meta["tokenizer.ggml.tokens"].index("<end_of_turn>"))  # ends a chat turn (llama.cpp: EOG)
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=key("attention.head_count_kv") or heads,
            head_dim=head_dim,
            max_position_embeddings=key("context_length", 4096),
            rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
            rope_theta=float(key("rope.freq_base", 1e6 if gemma else 10000.0)),
            rope_scaling=scaling,
            rope_local_theta=float(key("rope.freq_base_swa", 10000.0)) if gemma else None,
            hidden_act="gelu_pytorch_tanh" if gemma else "silu",
            qkv_bias=any(n.endswith("attn_q.bias") for n in tensor_names),
            o_bias=any(n.endswith("attn_output.bias") for n in tensor_names),
            qk_norm=any(n.endswith("attn_q_norm.weight") for n in tensor_names),
            tie_word_embeddings="output.weight" not in tensor_names,
            sliding_window=window,
            layer_types=_gguf_layer_types(key("attention.sliding_window_pattern"), layers) if gemma else (),
            # llama.cpp: Gemma 3 27B (62 layers) scales by hidden/heads, the others by head_dim
            query_pre_attn_scalar=(hidden // heads if layers == 62 else head_dim) if gemma else None,
            final_logit_softcapping=key("final_logit_softcapping"),
            norm_weight_offset=1.0 if gemma else 0.0,
            embed_scale=hidden ** 0.5 if gemma else None,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos,
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            dtype=to_dtype(dtype),
        )


# Structural sizes have no default worth taking: transformers' describe one particular 7B model, and a
# config.json without them is a mistake (the weights would not fit, after a 7B allocation).
_HF_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_GGUF_REQUIRED = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")

HF_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                  "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text"}

# What transformers takes for every other key a config.json leaves out: its config classes' field
# defaults, per model_type (tests/llm/test_config_defaults.py checks each against AutoConfig.for_model).
# head_dim / num_key_value_heads None: hidden_size // heads and the query head count, as transformers derives them.
_COMMON = dict(num_key_value_heads=None, head_dim=None, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0,
               tie_word_embeddings=False, attention_bias=False, mlp_bias=False, sliding_window=None,
               final_logit_softcapping=None, bos_token_id=None, eos_token_id=None, pad_token_id=None)
_QWEN = dict(_COMMON, num_key_value_heads=32, max_position_embeddings=32768, use_sliding_window=False,
             sliding_window=4096, max_window_layers=28)
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_COMMON, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    "mistral": dict(_COMMON, num_key_value_heads=8, max_position_embeddings=131072, sliding_window=4096,
                    bos_token_id=1, eos_token_id=2),
    "qwen2": _QWEN,
    "qwen3": dict(_QWEN, head_dim=128),
    "gemma3_text": dict(_COMMON, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                        max_position_embeddings=131072, tie_word_embeddings=True, query_pre_attn_scalar=256,
                        sliding_window=4096, sliding_window_pattern=6, rope_theta=1_000_000.0,
                        rope_local_base_freq=10000.0, bos_token_id=2, eos_token_id=1, pad_token_id=0),
}


def _hf_rope(cfg: Mapping[str, Any], defaults: Mapping[str, Any]) -> tuple[float, dict | None, float | None]:
    """(theta, scaling of full layers, theta of sliding layers) from either config.json style."""
    params = cfg.get("rope_parameters")
    local = defaults.get("rope_local_base_freq")  # None: one rope base for every layer
    if params:
        if FULL in params or SLIDING in params:  # per layer type (Gemma 3 in transformers 5)
            local = (params.get(SLIDING) or {}).get("rope_theta", local)
            params = params.get(FULL) or {}
        theta = params.get("rope_theta", defaults["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = cfg.get("rope_theta", defaults["rope_theta"])
        scaling = dict(cfg.get("rope_scaling") or {})
        if local is not None:
            local = cfg.get("rope_local_base_freq", local)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), (scaling if kind != "default" else None), (float(local) if local is not None else None)


def _hf_layer_types(cfg: Mapping[str, Any], mtype: str, window: int | None,
                    defaults: Mapping[str, Any]) -> tuple[str, ...]:
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        types = tuple(cfg["layer_types"])
        return types if window is not None else (FULL,) * n
    if mtype == "gemma3_text":
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or \
            defaults["sliding_window_pattern"]
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(n))
    if window is None:
        return (FULL,) * n
    if mtype in ("qwen2", "qwen3"):
        first = cfg.get("max_window_layers", defaults["max_window_layers"])
        return tuple(SLIDING if i >= first else FULL for i in range(n))
    return (SLIDING,) * n  # Mistral: one window for every layer


def _gguf_layer_types(pattern, n: int) -> tuple[str, ...]:
    """Sliding/full per layer from ``attention.sliding_window_pattern``: a period (every Nth layer is
    global; llama.cpp's Gemma 3 default is 6) or one bool per layer (True: sliding)."""
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise ValueError(f"GGUF attention.sliding_window_pattern: expected {n} entries, got {len(pattern)}")
        return tuple(SLIDING if p else FULL for p in pattern)
    period = int(pattern or 6)
    return tuple(SLIDING if (i + 1) % period else FULL for i in range(n))
