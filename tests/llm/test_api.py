"""The public API: every exported name, a cheap import, and AsyncLLM's per-request streams (deltas that
add up to the final answer, a bad request failing in its own stream, aborts freeing pages)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import pytest

from .engine_helpers import hf_greedy, loaded, one_thread, prompts  # noqa: F401


def test_exports_resolve():
    import warpforge.llm as llm

    assert set(llm.__all__) >= {"LLM", "LLMEngine", "AsyncLLM", "SamplingParams", "EngineConfig", "RequestOutput",
                                "load"}
    for name in llm.__all__:
        assert getattr(llm, name) is not None, name
    with pytest.raises(AttributeError):
        llm.not_a_name  # noqa: B018


def test_import_is_cheap():
    code = ("import sys, warpforge.llm; heavy = [m for m in ('torch', 'transformers', 'tokenizers', 'safetensors', "
            "'gguf', 'warpforge.llm.engine') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def make_async():
    pytest.importorskip("transformers")
    from warpforge.llm import AsyncLLM, EngineConfig, LLMEngine

    return AsyncLLM(LLMEngine(loaded("llama"), EngineConfig(max_model_len=128, page_size=4, num_pages=128)))


async def collect(llm, prompt, params, rid):
    return [out async for out in llm.generate(prompt, params, rid)]


def check_stream(outs):
    """Deltas concatenate to the final text and ids; only the last output is finished."""
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.delta_text for o in outs) == outs[-1].text
    assert [t for o in outs for t in o.delta_token_ids] == outs[-1].token_ids


def test_async_streams_concurrent_requests():
    from warpforge.llm import SamplingParams

    llm = make_async()
    ps = prompts()
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    async def bad():
        with pytest.raises(ValueError, match="empty prompt"):
            await collect(llm, "", greedy, "bad")
        return "raised"

    async def main():
        results = await asyncio.gather(
            collect(llm, ps[0], greedy, "a"), collect(llm, ps[2], greedy, "b"), bad(),
            collect(llm, "To be, or not to be", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), "c"),
            collect(llm, ps[1], SamplingParams(temperature=0.9, seed=3, max_tokens=5), "d"))
        await llm.shutdown()
        return results

    a, b, flag, c, d = asyncio.run(main())
    assert flag == "raised"
    for outs in (a, b, c, d):
        check_stream(outs)
    assert len(a) > 1 and a[-1].token_ids == hf_greedy("llama", ps[0], 64)[:12]
    assert b[-1].token_ids == hf_greedy("llama", ps[2], 64)[:12]
    assert [o.request_id for o in d] == ["d"] * len(d) and len(d[-1].token_ids) == 5
    assert not llm.has_unfinished()
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_async_stop_string_never_leaks_into_the_stream():
    from warpforge.llm import SamplingParams

    llm = make_async()
    prompt = "Who's there? Nay, answer me"
    full = asyncio.run(collect(llm, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), "x"))
    text = full[-1].text
    start = next(i for i in range(4, len(text) - 4) if text[i:i + 4].isprintable() and text.find(text[i:i + 4]) == i)
    stop = text[start:start + 4]
    outs = asyncio.run(collect(llm, prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                           stop=[stop]), "y"))
    check_stream(outs)
    assert outs[-1].text == text[:start] and outs[-1].finish_reason == "stop"
    assert all(stop not in "".join(o.delta_text for o in outs[:i + 1]) for i in range(len(outs)))


def test_async_abort_on_disconnect_frees_pages():
    from warpforge.llm import SamplingParams

    llm = make_async()
    bm = llm.engine.block_manager
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def leave_early():
        # A client that stops reading: closing the stream aborts the request.
        async with contextlib.aclosing(llm.generate(prompts()[0], long, "leaver")) as stream:
            async for out in stream:
                if len(out.token_ids) >= 3:
                    return out

    async def cancelled():
        # A server task cancelled on disconnect: the CancelledError inside the stream aborts it.
        seen = asyncio.Event()

        async def consume():
            async for _ in llm.generate(prompts()[1], long, "cancelled"):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def aborted_by_server():
        # The server aborts a live request: its stream ends with a finish_reason "abort" output.
        outs = []
        async for out in llm.generate(prompts()[3], long, "ext"):
            outs.append(out)
            if len(outs) == 2:
                llm.abort("ext")
        return outs

    async def main():
        out = await leave_early()
        await cancelled()
        ext = await aborted_by_server()
        check_stream(ext)
        assert ext[-1].finish_reason == "abort" and len(ext[-1].token_ids) < 10
        # The aborts were applied at the first step boundary: by the time a 4-token request is done,
        # the two ~95-token requests must be gone (not merely finished on their own later).
        others = await collect(llm, prompts()[2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), "z")
        state = (dict(llm.engine.requests), llm.has_unfinished(), bm.num_free_pages)
        await llm.shutdown()
        return out, others, state

    out, others, (requests, unfinished, free) = asyncio.run(main())
    assert not out.finished and len(others[-1].token_ids) == 4
    assert not requests and not unfinished and free == bm.num_pages


def test_async_failed_step_fails_every_stream_and_later_calls():
    from warpforge.llm import SamplingParams

    llm = make_async()
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    step, calls = llm.engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("device lost")
        return step()

    llm.engine.step = failing_step

    async def main():
        results = await asyncio.gather(collect(llm, prompts()[0], params, "a"), collect(llm, prompts()[2], params, "b"),
                                       return_exceptions=True)
        with pytest.raises(RuntimeError, match="failed earlier"):
            await collect(llm, prompts()[1], params, "c")
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "device lost" in str(r) for r in results)
