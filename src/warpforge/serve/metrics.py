"""/metrics: the server's Prometheus series, in a registry of its own (one per app, so tests and
several apps in one process never share counters).

Each series is ``warpforge_*``; the ones vLLM also exports are there a second time under vLLM's name with
its ``model_name`` label (``vllm:num_requests_running{model_name="..."}``, ...), so dashboards and
autoscalers written for vLLM read this server unchanged.

Request-side series are updated as requests run (the per-chunk ones, generated tokens and inter-token
gaps, are tallied in plain numbers and folded into their series before every scrape: a scrape reads
exactly what it would have read had each chunk updated the series itself); engine-side gauges (running and waiting
sequences, KV-cache use, prefix-cache hit rate, preemptions) are read at scrape time from what the
engine reported with its last step (``stats()`` of serve/engine_client.py), so they cost nothing in
between.
"""

from __future__ import annotations

import bisect
import collections

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "warpforge"
FOLD_AT = 4096  # inter-token gaps tallied before they are folded in without waiting for a scrape (bounds memory)
VLLM = "vllm"
# Latency buckets (seconds): sub-millisecond inter-token gaps up to minute-long requests.
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0, 20.0, 40.0, 80.0)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector:
    """Gauges and counters of the engine's last reported state (``engine_core.stats``), read when scraped."""

    def __init__(self, llm, model_name: str):
        from warpforge.serve.engine_client import as_engine

        self.llm, self.model_name = as_engine(llm), model_name

    def _vllm(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(f"{VLLM}:{name}", doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def collect(self):
        running, waiting, kv_used, hit, queried, preemptions, spec = self.llm.stats()
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_running", "Sequences running in the engine (holding KV pages).",
                                value=running)
        yield GaugeMetricFamily(f"{PREFIX}_num_requests_waiting",
                                "Sequences accepted and waiting for the engine to start them.", value=waiting)
        yield GaugeMetricFamily(f"{PREFIX}_kv_cache_usage_perc",
                                "Fraction of KV-cache pages in use (1 = full; cached free pages count as free).",
                                value=kv_used)
        yield self._vllm("num_requests_running", "Sequences running in the engine.", running)
        yield self._vllm("num_requests_waiting", "Sequences waiting for the engine to start them.", waiting)
        # vLLM's older name and its current one: dashboards exist for both
        yield self._vllm("gpu_cache_usage_perc", "KV-cache usage (1 = full).", kv_used)
        yield self._vllm("kv_cache_usage_perc", "KV-cache usage (1 = full).", kv_used)
        yield GaugeMetricFamily(f"{PREFIX}_prefix_cache_hit_rate",
                                "Prompt tokens served from the prefix cache over prompt tokens looked up "
                                "(0 before any).",
                                value=hit / queried if queried else 0.0)
        yield CounterMetricFamily(f"{PREFIX}_num_preemptions",
                                  "Sequences preempted (KV pages freed, recomputed later).",
                                  value=preemptions)
        if spec is not None:  # speculative decoding on: its counters (vLLM's spec_decode series)
            drafted, accepted, emitted, rate = spec
            yield CounterMetricFamily(f"{PREFIX}_spec_decode_num_draft_tokens", "Draft tokens verified by the target.",
                                      value=drafted)
            yield CounterMetricFamily(f"{PREFIX}_spec_decode_num_accepted_tokens", "Draft tokens the target accepted.",
                                      value=accepted)
            yield CounterMetricFamily(f"{PREFIX}_spec_decode_num_emitted_tokens",
                                      "Tokens added by speculative steps (accepted drafts + one per sequence).",
                                      value=emitted)
            yield GaugeMetricFamily(f"{PREFIX}_spec_decode_draft_acceptance_rate",
                                    "Accepted over drafted tokens since start (0 before any draft).",
                                    value=rate)


class _Twin:
    """One measurement kept in two series: ours and vLLM's name for it (with its model_name label)."""

    def __init__(self, *series):
        self.series = series

    def observe(self, value: float) -> None:
        for s in self.series:
            s.observe(value)

    def inc(self, value: float = 1) -> None:
        for s in self.series:
            s.inc(value)


def _observe_all(h: Histogram, values: list[float]) -> None:
    """``h.observe(v)`` for every v, as one update per bucket that got any (observe costs several calls and
    a lock per value). Through prometheus_client's Histogram internals where they are as expected (0.x:
    ``_upper_bounds`` sorted, one value per bucket, an observation counted in the first bucket whose bound
    is >= it), else value by value. The sum is added as one float: it may differ from adding the values
    one by one in the last bits."""
    bounds, buckets, total = (getattr(h, a, None) for a in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            h.observe(v)
        return
    for i, n in collections.Counter(bisect.bisect_left(bounds, v) for v in values).items():
        buckets[i].inc(n)
    total.inc(sum(values))


class ServerMetrics:
    """Every series /metrics shows; ``render()`` is the scrape body. ``model_name`` is the vLLM series' label."""

    def __init__(self, llm, model_name: str = "model"):
        self.registry = r = CollectorRegistry()

        def vllm(kind, name: str, doc: str, **kw):
            return kind(f"{VLLM}:{name}", doc, ["model_name"], registry=r, **kw).labels(model_name)

        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and outcome (ok, bad_request, "
                                "unauthorized, not_found, too_large, rejected, disconnected, aborted, error).",
                                ["endpoint", "outcome"], registry=r)
        self.ttft = _Twin(
            Histogram(f"{PREFIX}_time_to_first_token_seconds", "Request arrival to its first generated token.",
                      buckets=_LATENCY, registry=r),
            vllm(Histogram, "time_to_first_token_seconds", "Time to first token in seconds.", buckets=_LATENCY))
        self.tpot = _Twin(
            Histogram(f"{PREFIX}_time_per_output_token_seconds",
                      "Per sequence: (last token - first token) / (output tokens - 1).", buckets=_LATENCY, registry=r),
            vllm(Histogram, "time_per_output_token_seconds", "Time per output token in seconds.", buckets=_LATENCY))
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                             "Gap between successive outputs of one sequence.", buckets=_LATENCY, registry=r)
        self.e2e = _Twin(
            Histogram(f"{PREFIX}_e2e_request_latency_seconds", "Request arrival to its last token.", buckets=_LATENCY,
                      registry=r),
            vllm(Histogram, "e2e_request_latency_seconds", "End-to-end request latency in seconds.", buckets=_LATENCY))
        self.prompt_len = Histogram(f"{PREFIX}_request_prompt_tokens", "Prompt length of finished requests (tokens).",
                                    buckets=_TOKENS, registry=r)
        self.output_len = Histogram(f"{PREFIX}_request_generation_tokens",
                                    "Output length of finished sequences (tokens).", buckets=_TOKENS, registry=r)
        self.prompt_tokens = _Twin(
            Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of sequences that started generating.", registry=r),
            vllm(Counter, "prompt_tokens", "Number of prefill tokens processed."))
        self.generation_tokens = _Twin(Counter(f"{PREFIX}_generation_tokens", "Tokens generated.", registry=r),
                                       vllm(Counter, "generation_tokens", "Number of generation tokens processed."))
        r.register(_EngineCollector(llm, model_name))
        self._tokens = 0  # generated tokens not yet in generation_tokens
        self._gaps: list[float] = []  # inter-token gaps not yet in itl

    def chunk(self, tokens: int, gap: float | None) -> None:
        """A chunk of ``tokens`` generated tokens went out, ``gap`` seconds after its sequence's previous one
        (None: its first). Updating the Prometheus series per chunk (three with vLLM's twin, a lock and
        several calls each) was a large share of the SSE path (notes/serve.md); the tally costs an add and
        an append."""
        self._tokens += tokens
        if gap is not None:
            self._gaps.append(gap)
            if len(self._gaps) >= FOLD_AT:
                self.fold()

    def fold(self) -> None:
        """The tallied chunks into their series."""
        if self._tokens:
            self.generation_tokens.inc(self._tokens)
            self._tokens = 0
        gaps, self._gaps = self._gaps, []
        if gaps:
            _observe_all(self.itl, gaps)

    def render(self) -> bytes:
        self.fold()
        return generate_latest(self.registry)
