"""The ``warpforge profile`` command: resolve the target, profile it, print the picture, write the report.

Exit codes: 0 done; 2 bad input (unknown target, a model that fails, an empty window, unreadable
profiles to compare), with one clear line on stderr. ``--json`` prints the profile (or the comparison)
as JSON on stdout and everything else on stderr.
"""

from __future__ import annotations

import re
from pathlib import Path

import click
from typing import Any

import torch


def _err(msg: str) -> int:
    """One line on stderr for bad input; -> exit status 2."""
    from rich.markup import escape

    from warpforge._cli_support import make_console

    make_console(stderr=True).print(f"[bold red]warpforge profile:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    return 2


def _device(device: str) -> torch.device | None:
    """--device: auto is the GPU when there is one; None when CUDA is asked for and missing."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    return None if dev.type == "cuda" and not torch.cuda.is_available() else dev


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")[:80] or "profile"


def cli_profile(target: str | None, *, input_shapes: tuple[str, ...] = (), warmup: int = 5, iters: int = 20,
                out: str | None = None, compare_paths: tuple[str, str] | None = None, trace: bool = False,
                device: str = "auto", top: int = 15, batch: int | None = None, prompt_len: int | None = None,
                window: str = "light", json_out: bool = False, console=None) -> int:
    from warpforge._cli_support import make_console, native_output_to_log

    console = console or make_console()
    if json_out:  # stdout carries the JSON alone
        console = make_console(stderr=True)
    if compare_paths:
        return _compare(compare_paths, console, top, json_out)
    if not target:
        return _err("give a TARGET to profile, or --compare A.json B.json")
    from warpforge.profile.api import profile
    from warpforge.profile.targets import TargetError, parse_shape, resolve
    from warpforge.profile.trace import ProfileError

    dev = _device(device)
    if dev is None:
        return _err("--device cuda: CUDA is not available on this machine")
    try:
        shapes = [parse_shape(s) for s in input_shapes]
        t = resolve(target, input_shapes=shapes or None, device=dev, batch=batch, prompt_len=prompt_len)
    except TargetError as e:
        return _err(str(e))
    console.print(f"profiling [bold]{t.name}[/] on {dev}: {warmup} warm-up, {iters} measured iterations",
                  highlight=False)
    try:
        with native_output_to_log():  # the profiler's own prints (CUPTI, USDT probes) go to the log file
            p = profile(t.fn, *t.inputs, module=t.module, count_fn=t.count_fn, warmup=warmup, iters=iters,
                        name=t.name, work=t.work, window=window)
    except ProfileError as e:
        return _err(str(e))
    except ValueError as e:  # bad settings (iters < 1, ...)
        return _err(str(e))
    p.analysis.notes[:0] = t.notes
    out_dir = Path(out) if out else Path("out") / "profile" / _slug(target)
    paths = p.write(out_dir, trace=trace)
    if json_out:
        click.echo(paths["json"].read_text())
    print_summary(p.as_dict(), console, top)
    console.print(f"\nreport: {paths['html']}\njson:   {paths['json']}"
                  + (f"\ntrace:  {paths['trace']}" if "trace" in paths else ""), highlight=False)
    return 0


def print_summary(d: dict[str, Any], console, top: int = 15) -> None:
    """Verdict, headline figures, findings and the top operators, in the terminal."""
    from rich.markup import escape
    from rich.table import Table

    t, s = d["timing"], d["split"]
    console.print(f"\n[bold]{d['verdict']}[/]  ·  {t['window_ms']:.3f} ms per iteration"
                  + (f"  ·  profiler overhead {100 * t['overhead']:.1f}%" if t.get("overhead") is not None else "")
                  + (" (CPU half alone {}, CUDA half alone {})".format(
                      *(("—" if t["overhead_parts"].get(h) is None else f"{t['overhead_parts'][h]:+.1%}")
                        for h in ("cpu", "cuda")))
                     if t.get("overhead_parts") else "")
                  + f"  ·  {d['counts']['flops'] / 1e9:.3g} GFLOP, {d['counts']['bytes'] / 1e6:.3g} MB per iteration",
                  highlight=False)
    for warning in (d.get("meta", {}).get("host", {}).get("warning"), t.get("overhead_note")):
        if warning:  # a busy machine, an overhead below the noise: said, never shown as a figure
            console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False)
    dec = d.get("declared")
    if dec and dec.get("device_GBps") is not None:
        console.print(f"declared work: {dec['device_GBps']:,.4g} GB/s, {dec['device_TFLOPs']:.4g} TFLOP/s over "
                      f"{dec['device_us']:.1f} µs of device time per call", highlight=False)
    for f in [f for f in d["findings"] if f["severity"] > 0][:6]:
        console.print(f"  • {f['text']}", highlight=False, soft_wrap=True)
    cuda = d["device_type"] == "cuda"
    tab = Table(title=f"top {top} operators by {'GPU' if cuda else 'host'} time per iteration", title_justify="left")
    cols = ["operator (module / op)", "calls", "time", "share", "TFLOP/s", "GB/s"]
    cols += ["of roof", "bound"] if cuda else []
    for col in cols:
        tab.add_column(col, justify="left" if col.startswith("operator") else "right")
    for r in d["ops"][:top]:
        row = [r["name"], f"{r['calls']:g}", f"{r['time_us']:.1f} µs", f"{100 * r['share']:.1f}%",
               "—" if r.get("tflops") is None else f"{r['tflops']:.3g}",
               "—" if r.get("GBps") is None else f"{r['GBps']:.3g}"]
        if cuda:
            row += ["—" if r.get("fraction") is None else f"{100 * r['fraction']:.0f}%", r.get("bound") or "—"]
        tab.add_row(*row)
    console.print(tab)
    if not cuda:
        console.print("CPU run: host timers; the roofline is omitted (no GPU ceilings).", highlight=False)
    if s.get("busy_us") is not None:
        console.print(f"GPU busy {s['busy_us']:.1f} µs of {s['window_us']:.1f} µs; idle host-bound "
                      f"{s['idle_host_us']:.1f} µs, launch gaps {s['idle_launch_us']:.1f} µs", highlight=False)


def _compare(paths: tuple[str, str], console, top: int, json_out: bool = False) -> int:
    from rich.markup import escape
    from rich.table import Table

    from warpforge.profile.compare import compare

    try:
        c = compare(paths[0], paths[1], top=top)
    except ValueError as e:
        return _err(str(e))
    if json_out:
        import json

        click.echo(json.dumps(c, indent=1, default=str))
    console.print(f"A: {c['a']['target']} ({c['a']['device']}, {c['a']['time']})\n"
                  f"B: {c['b']['target']} ({c['b']['device']}, {c['b']['time']})", highlight=False, markup=False)
    for line in c["summary"]:
        style = "[yellow]" if line.startswith("warning:") else ""
        console.print(f"  • {style}{escape(line)}{'[/]' if style else ''}", highlight=False)
    split = Table(title="time split per iteration (B / A)", title_justify="left")
    for col in ("", "A", "B", "B/A", "change"):
        split.add_column(col, justify="left" if not col or col == "change" else "right")
    for k, v in c["split"].items():
        split.add_row(k, _n(v["a"]), _n(v["b"]), "—" if v["ratio"] is None else f"{v['ratio']:.3f}", v["change"])
    console.print(split)
    for label in ("ops", "kernels"):
        if not c[label]:
            continue
        tab = Table(title=f"{label} that moved most (µs per iteration)", title_justify="left")
        for col in ("name", "A", "B", "delta", "change"):
            tab.add_column(col, justify="left" if col in ("name", "change") else "right")
        for r in c[label]:
            tab.add_row(r["name"][:70], f"{r['a_us']:.1f}", f"{r['b_us']:.1f}", f"{r['delta_us']:+.1f}", r["change"])
        console.print(tab)
    return 0


def _n(v: float | None) -> str:
    return "—" if v is None else f"{v:,.1f}"
