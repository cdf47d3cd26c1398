"""Suite ``serve``: warpforge's OpenAI server under load, against the same requests offline, and its own cost.

``warpforge bench serve`` (no ``--url``) runs it. Our server runs as ``warpforge serve`` in its own process
on 127.0.0.1 (one per model, shared by its rate cases); the load generator (:mod:`warpforge.bench.loadgen`)
drives it from this process, so the client's parsing never shares an interpreter with the server. Cases,
in the order a time-limited call keeps them:

1. ``server cost per request, model step stubbed, 64 streams``: ``_serve_stub`` runs the real server over
   an engine whose step returns a fixed token at once (tiny model, CPU), driven by 64 concurrent
   closed-loop streams (default-mix prompts, 16 output tokens each) from up to 4 client processes
   (``_serve_clients``: one Python client would be the limit). Figure: each request's share of the
   server under processor sharing (:func:`~warpforge.bench.loadgen.metrics.shared_time`: dt / n(t) for
   every instant it is in flight, from the client's timestamps), the stub's own time taken out; p50 / p99
   against the bars 1 ms / 5 ms. Beside it: the raw E2E latency at 64 streams (which includes waiting
   behind the other 63), the server's CPU time per request (HTTP and engine processes), TTFT and ITL.
2. ``llama-1b @ inf req/s, 512 requests in64-512-out128``: the issue's workload (all at once, prompts of
   64-512 tokens, 128 out, ``ignore_eos``), peer ``offline``: the same prompts through ``LLM.generate`` in
   this process with the same engine settings, after the server has exited. Ratio = server output tok/s
   over offline output tok/s; the issue's bar is 0.95.
3. ``llama-8b @ R req/s, N requests sharegpt-like`` for R = 64, 16 (Poisson arrivals, the default length
   mix: ~200 prompt / ~180 output tokens of Shakespeare text, ``ignore_eos``), then ``@ inf`` (1000
   requests, against offline as in 2), then R = 4, 1 (last: at 1 req/s the arrivals alone take a minute,
   so a run cut short by a time limit keeps the rest). Figures per rate: output tok/s, TTFT / TPOT / ITL /
   E2E at p50/p90/p99. No peer runs the same schedule here, so the ratio is empty and ``baseline`` says
   so; the 16 req/s row carries vLLM's published setup under ``target.published`` (published, not
   same-run).

Weights are random bf16 at Llama 3.2 1B's and Llama 3.1 8B's shapes (``random_weights.cached_checkpoint``;
the tokenizer is the small Hamlet BPE, given to the load generator so prompts have exact token counts).
``--quick``: the same kinds of case at toy sizes on the CPU (a tiny Llama, a handful of requests, rates 4
and inf).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from warpforge.bench.loadgen.workload import SHAREGPT_LIKE, LengthMix
from warpforge.bench.suite import EndToEndCase, Run, Suite
from warpforge.bench.suites._llm_models import checkpoint, run_dtype

STREAMS = 64  # concurrent streams of the server-cost case
COST_TOKENS = 16  # output tokens per request in the server-cost case
STUB_PRESET = "llama-tiny-untied"  # the stubbed server never runs its model: the smallest that takes the mix

# vLLM's public performance dashboard runs this shape and schedule (Llama 3.1 8B, one H200, 200 ShareGPT
# prompts, Poisson arrivals at QPS 1 / 4 / 16 / inf). Named as published, never used as a same-run ratio.
VLLM_PUBLISHED = {
    "source": "https://buildkite.com/vllm/performance-benchmark/builds/9515 (vLLM performance benchmark, "
              "serving tests)",
    "setup": "vLLM, Llama-3.1-8B, tp 1, H200, 200 ShareGPT prompts, Poisson arrivals at QPS 16",
    "ttft_p99_ms": None,
    "note": "the setup is published, but the stored copy of the page did not yield its QPS-16 TTFT row; "
            "no figure is quoted rather than one from memory",
}


@dataclass(frozen=True)
class Shape:
    """One model's cases: the unlimited rate against offline (``requests``), and finite rates (rate ->
    requests: about 40-60 s of arrivals each, at least 60 requests)."""

    preset: str
    mix: LengthMix
    max_model_len: int
    requests: int
    rates: dict[float, int]
    warm: int  # requests of the untimed warm-up set (prefill sizes compiled, KV pages touched)


@dataclass(frozen=True)
class Sizes:
    shapes: tuple[Shape, ...]
    cost_requests: int  # requests of the server-cost case (a multiple of STREAMS)


# The issue's workload at Llama 3.2 1B's shape: 512 requests at once, prompts of 64-512 tokens (a clipped
# log-normal with a uniform draw's mean, 288), 128 output tokens each.
ISSUE_MIX = LengthMix("in64-512-out128", prompt_mean=288, output_mean=128, prompt_sigma=0.8, prompt_range=(64, 512),
                      output_range=(128, 128))
FULL = Sizes((Shape("llama-1b", ISSUE_MIX, 1024, 512, {}, 128),
              Shape("llama-8b", SHAREGPT_LIKE, 4096, 1000, {64.0: 640, 16.0: 640, 4.0: 160, 1.0: 60}, 256)),
             16 * STREAMS)
# Toy sizes for the CPU: lengths scaled down with the same spread, so that the tiny model's steps stay short.
QUICK_MIX = LengthMix("sharegpt-like-quick", prompt_mean=40, output_mean=12, prompt_sigma=0.9, output_sigma=0.8,
                      prompt_range=(4, 192), output_range=(2, 48))
QUICK = Sizes((Shape("llama-tiny-untied", QUICK_MIX, 512, 8, {4.0: 8}, 8),), STREAMS)


# ---- the server process ---------------------------------------------------------------------------

_LISTENING = re.compile(r"listening on (http://[^\s/]+)")


class ServerProcess:
    """A server in its own process on 127.0.0.1 (``argv``); ``url`` once its startup line says where it
    listens. stderr is drained by a thread (the last lines are kept for errors), so the pipe never fills."""

    def __init__(self, argv: list[str], *, ready_s: float = 900.0, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=env, start_new_session=True)
        self._url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._ready.wait(ready_s) or self._url is None:
            self.stop()
            raise RuntimeError(f"the server did not start within {ready_s:.0f} s: {' | '.join(self.tail)[-800:]}")

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line.rstrip())
            m = _LISTENING.search(line)
            if m and self._url is None:
                self._url = m.group(1)
                self._ready.set()
        self._ready.set()  # exited before listening: the constructor reports the tail

    @property
    def url(self) -> str:
        assert self._url is not None
        return self._url

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the server so far: its process and their children (the engine process),
        from Linux /proc; None where unknown."""
        def tree(pid: int) -> float:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            for task in os.listdir(f"/proc/{pid}/task"):
                for child in Path(f"/proc/{pid}/task/{task}/children").read_text().split():
                    try:
                        total += tree(int(child))
                    except OSError:  # exited meanwhile
                        pass
            return total

        try:
            return tree(self.proc.pid)
        except (OSError, IndexError, ValueError):
            return None

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM (the server drains and exits), SIGKILL after ``grace_s``; waits, so GPU memory is free."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_current: dict[str, Any] = {}  # the one running server: {"key": ..., "server": ServerProcess, ...}


