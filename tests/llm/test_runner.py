"""ModelRunner: step inputs (slots across scrambled pages, chunk offsets, sample rows), copy-on-write
page copies, KV sizing; on the GPU: CUDA-graph decode equals eager decode, memory-sized cache."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from warpforge.llm.block_manager import BlockManager  # noqa: E402
from warpforge.llm.engine import LLM  # noqa: E402
from warpforge.llm.engine_config import EngineConfig  # noqa: E402
from warpforge.llm.runner import ModelRunner  # noqa: E402
from warpforge.llm.sampling import SamplingParams  # noqa: E402
from warpforge.llm.scheduler import ScheduledBatch  # noqa: E402
from warpforge.llm.sequence import Sequence  # noqa: E402

from .engine_helpers import checkpoint, hf_greedy, loaded, one_thread, prompts  # noqa: E402,F401

PS = 4


def runner(num_pages: int = 32, **kw) -> ModelRunner:
    model, _, config = loaded("llama")
    ec = EngineConfig(max_model_len=64, page_size=PS, num_pages=num_pages, **kw)
    ec = ec.for_model(config.max_position_embeddings)
    return ModelRunner(model, config, ec, "cpu")


def seq_with_pages(tokens: list[int], pages: list[int], computed: int) -> Sequence:
    s = Sequence(tokens, SamplingParams(temperature=0.0))
    s.block_table, s.num_computed_tokens = list(pages), computed
    return s


def test_prepare_mixed_batch():
    r = runner()
    a = seq_with_pages(list(range(10, 20)), [7, 3, 12], computed=3)  # prefill chunk of tokens 3..8 (no sample)
    b = seq_with_pages(list(range(30, 36)), [5, 9], computed=5)  # decode of its 6th token (samples)
    c = seq_with_pages(list(range(40, 43)), [1], computed=0)  # whole prompt (samples)
    batch = ScheduledBatch()
    batch.add(a, 6)
    batch.add(b, 1)
    batch.add(c, 3)
    ids, pos, ctx, sample_idx = r.prepare(batch)
    assert ids.tolist() == list(range(13, 19)) + [35] + [40, 41, 42]
    assert pos.tolist() == [3, 4, 5, 6, 7, 8, 5, 0, 1, 2]
    # position p -> page block_table[p // 4], row p % 4
    assert ctx.slot_mapping.tolist() == [7 * 4 + 3, 3 * 4, 3 * 4 + 1, 3 * 4 + 2, 3 * 4 + 3, 12 * 4, 9 * 4 + 1,
                                         4, 5, 6]
    assert ctx.block_tables.tolist() == [[7, 3, 12], [5, 9, 0], [1, 0, 0]]
    assert ctx.block_tables.dtype == ctx.seq_lens.dtype == ctx.cu_seqlens_q.dtype == torch.int32
    assert ctx.seq_lens.tolist() == [9, 6, 3] and ctx.cu_seqlens_q.tolist() == [0, 6, 7, 10]
    assert ctx.max_seqlen_q == 6 and ctx.max_seq_len == 9 and not ctx.decode_only
    assert sample_idx.tolist() == [6, 9] and batch.sampling_seqs == [b, c]


def test_prepare_decode_graph_padding():
    r = runner()
    s = seq_with_pages([1, 2, 3, 4, 5], [2, 6], computed=4)
    batch = ScheduledBatch()
    batch.add(s, 1)
    h = r.host_inputs(batch, pad_to=4)
    assert batch.decode_only and h["slot_mapping"] == [6 * 4, -1, -1, -1] and h["seq_lens"] == [5, 0, 0, 0]
    assert h["block_tables"] == [[2, 6], [0, 0], [0, 0], [0, 0]] and h["sample_rows"] == [0]


def test_decode_arrays_match_host_inputs_and_track_page_changes():
    """The CUDA-graph path's numpy inputs equal host_inputs' lists, also after the page list grows,
    is replaced, or has a page swapped in place by copy-on-write."""
    import numpy as np

    r = runner()
    a = seq_with_pages(list(range(10, 19)), [7, 3, 12], computed=8)  # 9 tokens: position 8 in page 12
    b = seq_with_pages([1, 2, 3, 4, 5], [2, 6], computed=4)
    c = seq_with_pages([9] * 4, [5], computed=3)

    def check(seqs, pad):
        batch = ScheduledBatch()
        for s in seqs:
            batch.add(s, 1)
        want, got = r.host_inputs(batch, pad_to=pad), r.decode_arrays(batch, pad)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables"):
            assert np.array_equal(got[name], np.asarray(want[name])), name
        assert got["block_tables"].dtype == got["seq_lens"].dtype == np.int32
        return got

    got = check([a, b, c], 4)
    assert got["slot_mapping"].tolist() == [12 * 4, 6 * 4, 5 * 4 + 3, -1]
    a.token_ids.append(19)  # a new token in a new page
    a.block_table.append(30)
    a.num_computed_tokens += 1
    check([a, b, c], 4)
    b.block_table[1] = 8  # copy-on-write swaps the page in place: the block manager bumps the version
    b.block_table_version += 1
    assert check([b, a], 2)["block_tables"][0].tolist()[:2] == [2, 8]
    c.block_table = [11]  # a new list (freed and allocated again)
    check([c], 1)
    with pytest.raises(ValueError, match="decode-only"):
        prefill = ScheduledBatch()
        prefill.add(seq_with_pages([1, 2, 3], [1], computed=0), 3)
        r.decode_arrays(prefill, 1)


def test_copy_on_write_copies_every_layer():
    r = runner(num_pages=16)  # one sequence of max_model_len 64 needs 16 pages of 4
    for c in r.kv_caches:
        c.k_cache.normal_()
        c.v_cache.normal_()
    before = [(c.k_cache.clone(), c.v_cache.clone()) for c in r.kv_caches]
    r.copy_pages([(1, 5), (2, 6)])
    for (k, v), c in zip(before, r.kv_caches):
        assert torch.equal(c.k_cache[5], k[1]) and torch.equal(c.v_cache[6], v[2])
        assert torch.equal(c.k_cache[:5], k[:5]) and torch.equal(c.k_cache[7], k[7])


def test_run_samples_only_finished_ranges():
    r = runner()
    bm = BlockManager(r.num_pages, PS)
    p = prompts()[2]
    s = Sequence(p, SamplingParams(temperature=0.0))
    bm.allocate(s)
    first = ScheduledBatch()
    first.add(s, 4)  # a chunk that does not reach the prompt's end: nothing to sample
    assert r.run(first) == ([], [])
    s.num_computed_tokens = 4
    rest = ScheduledBatch()
    rest.add(s, len(p) - 4)
    ids, lps = r.run(rest)
    assert ids == hf_greedy("llama", p, 64)[:1] and lps == [None]


def test_kv_sizing_on_cpu():
    r = runner(num_pages=None)
    c = r.config
    assert r.page_bytes == 2 * c.num_layers * c.num_kv_heads * PS * c.head_dim * 4
    assert r.num_pages >= r.max_pages_per_seq == 16
    assert r.kv_caches[0].k_cache.shape == (r.num_pages, c.num_kv_heads, PS, c.head_dim)
    with pytest.raises(ValueError, match="fp8"):
        runner(kv_cache_dtype="fp8")  # fp8 pages need 16-bit queries


@pytest.mark.gpu
def test_cuda_graph_decode_equals_eager():
    ps = prompts()
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype=torch.float32, device="cuda", max_model_len=128, page_size=16, num_pages=64,
              cuda_graph_batch_sizes=[1, 2, 4, 8])
    graphed = LLM(str(checkpoint("llama")), **kw)
    graphs = graphed.engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    eager = LLM(str(checkpoint("llama")), enforce_eager=True, **kw)
    assert eager.engine.runner.graphs is None
    # Batches of 5 (padded to 8) and then, with staggered starts, other sizes; the same tokens either way.
    for n in (5, 3, 1):
        a, b = graphed.generate(ps[:n], params), eager.generate(ps[:n], params)
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert graphs.replays >= 3 * 15 - 3
    # Seeded sampling with penalties through graphs: still the eager result.
    sp = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=5, max_tokens=12)
    assert graphed.generate(ps, sp)[2].token_ids == eager.generate(ps, sp)[2].token_ids


@pytest.mark.gpu
def test_async_scheduling_on_cuda_graphs_changes_no_token():
    """Lookahead decode steps on the GPU (queued before the previous ids are read back, their input ids
    copied on the device into the graph's buffer) give exactly the tokens of the plain loop, bf16 too."""
    ps = prompts()
    kw = dict(dtype=torch.bfloat16, device="cuda", max_model_len=128, page_size=16, num_pages=64,
              cuda_graph_batch_sizes=[1, 2, 4, 8])
    on = LLM(str(checkpoint("llama")), async_scheduling=True, **kw)
    off = LLM(str(checkpoint("llama")), async_scheduling=False, **kw)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2)]
    for n in (1, 3, 5):
        a = on.generate(ps[:n], params[:n] if n <= 3 else params + params[:n - 3])
        b = off.generate(ps[:n], params[:n] if n <= 3 else params + params[:n - 3])
        assert [o.token_ids for o in a] == [o.token_ids for o in b]
        assert [o.logprobs for o in a] == [o.logprobs for o in b]
    assert on.engine.lookahead_steps > 20 and off.engine.lookahead_steps == 0
    assert on.engine.runner.graphs.replays > 20


