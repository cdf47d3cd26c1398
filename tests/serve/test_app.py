"""The app in-process (httpx's ASGI transport, no sockets) where a real server cannot easily get into the
state: a model without a chat template, an engine whose step fails; plus ServeConfig's checks and the
command's bad-usage errors."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket

import httpx
import pytest
from click.testing import CliRunner

from warpforge.serve.config import ServeConfig


@pytest.fixture(scope="module")
def engine_parts(tiny_model):
    import torch

    from warpforge.llm.loader import load

    torch.set_num_threads(1)
    return load(tiny_model, dtype=torch.float32, device="cpu")


def make_llm(engine_parts):
    from warpforge.llm import AsyncLLM, EngineConfig, LLMEngine

    return AsyncLLM(LLMEngine(engine_parts, EngineConfig(max_model_len=128, num_pages=64, page_size=4)))


def run_app(llm, config: ServeConfig, requests) -> list[httpx.Response]:
    """Send ``requests`` [(method, path, json)] in order to a fresh app over ``llm``; -> the responses."""
    from warpforge.serve.app import create_app

    async def main():
        app = create_app(llm, config)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as client:
            out = [await client.request(method, path, json=body) for method, path, body in requests]
        await llm.shutdown()
        return out

    return asyncio.run(main())


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "To be", "max_tokens": 2}


def test_chat_without_a_template_is_a_clear_400(engine_parts):
    llm = make_llm(engine_parts)
    saved = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = None
    try:
        chat, completion = run_app(llm, ServeConfig(served_model_name="tiny"),
                                   [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", COMPLETION)])
    finally:
        llm.tokenizer.chat_template = saved
        llm.tokenizer.__dict__.pop("_template", None)
    err = chat.json()["error"]
    assert chat.status_code == 400 and err["code"] == "no_chat_template" and "--chat-template" in err["message"]
    assert completion.status_code == 200  # completions need no template


def test_a_failed_engine_answers_500_then_health_503(engine_parts):
    llm = make_llm(engine_parts)

    def broken_step():
        raise RuntimeError("device lost")

    llm.engine.step = broken_step
    first, health, after, models = run_app(llm, ServeConfig(served_model_name="tiny"), [
        ("POST", "/v1/completions", COMPLETION), ("GET", "/health", None), ("POST", "/v1/chat/completions", CHAT),
        ("GET", "/v1/models", None)])
    assert first.status_code == 500 and first.json()["error"]["code"] == "engine_failed"
    assert "device lost" in first.json()["error"]["message"]
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_failed"
    assert after.status_code == 503 and models.status_code == 200


def test_each_app_has_its_own_metrics(engine_parts):
    from warpforge.serve.app import create_app

    llm = make_llm(engine_parts)
    a, b = create_app(llm, ServeConfig(served_model_name="a")), create_app(llm, ServeConfig(served_model_name="b"))
    a.state.server.metrics.requests.labels("/health", "ok").inc()
    assert b'endpoint="/health",outcome="ok"} 1.0' in a.state.server.metrics.render()
    assert b'endpoint="/health"' not in b.state.server.metrics.render()


def test_tallied_chunks_read_as_if_each_updated_the_series():
    """ServerMetrics.chunk tallies tokens and gaps; a scrape folds them in: the exposition equals one observe /
    inc per chunk (bucket edges included), and a scrape between chunks sees every chunk before it."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from warpforge.serve.engine_client import LocalEngine
    from warpforge.serve.metrics import _LATENCY, ServerMetrics

    class Idle(LocalEngine):
        def __init__(self) -> None:
            pass

        def stats(self) -> tuple:
            return (0, 0, 0.0, 0, 0, 0, None)

    gaps = [0.001, 0.0025, 0.0, 0.07, 80.0, 200.0, 0.00999, 0.01, *[0.0001 * k for k in range(1, 300)]]
    m = ServerMetrics(Idle())
    r = CollectorRegistry()
    itl = Histogram("warpforge_inter_token_latency_seconds", "x", buckets=_LATENCY, registry=r)
    tokens = Counter("warpforge_generation_tokens", "x", registry=r)

    def series(text: str, name: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith(name) and "_created" not in line]

    m.chunk(3, None)
    tokens.inc(3)
    for k, g in enumerate(gaps):
        m.chunk(k % 3 + 1, g)
        itl.observe(g)
        tokens.inc(k % 3 + 1)
        if k in (5, len(gaps) - 1):  # a scrape mid-way and at the end
            ours, theirs = m.render().decode(), generate_latest(r).decode()
            for name in ("warpforge_inter_token_latency_seconds", "warpforge_generation_tokens_total"):
                assert series(ours, name) == series(theirs, name) != []


