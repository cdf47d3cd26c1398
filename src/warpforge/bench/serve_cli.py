"""``warpforge bench serve``: load-test an OpenAI-compatible server, one record per request rate.

With ``--url`` it drives any server (ours, vLLM's, anyone's) through :mod:`warpforge.bench.loadgen`;
without it, it runs the ``serve`` suite (bench/suites/serve.py), which starts warpforge's own server.
The click command lives here (``warpforge.cli`` hands ``bench serve ...`` to it) and imports nothing
heavy until it runs, so ``--help`` stays instant.
"""

from __future__ import annotations

import asyncio
import math
import socket
import sys
from pathlib import Path
from typing import Any

import click

from warpforge._cli_support import record_options

NO_PEER = ("no peer in this run: a load-generator run measures one server at each rate (compare runs with "
           "`warpforge results compare`)")
# Options that only the load generator takes (the suite fixes its own workload).
LOAD_OPTIONS = ("model", "endpoint", "rate", "arrivals", "burstiness", "num_requests", "max_concurrency", "seed",
                "mix", "tokenizer", "ignore_eos", "temperature", "goodput", "api_key", "timeout")


# ---- tokenizers -------------------------------------------------------------------------------------

def resolve_tokenizer(spec: str | None) -> Any:
    """None, a tokenizer.json file or a directory holding one (read with `tokenizers`), or a GGUF file /
    ``gemma3-270m`` (read through warpforge.llm by the serve suite module)."""
    from warpforge.bench.loadgen import HFTokenizer, read_tokenizer

    if spec is None:
        return None
    if spec == "gemma3-270m" or Path(spec).expanduser().suffix == ".gguf":
        from warpforge.bench.suites.serve import gguf_tokenizer

        return HFTokenizer(gguf_tokenizer(spec))
    try:
        return read_tokenizer(spec)
    except ValueError as e:
        raise ValueError(f"--tokenizer: {e} (or a .gguf file, or gemma3-270m)") from None


# ---- records -------------------------------------------------------------------------------------

def serve_record(summary: dict[str, Any], *, case: str, params: dict[str, Any], device: dict[str, Any],
                 git: str | None, seed: int, n_requests: int, baseline: str = NO_PEER) -> dict[str, Any]:
    """One rate's record in the bench format: ``ours.ms`` is the run's wall time and ``ours["tok/s"]``
    the output-token throughput (as the llm suite's end-to-end rows); every latency figure beside them."""
    from warpforge.results.record import now_iso, validate_record

    if summary["completed"] == 0:
        ours: dict[str, Any] = {"error": f"no request completed: {summary['errors']}"}
    else:
        ms = 1e3 * summary["duration_s"]
        ours = {"ms": ms, "p20_ms": ms, "p80_ms": ms, "iqr_ms": 0.0, "tok/s": summary["output_throughput"],
                "tokens": summary["output_tokens"], **summary}
    failed = n_requests - summary["completed"]
    correct = {"rel_err": failed / n_requests, "tol": 0.0, "ok": failed == 0, "against": "completion",
               "note": "every request completed with a proper end of stream" if failed == 0 else
               f"{failed} of {n_requests} requests failed: {summary['errors']}"}
    if summary.get("short_outputs") and params.get("ignore_eos"):
        correct["short_outputs"] = (f"{summary['short_outputs']} requests ended before max_tokens: the server "
                                    "may ignore ignore_eos; the measured output lengths are used")
    rec = {"suite": "serve", "case": case, "params": params, "device": device, "git": git, "time": now_iso(),
           "ours": ours, "peers": {}, "ratio": {}, "roofline": None, "correct": correct, "metric": "tok/s",
           "baseline": baseline, "target": None, "meets": {},
           "work": {"prompt_tokens": summary.get("prompt_tokens"), "output_tokens": summary.get("output_tokens")},
           "seed": seed,
           "timing": {"method": "client wall clock (perf_counter) per SSE chunk", "warmup": 1, "rep": 1,
                      "interleaved": False}}
    validate_record(rec)
    return rec


# ---- the table -----------------------------------------------------------------------------------

def _pair(d: dict | None) -> str:
    if not d or d.get("p50") is None:
        return "—"
    return f"{d['p50']:.1f} / {d['p99']:.1f}"


