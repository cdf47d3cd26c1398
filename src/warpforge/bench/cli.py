"""`warpforge bench` and `warpforge results`: the terminal side of the bench part.

Each function returns the exit code: 0 fine, 1 a correctness check of ours failed (the run is still
stored and written), 2 a usage or store problem (unknown suite, unusable results store), said on stderr.
With ``json_out`` the records (or runs) go to stdout as JSON and everything else to stderr.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from warpforge._cli_support import note_in_log
from warpforge.settings import default_store_url

UNITS = {"GBps": "GB/s", "tflops": "TFLOP/s", "tok/s": "tok/s", "ms": "ms"}
CPU_NOTE = ("No CUDA device: 'ours' ran the torch reference path on the CPU, so these are reference-path "
            "figures, not Triton-kernel figures.")


# ---- formatting --------------------------------------------------------------------------------

def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.4f}" if x < 1 else f"{x:.3f}" if x < 100 else f"{x:.1f}"


def _fig(x: float | None) -> str:
    return "—" if x is None else f"{x:,.1f}" if x >= 10 else f"{x:.3g}"


def _ratio(r: float | None, interval: list[float] | None = None) -> str:
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
               "[bold red]error[/]" if "error" in ours else _ms(ours["ms"]),
               "—" if "error" in ours else fig]
        for p in peers:
            pr = r["peers"].get(p)
            row.append("—" if pr is None else "[yellow]error[/]" if "error" in pr else _ms(pr["ms"]))
        row += [_ratio(r["ratio"].get(p), (r.get("ratio_interval") or {}).get(p)) for p in peers]
        row += [_roof(r["roofline"]), _correct(r["correct"])]
        t.add_row(*row)
    return t


def _print_errors(records: list[dict[str, Any]], console: Console) -> None:
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


def _environment(records: list[dict[str, Any]], console: Console, host_shown: str | None = None) -> None:
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


def _err(msg: str) -> int:
    """One line on stderr for a usage or store problem; -> exit status 2."""
    from warpforge._cli_support import make_console

    make_console(stderr=True).print(f"[bold red]warpforge:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    return 2


def _store_error(e: Exception, console: Console | None = None) -> int:
    return _err(f"results store error: {e}")


def _print_json(data: Any) -> None:
    import json

    print(json.dumps(data, indent=1, default=str))


def out_file(out: str, suite: str) -> str:
    """Where ``--out`` puts a suite's records: a directory gets ``<suite>.jsonl`` (the committed records'
    layout, benchmarks/results/<device>/<suite>.jsonl); a path ending in .jsonl or .json is that file."""
    from pathlib import Path

    path = Path(out)
    if path.suffix in (".jsonl", ".json") or path.is_file():
        return str(path)
    path.mkdir(parents=True, exist_ok=True)
    return str(path / f"{suite}.jsonl")


# ---- warpforge bench -----------------------------------------------------------------------------

def _list(console: Console, quick: bool) -> int:
    from warpforge.bench.runner import list_suites, load_suite

    for name in list_suites():
        try:
            suite = load_suite(name)
            cases = suite.build(quick)
        except Exception as e:  # noqa: BLE001 - one broken suite must not hide the others
            console.print(f"[bold]{name}[/]: [red]cannot load ({escape(type(e).__name__ + ': ' + str(e))})[/]")
            continue
        console.print(f"[bold]{name}[/]: {escape(suite.description)}")
        for c in cases:
            vs = ", ".join(c.peers) or getattr(c, "baseline", "")  # end-to-end cases may judge against a figure
            console.print(f"  {escape(c.name)}  [dim](peers: {escape(vs)})[/]")
    return 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def cli_bench(suite: str | None, list_suites: bool, quick: bool, case_filter: str | None, store_url: str | None,
              no_store: bool, out: str | None, console: Console, json_out: bool = False) -> int:
    return run_bench(suite, list_suites, quick, case_filter, store_url, no_store, out, console, json_out)[0]


def run_bench(suite: str | None, list_suites: bool, quick: bool, case_filter: str | None, store_url: str | None,
              no_store: bool, out: str | None, console: Console,
              json_out: bool = False) -> tuple[int, int | None]:
    """`warpforge bench`; -> (exit status, the id of the run it stored or None). A caller that reads the run
    back uses the id: "latest" may be another process's run by then."""
    from warpforge.bench.record import now_iso, write_jsonl
    from warpforge.bench.runner import UnknownSuiteError, default_device, list_suites as _names, load_suite, run_suite

    if json_out:  # stdout carries the records alone
        from warpforge._cli_support import make_console

        console = make_console(stderr=True)
    if list_suites:
        return _list(console, quick), None
    if not suite:
        return _err(f"name a suite: warpforge bench SUITE (available: {', '.join(_names()) or 'none'})"), None
    try:
        s = load_suite(suite)
    except UnknownSuiteError as e:
        return _err(str(e)), None
    if out:
        out = out_file(out, s.name)
    device = default_device()
    if device.type == "cpu":
        console.print(f"[yellow]{CPU_NOTE}[/]")
    from warpforge.bench.host import check_host

    host_warning = check_host(device).warning  # checked again before each case, and kept in its record
    if host_warning:
        console.print(f"[yellow]{escape(host_warning)}[/]")
    started = now_iso()
    records: list[dict] = []
    if out:
        write_jsonl(out, [])  # start the file empty: each case is appended as it finishes

    def keep(record: dict) -> None:
        if out:
            write_jsonl(out, [record], append=True)

    interrupted = False
    # SIGTERM (a job scheduler's or `timeout`'s stop) ends the run like Ctrl-C: finished cases are kept.
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt) if _main_thread() else None
    try:
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[case]}"), console=console, transient=True) as bar:
            task = bar.add_task(f"bench {s.name}", total=None, case="")

            def progress(done: int, total: int, name: str) -> None:
                bar.update(task, completed=done, total=total, case=name)

            run_suite(s, quick=quick, case_filter=case_filter, progress=progress, device=device,
                      records=records, on_record=keep)
    except KeyboardInterrupt:
        interrupted = True
        console.print(f"[yellow]interrupted: keeping the {len(records)} finished case(s)[/]")
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    finished = now_iso()
    if not records:
        if interrupted:
            return 130, None
        return _err(f"-k {case_filter!r}: no case of {s.name} matches (warpforge bench --list shows them)"), None
    if json_out:
        _print_json(records)
    console.print(records_table(records, title=f"{s.name}" + (" (quick)" if quick else "")))
    _print_errors(records, console)
    _environment(records, console, host_shown=host_warning)

    rc, run_id = 130 if interrupted else 0, None
    if out:
        console.print(f"wrote {len(records)} records to {escape(out)}")
    if not no_store:
        from warpforge.bench.store import Store, StoreError

        try:
            with Store(store_url or default_store_url()) as store:
                run_id = store.add_run(s.name, records, {"started": started, "finished": finished,
                                                         "argv": ["warpforge", *sys.argv[1:]]})
                console.print(f"stored as run {run_id} in {escape(store.where)} "
                              f"([dim]warpforge results show {run_id}[/])")
                note_in_log(f"stored as run {run_id} in {store.where}")
        except StoreError as e:
            rc = _store_error(e, console)
    failed = [r["case"] for r in records if not r["correct"]["ok"]]
    if failed:
        console.print(f"[bold red]correctness FAILED for ours in {len(failed)} case(s):[/] "
                      f"{escape(', '.join(failed))}")
        rc = rc or 1
    bugs = [r["case"] for r in records if r.get("figure_errors")]
    if bugs:  # a fraction above its ceiling: a bug in a ceiling or a work count, not a result
        console.print(f"[bold red]figures above their ceilings in {len(bugs)} case(s) (not stored as figures):[/] "
                      f"{escape(', '.join(bugs))}")
        rc = rc or 1
    return rc, run_id


