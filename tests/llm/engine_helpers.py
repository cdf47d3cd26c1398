"""Shared by the runner/engine/API/CLI tests: tiny checkpoints (one per arch per session), HF greedy
references, fixed token-id prompts, and one torch thread (2-core CI boxes run several pytest
processes; two OpenMP threads per process then spin against each other, 30x slower)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3"]
_ROOT = Path(tempfile.mkdtemp(prefix="wf-llm-tests-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@functools.cache
def checkpoint(arch: str) -> Path:
    from warpforge.llm.testing import tiny_checkpoint

    return tiny_checkpoint(arch, _ROOT / arch)


@functools.cache
def loaded(arch: str):
    """(model, tokenizer, config) fp32 on CPU. Each engine binds its own KV caches to the model,
    so tests share one load and must not run two engines on it at once."""
    from warpforge.llm.loader import load

    return load(checkpoint(arch), dtype=torch.float32, device="cpu")


def prompts(vocab: int = 500, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of different lengths; #0 and #1 share a 40-token prefix, #3 repeats #0.
    Long enough to cross the tiny models' sliding windows (16) and several 4-token pages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (80,), generator=g).tolist()  # 0..4 are special tokens
    base = ids[:40]
    return [base + ids[40:43], base + ids[43:45], ids[50:57], base + ids[40:43], ids[60:61]]


_HF: dict = {}


def hf_greedy(arch: str, prompt: list[int], n: int) -> list[int]:
    """HF transformers' greedy continuation (fp32, CPU) of ``n`` tokens, EOS ignored."""
    transformers = pytest.importorskip("transformers")
    key = (arch, tuple(prompt), n)
    if key not in _HF:
        if arch not in _HF:
            _HF[arch] = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(arch), dtype=torch.float32).eval()
            # A GenerationConfig passed to generate() is merged over this one: clear EOS at the source.
            _HF[arch].generation_config.eos_token_id = None
        # No EOS at all (not min_new_tokens, which would mask EOS logits): the engine's ignore_eos.
        config = transformers.GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = _HF[arch].generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        _HF[key] = out[0, len(prompt):].tolist()
    return _HF[key]