def serve_table(records: list[dict[str, Any]], title: str | None = None) -> Any:
    """rate | ok/failed | req/s | out tok/s | TTFT, TPOT, ITL, E2E p50 / p99 ms | goodput (when limits were given)."""
    from rich.table import Table

    goodput = any(r["ours"].get("goodput") for r in records)
    t = Table(title=title, title_justify="left", header_style="bold")
    cols = ["rate\nreq/s", "ok /\nfailed", "req/s", "out\ntok/s", "TTFT ms\np50 / p99", "TPOT ms\np50 / p99",
            "ITL ms\np50 / p99", "E2E ms\np50 / p99"] + (["goodput\nreq/s"] if goodput else [])
    for col in cols:
        t.add_column(col, justify="right")
    for r in records:
        o, rate = r["ours"], str(r["params"]["rate"])
        if "error" in o:
            t.add_row(rate, f"0 / [red]{r['params']['num_requests']}[/]", *["—"] * (len(cols) - 2))
            continue
        failed = f"[red]{o['failed']}[/]" if o["failed"] else "0"
        row = [rate, f"{o['completed']} / {failed}", f"{o['request_throughput']:.2f}", f"{o['output_throughput']:,.0f}",
               _pair(o["ttft_ms"]), _pair(o["tpot_ms"]), _pair(o["itl_ms"]), _pair(o["e2e_ms"])]
        if goodput:
            gp = o.get("goodput")
            row.append("—" if not gp else f"{gp['req_s']:.2f} ({100 * gp['fraction']:.0f}%)")
        t.add_row(*row)
    return t


# ---- the run -------------------------------------------------------------------------------------

def _raise_nofile_limit() -> None:
    """An unlimited rate opens one connection per request: lift the soft open-files limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if hard != resource.RLIM_INFINITY else 1 << 16
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):
        pass


def _rate_line(rec: dict[str, Any]) -> str:
    """One line per finished rate (a long sweep shows progress between its rates)."""
    o, rate = rec["ours"], rec["params"]["rate"]
    if "error" in o:
        return f"[red]{rate} req/s: {o['error']}[/]"
    failed = f", [red]{o['failed']} failed[/]" if o["failed"] else ""
    return (f"{rate} req/s: {o['completed']} done{failed} in {o['duration_s']:.1f} s, "
            f"{o['output_throughput']:,.0f} out tok/s, TTFT p50/p99 {_pair(o['ttft_ms'])} ms, "
            f"TPOT p50/p99 {_pair(o['tpot_ms'])} ms")


def _redacted_argv(argv: list[str]) -> list[str]:
    """argv for the store, with the --api-key value replaced."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
        elif a.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(a)
        hide = not hide and a == "--api-key"
    return ["warpforge", *out]


