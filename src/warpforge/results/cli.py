"""`warpforge results`: the runs in the store (list, show, compare), and the committed records and the store
over time (stale, table, history, report, check).

Each function returns the exit code: 0 fine, 1 what the command checks for was found (a regression, a table
that disagrees with its records, a stale record with --strict), 2 bad usage or an unreadable source, said
on one line on stderr. Sources: committed JSON lines (a file or a directory of ``<suite>.jsonl``, default
``benchmarks/results/h200``; their earlier versions in git too) and the results store.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from warpforge.results.terminal import (ms_text, print_environment, print_error, print_json, print_record_errors,
                                        print_store_error, ratio_text, records_table)
from warpforge.settings import default_store_url

DEFAULT_RECORDS = "benchmarks/results/h200"


# ---- list, show, compare: the runs in the store ------------------------------------------------------

def _open(store_url: str | None) -> Any:
    from warpforge.results.store import Store

    return Store(store_url or default_store_url(), create=False)


def _json_console(console: Console, json_out: bool) -> Console:
    """The console for everything but the JSON: stderr when stdout carries JSON."""
    if not json_out:
        return console
    from warpforge._cli_support import make_console

    return make_console(stderr=True)


def cli_results_list(store_url: str | None, suite: str | None, limit: int, console: Console,
                     json_out: bool = False) -> int:
    from warpforge.results.store import StoreError, StoreMissing

    console = _json_console(console, json_out)
    try:
        with _open(store_url) as store:
            runs = store.list_runs(suite=suite, limit=limit)
            where = store.where
    except StoreMissing as e:
        console.print(str(e))
        if json_out:
            print_json([])
        return 0
    except StoreError as e:
        return print_store_error(e, console)
    if json_out:
        print_json(runs)
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
    from warpforge.results.store import StoreError

    console = _json_console(console, json_out)
    try:
        with _open(store_url) as store:
            got = store.get_run(run)
    except StoreError as e:
        return print_store_error(e, console)
    if json_out:
        print_json(got)
        return 0
    meta, records = got["run"], got["records"]
    console.print(f"[bold]run {meta['id']}[/]: suite {escape(meta['suite'])}, {meta['started']} -> {meta['finished']}, "
                  f"host {escape(meta['host'] or '?')}, warpforge {meta['warpforge_version']}")
    if meta.get("argv"):
        console.print(f"[dim]command: {escape(' '.join(map(str, meta['argv'])))}[/]")
    if records:
        console.print(records_table(records))
        print_record_errors(records, console)
        print_environment(records, console)
    else:
        console.print("(no records)")
    return 0


def cli_results_compare(run_a: str, run_b: str, store_url: str | None, console: Console,
                        json_out: bool = False) -> int:
    from warpforge.results.store import FLAG_FLOOR, StoreError, compare_records

    console = _json_console(console, json_out)
    try:
        with _open(store_url) as store:
            a, b = store.get_run(run_a), store.get_run(run_b)
    except StoreError as e:
        return print_store_error(e, console)
    ra, rb = a["run"], b["run"]
    if json_out:
        print_json({"a": ra, "b": rb, "cases": compare_records(a["records"], b["records"])})
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
        t.add_row(escape(row["case"]), ms_text(row["a_ms"]), ms_text(row["b_ms"]), ratio_text(row["ratio"]), *spread,
                  shown)
    console.print(t)
    console.print(f"{counts['faster']} faster, {counts['slower']} slower in B; a change is flagged when it exceeds "
                  f"both runs' relative spread (IQR/median) plus {100 * FLAG_FLOOR:.0f}%. A/B above 1: B is faster.")
    return 0


def _store(store_url: str | None, *, required: bool) -> Any:
    """The store, or None when it does not exist and is not required (StoreError otherwise)."""
    from warpforge.results.store import Store, StoreMissing

    try:
        return Store(store_url or default_store_url(), create=False)
    except StoreMissing:
        if required:
            raise
        return None


# ---- stale ---------------------------------------------------------------------------------------

def cli_results_stale(paths: Sequence[str], rev: str, strict: bool, console: Console, json_out: bool = False) -> int:
    from warpforge.results.provenance import GitError, stale_groups, timed_paths

    console = _json_console(console, json_out)
    try:
        groups = stale_groups(list(paths) or [DEFAULT_RECORDS], rev=rev)
    except (GitError, FileNotFoundError, ValueError) as e:
        return print_error(str(e))
    if json_out:
        print_json([g.as_dict() for g in groups])
    else:
        t = Table(title=f"committed records against {rev}", title_justify="left", header_style="bold")
        for col in ("file", "suite", "commit", "cases", "status", "timed code changed since"):
            t.add_column(col, justify="right" if col == "cases" else "left")
        for g in groups:
            color = {"current": "green", "stale": "yellow"}.get(g.status, "red")
            changed = (f"{g.commits} commit(s): " + ", ".join(x.removeprefix("src/warpforge/") for x in g.changed[:4])
                       + (f", +{len(g.changed) - 4} more" if len(g.changed) > 4 else "")) if g.changed else ""
            t.add_row(escape(g.file), escape(g.suite), escape((g.git or "none")[:12]), str(len(g.cases)),
                      f"[{color}]{g.status}[/]", escape(changed))
        console.print(t)
        n = {s: sum(len(g.cases) for g in groups if g.status == s) for s in {g.status for g in groups}}
        console.print(", ".join(f"{v} {k}" for k, v in sorted(n.items())) + " record(s). The timed code of a suite: "
                      "its modules, what they time and the harness (warpforge.results.provenance.SUITE_SOURCES); e.g. "
                      f"memory: {', '.join(timed_paths('memory')[-2:])}")
    return 1 if strict and any(g.status != "current" for g in groups) else 0


# ---- table ---------------------------------------------------------------------------------------

def _split_cases(cases: Sequence[str]) -> list[str]:
    return [c.strip() for arg in cases for c in arg.split(";") if c.strip()]


def _records_dir_for(md: Path, records: str | None) -> Path:
    if records:
        return Path(records)
    beside = md.resolve().parent / DEFAULT_RECORDS
    return beside if beside.is_dir() else Path(DEFAULT_RECORDS)


def _md_loaders(md: Path, records: str | None, stale: bool) -> tuple[Any, Any]:
    """The loader of a Markdown file's tables (``--records`` or the default beside it) and the one for a
    marker's records=DIR (relative to the file); ``stale``: rows say how many commits have touched the code
    they time since they were measured."""
    from warpforge.results.provenance import GitError, repo_root
    from warpforge.results.tables import dir_loader, stale_loader

    loaders: dict[Path, Any] = {}

    def loader(d: Path) -> Any:
        if d not in loaders:
            loaders[d] = dir_loader(d)
            if stale:
                try:
                    loaders[d] = stale_loader(loaders[d], repo_root(md))
                except GitError:
                    pass
        return loaders[d]

    return loader(_records_dir_for(md, records)), lambda rel: loader(md.resolve().parent / rel)


def cli_results_table(suite: str | None, cases: Sequence[str], peers: str | None, fmt: str, records: str | None,
                      store_url: str | None, run: str | None, update: Sequence[str], check: Sequence[str],
                      console: Console) -> int:
    from warpforge.results.store import StoreError
    from warpforge.results.tables import (TableError, check_markdown, count_markers, dir_loader, render_suites,
                                          update_markdown)

    if update or check:
        if suite or cases or run:
            return print_error("--update/--check regenerate the tables their markers name: give no SUITE, --cases "
                               "or --run")
        rc = 0
        for path, write in [(p, True) for p in update] + [(p, False) for p in check]:
            md = Path(path)
            if not md.is_file():
                return print_error(f"{'--update' if write else '--check'}: no such file: {md}")
            text = md.read_text(encoding="utf-8")
            load, load_for = _md_loaders(md, records, write)
            try:
                if write:
                    new, changed = update_markdown(text, load, load_for)
                    if new != text:
                        md.write_text(new, encoding="utf-8")
                    shown = f" ({escape('; '.join(changed))})" if changed else ""
                    console.print(f"{escape(str(md))}: {count_markers(text)} marked table(s), "
                                  f"{len(changed)} regenerated{shown}")
                else:
                    problems = check_markdown(text, load, load_for)
                    for p in problems:
                        console.print(f"[red]{escape(str(md))}: {escape(p)}[/]")
                    if not problems:
                        console.print(f"{escape(str(md))}: {count_markers(text)} marked table(s) agree with "
                                      "the records")
                    rc = rc or (1 if problems else 0)
            except TableError as e:
                return print_error(f"{md}: {e}")
        return rc
    if not suite:
        return print_error("name a suite: warpforge results table SUITE (or --update FILE to regenerate marked tables)")
    try:
        if run is not None:
            with _store(store_url, required=True) as store:
                stored = store.get_run(run)["records"]
            load = lambda _suite: stored  # noqa: E731
        else:
            src = Path(records or DEFAULT_RECORDS)
            load = dir_loader(src) if src.is_dir() else (lambda _suite: _read_file(src))
        peer_list = [p.strip() for p in peers.split(",") if p.strip()] if peers else None
        suites = [x.strip() for x in suite.split(",") if x.strip()]
        text = render_suites(load, suites, _split_cases(cases) or None, peer_list, fmt)
    except (TableError, StoreError, FileNotFoundError) as e:
        return print_error(str(e))
    print(text)
    return 0


def _read_file(path: Path) -> list[dict[str, Any]]:
    from warpforge.results.record import read_jsonl

    if not path.is_file():
        raise FileNotFoundError(f"no records at {path} (expected a .jsonl file or a directory of <suite>.jsonl)")
    return read_jsonl(path, validate=False)


# ---- history and report --------------------------------------------------------------------------

def _gather(records: Sequence[str], store_url: str | None, with_git: bool, case: str | None = None):
    """(sourced records, the sources' names) from the committed files and the store (if it exists)."""
    from warpforge.results.history import committed_records, dedupe, store_records

    items, names = [], []
    for r in records or ([DEFAULT_RECORDS] if Path(DEFAULT_RECORDS).exists() else []):
        items += committed_records(r, with_git=with_git)
        names.append(str(r) + (" (and its git history)" if with_git else ""))
    store = _store(store_url, required=store_url is not None)
    if store is not None:
        with store:
            items += store_records(store, case=case)
            names.append(f"store {store.where}")
    return dedupe(items), names


def cli_results_history(case: str, suite: str | None, records: Sequence[str], store_url: str | None, with_git: bool,
                        console: Console, json_out: bool = False) -> int:
    from warpforge.results.history import REGRESSED, find_case, history
    from warpforge.results.store import StoreError

    console = _json_console(console, json_out)
    try:
        items, names = _gather(records, store_url, with_git)
        suite, case = find_case(items, case, suite)
    except (StoreError, FileNotFoundError, LookupError) as e:
        return print_error(str(e))
    pts = history(items, case, suite)
    if json_out:
        print_json({"suite": suite, "case": case, "points": [p.as_dict() for p in pts]})
        return 0
    t = Table(title=f"{suite}: {case}", title_justify="left", header_style="bold")
    for col in ("time (UTC)", "commit", "source", "ours ms (p20-p80)", "vs peers", "roofline", "check", "vs previous"):
        t.add_column(col, justify="right" if col.startswith("ours") else "left")
    for p in pts:
        ratios = "; ".join(f"{v:.2f}x {n}" + (f" ({p.ratio_interval[n][0]:.2f}-{p.ratio_interval[n][1]:.2f})"
                                                if n in p.ratio_interval else "") for n, v in p.ratio.items())
        ratios += "".join(f"; — {n}" for n in p.ratio_null) if ratios else "; ".join(f"— {n}" for n in p.ratio_null)
        ms = "error" if p.ms is None else f"{p.ms:.4g}" + (f" ({p.p20_ms:.4g}-{p.p80_ms:.4g})"
                                                           if p.p20_ms is not None and p.p80_ms is not None else "")
        flag = p.flag + (f" {100 * (p.change - 1):+.1f}% (band ±{100 * p.band:.1f}%)"
                         if p.change is not None and p.band is not None else "")
        color = "red" if p.flag in REGRESSED else "green" if p.flag == "faster" else ""
        t.add_row(p.time[:16].replace("T", " "), escape((p.git or "—")[:12]), escape(p.source),
                  ms + (" noisy" if p.noisy else ""), escape(ratios or "—"),
                  "—" if p.fraction is None else f"{100 * p.fraction:.0f}% {p.bound or ''}",
                  escape(p.check) if p.ok else f"[red]{escape(p.check)}[/]",
                  f"[{color}]{escape(flag)}[/]" if color else escape(flag))
    console.print(t)
    console.print(f"[dim]{len(pts)} record(s) from {escape('; '.join(names))}. vs previous: ours' time against the "
                  "record before it, flagged beyond the noise band (the larger spread of the two, +2%).[/]")
    return 0


def cli_results_report(out: str, records: Sequence[str], store_url: str | None, with_git: bool,
                       console: Console) -> int:
    from warpforge.results.record import now_iso
    from warpforge.results.report_html import case_count, render_dashboard
    from warpforge.results.store import StoreError

    try:
        items, names = _gather(records, store_url, with_git)
    except (StoreError, FileNotFoundError) as e:
        return print_error(str(e))
    if not items:
        return print_error(f"no records to show (looked in {', '.join(records) or DEFAULT_RECORDS} and the store)")
    html = render_dashboard(items, sources=names, generated=f"generated {now_iso()}")
    path = Path(out)
    if path.suffix.lower() in (".html", ".htm"):
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        path.mkdir(parents=True, exist_ok=True)
        path = path / "index.html"
    path.write_text(html, encoding="utf-8")
    n_reg = html.count('<section class="case regressed"')
    console.print(f"wrote {escape(str(path))}: {case_count(html)} cases, {len(items)} records; "
                  f"{n_reg} case(s) whose latest record regressed beyond its noise band")
    return 0


# ---- check (the gate) ----------------------------------------------------------------------------

def _records_of(spec: str, store_url: str | None) -> tuple[list[dict[str, Any]], str]:
    """A run given as a path (.jsonl file or directory: the records as they are now) or a store run."""
    from warpforge.results.history import read_records

    p = Path(spec)
    if p.exists():
        return [s.record for s in read_records(p)], str(p)
    with _store(store_url, required=True) as store:
        got = store.get_run(spec)
        return got["records"], f"run {got['run']['id']} ({got['run']['suite']}, {got['run']['started']})"


def cli_results_check(baseline: str, run: str, store_url: str | None, console: Console, json_out: bool = False) -> int:
    from warpforge.results.history import FLOOR, UNKNOWN_SPREAD, gate, regressions
    from warpforge.results.store import StoreError

    console = _json_console(console, json_out)
    try:
        base, base_name = _records_of(baseline, store_url)
        cur, cur_name = _records_of(run, store_url)
    except (StoreError, FileNotFoundError) as e:
        return print_error(f"results check: {e}")
    rows = gate(base, cur)
    bad = regressions(rows)
    compared = [r for r in rows if r.flag not in ("new", "missing", "other device", "other settings")]
    if json_out:
        print_json({"baseline": base_name, "run": cur_name, "regressed": len(bad),
                     "cases": [r.as_dict() for r in rows]})
    else:
        t = Table(title=f"{cur_name} against {base_name}", title_justify="left", header_style="bold")
        for col in ("suite", "case", "baseline ms", "ms", "change", "band", "verdict"):
            t.add_column(col, justify="right" if col in ("baseline ms", "ms", "change", "band") else "left")
        for r in rows:
            color = "red" if r in bad else "green" if r.flag == "faster" else "dim"
            t.add_row(escape(r.suite), escape(r.case), "—" if r.base_ms is None else f"{r.base_ms:.4g}",
                      "—" if r.ms is None else f"{r.ms:.4g}",
                      "—" if r.change is None else f"{100 * (r.change - 1):+.1f}%",
                      "—" if r.band is None else f"±{100 * r.band:.1f}%",
                      f"[{color}]{escape(r.flag or 'within noise')}[/]")
        console.print(t)
        console.print(f"[dim]band: the larger relative spread of the two records (p80/p20, round medians; "
                      f"{100 * UNKNOWN_SPREAD:.0f}% for a single repeat) + {100 * FLOOR:.0f}%[/]")
    if not compared:
        return print_error(f"results check: no case of {cur_name} is in {base_name}: nothing was compared")
    if bad:
        console.print(f"[bold red]{len(bad)} of {len(compared)} case(s) regressed beyond their noise band:[/] "
                      + escape(", ".join(f"{r.case} ({r.flag})" for r in bad)))
        return 1
    console.print(f"[green]no regression[/] in {len(compared)} case(s)")
    return 0


__all__ = ["cli_results_check", "cli_results_history", "cli_results_report", "cli_results_stale",
           "cli_results_table"]
