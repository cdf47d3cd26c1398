"""A run's records in the terminal: the table `warpforge bench` and `warpforge results show` print, the lines
under it (failures, wrong peers, noise, figure bugs) and the environment it ran in; and how a command says it
failed (one line on stderr, exit 2) or prints JSON."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

UNITS = {"GBps": "GB/s", "tflops": "TFLOP/s", "tok/s": "tok/s", "ms": "ms"}
CPU_NOTE = ("No CUDA device: 'ours' ran the torch reference path on the CPU, so these are reference-path "
            "figures, not Triton-kernel figures.")


def ms_text(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.4f}" if x < 1 else f"{x:.3f}" if x < 100 else f"{x:.1f}"


def _fig(x: float | None) -> str:
    return "—" if x is None else f"{x:,.1f}" if x >= 10 else f"{x:.3g}"


def ratio_text(r: float | None, interval: list[float] | None = None) -> str:
    """A ratio with its interval (the lowest and highest per-round ratio) when the record has one."""
    if r is None:
        return "—"
    color = "green" if r > 1 else "red" if r < 1 else ""
    shown = f"{r:.2f}x" + (f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else "")
    return f"[{color}]{shown}[/]" if color else shown


def _correct(c: dict[str, Any]) -> str:
    err = c.get("rel_err")
    shown = "—" if err is None else f"{err:.1e}"
    if c.get("against") == "baseline":
        return "baseline"
    if c.get("against") == "completion" and c.get("ok"):
        return "completed"
    if c.get("ok"):
        return f"[green]ok[/] {shown}"
    return f"[bold red]FAIL[/] {shown}" + (f" ({escape(c['note'])})" if c.get("note") else "")


def _roof(r: dict[str, Any] | None) -> str:
    if not r:
        return "—"
    return f"{100 * r['fraction']:.0f}% {'mem' if r['bound'] == 'memory' else 'compute'}"


def records_table(records: list[dict[str, Any]], title: str | None = None) -> Table:
    """case | ours ms | figure | each peer's ms | ours vs each peer | roofline | correct."""
    peers: list[str] = []
    for r in records:
        peers += [p for p in r["peers"] if p not in peers]
    metrics = {r.get("metric", "GBps") for r in records}
    unit = UNITS.get(next(iter(metrics)), "figure") if len(metrics) == 1 else "figure"
    t = Table(title=title, title_justify="left", header_style="bold")
    t.add_column("case")
    t.add_column("ours ms", justify="right")
    t.add_column(unit, justify="right")
    for p in peers:
        t.add_column(f"{p} ms", justify="right")
    for p in peers:
        t.add_column(f"vs {p}", justify="right")
    t.add_column("roofline", justify="right")
    t.add_column("correct")
    for r in records:
        ours, metric = r["ours"], r.get("metric", "GBps")
        fig = _fig(ours.get(metric)) + ("" if len(metrics) == 1 else f" {UNITS.get(metric, metric)}")
        noisy = (r.get("stability") or {}).get("noisy")
        row = [escape(r["case"]) + (" [yellow]noisy[/]" if noisy else ""),
               "[bold red]error[/]" if "error" in ours else ms_text(ours["ms"]),
               "—" if "error" in ours else fig]
        for p in peers:
            pr = r["peers"].get(p)
            row.append("—" if pr is None else "[yellow]error[/]" if "error" in pr else ms_text(pr["ms"]))
        row += [ratio_text(r["ratio"].get(p), (r.get("ratio_interval") or {}).get(p)) for p in peers]
        row += [_roof(r["roofline"]), _correct(r["correct"])]
        t.add_row(*row)
    return t