def run_sweep(*, url: str, model: str | None, endpoint: str, rates: list[float], arrivals: str, burstiness: float,
              num_requests: int, max_concurrency: int | None, seed: int, mix: str, tokenizer: str | None,
              ignore_eos: bool, temperature: float, goodput: dict[str, float], api_key: str | None,
              timeout: float, console: Any, on_record: Any = None) -> list[dict[str, Any]]:
    """Every rate in turn against ``url``; returns the records (also passed to ``on_record`` one by one).
    ValueError / ServerError for bad input or an unusable server, before any timed run."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from warpforge.bench.loadgen import (Target, arrival_times, case_name, make_requests, parse_mix, rate_label,
                                         run_load, summarize)
    from warpforge.bench.loadgen.client import ServerError, check_request, served_models
    from warpforge.results.record import git_version

    length_mix = parse_mix(mix)
    tok = resolve_tokenizer(tokenizer)
    probe = Target(url=url, model=model or "", endpoint=endpoint, api_key=api_key, ignore_eos=ignore_eos,
                   temperature=temperature, timeout_s=timeout)
    try:
        models = asyncio.run(served_models(probe))
    except ServerError as e:
        if model is None or str(e).startswith("cannot reach"):
            raise
        models = []  # a server without a model list: the test request below says whether --model is right
    if model is None:
        if not models:
            raise ValueError(f"--model: {probe.base}/models lists no model; name one")
        model = models[0]
    elif models and model not in models:
        raise ValueError(f"--model: {model!r} is not served at {probe.where} (it serves: {', '.join(models)})")
    target = Target(url=url, model=model, endpoint=endpoint, api_key=api_key, ignore_eos=ignore_eos,
                    temperature=temperature, timeout_s=timeout)
    _raise_nofile_limit()
    warm = make_requests(1, length_mix, seed, tokenizer=tok, text_seed=seed + 10_000)[0]
    asyncio.run(check_request(target, warm))

    device = {"name": f"server at {target.where}", "driver": None, "torch": None,
              "client": socket.gethostname(), "note": "the OpenAI API does not say what the server runs on"}
    git = git_version()
    records = []
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[status]}"))
    with Progress(*columns, console=console, transient=True) as bar:
        for i, rate in enumerate(rates):
            # Same lengths at every rate; new text per rate, so no rate hits an earlier rate's prefix cache.
            specs = make_requests(num_requests, length_mix, seed, tokenizer=tok, text_seed=seed + 1 + i)
            times = arrival_times(num_requests, rate, arrivals=arrivals, burstiness=burstiness, seed=seed + i)
            task = bar.add_task(f"{rate_label(rate)} req/s", total=num_requests, status="")
            state = {"sent": 0, "done": 0, "failed": 0, "events": 0}

            def sent(state=state) -> None:
                state["sent"] += 1

            def finished(res, state=state, task=task) -> None:  # the stream is parsed after the run
                state["done"] += 1
                state["failed"] += res.error is not None
                state["events"] += len(res.events or ())
                bar.update(task, advance=1, status=f"in flight {state['sent'] - state['done']}  "
                                                   f"errors {state['failed']}  {state['events']:,} SSE events")

            run = asyncio.run(run_load(target, specs, times, max_concurrency=max_concurrency,
                                       on_result=finished, on_send=sent))
            bar.remove_task(task)
            summary = summarize(run, goodput=goodput, tokenizer=tok, prompt_tokens=[s.prompt_tokens for s in specs])
            params = {"url": target.base, "endpoint": endpoint, "model": model, "rate": rate_label(rate),
                      "arrivals": arrivals, "burstiness": burstiness, "num_requests": num_requests,
                      "max_concurrency": max_concurrency, "mix": length_mix.describe(), "seed": seed,
                      "ignore_eos": ignore_eos, "temperature": temperature, "tokenizer": tokenizer}
            rec = serve_record(summary, case=case_name(model, rate, num_requests, length_mix.name, arrivals),
                               params=params, device=device, git=git, seed=seed, n_requests=num_requests)
            records.append(rec)
            if on_record is not None:
                on_record(rec)
            console.print(_rate_line(rec))
            if summary["client_cpu"] and summary["client_cpu"] > 0.9:
                console.print(f"[yellow]{rate_label(rate)} req/s: the load generator used "
                              f"{100 * summary['client_cpu']:.0f}% of a core: it may limit what is measured[/]")
    return records


def cli_bench_serve(*, url: str, model: str | None, endpoint: str, rate: str, arrivals: str, burstiness: float,
                    num_requests: int, max_concurrency: int | None, seed: int, mix: str, tokenizer: str | None,
                    ignore_eos: bool, temperature: float, goodput: tuple[str, ...], api_key: str | None,
                    timeout: float, store_url: str | None, no_store: bool, out: str | None, console: Any,
                    err: Any = None) -> int:
    """The load generator's command: 0 fine, 1 some request failed, 2 bad usage or an unusable server or
    store, 130 interrupted (finished rates are kept). Errors go to ``err`` (stderr), the rest to ``console``."""
    from rich.markup import escape

    from warpforge._cli_support import make_console, note_in_log
    from warpforge.settings import default_store_url
    from warpforge.bench.loadgen import ServerError, parse_goodput, parse_rates
    from warpforge.results.record import now_iso, write_jsonl

    err = err or make_console(stderr=True)
    try:
        rates, limits = parse_rates(rate), parse_goodput(goodput)
        if not (burstiness > 0 and math.isfinite(burstiness)):
            raise ValueError(f"--burstiness: expected a number > 0, got {burstiness}")
    except ValueError as e:
        err.print(f"[red]{escape(str(e))}[/]")
        return 2
    records: list[dict] = []
    if out:
        from warpforge.bench.cli import out_file

        out = out_file(out, "serve")  # as `warpforge bench SUITE --out`: a directory gets serve.jsonl
        write_jsonl(out, [])

    def keep(rec: dict) -> None:
        if out:
            write_jsonl(out, [rec], append=True)

    started, rc = now_iso(), 0
    try:
        run_sweep(url=url, model=model, endpoint=endpoint, rates=rates, arrivals=arrivals, burstiness=burstiness,
                  num_requests=num_requests, max_concurrency=max_concurrency, seed=seed, mix=mix,
                  tokenizer=tokenizer, ignore_eos=ignore_eos, temperature=temperature, goodput=limits,
                  api_key=api_key, timeout=timeout, console=console,
                  on_record=lambda r: (records.append(r), keep(r)))
    except (ValueError, ServerError) as e:
        err.print(f"[red]{escape(str(e))}[/]")
        return 2
    except ModuleNotFoundError as e:
        err.print(f"[red]{escape(str(e.name))} is missing: install the serve extra (pip install 'warpforge[serve]')[/]")
        return 2
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: keeping the {len(records)} finished rate(s)[/]")
        rc = 130
    if not records:
        return rc or 2
    p, where = records[0]["params"], records[0]["device"]["name"].removeprefix("server at ")
    console.print(serve_table(records, title=f"serve: {p['model']} at {where}, {p['num_requests']} requests "
                                             f"{p['mix']['name']} per rate"))
    console.print("[dim]times from the client's clock per SSE chunk; TTFT: first chunk with a choice; ITL: gaps "
                  "between such chunks; TPOT: (E2E - TTFT) / (output tokens - 1); token counts: "
                  f"{escape(str(records[-1]['ours'].get('token_counts')))}[/]")
    for r in records:
        if r["correct"].get("short_outputs"):
            console.print(f"[yellow]{escape(r['case'])}: {escape(r['correct']['short_outputs'])}[/]")
    if out:
        console.print(f"wrote {len(records)} records to {escape(out)}")
    if not no_store:
        from warpforge.results.store import Store, StoreError

        try:
            with Store(store_url or default_store_url()) as store:
                run_id = store.add_run("serve", records, {"started": started, "finished": now_iso(),
                                                          "argv": _redacted_argv(sys.argv[1:])})
                console.print(f"stored as run {run_id} in {escape(store.where)} "
                              f"([dim]warpforge results show {run_id}[/])")
                note_in_log(f"stored as run {run_id} in {store.where}")
        except StoreError as e:
            err.print(f"[bold red]results store error:[/] {escape(str(e))}")
            rc = rc or 2
    failed = sum(r["params"]["num_requests"] - r["ours"].get("completed", 0) for r in records)
    if failed:
        console.print(f"[bold red]{failed} request(s) failed[/] (see the failed column; errors are in the records)")
        rc = rc or 1
    return rc


# ---- the click command ----------------------------------------------------------------------------

HELP = """Load-test an OpenAI-compatible server at several request rates; one record per rate.