def stop_server() -> None:
    server = _current.pop("server", None)
    _current.clear()
    if server is not None:
        server.stop()


atexit.register(stop_server)


def _server(key: tuple, argv: list[str], warm: Any) -> ServerProcess:
    """The running server for ``key``, else a new one (the previous one stopped first: one GPU, one server).
    ``warm(url)`` runs once per new server, before any timed run."""
    if _current.get("key") == key and _current["server"].proc.poll() is None:
        return _current["server"]
    stop_server()
    server = ServerProcess(argv)
    _current.update(key=key, server=server)
    warm(server.url)
    return server


# ---- checkpoints and tokenizers -------------------------------------------------------------------

def gguf_tokenizer(spec: str) -> Any:
    """The `tokenizers` backend of a GGUF file or ``gemma3-270m`` (for ``bench serve --tokenizer``)."""
    from warpforge.llm.loader import GGUFFile, resolve_model
    from warpforge.llm.tokenizer import Tokenizer

    return Tokenizer.from_gguf(GGUFFile(resolve_model(spec)).meta).backend


def _tokenizer(checkpoint: Path) -> Any:
    from warpforge.bench.loadgen import read_tokenizer

    return read_tokenizer(checkpoint)


# ---- runs -----------------------------------------------------------------------------------------

def _requests(sh: Shape, n: int, tok: Any, rate_index: int, seed: int = 0) -> list:
    from warpforge.bench.loadgen import make_requests

    return make_requests(n, sh.mix, seed, tokenizer=tok, text_seed=seed + 1 + rate_index)