def print_record_errors(records: list[dict[str, Any]], console: Console) -> None:
    for r in records:
        if "error" in r["ours"]:
            console.print(f"[bold red]ours failed[/] in {escape(r['case'])}: {escape(r['ours']['error'])}")
        for name, p in r["peers"].items():
            if "error" in p:
                console.print(f"[yellow]peer {escape(name)} unavailable[/] in {escape(r['case'])}: "
                              f"{escape(p['error'])}")
        for name, p in r["peers"].items():
            if "error" not in p and not p["correct"]["ok"]:
                console.print(f"[yellow]peer {escape(name)} is wrong[/] in {escape(r['case'])} "
                              f"(rel_err {p['correct'].get('rel_err')}): shown, no ratio taken against it")
        for name, why in (r.get("ratio_null") or {}).items():
            if why.startswith("different work"):  # failures and failed checks have their own lines
                console.print(f"[yellow]no ratio vs {escape(name)}[/] in {escape(r['case'])}: {escape(why)}")
        stab = r.get("stability") or {}
        if stab.get("noisy"):
            worst = {n: s for n, s in (stab.get("spread") or {}).items()
                     if any(v is None or v > stab["bound"] for v in s.values())}
            shown = ", ".join(f"{escape(n)} rounds {_spread(s.get('rounds'))} p80/p20 {_spread(s.get('p80_p20'))}"
                              for n, s in worst.items())
            console.print(f"[yellow]noisy[/] {escape(r['case'])}: after {stab.get('attempts')} attempt(s) the spread "
                          f"exceeds {stab['bound']:.2f} ({shown})")
        for msg in r.get("figure_errors") or []:
            console.print(f"[bold red]figure bug[/] in {escape(r['case'])}: {escape(msg)}")


def _spread(x: float | None) -> str:
    return "unbounded" if x is None else f"{x:.2f}"


def print_environment(records: list[dict[str, Any]], console: Console, host_shown: str | None = None) -> None:
    if not records:
        return
    r = records[0]
    d = r["device"]
    what = d["name"] if d["name"] != "cpu" else f"cpu ({d.get('model', '?')}, {d.get('threads', '?')} threads)"
    extra = ", ".join(f"{k} {d[k]}" for k in ("driver", "cuda", "torch", "triton") if d.get(k))
    t = r.get("timing", {})
    console.print(f"[dim]device: {escape(what)}; {escape(extra)}; git {r['git'] or 'none'}; "
                  f"timing: {t.get('method')}, {t.get('warmup')} warm-up, median of {t.get('rep')}; "
                  "ratio = peer ms / ours ms (above 1: warpforge faster), on the same work, against peers that "
                  "passed their check; (low-high): the per-round range[/]")
    warnings = {w for x in records if (w := (x.get("host") or {}).get("warning"))}
    for w in sorted(warnings - {host_shown}):  # a busy machine during the run (the start's line is not repeated)
        console.print(f"[yellow]{escape(w)}[/]")
    sources = {r["roofline"].get("ceilings") for r in records if r["roofline"]}
    if sources:
        console.print(f"[dim]roofline against: {escape('; '.join(sorted(str(x) for x in sources)))}[/]")
    elif d["name"] == "cpu":
        # `warpforge probe` caches this CPU's figures all the same; they are not the reason.
        console.print("[dim]roofline: not computed for CPU runs (the cases run the torch reference at "
                      "cache-resident sizes, where a DRAM roofline fraction would mean nothing)[/]")
    else:
        console.print("[dim]roofline: none (no probe cache and no datasheet for this GPU; "
                      "`warpforge probe` measures its ceilings)[/]")
    if d["name"] == "cpu":
        console.print(f"[yellow]{CPU_NOTE}[/]")


def print_error(msg: str) -> int:
    """One line on stderr for a usage or store problem; -> exit status 2."""
    from warpforge._cli_support import make_console

    make_console(stderr=True).print(f"[bold red]warpforge:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    return 2


def print_store_error(e: Exception, console: Console | None = None) -> int:
    return print_error(f"results store error: {e}")


def print_json(data: Any) -> None:
    import json

    print(json.dumps(data, indent=1, default=str))
