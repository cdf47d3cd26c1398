"""Many clients at once: 64 concurrent streams with a quarter leaving early, and a non-streamed request whose
client goes away. Every remaining stream completes; every abandoned request is aborted (its KV pages
freed); the gauges return to zero."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from .test_openai_api import PROMPTS

N_CLIENTS = 64
MAX_TOKENS = 24


def _counter(metrics: dict, name: str, **labels) -> float:
    key = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    return metrics.get(key, 0.0)


def wait_idle(server, timeout: float = 15.0) -> dict:
    """/metrics once nothing runs, waits or holds KV pages (fails after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (m["warpforge_num_requests_running"] == 0 and m["warpforge_num_requests_waiting"] == 0
                and m["warpforge_kv_cache_usage_perc"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_64_streams_with_a_quarter_disconnecting(server):
    before = server.metrics()
    client = server.async_client(timeout=120)

    async def stay(i: int):
        stream = await client.completions.create(model=server.model, prompt=PROMPTS[i % 3] + f" {i}",
                                                 max_tokens=MAX_TOKENS, temperature=0.8, seed=i, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = [ch async for ch in stream]
        return "stayed", [ch.choices[0].finish_reason for ch in chunks if ch.choices], chunks[-1].usage

    async def leave(i: int):
        stream = await client.completions.create(model=server.model, prompt=PROMPTS[i % 3], max_tokens=200,
                                                 stream=True, extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()  # drops the connection mid-stream
        return "left", seen, None

    async def main():
        try:
            return await asyncio.gather(*(leave(i) if i % 4 == 0 else stay(i) for i in range(N_CLIENTS)))
        finally:
            await client.close()

    results = asyncio.run(main())
    stayed = [r for r in results if r[0] == "stayed"]
    assert len(stayed) == N_CLIENTS * 3 // 4
    for _, finishes, usage in stayed:
        assert finishes[-1] == "length" and finishes[:-1] == [None] * (len(finishes) - 1)
        assert usage.completion_tokens == MAX_TOKENS
    assert all(r[1] == 3 for r in results if r[0] == "left")

    after = wait_idle(server)
    assert after["warpforge_num_requests_running"] == 0 and after["warpforge_num_requests_waiting"] == 0
    assert after["warpforge_kv_cache_usage_perc"] == 0
    ep = {"endpoint": "/v1/completions"}
    assert _counter(after, "warpforge_requests_total", **ep, outcome="ok") - \
        _counter(before, "warpforge_requests_total", **ep, outcome="ok") == N_CLIENTS * 3 // 4
    assert _counter(after, "warpforge_requests_total", **ep, outcome="disconnected") - \
        _counter(before, "warpforge_requests_total", **ep, outcome="disconnected") == N_CLIENTS // 4
    # the leavers were aborted: far fewer tokens than 16 x 200 were generated for them
    generated = after["warpforge_generation_tokens_total"] - before["warpforge_generation_tokens_total"]
    assert generated < N_CLIENTS * 3 // 4 * MAX_TOKENS + N_CLIENTS // 4 * 100


def test_a_non_streamed_request_is_aborted_when_its_client_leaves(server):
    before = server.metrics()
    body = {"model": server.model, "prompt": PROMPTS[1], "n": 16, "max_tokens": 230, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    after = wait_idle(server)
    assert after["warpforge_kv_cache_usage_perc"] == 0 and after["warpforge_num_requests_running"] == 0
    ep = {"endpoint": "/v1/completions"}
    assert _counter(after, "warpforge_requests_total", **ep, outcome="disconnected") - \
        _counter(before, "warpforge_requests_total", **ep, outcome="disconnected") == 1
    generated = after["warpforge_generation_tokens_total"] - before["warpforge_generation_tokens_total"]
    assert generated < 16 * 230  # stopped early, not run to the end
    # and the server carries on
    r = server.client().completions.create(model=server.model, prompt="To be", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_metrics_lists_every_series(server):
    text = httpx.get(server.root + "/metrics", timeout=10).text
    assert httpx.get(server.root + "/metrics", timeout=10).headers["content-type"].startswith("text/plain")
    for name in ["warpforge_requests_total", "warpforge_time_to_first_token_seconds_bucket",
                 "warpforge_time_per_output_token_seconds_bucket", "warpforge_inter_token_latency_seconds_bucket",
                 "warpforge_e2e_request_latency_seconds_bucket", "warpforge_request_prompt_tokens_bucket",
                 "warpforge_request_generation_tokens_bucket", "warpforge_num_requests_running",
                 "warpforge_num_requests_waiting", "warpforge_kv_cache_usage_perc", "warpforge_prefix_cache_hit_rate",
                 "warpforge_prompt_tokens_total", "warpforge_generation_tokens_total",
                 "warpforge_num_preemptions_total"]:
        assert f"\n{name}" in text, name
    for _ in range(2):  # the second one finds the first one's full prompt pages in the prefix cache
        server.client().completions.create(model=server.model, prompt=" ".join(PROMPTS) * 2, max_tokens=5)
    m = server.metrics()
    assert m["warpforge_time_to_first_token_seconds_count"] >= 2 and m["warpforge_e2e_request_latency_seconds_sum"] > 0
    assert m["warpforge_request_prompt_tokens_count"] >= 2 and m["warpforge_request_generation_tokens_sum"] >= 10
    assert 0 < m["warpforge_prefix_cache_hit_rate"] <= 1


def test_metrics_also_carry_vllms_names_with_the_model_label(server):
    """vLLM dashboards and autoscalers read these names; each is the same measurement as ours."""
    server.client().completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=4)
    m = server.metrics()
    label = f'{{model_name="{server.model}"}}'
    for ours, vllm in [("num_requests_running", "num_requests_running"),
                       ("num_requests_waiting", "num_requests_waiting"),
                       ("kv_cache_usage_perc", "gpu_cache_usage_perc"), ("kv_cache_usage_perc", "kv_cache_usage_perc"),
                       ("prompt_tokens_total", "prompt_tokens_total"),
                       ("generation_tokens_total", "generation_tokens_total"),
                       ("time_to_first_token_seconds_count", "time_to_first_token_seconds_count"),
                       ("time_per_output_token_seconds_sum", "time_per_output_token_seconds_sum"),
                       ("e2e_request_latency_seconds_count", "e2e_request_latency_seconds_count")]:
        assert m[f"vllm:{vllm}{label}"] == m[f"warpforge_{ours}"], vllm
    assert m[f"vllm:generation_tokens_total{label}"] >= 4
    assert m[f'vllm:e2e_request_latency_seconds_bucket{{le="+Inf",model_name="{server.model}"}}'] >= 1
