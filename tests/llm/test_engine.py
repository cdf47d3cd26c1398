"""LLM/LLMEngine against HF transformers: greedy tokens identical for every tiny architecture, also
with prefix-cache hits (and copy-on-write), forced preemption and chunked prefill; then stop strings
and stop ids, lengths, seeds, logprobs, abort, bad requests and chat."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from warpforge.llm.engine import LLM, LLMEngine  # noqa: E402
from warpforge.llm.engine_config import EngineConfig  # noqa: E402
from warpforge.llm.sampling import SamplingParams  # noqa: E402

from .engine_helpers import ARCHS, hf_greedy, loaded, one_thread, prompts  # noqa: E402,F401

N = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)


def make_llm(arch: str = "llama", **kw) -> LLM:
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 256)
    return LLM(loaded(arch), max_model_len=128, **kw)


def spy(llm: LLM) -> dict:
    """Count what the scheduler did: preemptions, CoW copies, steps mixing prefill chunks and decodes."""
    stats = {"preempted": 0, "copies": 0, "mixed": 0, "chunked": 0}
    sched = llm.engine.scheduler
    schedule = sched.schedule

    def counting():
        b = schedule()
        stats["preempted"] += len(b.preempted)
        stats["copies"] += len(b.copies)
        stats["mixed"] += 1 in b.num_new_tokens and any(n > 1 for n in b.num_new_tokens)
        stats["chunked"] += any(s.num_computed_tokens + n < s.num_tokens for s, n in zip(b.seqs, b.num_new_tokens))
        return b

    sched.schedule = counting
    return stats


@pytest.mark.parametrize("variant", ["plain", "prefix_cache", "preemption", "chunked_prefill"])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_hf(arch, variant):
    ps = prompts()
    kw = {"enable_prefix_caching": variant == "prefix_cache"}
    if variant == "preemption":
        kw["num_pages"] = 40  # 5 sequences of up to 27 pages each: the newest get preempted and recomputed
    if variant == "chunked_prefill":
        kw["max_num_batched_tokens"] = 8  # 43-token prompts prefill over 6+ steps, beside other decodes
    llm = make_llm(arch, **kw)
    stats = spy(llm)
    if variant == "prefix_cache":
        llm.generate([ps[0]], GREEDY)  # its 10 full pages enter the cache
        ps = ps + [ps[0][:40]]  # fully cached, page-aligned: the last page is shared, then copied on write
        hits_before = llm.engine.block_manager.prefix_hit_tokens
    outs = llm.generate(ps, GREEDY)
    for p, out in zip(ps, outs):
        assert out.finish_reason == "length" and out.prompt_token_ids == p
        assert out.token_ids == hf_greedy(arch, p, N), f"prompt of {len(p)} tokens"
    if variant == "prefix_cache":
        assert llm.engine.block_manager.prefix_hit_tokens - hits_before >= 4 * 39
        assert stats["copies"] >= 1
    if variant == "preemption":
        assert stats["preempted"] > 0
    if variant == "chunked_prefill":
        assert stats["mixed"] > 0 and stats["chunked"] > 0
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages and not llm.engine.requests


def greedy_text(llm: LLM, prompt: str, n: int = 24):
    return llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[0]


def test_stop_strings_and_stop_ids():
    llm = make_llm()
    prompt = "To be, or not to be, that is the question"
    ref = greedy_text(llm, prompt)
    text = ref.text
    # A stop string of three printable chars that first occurs a few chars in (it may span tokens).
    start = next(i for i in range(3, len(text) - 3) if text[i:i + 3].isprintable() and text.find(text[i:i + 3]) == i)
    stop = text[start:start + 3]
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert out.text == text[:start] and out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[:len(out.token_ids)] and len(out.token_ids) < 24
    stop_id = ref.token_ids[10]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id])
    out = llm.generate(prompt, params)[0]
    assert out.token_ids == ref.token_ids[:ref.token_ids.index(stop_id) + 1] and out.finish_reason == "stop"


def test_eos_ends_the_output_unless_ignored():
    llm = make_llm("qwen2")
    p = prompts()[1]
    ref = hf_greedy("qwen2", p, N)
    eos = llm.engine.model_config.eos_token_ids[0]
    assert eos in ref[:10]  # this tiny model's greedy output reaches EOS early (found once, fixed by the seed)
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=N))[0]
    assert out.token_ids == ref[:ref.index(eos) + 1] and out.finish_reason == "stop"
    assert out.text == llm.tokenizer.decode(out.token_ids)  # the EOS token is not in the text


def test_length_limits():
    llm = make_llm()
    out = llm.generate([7] * 10, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=True)[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    out = llm.generate([7] * 120, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"  # max_model_len 128


def test_seed_reproduces_regardless_of_batch():
    llm = make_llm()
    p = prompts()[2]
    seeded = SamplingParams(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
    alone = llm.generate(p, seeded)[0].token_ids
    mixed = llm.generate([prompts()[0], p, prompts()[1]],
                         [SamplingParams(temperature=1.0, max_tokens=16), seeded, SamplingParams(temperature=0.8)])
    assert mixed[1].token_ids == alone
    other = llm.generate(p, SamplingParams(temperature=1.0, max_tokens=16, seed=8, ignore_eos=True))[0].token_ids
    assert other != alone


def test_logprobs_and_metrics():
    llm = make_llm()
    out = llm.generate(prompts()[2], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True))[0]
    assert len(out.logprobs) == 6
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and len(lp) == 3  # greedy: the chosen token is the top-1
        assert lp[tok] == pytest.approx(max(lp.values())) and lp[tok] <= 0
    m = out.metrics
    assert m.num_prompt_tokens == 7 and m.num_output_tokens == 6
    assert 0 < m.ttft <= m.e2e and m.decode_tokens_per_s > 0
    assert llm.generate(prompts()[2], SamplingParams(max_tokens=2))[0].logprobs is None


def test_abort_frees_pages_at_once():
    engine = LLMEngine(loaded("llama"), EngineConfig(max_model_len=128, page_size=4, num_pages=64))
    bm = engine.block_manager
    ids = [engine.add_request(p, GREEDY) for p in prompts()[:3]]
    engine.step()
    engine.step()
    assert bm.num_free_pages < bm.num_pages
    out = engine.abort(ids[1])
    assert out.finish_reason == "abort" and out.request_id == ids[1] and engine.abort(ids[1]) is None
    for rid in (ids[0], ids[2]):
        engine.abort(rid)
    assert bm.num_free_pages == bm.num_pages and not engine.has_unfinished()


def test_bad_request_fails_alone():
    llm = make_llm()
    p0, p2 = prompts()[0], prompts()[2]
    outs = llm.generate([p0, "", [3] * 200, [99999], p2],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "error", "error", "error", "length"]
    assert "empty prompt" in outs[1].error and "max_model_len" in outs[2].error and "[0, 512)" in outs[3].error
    assert outs[0].token_ids == hf_greedy("llama", p0, N)[:8] and outs[4].token_ids == hf_greedy("llama", p2, N)[:8]
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate("", GREEDY)
    with pytest.raises(ValueError, match="expected one per prompt"):
        llm.generate([p0, p2], [GREEDY])
    # On the engine: a bad request mid-run raises at add_request and the running ones carry on.
    engine = llm.engine
    rid = engine.add_request(p2, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="params"):
        engine.add_request(p0, {"temperature": 0})
    with pytest.raises(ValueError, match="still running"):
        engine.add_request(p0, request_id=rid)
    done = [o for _ in range(10) for o in engine.step() if o.finished]
    assert [o.token_ids for o in done] == [outs[4].token_ids]


def test_chat_uses_the_template_once():
    llm = make_llm()
    messages = [{"role": "user", "content": "Who's there?"}]
    out = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids.count(llm.tokenizer.bos_token_id) == 1 and len(out.token_ids) == 4
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "Nay"}]], SamplingParams(max_tokens=2))
    assert len(two) == 2 and two[0].prompt_token_ids == out.prompt_token_ids


def test_async_scheduling_gives_the_same_tokens_and_stops_as_the_plain_loop():
    """Lookahead steps (queued before the previous step's ids are read) change nothing a user sees:
    greedy and seeded tokens, EOS, stop ids and strings, length limits, more requests than slots
    (admissions between decode runs), a penalty row (no lookahead while it runs), aborts."""
    eos_prompt = prompts()[1]  # qwen2's greedy output reaches EOS early (test_eos_ends_...)
    ref_ids = hf_greedy("qwen2", prompts()[0], 24)

    def run(async_scheduling: bool):
        llm = make_llm("qwen2", async_scheduling=async_scheduling, max_num_seqs=4)
        ps = prompts()
        params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=N),  # stops at EOS
                  SamplingParams(temperature=1.0, max_tokens=20, seed=3, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, stop_token_ids=[ref_ids[5]]),
                  SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                  SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3)]
        prompts_ = [ps[0], eos_prompt, ps[2], ps[0], ps[4], ps[3]]
        outs = llm.generate(prompts_, params)
        return llm, [(o.token_ids, o.finish_reason) for o in outs]

    llm_plain, plain = run(False)
    llm_async, got = run(True)
    assert got == plain
    assert plain[0][0] == ref_ids and plain[1][1] == "stop" and plain[3][1] == "stop" and plain[4][1] == "length"
    assert llm_plain.engine.lookahead_steps == 0 and llm_async.engine.lookahead_steps > 0
    bm = llm_async.engine.block_manager
    assert not llm_async.engine.has_unfinished() and bm.num_free_pages == bm.num_pages
    assert all(-1 not in ids for ids, _ in got)  # no placeholder ever leaks out


def test_abort_during_a_lookahead_step():
    engine = LLMEngine(loaded("llama"), EngineConfig(max_model_len=128, page_size=4, num_pages=64))
    ids = [engine.add_request(p, GREEDY) for p in prompts()[:2]]
    for _ in range(4):
        engine.step()
    assert engine._ahead is not None  # a decode step is queued ahead
    engine.abort(ids[0])
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (done,) = [o for o in outs if o.finished]
    assert done.request_id == ids[1] and len(done.token_ids) == N and -1 not in done.token_ids
    assert done.token_ids == hf_greedy("llama", prompts()[1], N)
    assert engine.lookahead_steps >= N - 8  # steady decoding runs ahead nearly every step
    bm = engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_a_failed_lookahead_launch_leaves_no_placeholder():
    engine = LLMEngine(loaded("llama"), EngineConfig(max_model_len=128, page_size=4, num_pages=64))
    rid = engine.add_request(prompts()[0], GREEDY)
    engine.step()  # the prefill
    launch = engine.runner.launch

    def failing(batch, ids_from=None):
        if batch.lookahead:
            raise RuntimeError("device lost")
        return launch(batch, ids_from)

    engine.runner.launch = failing
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    seq = engine.scheduler.get(rid)
    assert not seq.pending_token and -1 not in seq.token_ids and engine._ahead is None
