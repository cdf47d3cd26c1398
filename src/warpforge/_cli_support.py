"""What every ``warpforge`` command shares: where output goes and how a command fails.

* Tables and reports go to stdout, at full width when stdout is not a terminal (a pipe or a log file
  gets whole rows, not rows cut at 80 columns).
* Errors go to stderr: a bad input is one line and exit 2; anything else is one line naming the
  exception, exit 1, with the traceback in the run's log file.
* Other libraries' noise (warnings, log records, tqdm bars, native prints of the profiler) goes to
  the command's log file, ``<cache dir>/logs/<time>-<pid>.log``; ``--verbose`` shows it, and tracebacks,
  on stderr. One file per process: two commands running at once (a bench and a serve) never write into
  each other's log, and an error line names its own file.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import click

PACKAGE_DIR = str(Path(__file__).resolve().parent)
# Log records shown on stderr as usual: warpforge's own, and the web server's (`warpforge serve` exists
# to run it: its startup, bind errors and the access log a user asked for are the output).
SHOWN_LOGGERS = ("warpforge", "uvicorn")
WIDE = 1000  # columns for a console that is not a terminal: rich tables then take their natural width
# ...but a section rule fills whatever width it is given: off a terminal it takes this many columns instead
# of WIDE (the width a terminal's rules have on a common 100-column window).
RULE_WIDTH = 100
KEEP_LOGS = 50  # the newest command logs kept in <cache dir>/logs; older ones are removed when a command starts

_state = {"verbose": False, "log": None, "path": None}


def verbose() -> bool:
    return bool(_state["verbose"])


def logs_dir() -> Path:
    from warpforge import settings

    return settings.cache_dir() / "logs"


def log_path() -> Path:
    """This process's log file, named once (the time of its first command and the pid): every command the
    process runs writes there."""
    folder, pid = logs_dir(), os.getpid()
    # named again in a forked child, or when the cache dir moved (settings are read per call)
    if _state["path"] is None or _state["path"].parent != folder or not _state["path"].stem.endswith(f"-{pid}"):
        _state["path"] = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{pid}.log"
    return _state["path"]


def _prune_logs(folder: Path, keep: int = KEEP_LOGS) -> None:
    """Remove all but the ``keep`` newest logs (another process may be pruning too: a file already gone is
    fine)."""
    try:
        logs = sorted(folder.glob("*.log"), key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:
        return
    for old in logs[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()


def note_in_log(text: str) -> None:
    """A line in the command's log (what it stored, for instance), so the log names what its run left."""
    log = _state["log"]
    if log is not None:
        log.write(text.rstrip("\n") + "\n")
        log.flush()


@functools.lru_cache(maxsize=1)
def _console_class():
    from rich.console import Console
    from rich.rule import Rule

    class WarpforgeConsole(Console):
        """rich's Console whose section rules stay RULE_WIDTH wide when the output is not a terminal (its
        width is then WIDE so that tables keep whole rows)."""

        def __init__(self, *args, rule_width: int | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.rule_width = rule_width

        def rule(self, title="", *, characters: str = "─", style="rule.line", align="center") -> None:
            width = min(self.width, self.rule_width) if self.rule_width else None
            self.print(Rule(title=title, characters=characters, style=style, align=align), width=width)

    return WarpforgeConsole


def make_console(*, stderr: bool = False, quiet: bool = False):
    """The one place a command's rich Console is made: on a terminal its width; elsewhere (a pipe, a file)
    whole table rows (WIDE columns, as ``COLUMNS`` does not say otherwise) and RULE_WIDTH-column rules."""
    stream = sys.stderr if stderr else sys.stdout
    tty = hasattr(stream, "isatty") and stream.isatty()
    columns = os.environ.get("COLUMNS", "")
    wide = not (tty or columns.isdigit())
    return _console_class()(stderr=stderr, quiet=quiet, width=WIDE if wide else None,
                            rule_width=RULE_WIDTH if wide else None)


class AliasChoice(click.Choice):
    """A choice with accepted alternative spellings (``float16`` for ``fp16``), given to the command as
    the documented spelling; ``--help`` lists only the documented ones."""

    def __init__(self, choices, aliases: dict[str, str]):
        super().__init__(choices)
        self.aliases = aliases

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.lower() in self.aliases:
            value = self.aliases[value.lower()]
        return super().convert(value, param, ctx)


class _Router(io.TextIOBase):
    """sys.stderr while a command runs: what other libraries emit through logging, warnings or tqdm
    goes to the log file (and on to stderr with --verbose); everything else, including warpforge's own
    warnings and log records, is written to stderr as usual."""

    def __init__(self, stream, log, show_all: bool):
        self.stream, self.log, self.show_all = stream, log, show_all

    def _noise(self) -> bool:
        frame = sys._getframe(2)  # the caller of write()
        module = frame.f_globals.get("__name__", "")
        if module == "logging":
            record = frame.f_locals.get("record")
            return not (record is not None and str(getattr(record, "name", "")).startswith(SHOWN_LOGGERS))
        if module == "warnings":
            msg = frame.f_locals.get("msg")
            return not str(getattr(msg, "filename", "")).startswith(PACKAGE_DIR)
        return module.startswith("tqdm")

    def write(self, s: str) -> int:
        if self._noise():
            self.log.write(s)
            self.log.flush()
            if not self.show_all:
                return len(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self):  # noqa: D401 - mirrors the wrapped stream
        return getattr(self.stream, "encoding", "utf-8")

    def __getattr__(self, name: str):  # buffer, errors, ...: the wrapped stream's
        if name == "stream":
            raise AttributeError(name)
        return getattr(self.stream, name)


@contextlib.contextmanager
def routed_output(show_all: bool) -> Iterator[None]:
    """Install the stderr router and the log file for one command (restored afterwards)."""
    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    _prune_logs(path.parent, keep=KEEP_LOGS - 1)
    log = open(path, "a", encoding="utf-8")  # "a": a second command in this process (a test) adds to it
    log.write(f"warpforge {' '.join(sys.argv[1:])}\n")
    saved = sys.stderr, _state["log"], _state["verbose"]
    sys.stderr = _Router(sys.stderr, log, show_all)
    _state["log"], _state["verbose"] = log, show_all
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr) if show_all else logging.StreamHandler(log)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    level = root.level
    root.addHandler(handler)
    if show_all:
        root.setLevel(min(level or logging.WARNING, logging.INFO))
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        sys.stderr, _state["log"], _state["verbose"] = saved
        log.close()