@pytest.mark.gpu
def test_pdl_decode_graphs_change_no_token():
    """Decode graphs captured with programmatic dependent launch: every kernel still waits for the one
    before it, so bf16 tokens and logprobs are bit-identical to graphs without (a race would move them)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90")
    ps = prompts()
    kw = dict(dtype=torch.bfloat16, device="cuda", max_model_len=128, page_size=16, num_pages=64,
              cuda_graph_batch_sizes=[1, 2, 4, 8])
    on = LLM(str(checkpoint("llama")), pdl=True, **kw)
    off = LLM(str(checkpoint("llama")), pdl=False, **kw)
    assert on.engine.runner.graphs.pdl and not off.engine.runner.graphs.pdl
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    for _ in range(3):
        for n in (1, 3, 5):
            a, b = on.generate(ps[:n], params), off.generate(ps[:n], params)
            assert [o.token_ids for o in a] == [o.token_ids for o in b]
            assert [o.logprobs for o in a] == [o.logprobs for o in b]
    assert on.engine.runner.graphs.replays > 3 * 3 * 20  # decode steps ran on the PDL graphs


@pytest.mark.gpu
def test_kv_cache_sized_from_free_memory(tmp_path):
    from warpforge.llm.testing import tiny_checkpoint

    # 64 KiB pages (head_dim 256) and room for 4096 sequences (8 GiB): a 5% budget (7 GB on a 141 GB
    # H200, 4 GB on 80 GB parts), not the cap, decides.
    path = tiny_checkpoint("llama", tmp_path / "wide", head_dim=256)
    util = 0.05
    llm = LLM(str(path), dtype=torch.bfloat16, device="cuda", max_model_len=256, max_num_seqs=4096,
              gpu_memory_utilization=util, enforce_eager=True)
    r = llm.engine.runner
    free, total = torch.cuda.mem_get_info()
    kv_bytes = r.num_pages * r.page_bytes
    assert r.page_bytes == 2 * 2 * 2 * 16 * 256 * 2 and r.num_pages < 2 * 4096 * r.max_pages_per_seq
    assert kv_bytes <= util * total and free >= (1 - util) * total - (256 << 20)
    assert kv_bytes > util * total - (2 << 30)  # weights, context and the profiling step take the rest
    out = llm.generate(prompts()[0], SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: (1 + gamma) norms, sandwich blocks
def test_fused_norm_gives_the_unfused_tokens_and_logprobs_on_cpu(arch):
    """EngineConfig.fused_norm: on CPU the fused call runs rms_norm then linear (the references), so tokens
    and logprobs are bit-identical; the layers really take the fused path (every layer flagged)."""
    ps = prompts()
    kw = dict(dtype=torch.float32, device="cpu", max_model_len=128, page_size=4, num_pages=128)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    on = LLM(str(checkpoint(arch)), fused_norm=True, **kw)
    assert on.engine.config.fused_norm and all(layer.fused_norm for layer in on.engine.model.model.layers)
    a = on.generate(ps[:3], params)
    off = LLM(str(checkpoint(arch)), fused_norm=False, **kw)
    assert not any(layer.fused_norm for layer in off.engine.model.model.layers)
    b = off.generate(ps[:3], params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]


def test_fused_norm_from_the_settings(monkeypatch):
    monkeypatch.setenv("WARPFORGE_FUSED_NORM", "1")
    assert EngineConfig().fused_norm is True
    assert EngineConfig(fused_norm=False).fused_norm is False  # an explicit field wins
    monkeypatch.setenv("WARPFORGE_FUSED_NORM", "0")
    assert EngineConfig().fused_norm is False
    monkeypatch.setenv("WARPFORGE_FUSED_NORM", "late")
    with pytest.raises(ValueError, match="^WARPFORGE_FUSED_NORM: expected"):
        EngineConfig()
    monkeypatch.delenv("WARPFORGE_FUSED_NORM")
    assert EngineConfig().fused_norm is False  # off by default until measured
    with pytest.raises(ValueError, match="^fused_norm: expected a bool"):
        EngineConfig(fused_norm="yes")


@pytest.mark.gpu
def test_fused_norm_decode_graphs_gpu():
    """bf16 on CUDA graphs: the fused norm moves the mean square's fp32 summation order only, so the greedy
    tokens of the tiny model agree with the unfused engine's and the logprobs within bf16 noise."""
    ps = prompts()
    kw = dict(dtype=torch.bfloat16, device="cuda", max_model_len=128, page_size=16, num_pages=64,
              cuda_graph_batch_sizes=[1, 2, 4, 8])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    on = LLM(str(checkpoint("llama")), fused_norm=True, **kw)
    a = on.generate(ps[:3], params)
    assert on.engine.runner.graphs.replays > 20
    del on
    off = LLM(str(checkpoint("llama")), fused_norm=False, **kw)
    b = off.generate(ps[:3], params)
    same = sum(x == y for oa, ob in zip(a, b) for x, y in zip(oa.token_ids, ob.token_ids))
    assert same >= 0.9 * sum(len(o.token_ids) for o in a)  # bf16 near-ties on random weights may part late
    first = [oa.token_ids[:4] == ob.token_ids[:4] for oa, ob in zip(a, b)]
    assert all(first)