def _target(url: str, model: str, **kw: Any) -> Any:
    from warpforge.bench.loadgen import Target

    return Target(url=url, model=model, ignore_eos=True, **kw)


def _warm_specs(sh: Shape, tok: Any) -> list:
    from warpforge.bench.loadgen import make_requests

    return make_requests(sh.warm, sh.mix, 0, tokenizer=tok, text_seed=999)


def _warm(model: str, sh: Shape, tok: Any) -> Any:
    """A set of requests at once, of text no case uses (the offline peer warms up on the same set): prefill
    sizes compiled, KV pages touched, before anything is timed."""
    from warpforge.bench.loadgen import run_load

    def warm(url: str) -> None:
        specs = _warm_specs(sh, tok)
        run = asyncio.run(run_load(_target(url, model), specs, [0.0] * len(specs)))
        bad = [r.error for r in run.results if not r.ok]
        if bad:
            raise RuntimeError(f"warm-up requests failed: {bad[:3]}")
    return warm


def _summary_run(run: Any, specs: list, work: dict | None = None, client_procs: int = 1) -> Run:
    from warpforge.bench.loadgen import summarize

    s = summarize(run, prompt_tokens=[x.prompt_tokens for x in specs])
    out = {"n": len(specs), "failed": s["failed"], "short": s["short_outputs"], "errors": s["errors"]}
    extra = {k: v for k, v in s.items() if k not in ("output_tokens",)}
    extra["client_processes"] = client_procs
    return Run(ms=1e3 * run.duration_s, tokens=s["output_tokens"], output=out, extra=extra, work=work or {})


def _work(preset: str, device: torch.device, prompt_lens: list[int], out_lens: list[int]) -> dict:
    from warpforge.bench.suites._llm_work import _shape, generation_work

    return generation_work(_shape(preset), torch.empty((), dtype=run_dtype(device)).element_size(), prompt_lens,
                           out_lens)


def server_run(sh: Shape, rate: float, n: int, rate_index: int, *, with_work: bool = False):
    """``warpforge serve`` (shared across the shape's rate cases) driven at ``rate`` with ``n`` requests."""
    def fn(device: torch.device, rep: int) -> list[Run]:
        from warpforge.bench.loadgen import arrival_times
        from warpforge.bench.suites._serve_clients import client_procs, drive

        ckpt = checkpoint(sh.preset, run_dtype(device))
        tok = _tokenizer(ckpt)
        argv = [sys.executable, "-m", "warpforge", "serve", str(ckpt), "--host", "127.0.0.1", "--port", "0",
                "--served-model-name", sh.preset, "--max-model-len", str(sh.max_model_len),
                "--max-queue", str(max(sh.requests, 1024)), "--shutdown-grace", "5"]
        server = _server(("serve", sh.preset, str(device)), argv, _warm(sh.preset, sh, tok))
        specs = _requests(sh, n, tok, rate_index)
        runs = []
        for i in range(rep):
            times = arrival_times(len(specs), rate, arrivals="poisson", seed=rate_index + i)
            run = drive(_target(server.url, sh.preset), specs, times)
            work = None
            if with_work:
                done = [r for r in run.results if r.ok]
                work = _work(sh.preset, device, [r.prompt_tokens or 0 for r in done],
                             [r.output_tokens or 0 for r in done]) if done else None
            runs.append(_summary_run(run, specs, work, client_procs()))
        return runs
    return fn


def offline_run(sh: Shape, rate_index: int):
    """The same prompts through ``LLM.generate`` at once, same engine settings; the server is stopped first
    (one GPU holds one engine's KV pool)."""
    def fn(device: torch.device, rep: int) -> list[Run]:
        from warpforge.llm import LLM, SamplingParams

        stop_server()
        ckpt = checkpoint(sh.preset, run_dtype(device))
        tok = _tokenizer(ckpt)
        specs = _requests(sh, sh.requests, tok, rate_index)
        llm = LLM(str(ckpt), device=device, max_model_len=sh.max_model_len)
        # The server's warm-up set, untimed: prefill sizes compiled and KV pages touched on both sides.
        warm_specs = _warm_specs(sh, tok)
        llm.generate([s.prompt for s in warm_specs],
                     [SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True) for s in warm_specs])
        params = [SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True) for s in specs]
        runs = []
        for _ in range(rep):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            outs = llm.generate([s.prompt for s in specs], params)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            wall = time.perf_counter() - t0
            n_out = [len(o.token_ids) for o in outs]
            runs.append(Run(ms=1e3 * wall, tokens=sum(n_out), output=None,
                            extra={"requests": len(specs), "output_throughput": sum(n_out) / wall},
                            work=_work(sh.preset, device, [len(o.prompt_token_ids) for o in outs], n_out)))
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return runs
    return fn