@contextlib.contextmanager
def native_output_to_log() -> Iterator[None]:
    """Send what native code prints to file descriptors 1 and 2 (the profiler's ``USDT:`` lines, CUPTI
    notices) to the log file for the duration; a no-op with --verbose or outside a command."""
    log = _state["log"]
    if verbose() or log is None:
        yield
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    log.flush()
    try:
        saved = [os.dup(1), os.dup(2)]
    except OSError:  # no real descriptors (an embedding host): nothing to redirect
        yield
        return
    try:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


BAD_INPUT = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def report_failure(command: str, exc: BaseException) -> int:
    """One line on stderr for an exception no command handled; the traceback to the log (and to stderr
    with --verbose). -> exit status: 2 for bad input, 1 for anything else."""
    tb = "".join(traceback.format_exception(exc))
    log = _state["log"]
    if log is not None:
        log.write(tb)
        log.flush()
    if verbose():
        click.echo(tb.rstrip("\n"), err=True)
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, BAD_INPUT):
        click.echo(f"warpforge {command}: {first or type(exc).__name__}", err=True)
        return 2
    where = "" if verbose() else f"; the traceback is in {log_path()} (--verbose prints it)"
    click.echo(f"warpforge {command}: internal error: {type(exc).__name__}: {first}{where}", err=True)
    return 1


class WarpforgeGroup(click.Group):
    """The top-level group: ``--verbose`` anywhere on the line, output routing, and one line for any
    exception a command lets through."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # --verbose is a global flag users put at the end as often as at the start: take it anywhere
        # before a "--" (no sub-command has an option of that name).
        cut = args.index("--") if "--" in args else len(args)
        if "--verbose" in args[:cut]:
            args = [a for a in args[:cut] if a != "--verbose"] + args[cut:]
            args.insert(0, "--verbose")
        return super().parse_args(ctx, args)

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name, cmd, rest = super().resolve_command(ctx, args)
        ctx.meta["warpforge.command"] = name
        return name, cmd, rest

    def invoke(self, ctx: click.Context):
        show_all = bool(ctx.params.get("verbose"))
        with routed_output(show_all):
            try:
                return super().invoke(ctx)
            except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort,
                    SystemExit, KeyboardInterrupt):
                raise
            except Exception as e:  # noqa: BLE001 - the one place an unhandled error becomes one line
                sys.exit(report_failure(ctx.meta.get("warpforge.command", "?"), e))


def record_options(out_name: str) -> Callable[[Callable], Callable]:
    """``--store``, ``--no-store`` and ``--out``: where a benchmark command's records go (the results store, and
    JSON lines in ``out_name`` under a directory given to --out), the same for every command that measures."""
    def apply(f: Callable) -> Callable:
        f = click.option("--out", "out", type=click.Path(), default=None,
                         help=f"Also write the records as JSON lines: a directory gets {out_name}; a path ending in "
                              ".jsonl is that file.")(f)
        f = click.option("--no-store", is_flag=True, help="Do not append this run to the results store.")(f)
        return click.option("--store", "store_url", default=None,
                            help="Results store: an SQLAlchemy URL or a path to an SQLite file (default: "
                                 "$WARPFORGE_STORE or ~/.local/share/warpforge/results.sqlite).")(f)
    return apply


__all__ = ["AliasChoice", "WarpforgeGroup", "log_path", "logs_dir", "make_console", "native_output_to_log",
           "note_in_log", "record_options", "report_failure", "routed_output", "verbose"]
