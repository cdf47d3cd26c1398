"""Profile targets for warpforge's own LLM engine: one decode step of a batch, or one prefill of a batch.

``llm:CHECKPOINT`` profiles ``LLMEngine.step`` once every sequence of the batch is past its prompt, so
every measured step is a decode step (replayed from a CUDA graph on a GPU, as the engine serves).
``llm-prefill:CHECKPOINT`` adds fresh random prompts each iteration and steps until they are done
(one sampled token each), with prefix caching off so no prompt is served from cache. Prompts are
random token ids: the step's cost does not depend on what the tokens say.

FLOPs are counted on an eager step: the CUDA-graph replay hides the model's operators from the
dispatcher, so the counting call runs the engine with its graphs set aside.

``random_checkpoint(dir, "llama-1b")`` (from :mod:`warpforge.llm.random_weights`) writes a Llama-3.2-1B-shaped
HF checkpoint with random weights (no network, no HF transformers) for profiling the engine at a real model's
shapes.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Random-weight checkpoints live with the engine; re-exported here for the profile target and its tests.
from warpforge.llm.random_weights import PRESETS, random_checkpoint  # noqa: F401

# Decode steps a profile may take, with margin: at iters=20, warm-up 5 + counted 1 + pad sizing 2 + plain 20
# + detail 21 + timed 21 + plain 20 + the two overhead_parts windows 2 x 21 = 152.
DECODE_ROOM = 256


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
