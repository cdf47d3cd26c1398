"""`warpforge demo`: the main job on the embedded default, with measured figures.

Grows as parts land. Today: probe the machine (quick), then the `memory` suite (our Triton
copy/fill/sum against torch, same run, checked and stored). On a machine without a GPU both
run smaller and say so.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console


def _headline(console: Console, store_url: str | None) -> None:
    """One line per figure a reader should take away, read back from what was just measured."""
    from warpforge._paths import default_store_url
    from warpforge.bench.store import Store, StoreError
    from warpforge.hw.probe import _fmt, figures, load_cached

    probe = load_cached()
    if probe:
        for row in figures(probe)[:4]:
            if row.get("error"):
                continue
            frac = f" ({row['fraction']:.0%} of datasheet)" if row.get("fraction") else ""
            text = row["text"] or _fmt(row["measured"], row["unit"])
            console.print(f"  probe  {row['figure']}: [bold]{text}[/]{frac}")
    try:
        with Store(store_url or default_store_url(), create=False) as store:
            run = store.get_run("latest")
    except StoreError as e:
        console.print(f"  [yellow]no stored bench run to summarize: {e}[/]")
        return
    for rec in run["records"]:
        ratios = ", ".join(f"{r:.2f}x vs {p}" for p, r in rec.get("ratio", {}).items())
        fig = _figure(rec)
        ok = "[green]ok[/]" if rec["correct"]["ok"] else "[red]WRONG[/]"
        console.print(f"  bench  {rec['case']}: [bold]{fig}[/] {ratios} correct={ok}")


def _figure(rec: dict[str, Any]) -> str:
    ours = rec["ours"]
    if "GBps" in ours:
        return f"{ours['GBps']:.0f} GB/s"
    if "tflops" in ours:
        return f"{ours['tflops']:.1f} TFLOP/s"
    return f"{ours['ms']:.3f} ms"


def run_demo(store_url: str | None, console: Console) -> int:
    import torch

    from warpforge.bench.cli import cli_bench
    from warpforge.hw.probe import cli_probe

    gpu = torch.cuda.is_available()
    where = torch.cuda.get_device_name() if gpu else "CPU only (smaller sizes; kernels run their torch references)"
    console.rule("[bold]warpforge demo")
    console.print(f"machine: {where}")
    console.rule("1/2  warpforge probe --quick: the machine's measured ceilings")
    rc = cli_probe(quick=True, json_out=None, use_cache=True, console=console)
    console.rule("2/2  warpforge bench memory --quick: our Triton kernels vs torch, same inputs, same run")
    rc = rc or cli_bench(suite="memory", list_suites=False, quick=True, case_filter=None, store_url=store_url,
                         no_store=False, out=None, console=console)
    console.rule("measured")
    _headline(console, store_url)
    console.print("next: `warpforge probe` (full), `warpforge bench --list`, `warpforge results list`")
    return rc
