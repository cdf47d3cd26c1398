"""A load generator for OpenAI-compatible servers (``warpforge bench serve --url``): HTTP only.

``workload`` draws what to send (Shakespeare prompts at a seeded length mix) and when (Poisson or
constant arrivals); ``client`` sends it as streaming requests and times every SSE chunk; ``metrics``
turns one rate's requests into throughputs, latency percentiles and goodput. Nothing here imports a
warpforge product part: it measures any server, ours or another.
"""

from warpforge.bench.loadgen.client import LoadRun, RequestResult, ServerError, Target, run_load
from warpforge.bench.loadgen.metrics import distribution, parse_goodput, summarize
from warpforge.bench.loadgen.workload import (SHAREGPT_LIKE, HFTokenizer, LengthMix, RequestSpec, arrival_times,
                                              case_name, make_requests, parse_mix, parse_rates, rate_label,
                                              read_tokenizer)

__all__ = ["LoadRun", "RequestResult", "ServerError", "Target", "run_load", "distribution", "parse_goodput",
           "summarize", "SHAREGPT_LIKE", "HFTokenizer", "LengthMix", "RequestSpec", "arrival_times", "case_name",
           "make_requests", "parse_mix", "parse_rates", "rate_label", "read_tokenizer"]
