"""`warpforge bench`: run a suite, print its table (the results part's), store and write its records.

Each function returns the exit code: 0 fine, 1 a correctness check of ours failed (the run is still
stored and written), 2 a usage or store problem (unknown suite, unusable results store), said on stderr.
With ``json_out`` the records (or runs) go to stdout as JSON and everything else to stderr.
"""

from __future__ import annotations

import signal
import sys

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from warpforge._cli_support import note_in_log
from warpforge.results.terminal import (CPU_NOTE, print_environment, print_error, print_json, print_record_errors,
                                        print_store_error, records_table)
from warpforge.settings import default_store_url


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
    from warpforge.results.record import now_iso, write_jsonl
    from warpforge.bench.runner import UnknownSuiteError, default_device, list_suites as _names, load_suite, run_suite

    if json_out:  # stdout carries the records alone
        from warpforge._cli_support import make_console

        console = make_console(stderr=True)
    if list_suites:
        return _list(console, quick), None
    if not suite:
        return print_error(f"name a suite: warpforge bench SUITE (available: {', '.join(_names()) or 'none'})"), None
    try:
        s = load_suite(suite)
    except UnknownSuiteError as e:
        return print_error(str(e)), None
    if out:
        out = out_file(out, s.name)
    device = default_device()
    if device.type == "cpu":
        console.print(f"[yellow]{CPU_NOTE}[/]")
    from warpforge.results.host import check_host

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
        return print_error(f"-k {case_filter!r}: no case of {s.name} matches (warpforge bench --list shows them)"), None
    if json_out:
        print_json(records)
    console.print(records_table(records, title=f"{s.name}" + (" (quick)" if quick else "")))
    print_record_errors(records, console)
    print_environment(records, console, host_shown=host_warning)

    rc, run_id = 130 if interrupted else 0, None
    if out:
        console.print(f"wrote {len(records)} records to {escape(out)}")
    if not no_store:
        from warpforge.results.store import Store, StoreError

        try:
            with Store(store_url or default_store_url()) as store:
                run_id = store.add_run(s.name, records, {"started": started, "finished": finished,
                                                         "argv": ["warpforge", *sys.argv[1:]]})
                console.print(f"stored as run {run_id} in {escape(store.where)} "
                              f"([dim]warpforge results show {run_id}[/])")
                note_in_log(f"stored as run {run_id} in {store.where}")
        except StoreError as e:
            rc = print_store_error(e, console)
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
