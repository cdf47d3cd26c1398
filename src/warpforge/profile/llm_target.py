"""Profile targets for warpforge's own LLM engine: one decode step of a batch, or one prefill of a batch.

``llm:CHECKPOINT`` profiles ``LLMEngine.step`` once every sequence of the batch is past its prompt, so
every measured step is a decode step (replayed from a CUDA graph on a GPU, as the engine serves).
``llm-prefill:CHECKPOINT`` adds fresh random prompts each iteration and steps until they are done
(one sampled token each), with prefix caching off so no prompt is served from cache. Prompts are
random token ids: the step's cost does not depend on what the tokens say.

FLOPs are counted on an eager step: the CUDA-graph replay hides the model's operators from the
dispatcher, so the counting call runs the engine with its graphs set aside.

``random_checkpoint(dir, "llama-1b")`` writes a Llama-3.2-1B-shaped HF checkpoint with random weights
(no network, no HF transformers) for profiling the engine at a real model's shapes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

DECODE_ROOM = 256  # decode steps a profile may take: warm-up + counted + 3 windows of iters, with margin

# Shapes of public checkpoints, for random-weight stand-ins (the cost of a step depends on the shapes only).
PRESETS: dict[str, dict[str, Any]] = {
    # Llama 3.2 1B: 16 layers, d 2048, GQA 32/8 heads of 64, SwiGLU 8192, vocab 128256, tied embeddings.
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # The same family at toy size, for tests on CPU.
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=True,
                       rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=512),
}


def llm_engine(path: str, *, batch: int, prompt_len: int, device: torch.device, prefill: bool):
    """An engine sized for the profile: room for the batch and up to DECODE_ROOM steps (within the
    model's context), a fixed KV pool (no memory-probing run). Weights in bfloat16 on a GPU."""
    from warpforge.llm.config import to_dtype
    from warpforge.llm.engine import LLMEngine
    from warpforge.llm.engine_config import EngineConfig
    from warpforge.llm.loader import load

    loaded = load(path, dtype=to_dtype(None, torch.bfloat16 if device.type == "cuda" else torch.float32),
                  device=device)
    context = loaded[2].max_position_embeddings
    page = 16
    max_len = min(prompt_len + (1 if prefill else DECODE_ROOM), context)
    if max_len - prompt_len < (1 if prefill else 64):
        raise ValueError(f"a {prompt_len}-token prompt leaves too little of the model's {context}-token context "
                         "for the profile's decode steps; lower --prompt-len")
    cfg = EngineConfig(max_model_len=max_len, max_num_seqs=batch, page_size=page,
                       max_num_batched_tokens=max(8192, batch * prompt_len if prefill else 8192),
                       num_pages=batch * math.ceil(max_len / page) + 8, enable_prefix_caching=False)
    return LLMEngine(loaded, cfg)


def _prompts(engine, batch: int, prompt_len: int, gen: torch.Generator) -> list[list[int]]:
    vocab = engine.model_config.vocab_size
    return torch.randint(min(16, vocab - 1), vocab, (batch, prompt_len), generator=gen).tolist()


def llm_step(engine, phase: str = "decode", *, batch: int = 8, prompt_len: int = 128, seed: int = 0) -> dict[str, Any]:
    """A target dict (fn, inputs, module, count_fn) running one engine step per call (see module doc)."""
    from warpforge.llm.sampling import SamplingParams

    if phase not in ("decode", "prefill"):
        raise ValueError(f"phase: expected 'decode' or 'prefill', got {phase!r}")
    gen = torch.Generator().manual_seed(seed)
    greedy = {"temperature": 0.0, "ignore_eos": True}

    if phase == "prefill":
        def prefill() -> None:
            for p in _prompts(engine, batch, prompt_len, gen):
                engine.add_request(p, SamplingParams(max_tokens=1, **greedy))
            while engine.has_unfinished():  # long prompts prefill in chunks over several steps
                engine.step()

        return {"fn": prefill, "inputs": (), "module": engine.model, "count_fn": prefill,
                "name": f"llm prefill: batch {batch} x {prompt_len} tokens"}

    room = engine.config.max_model_len - prompt_len
    for p in _prompts(engine, batch, prompt_len, gen):
        engine.add_request(p, SamplingParams(max_tokens=room, **greedy))
    while any(not r.seq.output_token_ids for r in engine.requests.values()):
        engine.step()  # the prompts, until every sequence has its first token

    def decode() -> None:
        if not engine.has_unfinished():
            raise RuntimeError(f"the decode batch used up its {room} tokens; profile fewer iterations")
        engine.step()

    def decode_eager() -> None:
        runner = engine.runner
        graphs = getattr(runner, "graphs", None)
        runner.graphs = None  # the eager forward, so the counter sees the model's operators
        try:
            decode()
        finally:
            runner.graphs = graphs

    return {"fn": decode, "inputs": (), "module": engine.model, "count_fn": decode_eager,
            "name": f"llm decode: batch {batch}, context {prompt_len}+"}


def random_checkpoint(path: str | Path, preset: str = "llama-1b", *, dtype: torch.dtype = torch.bfloat16,
                      seed: int = 0) -> Path:
    """An HF-format Llama checkpoint with random weights and the shapes of ``preset`` (config.json,
    model.safetensors, a small byte-level BPE tokenizer): what the engine loads, made without network
    or HF transformers. Weights ~ N(0, 0.02), norms 1. Llama-1B in bfloat16 is a 2.5 GB file."""
    import json

    from safetensors.torch import save_file

    from warpforge.llm.testing import BOS_ID, CHAT_TEMPLATE, EOS_ID, tiny_tokenizer_json

    if preset not in PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PRESETS)}, got {preset!r}")
    c = dict(PRESETS[preset])
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    d, f, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    tensors = {"model.embed_tokens.weight": w(c["vocab_size"], d), "model.norm.weight": torch.ones(d, dtype=dtype)}
    if not c["tie_word_embeddings"]:
        tensors["lm_head.weight"] = w(c["vocab_size"], d)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(nh * hd, d), p + "self_attn.k_proj.weight": w(nkv * hd, d),
                    p + "self_attn.v_proj.weight": w(nkv * hd, d), p + "self_attn.o_proj.weight": w(d, nh * hd),
                    p + "mlp.gate_proj.weight": w(f, d), p + "mlp.up_proj.weight": w(f, d),
                    p + "mlp.down_proj.weight": w(d, f), p + "input_layernorm.weight": torch.ones(d, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(d, dtype=dtype)}
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "attention_bias": False, "mlp_bias": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
              "torch_dtype": str(dtype).removeprefix("torch."), **c}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer.json").write_text(tiny_tokenizer_json())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}, indent=1))
    return out