\b
With --url: any server (warpforge serve, vLLM, SGLang, ...):
  warpforge bench serve --url http://127.0.0.1:8000 --rate 1,4,16,64,inf
Each rate sends --num-requests streaming requests (prompts of Shakespeare
text, lengths from --mix, the same for every rate; new text per rate so no
rate hits an earlier one's prefix cache), timed per SSE chunk on the client.
Per rate: request and output-token throughput, TTFT / TPOT / ITL / E2E at
p50, p90, p99 and mean, goodput under --goodput limits, errors. Records go to
the results store (suite "serve") and, with --out, to a JSON-lines file.

\b
Without --url: runs the `serve` suite, which starts warpforge's own server on
a Llama-3.1-8B-shaped model with random bf16 weights (a GPU run; --quick: a
tiny model on the CPU) and measures it against LLM.generate offline, plus
the server's own cost per request with the model step stubbed out.

Exit status: 0 fine, 1 some request failed, 2 bad usage or an unusable server.
"""


class _Rates(click.ParamType):
    name = "RATES"

    def convert(self, value, param, ctx):
        from warpforge.bench.loadgen.workload import parse_rates

        try:
            parse_rates(value)
        except ValueError as e:
            self.fail(str(e).removeprefix("--rate: "), param, ctx)
        return value


@click.command("serve", help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--url", default=None, help="Base URL of the server: http://HOST:PORT, with or without /v1.")
@click.option("--model", default=None, help="Model name for the requests (default: the first in GET /v1/models).")
@click.option("--endpoint", default="completions", show_default=True, type=click.Choice(["completions", "chat"]),
              help="/v1/completions (text prompt) or /v1/chat/completions (the prompt as one user message).")
@click.option("--rate", default="1,4,16,64,inf", show_default=True, type=_Rates(),
              help="Request rates to sweep, req/s, comma-separated; inf sends every request at once.")
@click.option("--arrivals", default="poisson", show_default=True, type=click.Choice(["poisson", "constant"]),
              help="Gaps between requests: random (gamma with shape --burstiness; 1 = Poisson) or exactly 1/rate.")
@click.option("--burstiness", default=1.0, show_default=True, type=float,
              help="Shape of the gamma gaps for poisson arrivals: below 1 burstier, above 1 more regular.")
@click.option("--num-requests", default=1000, show_default=True, type=click.IntRange(min=1),
              help="Requests per rate.")
@click.option("--max-concurrency", default=None, type=click.IntRange(min=1),
              help="At most this many requests in flight; a due request waits for a slot (default: no limit).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of lengths, text and arrival times.")
@click.option("--mix", default="sharegpt-like", show_default=True,
              help="Prompt/output lengths: sharegpt-like (log-normal, ~200 in / ~180 out tokens on average, "
                   "4..1024 each) or fixed:IN:OUT.")
@click.option("--tokenizer", default=None, metavar="PATH|gemma3-270m",
              help="The served model's tokenizer (tokenizer.json, an HF directory, a .gguf or gemma3-270m): "
                   "prompts get exactly their drawn token counts. Without it prompts are cut at ~4 characters "
                   "a token and the server's usage counts say what was sent.")
@click.option("--ignore-eos/--no-ignore-eos", default=True, show_default=True,
              help="Send ignore_eos (a vLLM extension warpforge serve accepts) so outputs run to max_tokens; a "
                   "server that ignores it stops early: the measured lengths are recorded and reported.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="Sampling temperature.")
@click.option("--goodput", multiple=True, metavar="KEY:MS",
              help="Latency limits of a good request, e.g. --goodput 'ttft:500 tpot:50' (keys ttft, tpot, e2e; "
                   "milliseconds); goodput = good requests per second.")
@click.option("--api-key", default=None, envvar="WARPFORGE_API_KEY",
              help="Bearer token for the server (default: $WARPFORGE_API_KEY); never stored.")
@click.option("--timeout", default=600.0, show_default=True, type=float, help="Seconds a request may take.")
@click.option("--quick", is_flag=True, help="Without --url: the suite at toy sizes on the CPU.")
@click.option("-k", "case_filter", default=None, help="Without --url: only suite cases whose name contains this.")
@record_options("serve.jsonl")
@click.pass_context
def bench_serve(ctx: click.Context, url: str | None, quick: bool, case_filter: str | None, store_url: str | None,
                no_store: bool, out: str | None, **load: Any) -> None:
    from warpforge._cli_support import make_console

    console, err = make_console(), make_console(stderr=True)
    given = [n for n in LOAD_OPTIONS
             if ctx.get_parameter_source(n) not in (None, click.core.ParameterSource.DEFAULT)
             and not (n == "api_key" and ctx.get_parameter_source(n) == click.core.ParameterSource.ENVIRONMENT)]
    if url is None:
        if given:
            opts = ", ".join("--" + n.replace("_", "-") for n in given)
            err.print(f"[red]{opts}: only with --url (without --url, `warpforge bench serve` runs the fixed "
                          "serve suite)[/]")
            sys.exit(2)
        from warpforge.bench.cli import cli_bench

        sys.exit(cli_bench(suite="serve", list_suites=False, quick=quick, case_filter=case_filter,
                           store_url=store_url, no_store=no_store, out=out, console=console))
    if quick or case_filter:
        err.print("[red]--quick, -k: only without --url (they select the serve suite's cases)[/]")
        sys.exit(2)
    sys.exit(cli_bench_serve(url=url, store_url=store_url, no_store=no_store, out=out, console=console, err=err,
                             **load))
