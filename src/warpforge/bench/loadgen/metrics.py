"""From the requests of one rate to its figures: throughputs, latency percentiles, goodput, errors.

Latencies in milliseconds. Percentiles interpolate linearly between order statistics (numpy's default,
as vLLM's bench serve reports them). Per request: TTFT (send to first content chunk), E2E (send to the
end of the stream), TPOT = (E2E - TTFT) / (output tokens - 1) for requests with more than one output
token; ITL pools every gap between successive content chunks of every request.

Token counts: the server's ``usage`` (``stream_options.include_usage``) when it sent one; else the
tokenizer's count of the returned text when a tokenizer was given; else the number of content chunks.
The summary says which source it used.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from warpforge.bench.loadgen.client import LoadRun, RequestResult
from warpforge.bench.loadgen.workload import TokenizerLike

PERCENTILES = (50, 90, 99)
GOODPUT_KEYS = ("ttft", "tpot", "e2e")


def distribution(values_ms: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (and the count) of a list of milliseconds; None figures when it is empty."""
    if not len(values_ms):
        return {"n": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values_ms, dtype=np.float64)
    return {"n": int(a.size), "mean": float(a.mean()),
            **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def parse_goodput(specs: Sequence[str]) -> dict[str, float]:
    """``["ttft:200", "tpot:50"]`` -> {"ttft": 200.0, "tpot": 50.0} (limits in ms)."""
    out: dict[str, float] = {}
    for spec in specs:
        for item in spec.split():
            key, _, ms = item.partition(":")
            try:
                limit = float(ms)
            except ValueError:
                limit = float("nan")
            if key not in GOODPUT_KEYS or not (limit > 0 and math.isfinite(limit)):
                raise ValueError(f"--goodput: expected KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)} and "
                                 f"MS > 0, got {item!r}")
            if key in out:
                raise ValueError(f"--goodput: {key} given twice")
            out[key] = limit
    return out


def output_tokens(r: RequestResult, tokenizer: TokenizerLike | None) -> tuple[int, str]:
    """(count, source) of one finished request's output tokens."""
    if r.output_tokens is not None:
        return int(r.output_tokens), "usage"
    if tokenizer is not None:
        return len(tokenizer.encode(r.text)), "tokenizer"
    return r.chunks, "chunks"


def tpot_ms(r: RequestResult, n_out: int) -> float | None:
    if r.ttft is None or r.e2e is None or n_out < 2:
        return None
    return 1e3 * (r.e2e - r.ttft) / (n_out - 1)


def is_good(ttft: float | None, tpot: float | None, e2e: float | None, limits: dict[str, float]) -> bool:
    """Every given limit met (ms). A request without a decode phase (one output token) has no TPOT and
    meets any TPOT limit."""
    got = {"ttft": ttft, "tpot": tpot, "e2e": e2e}
    return all(got[k] <= limit if got[k] is not None else k == "tpot" for k, limit in limits.items())


def summarize(run: LoadRun, *, goodput: dict[str, float] | None = None,
              tokenizer: TokenizerLike | None = None,
              prompt_tokens: Sequence[int | None] | None = None) -> dict[str, Any]:
    """The figures of one rate (JSON-able; every time in ms). ``prompt_tokens[i]``: the client's count
    for request i, used where the server sent no usage."""
    done = [r for r in run.results if r.ok]
    failed = [r for r in run.results if not r.ok]
    dur = run.duration_s
    sources: Counter = Counter()
    n_out, ttft, e2e, tpot, itl, good = [], [], [], [], [], 0
    n_prompt = 0
    prompt_known = True
    for r in done:
        n, src = output_tokens(r, tokenizer)
        sources[src] += 1
        n_out.append(n)
        p = r.prompt_tokens if r.prompt_tokens is not None else (prompt_tokens[r.index] if prompt_tokens else None)
        prompt_known &= p is not None
        n_prompt += p or 0
        t = tpot_ms(r, n)
        ttft.append(1e3 * r.ttft)
        e2e.append(1e3 * r.e2e)
        if t is not None:
            tpot.append(t)
        itl.extend(1e3 * x for x in r.itl)
        good += is_good(1e3 * r.ttft, t, 1e3 * r.e2e, goodput or {})
    total_out = sum(n_out)
    short = sum(n < r.max_tokens for n, r in zip(n_out, done))
    return {
        "completed": len(done), "failed": len(failed),
        "errors": dict(Counter(r.error for r in failed).most_common()),
        # The first message of each kind (an error body, an exception's text), to act on without a rerun.
        "error_samples": {e: next(r.text for r in failed if r.error == e)[:200] for e in {r.error for r in failed}},
        "duration_s": dur,
        "request_throughput": len(done) / dur if dur > 0 else None,  # req/s
        "output_throughput": total_out / dur if dur > 0 else None,  # tok/s
        "total_token_throughput": (total_out + n_prompt) / dur if dur > 0 and prompt_known else None,
        "prompt_tokens": n_prompt if prompt_known else None, "output_tokens": total_out,
        "token_counts": "+".join(sorted(sources)) or None,
        "ttft_ms": distribution(ttft), "tpot_ms": distribution(tpot), "itl_ms": distribution(itl),
        "e2e_ms": distribution(e2e),
        "goodput": {"limits_ms": dict(goodput or {}), "req_s": good / dur if dur > 0 else None,
                    "fraction": good / len(run.results) if run.results else None} if goodput else None,
        # Little's law: the mean number of requests in flight over the run.
        "mean_concurrency": sum(e2e) / 1e3 / dur if dur > 0 else None,
        # Requests that ended before their max_tokens: a server that ignores ignore_eos stops at EOS.
        "short_outputs": short,
        "client_cpu": run.client_cpu_s / dur if dur > 0 else None,  # near 1: the client may be the limit
    }


def shared_time(intervals: Sequence[tuple[float, float]]) -> list[float]:
    """Each interval's share of a server that splits its time evenly among the requests in flight:
    request i is charged dt / n(t) for every instant t of [start_i, end_i], n(t) being the intervals
    open at t. The charges add up to the time during which anything was in flight. With the model step
    stubbed out the server is the only thing working, so a request's charge is what serving it cost."""
    edges = sorted({t for iv in intervals for t in iv})
    if not edges:
        return []
    delta = np.zeros(len(edges))
    pos = {t: k for k, t in enumerate(edges)}
    for s, e in intervals:
        if e < s:
            raise ValueError(f"interval ({s}, {e}) ends before it starts")
        delta[pos[s]] += 1
        delta[pos[e]] -= 1
    n = np.cumsum(delta)[:-1]  # in flight over [edges[k], edges[k + 1])
    share = np.where(n > 0, np.diff(edges) / np.maximum(n, 1), 0.0)
    acc = np.concatenate([[0.0], np.cumsum(share)])  # the charge to one request open since edges[0]
    return [float(acc[pos[e]] - acc[pos[s]]) for s, e in intervals]
