"""Where the optimizer's third-party output goes, and how failure reasons are kept.

torch.onnx and torch.export print what they traced when they fail (an ONNX export that gives up can print
the whole exported graph: thousands of lines), from Python and from C++ alike. A run's terminal should carry
the table and one line per failure, so :func:`to_log` sends everything written to stdout and stderr (the file
descriptors, not only ``sys.stdout``) inside it to the run's log file: ``<out>/optimize.log`` from the CLI,
``optimize(log=...)`` from Python, else a file in the temporary directory. The report names the file.

A failure's reason is kept whole (every line) in report.json; the table shows its first line. Escape codes
(the colours some tools put in their messages) are removed from both: :func:`clean`.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

# CSI sequences (colours, cursor moves), OSC sequences (titles, links), and the two-byte escapes.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")

_log_path: Path | None = None


def clean(text: str) -> str:
    """``text`` without terminal escape codes, trailing blanks stripped."""
    return _ANSI.sub("", text).strip()


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, cleaned (what a table shows of a reason)."""
    return next((line.strip() for line in clean(text).splitlines() if line.strip()), "")


def error_text(e: BaseException) -> str:
    """``Type: message``, the whole message (every line), no escape codes."""
    msg = clean(str(e))
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def log_path() -> Path:
    """The current run's log file (:func:`logging_to`), else one per process in the temporary directory."""
    return _log_path or Path(tempfile.gettempdir()) / f"warpforge-optimize-{os.getpid()}.log"


@contextlib.contextmanager
def logging_to(path: str | Path | None) -> Iterator[Path]:
    """Send :func:`to_log` output to ``path`` (created; appended to) while inside; None: the default file."""
    global _log_path
    old = _log_path
    _log_path = Path(path) if path is not None else None
    try:
        yield log_path()
    finally:
        _log_path = old


def note(text: str) -> None:
    """Append ``text`` (a full error, a dump) to the log file."""
    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(clean(text) + "\n")


@contextlib.contextmanager
def to_log(what: str) -> Iterator[Path]:
    """Everything written to stdout and stderr inside (Python and native code) goes to the log file, under a
    header naming ``what``."""
    path = log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            s.flush()
    with open(path, "a", encoding="utf-8") as text:
        text.write(f"==== {time.strftime('%H:%M:%S')} {what}\n")
        text.flush()
        saved = []
        try:
            for fd in (1, 2):
                saved.append((fd, os.dup(fd)))
                os.dup2(text.fileno(), fd)
        except OSError:  # no file descriptors to redirect (an embedded interpreter): Python-level only
            pass
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield path
        finally:
            for s in (sys.__stdout__, sys.__stderr__):
                with contextlib.suppress(Exception):
                    s.flush()
            text.flush()
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)


__all__ = ["clean", "error_text", "first_line", "log_path", "logging_to", "note", "to_log"]
