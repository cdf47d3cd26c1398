"""Scheduler + EngineConfig: chunked prefill under the budget, mixed batches, FCFS, max_num_seqs,
preemption by recompute, abort from every state, finish conditions, and a simulated KV cache
that checks every step reads exactly the right tokens (prefix cache, CoW and preemption included)."""

from __future__ import annotations

import random

import pytest

from warpforge.llm.block_manager import BlockManager
from warpforge.llm.engine_config import EngineConfig
from warpforge.llm.sampling import SamplingParams
from warpforge.llm.scheduler import ScheduledBatch, Scheduler
from warpforge.llm.sequence import Sequence, SequenceStatus

from .test_block_manager import check_invariants

EOS = 0
VOCAB = 40


def make(num_pages=64, page_size=4, max_model_len=256, eos=(EOS,), **cfg) -> Scheduler:
    config = EngineConfig(max_model_len=max_model_len, page_size=page_size, num_pages=num_pages, **cfg)
    return Scheduler(config, BlockManager(num_pages, page_size, config.enable_prefix_caching), eos_token_ids=eos)


def seq(n: int, start: int = 1, **params) -> Sequence:
    params.setdefault("max_tokens", 100)
    params.setdefault("ignore_eos", True)
    return Sequence([start + i % (VOCAB - 2) for i in range(n)], SamplingParams(**params))


def next_token(context: list[int]) -> int:
    """A deterministic stand-in for the model: depends on the whole context it reads."""
    return 1 + (sum((i + 1) * t for i, t in enumerate(context)) * 7 + len(context)) % (VOCAB - 1)


