"""A server with limits: --api-key (401 everywhere but /health, the key never logged), --max-num-seqs 2
--max-queue 2 (a burst gets 429 + Retry-After, then the server serves normally), --chat-template
(replaces a checkpoint that has none)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import httpx
import pytest

KEY = "sekrit-key-4f9a"
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


@pytest.fixture(scope="module")
def limited(start_server, tiny_model, tmp_path_factory):
    """The tiny checkpoint without a chat template, served with a template file, a key and a small queue."""
    root = tmp_path_factory.mktemp("no-template")
    ckpt = shutil.copytree(tiny_model, root / "llama")
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg))
    (root / "template.jinja").write_text(TEMPLATE)
    with start_server("--api-key", KEY, "--max-num-seqs", "2", "--max-queue", "2", "--chat-template",
                      root / "template.jinja", model=ckpt) as s:
        yield s


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                                         ("GET", "/v1/unknown"), ("GET", "/v1/models/x"), ("POST", "/tokenize"),
                                         ("POST", "/detokenize"), ("GET", "/version")])
def test_every_endpoint_but_health_wants_the_key(limited, method, path):
    body = {"model": limited.model, "prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                    {"Authorization": f"Bearer {KEY}x"}):
        r = httpx.request(method, limited.root + path, json=body if method == "POST" else None, headers=headers,
                          timeout=10)
        assert r.status_code == 401, (headers, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and KEY not in r.text
    assert httpx.get(limited.root + "/health", timeout=10).status_code == 200


def test_the_right_key_works_and_is_never_logged(limited):
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=limited.base_url, api_key="wrong", max_retries=0).models.list()
    assert limited.client().models.list().data[0].id == limited.model
    lower = httpx.get(limited.base_url + "/models", headers={"Authorization": f"bearer {KEY}"}, timeout=10)
    assert lower.status_code == 200  # the scheme is case-insensitive (RFC 7235)
    assert httpx.get(limited.root + "/metrics", headers=limited.headers, timeout=10).status_code == 200
    assert KEY not in limited.output()


def test_metrics_without_auth_opens_metrics_alone(start_server):
    with start_server("--api-key", KEY, "--metrics-without-auth") as s:
        assert httpx.get(s.root + "/metrics", timeout=10).status_code == 200  # a scraper without the key
        for method, path in [("GET", "/v1/models"), ("POST", "/tokenize"), ("GET", "/version")]:
            assert httpx.request(method, s.root + path, json={"prompt": "x"}, timeout=10).status_code == 401, path
        assert httpx.post(s.root + "/tokenize", json={"prompt": "x"}, headers=s.headers, timeout=10).status_code == 200


def test_chat_template_flag_replaces_the_missing_template(limited):
    from warpforge.llm.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "Who's there?"}]
    r = limited.client().chat.completions.create(model=limited.model, messages=messages, max_tokens=2)
    rendered = "[user] Who's there?\n[assistant] "
    tok = Tokenizer.from_dir(limited.checkpoint)
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))


def test_a_burst_beyond_the_queue_gets_429_then_the_server_recovers(limited):
    body = {"model": limited.model, "prompt": "To be, or not to be", "max_tokens": 60, "ignore_eos": True,
            "stream": True}
    waiting_seen = []

    async def one(client: httpx.AsyncClient):
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, dict(r.headers), json.loads(await r.aread())
            lines = [line async for line in r.aiter_lines() if line]
            return 200, None, lines

    async def watch(client: httpx.AsyncClient, stop: asyncio.Event):
        while not stop.is_set():
            text = (await client.get("/metrics")).text
            waiting_seen.append(float(next(line.split()[-1] for line in text.splitlines()
                                           if line.startswith("warpforge_num_requests_waiting "))))
            await asyncio.sleep(0.02)

    async def main():
        async with httpx.AsyncClient(base_url=limited.root, headers=limited.headers, timeout=60,
                                     limits=httpx.Limits(max_connections=32)) as client:
            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(client, stop))
            results = await asyncio.gather(*(one(client) for _ in range(12)))
            stop.set()
            await watcher
            return results

    results = asyncio.run(main())
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 429]
    assert len(ok) + len(refused) == 12 and len(ok) >= 4 and refused  # 2 running + 2 waiting admitted at once
    for _, headers, body_ in refused:
        assert headers["retry-after"] == "1" and body_["error"]["code"] == "queue_full"
        assert body_["error"]["type"] == "rate_limit_error"
    for _, _, lines in ok:
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
    assert max(waiting_seen) >= 1  # requests did queue behind the two running ones

    # the burst has passed: the server serves normally and holds nothing
    r = limited.client().completions.create(model=limited.model, prompt="To be", max_tokens=3)
    assert r.usage.completion_tokens == 3
    deadline = time.monotonic() + 10
    while limited.metrics()["warpforge_kv_cache_usage_perc"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    m = limited.metrics()
    assert m["warpforge_kv_cache_usage_perc"] == 0 and m["warpforge_num_requests_running"] == 0
    assert m['warpforge_requests_total{endpoint="/v1/completions",outcome="rejected"}'] == len(refused)


def test_more_choices_than_the_server_admits_is_400(limited):
    r = httpx.post(limited.base_url + "/completions", headers=limited.headers, timeout=10,
                   json={"model": limited.model, "prompt": "x", "n": 5, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