def test_preemptions_reach_the_counter(engine_parts):
    """Too few KV pages for the batch: the scheduler preempts, and /metrics counts it."""
    from warpforge.llm import AsyncLLM, EngineConfig, LLMEngine, SamplingParams
    from warpforge.serve.metrics import ServerMetrics

    # 12 pages of 4 tokens for 4 sequences that grow to 20 tokens each
    engine = LLMEngine(engine_parts, EngineConfig(max_model_len=40, num_pages=12, page_size=4))
    for _ in range(4):
        engine.add_request([5, 6, 7, 8, 9, 10], SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [len(o.token_ids) for o in done] == [14] * 4
    text = ServerMetrics(AsyncLLM(engine)).render().decode()
    count = float(next(line.split()[-1] for line in text.splitlines()
                       if line.startswith("warpforge_num_preemptions_total")))
    assert count == engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kw,says", [
    (dict(model=""), "model"), (dict(port=70000), "port"), (dict(max_queue=-1), "max_queue"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(dtype="fp4"), "dtype"),
    (dict(kv_cache_dtype="int4"), "kv_cache_dtype"), (dict(api_key=""), "api_key"),
    (dict(shutdown_grace_s=-1), "shutdown_grace_s"), (dict(max_model_len=1), "max_model_len"),
    (dict(served_model_name=" "), "served_model_name"), (dict(chat_template=""), "chat_template"),
])
def test_serve_config_names_the_bad_setting(kw, says):
    with pytest.raises(ValueError, match=f"^{says}: "):
        ServeConfig(**{"model": "m", **kw})


def test_serve_config_never_shows_the_key():
    c = ServeConfig(model="m", api_key="hunter2")
    assert "hunter2" not in repr(c) and c.model_name == "m" and c.max_in_flight == 256 + 1024


def test_cli_bad_usage_is_one_line_and_exit_2(tiny_model, tmp_path):
    from warpforge.cli import main

    def run(*args):
        out = CliRunner().invoke(main, ["serve", *args])
        assert out.exit_code == 2, out.output
        lines = [line for line in out.output.splitlines() if line.strip()]
        assert "Traceback" not in out.output
        return lines[-1]

    assert "no such file or directory" in run(str(tmp_path / "missing"))
    assert "--chat-template" in run(str(tiny_model), "--chat-template", str(tmp_path / "nope.jinja"))
    assert "port" in run(str(tiny_model), "--port", "70000").lower()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"port {port} is in use on 127.0.0.1" in run(str(tiny_model), "--port", str(port))
    broken = shutil.copytree(tiny_model, tmp_path / "broken")
    (broken / "config.json").write_text(json.dumps({"model_type": "nonsense"}))
    run(str(broken))  # a checkpoint the loader refuses: one line, exit 2


def test_constraint_checks_are_cached_and_bounded(engine_parts, monkeypatch):
    """Each distinct constraint compiles once (good or bad: a bad one is the same 400 again, naming the field
    that asked); the cache keeps the last GRAMMAR_CACHE outcomes."""
    pytest.importorskip("xgrammar")
    from warpforge.llm.structured import StructuredOutputsParams
    from warpforge.serve import app as app_module
    from warpforge.serve.protocol import APIError

    monkeypatch.setattr(app_module, "GRAMMAR_CACHE", 3)
    llm = make_llm(engine_parts)
    state = app_module.ServerState(llm, ServeConfig(served_model_name="tiny"))
    compiled = []
    real = llm.engine.grammars.compile
    monkeypatch.setattr(llm.engine.grammars, "compile", lambda so: (compiled.append(so), real(so))[1])

    async def main():
        bad = StructuredOutputsParams(regex="(unclosed")
        for _ in range(2):
            with pytest.raises(APIError) as e:
                await state.check_constraint(bad, "guided_regex")
            assert e.value.status == 400 and e.value.param == "guided_regex"
            assert e.value.message.startswith("guided_regex: not a usable regex")
        for n in range(4):
            await state.check_constraint(StructuredOutputsParams(choice=[f"yes{n}", "no"]), "guided_choice")
        await state.check_constraint(StructuredOutputsParams(choice=["yes3", "no"]), "guided_choice")
        await llm.shutdown()

    asyncio.run(main())
    state.close()
    assert len(compiled) == 5  # the bad regex once, four choices once each; the repeats came from the cache
    assert len(state._grammar_seen) == 3 and not state._grammar_running