class FakeRunner:
    """A KV 'cache' of token ids: writes each computed token at its slot, performs the CoW copies,
    then checks every sampling sequence reads back exactly its own tokens at every position."""

    def __init__(self, sched: Scheduler, token=next_token):
        bm = sched.block_manager
        self.bm, self.ps, self.token = bm, bm.page_size, token
        self.kv = [[None] * bm.page_size for _ in range(bm.num_pages)]

    def run(self, batch: ScheduledBatch) -> list[int]:
        for src, dst in batch.copies:
            self.kv[dst] = list(self.kv[src])
        ids = []
        for s, n in zip(batch.seqs, batch.num_new_tokens):  # store_kv for the whole batch first
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + n):
                page = s.block_table[pos // self.ps]
                assert self.bm.pages[page].ref_count == 1, "write into a shared page"
                self.kv[page][pos % self.ps] = s.token_ids[pos]
        for s, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.sample_mask):
            end = s.num_computed_tokens + n
            context = [self.kv[s.block_table[p // self.ps]][p % self.ps] for p in range(end)]
            assert context == s.token_ids[:end], f"{s}: reads wrong KV"
            if samples:
                ids.append(self.token(context))
        return ids


def drive(sched: Scheduler, seqs=(), max_steps=10_000, token=next_token, check=None,
          runner: FakeRunner | None = None) -> list[ScheduledBatch]:
    for s in seqs:
        sched.add(s)
    runner, batches = runner or FakeRunner(sched, token), []
    while sched.has_unfinished() and len(batches) < max_steps:
        batch = sched.schedule()
        assert batch.num_tokens <= sched.config.max_num_batched_tokens
        assert len(batch.seqs) <= sched.config.max_num_seqs
        sched.postprocess(batch, runner.run(batch))
        check_invariants(sched.block_manager, sched.running)
        if check:
            check(batch)
        batches.append(batch)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_pages == sched.block_manager.num_pages
    return batches


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(next_token(ids))
    return ids[len(prompt):]


# -- EngineConfig -------------------------------------------------------------------------------
def test_engine_config_defaults_and_validation():
    c = EngineConfig()
    assert c.max_num_seqs == 256 and c.max_num_batched_tokens == 8192 and c.page_size == 16
    assert c.cuda_graph_batch_sizes[:6] == [1, 2, 4, 8, 16, 32] and c.cuda_graph_batch_sizes[-1] == 256
    assert EngineConfig(max_num_seqs=1000).cuda_graph_batch_sizes[-1] == 512
    assert EngineConfig(max_num_seqs=20).cuda_graph_batch_sizes == [1, 2, 4, 8, 16, 20]
    assert EngineConfig(cuda_graph_batch_sizes=[8, 1, 8]).cuda_graph_batch_sizes == [1, 8]
    assert EngineConfig().for_model(4096).max_model_len == 4096
    assert EngineConfig(max_model_len=100).for_model(4096).max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=8192).for_model(4096)
    for field, bad in [("max_num_batched_tokens", 0), ("max_num_seqs", 0), ("page_size", 0), ("num_pages", 0),
                       ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5), ("kv_cache_dtype", "int4"),
                       ("max_model_len", 1), ("cuda_graph_batch_sizes", [0]), ("enforce_eager", 1)]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(**{field: bad})
    with pytest.raises(ValueError, match="max_model_len"):
        Scheduler(EngineConfig(), BlockManager(4, 16))


# -- admission errors -----------------------------------------------------------------------------
def test_add_rejects_impossible_requests_by_name():
    sched = make(num_pages=16, page_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="request 'r1'.*empty prompt"):
        sched.add(Sequence([], seq_id="r1"))
    with pytest.raises(ValueError, match="request 'r2'.*max_model_len 32"):
        sched.add(Sequence(list(range(1, 33)), seq_id="r2"))
    sched_small = make(num_pages=2, page_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="request 'r3'.*3 KV pages"):
        sched_small.add(Sequence(list(range(1, 10)), seq_id="r3"))
    ok = Sequence(list(range(1, 32)), seq_id="r4")
    sched.add(ok)  # 31 + 1 = max_model_len: fits
    with pytest.raises(ValueError, match="already queued"):
        sched.add(Sequence([1], seq_id="r4"))
    assert list(sched.waiting) == [ok]


# -- chunking and batching ------------------------------------------------------------------------
def test_long_prompt_is_chunked_and_only_last_chunk_samples():
    sched = make(max_num_batched_tokens=8)
    s = seq(20, max_tokens=3)
    sched.add(s)
    runner = FakeRunner(sched)
    shapes = []
    while sched.has_unfinished():
        b = sched.schedule()
        shapes.append((b.num_new_tokens, b.sample_mask))
        sched.postprocess(b, runner.run(b))
    assert shapes == [([8], [False]), ([8], [False]), ([4], [True]), ([1], [True]), ([1], [True])]
    assert s.output_token_ids == reference_output(s.prompt_token_ids, 3)
    assert s.finish_reason == "length"


def test_decodes_first_then_prefill_chunks_under_the_budget():
    sched = make(max_num_batched_tokens=10)
    a = seq(3)
    sched.add(a)
    runner = FakeRunner(sched)
    sched.postprocess(b := sched.schedule(), runner.run(b))  # a prefilled, now decoding
    b_seq, c_seq = seq(30, start=5), seq(4, start=9)
    sched.add(b_seq)
    sched.add(c_seq)
    batch = sched.schedule()
    assert batch.seqs == [a, b_seq] and batch.num_new_tokens == [1, 9] and batch.sample_mask == [True, False]
    assert not batch.decode_only
    sched.postprocess(batch, runner.run(batch))
    batch = sched.schedule()  # partially prefilled b continues before c is admitted (FCFS)
    assert batch.seqs == [a, b_seq] and batch.num_new_tokens == [1, 9]
    sched.postprocess(batch, runner.run(batch))
    batch = sched.schedule()  # c still waits: the budget is spent on b
    assert batch.seqs == [a, b_seq] and batch.num_new_tokens == [1, 9] and list(sched.waiting) == [c_seq]
    sched.postprocess(batch, runner.run(batch))
    batch = sched.schedule()  # b: 3 left (samples); c: admitted with the rest of the budget
    assert batch.seqs == [a, b_seq, c_seq] and batch.num_new_tokens == [1, 3, 4]
    assert batch.sample_mask == [True, True, True]
    sched.postprocess(batch, runner.run(batch))
    batch = sched.schedule()
    assert batch.decode_only and batch.seqs == [a, b_seq, c_seq]


def test_max_num_seqs_limits_running():
    sched = make(max_num_seqs=2)
    seqs = [seq(5, max_tokens=4), seq(5, start=3, max_tokens=2), seq(5, start=7, max_tokens=2)]
    seen = []
    drive(sched, seqs, check=lambda b: seen.append([s.seq_id for s in b.seqs]))
    assert all(len(ids) <= 2 for ids in seen)
    third = seqs[2].seq_id
    assert third not in seen[0] and any(third in ids for ids in seen)
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params.max_tokens)