# ---- warpforge results ---------------------------------------------------------------------------

def _open(store_url: str | None) -> Any:
    from warpforge.bench.store import Store

    return Store(store_url or default_store_url(), create=False)


def _json_console(console: Console, json_out: bool) -> Console:
    """The console for everything but the JSON: stderr when stdout carries JSON."""
    if not json_out:
        return console
    from warpforge._cli_support import make_console

    return make_console(stderr=True)


def cli_results_list(store_url: str | None, suite: str | None, limit: int, console: Console,
                     json_out: bool = False) -> int:
    from warpforge.bench.store import StoreError, StoreMissing

    console = _json_console(console, json_out)
    try:
        with _open(store_url) as store:
            runs = store.list_runs(suite=suite, limit=limit)
            where = store.where
    except StoreMissing as e:
        console.print(str(e))
        if json_out:
            _print_json([])
        return 0
    except StoreError as e:
        return _store_error(e, console)
    if json_out:
        _print_json(runs)
        return 0
    if not runs:
        console.print(f"no runs{f' of suite {suite}' if suite else ''} in {escape(where)}")
        return 0
    t = Table(title=f"runs in {where}", title_justify="left", header_style="bold")
    for col in ("run", "suite", "started (UTC)", "device", "git", "cases", "failed", "host"):
        t.add_column(col, justify="right" if col in ("run", "cases", "failed") else "left")
    for r in runs:
        failed = f"[bold red]{r['n_failed']}[/]" if r["n_failed"] else "0"
        t.add_row(str(r["id"]), escape(r["suite"]), r["started"].replace("+00:00", ""), escape(r["device"]),
                  (r["git"] or "—")[:12] + ("-dirty" if (r["git"] or "").endswith("-dirty") else ""),
                  str(r["n_records"]), failed, escape(r["host"] or ""))
    console.print(t)
    return 0