def stub_cost_run(sz: Sizes, mix: LengthMix):
    """The server-cost case: 64 closed-loop streams against ``_serve_stub`` (see the module docstring)."""
    def fn(device: torch.device, rep: int) -> list[Run]:
        from warpforge.bench.loadgen import LengthMix, make_requests, run_load, summarize
        from warpforge.bench.loadgen.metrics import distribution, shared_time
        from warpforge.bench.suites._serve_clients import client_procs, drive

        procs = client_procs()
        ckpt = checkpoint(STUB_PRESET, torch.float32)
        tok = _tokenizer(ckpt)
        mix_ = LengthMix(f"{mix.name} prompts, {COST_TOKENS} out", prompt_mean=mix.prompt_mean,
                         output_mean=COST_TOKENS, prompt_sigma=mix.prompt_sigma, prompt_range=mix.prompt_range,
                         output_range=(COST_TOKENS, COST_TOKENS))
        stats = Path(tempfile.mkdtemp(prefix="wf-stub-")) / "stub.json"
        argv = [sys.executable, "-m", "warpforge.bench.suites._serve_stub", str(ckpt), "--stats", str(stats),
                "--max-num-seqs", str(2 * STREAMS), "--max-model-len", str(mix.prompt_range[1] + 2 * COST_TOKENS)]

        def warm(url: str) -> None:
            w = make_requests(STREAMS, mix_, 0, tokenizer=tok, text_seed=997)
            asyncio.run(run_load(_target(url, "stub"), w, [0.0] * len(w), max_concurrency=STREAMS))

        server = _server(("stub", str(stats)), argv, warm)
        runs = []
        for i in range(rep):
            specs = make_requests(sz.cost_requests, mix_, 1, tokenizer=tok, text_seed=100 + i)
            cpu0 = server.cpu_seconds()
            run = drive(_target(server.url, "stub"), specs, [0.0] * len(specs), STREAMS)
            cpu1 = server.cpu_seconds()
            runs.append((run, None if cpu0 is None or cpu1 is None else cpu1 - cpu0))
        stop_server()  # the stub writes its stats as it exits
        st = json.loads(stats.read_text()) if stats.is_file() else {"steps": 0, "seconds": 0.0}
        shutil.rmtree(stats.parent, ignore_errors=True)
        stub_step_s = st["seconds"] / st["steps"] if st["steps"] else 0.0
        out = []
        for run, cpu in runs:
            done = [r for r in run.results if r.ok]
            s = summarize(run)
            if not done:
                raise RuntimeError(f"no request to the stubbed server completed: {s['errors']} {s['error_samples']}")
            # Every step a request waits on is one stub call: take those out of its latency, and its 1/n share
            # of them out of its charge (n: the mean number of requests in flight).
            charge = shared_time([(r.sent, r.sent + r.e2e) for r in done])
            n_out = [r.output_tokens or r.chunks for r in done]
            share = stub_step_s / max(s["mean_concurrency"], 1.0)
            cost = [1e3 * (c - n * share) for c, n in zip(charge, n_out)]
            over = [1e3 * (r.e2e - n * stub_step_s) for r, n in zip(done, n_out)]
            cost_d = distribution(cost)
            extra = {"cost_ms": cost_d, "cost_p50_ms": cost_d["p50"], "cost_p99_ms": cost_d["p99"],
                     "e2e_minus_stub_ms": distribution(over), "ttft_ms": s["ttft_ms"], "itl_ms": s["itl_ms"],
                     "streams": STREAMS, "output_tokens_per_request": COST_TOKENS,
                     "requests": len(run.results), "completed": s["completed"], "failed": s["failed"],
                     "errors": s["errors"],
                     # both processes (HTTP and engine), stub included: the cost a loaded machine cannot inflate
                     "server_cpu_ms_per_request": None if cpu is None else 1e3 * cpu / max(1, len(done)),
                     "wall_ms_per_request": 1e3 * run.duration_s / max(1, len(done)),
                     "stub_step_us": 1e6 * stub_step_s, "stub_steps": st["steps"],
                     "client_cpu": s["client_cpu"], "client_processes": procs,
                     "mean_concurrency": s["mean_concurrency"],
                     "how": "each request is charged dt/n(t) for every instant it is in flight (n(t): requests in "
                            "flight, client timestamps), less its share of the stub's time; p50/p99 over requests"}
            out.append(Run(ms=cost_d["p50"], tokens=sum(n_out),
                           output={"n": len(run.results), "failed": s["failed"], "short": s["short_outputs"],
                                   "errors": s["errors"]}, extra=extra))
        return out
    return fn