def test_budget_smaller_than_running_decodes():
    sched = make(max_num_batched_tokens=2, max_num_seqs=4)
    seqs = [seq(2, start=i + 1, max_tokens=5) for i in range(4)]
    batches = drive(sched, seqs)
    assert max(b.num_tokens for b in batches) == 2
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 5)


# -- finish conditions ----------------------------------------------------------------------------
def scripted(tokens: list[int]):
    it = iter(tokens)
    return lambda context: next(it)


@pytest.mark.parametrize("params,script,want_ids,status,reason,stop_reason", [
    (dict(ignore_eos=False), [5, 6, EOS, 7], [5, 6, EOS], "FINISHED_STOPPED", "stop", None),
    (dict(ignore_eos=True, max_tokens=4), [5, EOS, 6, 7, 8], [5, EOS, 6, 7], "FINISHED_LENGTH", "length", None),
    (dict(stop_token_ids=[9]), [5, 9, 6], [5, 9], "FINISHED_STOPPED", "stop", 9),
    (dict(max_tokens=2), [5, 6, 7], [5, 6], "FINISHED_LENGTH", "length", None),
    (dict(max_tokens=100), [5] * 100, [5] * 6, "FINISHED_LENGTH", "length", None),  # max_model_len 10
])
def test_finish_conditions(params, script, want_ids, status, reason, stop_reason):
    sched = make(max_model_len=10)
    s = seq(4, **params)
    drive(sched, [s], token=scripted(script))
    assert s.output_token_ids == want_ids and s.status.name == status
    assert s.finish_reason == reason and s.stop_reason == stop_reason
    assert s.block_table == [] and sched.get(s.seq_id) is None


def test_stop_string_helper_and_finish():
    sched = make()
    s = seq(3, stop=["END", "\n\n"])
    sched.add(s)
    sched.postprocess(sched.schedule(), [5])
    assert not s.check_stop("Hello EN")
    assert s.check_stop("Hello END and more") and s.output_text == "Hello " and s.stop_reason == "END"
    sched.finish(s)
    assert s.status == SequenceStatus.FINISHED_STOPPED and s.finish_reason == "stop"
    assert not sched.has_unfinished() and sched.block_manager.num_free_pages == 64
    assert not seq(3).check_stop("no stop strings END")


# -- abort ----------------------------------------------------------------------------------------
def test_abort_from_every_state():
    sched = make(max_num_batched_tokens=8, max_num_seqs=3)
    waiting_only = make(max_num_seqs=1)
    w = seq(3)
    waiting_only.add(seq(3))
    waiting_only.add(w)
    waiting_only.schedule()
    assert waiting_only.abort(w.seq_id) is w and w.status == SequenceStatus.FINISHED_ABORTED
    assert len(waiting_only.waiting) == 0 and w.finish_reason == "abort"

    decoding, prefilling = seq(3, max_tokens=50), seq(30, start=4)
    sched.add(decoding)
    runner = FakeRunner(sched)
    sched.postprocess(b := sched.schedule(), runner.run(b))
    sched.add(prefilling)
    sched.postprocess(b := sched.schedule(), runner.run(b))
    assert prefilling.status == SequenceStatus.RUNNING and 0 < prefilling.num_computed_tokens < 30
    free = sched.block_manager.num_free_pages
    assert sched.abort(prefilling.seq_id) is prefilling
    assert sched.block_manager.num_free_pages == free + 8  # freed at once
    b = sched.schedule()
    ids = runner.run(b)
    assert sched.abort(decoding.seq_id) is decoding  # after the runner, before postprocess()
    assert sched.postprocess(b, ids) == [] and decoding.num_output_tokens == 2  # the last token dropped
    assert sched.abort(decoding.seq_id) is None and sched.abort("nope") is None
    assert not sched.has_unfinished() and sched.block_manager.num_free_pages == 64
    check_invariants(sched.block_manager, [])