def cli_results_show(run: str, store_url: str | None, console: Console, json_out: bool = False) -> int:
    from warpforge.bench.store import StoreError

    console = _json_console(console, json_out)
    try:
        with _open(store_url) as store:
            got = store.get_run(run)
    except StoreError as e:
        return _store_error(e, console)
    if json_out:
        _print_json(got)
        return 0
    meta, records = got["run"], got["records"]
    console.print(f"[bold]run {meta['id']}[/]: suite {escape(meta['suite'])}, {meta['started']} -> {meta['finished']}, "
                  f"host {escape(meta['host'] or '?')}, warpforge {meta['warpforge_version']}")
    if meta.get("argv"):
        console.print(f"[dim]command: {escape(' '.join(map(str, meta['argv'])))}[/]")
    if records:
        console.print(records_table(records))
        _print_errors(records, console)
        _environment(records, console)
    else:
        console.print("(no records)")
    return 0


def cli_results_compare(run_a: str, run_b: str, store_url: str | None, console: Console,
                        json_out: bool = False) -> int:
    from warpforge.bench.store import FLAG_FLOOR, StoreError, compare_records

    console = _json_console(console, json_out)
    try:
        with _open(store_url) as store:
            a, b = store.get_run(run_a), store.get_run(run_b)
    except StoreError as e:
        return _store_error(e, console)
    ra, rb = a["run"], b["run"]
    if json_out:
        _print_json({"a": ra, "b": rb, "cases": compare_records(a["records"], b["records"])})
        return 0
    console.print(f"A = run {ra['id']} ({escape(ra['suite'])}, {escape(ra['device'])}, {ra['started']}, "
                  f"git {(ra['git'] or '—')[:12]})")
    console.print(f"B = run {rb['id']} ({escape(rb['suite'])}, {escape(rb['device'])}, {rb['started']}, "
                  f"git {(rb['git'] or '—')[:12]})")
    if ra["suite"] != rb["suite"] or ra["device"] != rb["device"]:
        console.print("[yellow]warning: the runs differ in suite or device; only same-named cases are compared[/]")
    rows = compare_records(a["records"], b["records"])
    t = Table(header_style="bold")
    for col in ("case", "A ms", "B ms", "A/B", "IQR/med A", "IQR/med B", "change"):
        t.add_column(col, justify="left" if col in ("case", "change") else "right")
    counts = {"faster": 0, "slower": 0}
    for row in rows:
        flag = row["flag"]
        counts[flag] = counts.get(flag, 0) + 1
        shown = {"faster": "[green]B faster[/]", "slower": "[red]B slower[/]"}.get(flag, f"[dim]{flag}[/]" if flag
                                                                                    else "[dim]within spread[/]")
        spread = [("—" if s is None else f"{100 * s:.1f}%") for s in (row["a_spread"], row["b_spread"])]
        t.add_row(escape(row["case"]), _ms(row["a_ms"]), _ms(row["b_ms"]), _ratio(row["ratio"]), *spread, shown)
    console.print(t)
    console.print(f"{counts['faster']} faster, {counts['slower']} slower in B; a change is flagged when it exceeds "
                  f"both runs' relative spread (IQR/median) plus {100 * FLAG_FLOOR:.0f}%. A/B above 1: B is faster.")
    return 0