def completed_check(ours: dict, _peer: Any) -> dict[str, Any]:
    """Every request completed, each with exactly the output tokens it asked for (ignore_eos honoured)."""
    bad = ours["failed"] + ours["short"]
    return {"ok": bad == 0, "rel_err": bad / max(1, ours["n"]), "tol": 0.0, "failed": ours["failed"],
            "short_outputs": ours["short"], "errors": ours["errors"]}


# ---- the cases ------------------------------------------------------------------------------------

NO_PEER = "no peer runs this schedule in this run (ratio empty): the figures are the result"


def _cases(quick: bool) -> list[EndToEndCase]:
    """In the order a time-limited call should keep them: the server cost (CPU, seconds), then per shape the
    rates of 16 req/s and up and the unlimited rate against offline on one server, then the slow low rates
    (a server of their own: the offline peer stopped the first; --quick keeps them on the first)."""
    sz = QUICK if quick else FULL
    cost_mix = sz.shapes[-1].mix
    cases = [EndToEndCase(
        name=f"server cost per request, model step stubbed, {STREAMS} streams",
        params={"streams": STREAMS, "output_tokens": COST_TOKENS, "requests": sz.cost_requests,
                "mix": f"{cost_mix.name} prompts", "model": f"{STUB_PRESET} (never run: step stubbed), CPU"},
        ours=stub_cost_run(sz, cost_mix), peers={}, check=completed_check, dtype=torch.float32, metric="ms",
        timing={"method": "client timestamps; processor-sharing charge per request", "warmup": STREAMS, "rep": 1,
                "interleaved": False},
        baseline="the issue's bars: server cost per request p50 <= 1 ms, p99 <= 5 ms at 64 concurrent streams "
                 "(vLLM's API server is the usual comparison; no same-run peer)",
        target={"max_ms": 1.0, "max": {"cost_p99_ms": 5.0}})]
    low = []
    for sh in sz.shapes:
        for i, (rate, n) in enumerate(sorted(sh.rates.items(), key=lambda rn: -rn[0])):
            (cases if rate >= 16 or quick else low).append(_rate_case(sh, rate, n, i, quick))
        cases.append(_rate_case(sh, math.inf, sh.requests, len(sh.rates), quick))
    return cases + low


def _rate_case(sh: Shape, rate: float, n: int, rate_index: int, quick: bool) -> EndToEndCase:
    from warpforge.bench.loadgen import case_name

    bf16 = torch.bfloat16
    params = {"preset": sh.preset, "requests": n, "mix": sh.mix.describe(), "arrivals": "poisson",
              "max_model_len": sh.max_model_len, "ignore_eos": True, "server": "warpforge serve (own process)",
              "rate": "inf" if math.isinf(rate) else rate}
    timing = {"method": "client wall clock (perf_counter) per SSE chunk; offline: wall clock around generate; "
                        "both after the same untimed set of requests of other text (warmup: its size)",
              "warmup": sh.warm, "rep": 1, "interleaved": False}
    name = case_name(sh.preset, rate, n, sh.mix.name)
    if math.isinf(rate):
        return EndToEndCase(
            name=name, params=params, ours=server_run(sh, rate, n, rate_index, with_work=True),
            peers={"offline": offline_run(sh, rate_index)}, check=completed_check, dtype=bf16, timing=timing,
            baseline="the same requests offline through LLM.generate, same engine settings, same run "
                     "(ratio = server / offline output tok/s)",
            target={"ratio": {"offline": 0.95}})
    published = rate == 16.0 and sh.preset == "llama-8b" and not quick
    return EndToEndCase(
        name=name, params=params, ours=server_run(sh, rate, n, rate_index), peers={}, check=completed_check,
        dtype=bf16, timing=timing,
        baseline=NO_PEER + ("; vLLM's published figure for a comparable setup is under target.published "
                            "(published, not same-run)" if published else ""),
        target={"published": VLLM_PUBLISHED} if published else None)


SUITE = Suite(name="serve", description="warpforge serve under load (1-64 req/s and unlimited, vs LLM.generate "
                                        "offline) and its own cost per request with the model step stubbed",
              cases=_cases)