# -- preemption -----------------------------------------------------------------------------------
def test_preemption_by_recompute_keeps_outputs_exact():
    sched = make(num_pages=10, page_size=2, max_num_seqs=4)  # all three admitted, one page to spare
    seqs = [seq(5, start=1 + 3 * i, max_tokens=8) for i in range(3)]
    events = []

    def check(batch):
        if batch.preempted:
            events.append([s.seq_id for s in batch.preempted])
            assert all(s.status == SequenceStatus.WAITING and s.block_table == [] for s in batch.preempted)
            assert sched.waiting[0] is batch.preempted[-1]
            # no admission in a step that preempted
            assert all(s.num_computed_tokens > 0 or s.num_cached_tokens > 0 for s in batch.seqs)

    drive(sched, seqs, check=check)
    assert events, "the pool was meant to run out"
    assert events[0] == [seqs[2].seq_id]  # the newest running sequence goes first
    assert sum(s.num_preemptions for s in seqs) >= 1
    for s in seqs:
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 8)


def test_lone_sequence_out_of_pages_finishes_with_length():
    sched = make(num_pages=2, page_size=2, max_model_len=64)
    s = seq(3, max_tokens=50)
    batches = drive(sched, [s])
    assert s.status == SequenceStatus.FINISHED_LENGTH and s.num_tokens == 5
    assert batches[-1].finished == [s]


# -- prefix caching through the scheduler ---------------------------------------------------------
def test_repeated_prompt_hits_prefix_cache_with_copy_on_write():
    sched = make(page_size=4)
    a = seq(8, max_tokens=6)
    sched.add(a)
    runner = FakeRunner(sched)
    sched.postprocess(b := sched.schedule(), runner.run(b))
    b_seq = Sequence(list(a.prompt_token_ids), SamplingParams(max_tokens=6, ignore_eos=True))
    sched.add(b_seq)
    batch = sched.schedule()
    assert b_seq.num_cached_tokens == 7 and batch.num_new_tokens == [1, 1]
    assert batch.copies == [(a.block_table[1], b_seq.block_table[1])]
    sched.postprocess(batch, runner.run(batch))
    drive(sched, runner=runner)
    assert b_seq.output_token_ids == a.output_token_ids == reference_output(a.prompt_token_ids, 6)


def test_random_workload_matches_reference():
    """Arrivals, shared prefixes, chunking, preemption and aborts over a tight pool."""
    rng = random.Random(1)
    for caching in (True, False):
        sched = make(num_pages=14, page_size=3, max_model_len=40, max_num_batched_tokens=7, max_num_seqs=5,
                     enable_prefix_caching=caching)
        system = [rng.randrange(1, VOCAB) for _ in range(7)]
        # Repeated tails make whole prompts repeat: 7 + 2 tokens fill 3 pages (full hits, CoW).
        tails = [[rng.randrange(1, VOCAB) for _ in range(n)] for n in (0, 2, 2, 5, 8)]
        pending = [Sequence(system + (rng.choice(tails) if rng.random() < 0.6 else
                                      [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 9))]),
                            SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True)) for _ in range(25)]
        everything, aborted = list(pending), set()
        runner = FakeRunner(sched)
        preemptions = copies = 0
        while pending or sched.has_unfinished():
            for _ in range(rng.randrange(0, 3)):
                if pending:
                    sched.add(pending.pop(0))
            if rng.random() < 0.05 and sched.running:
                aborted.add(sched.abort(rng.choice(sched.running).seq_id).seq_id)
            batch = sched.schedule()
            preemptions += len(batch.preempted)
            copies += len(batch.copies)
            sched.postprocess(batch, runner.run(batch))
            check_invariants(sched.block_manager, sched.running)
        assert preemptions > 0
        for s in everything:
            if s.seq_id not in aborted:
                assert s.finish_reason == "length"
                assert s.output_token_ids == reference_output(s.prompt_token_ids, s.params.max_tokens)
        assert sched.block_manager.num_free_pages == 14
        if caching:
            assert sched.block_manager.prefix_hit_tokens > 0 and copies > 0
