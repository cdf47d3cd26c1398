"""Result tables generated from records, and the markers that keep a document's tables generated.

:func:`render_table` turns a suite's records into a Markdown table (one row per case: ours, the ratio
against each peer with its per-round interval or why there is none, the roofline fraction, the check, and the
record it comes from). A Markdown file holds generated tables between markers::

    <!-- results:table suite=kernels cases="bfloat16 matmul M8192 N8192 K8192; fp8 matmul rowwise M8192 N8192 K8192" -->
    (generated: leave this to `warpforge results table --update FILE`)
    <!-- /results:table -->

Marker keys: ``suite`` (required; several separated by ``,`` for a table across suites), ``cases`` (exact
case names separated by ``;``, in the order shown, each optionally written ``SUITE: CASE``; default every case
of the one suite), ``peers`` (peer names separated by ``,``: only these in the ratio column).
:func:`update_markdown` regenerates every marked table; :func:`check_markdown` lists the tables that
disagree with the records (a test runs it over the README).
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UNITS = {"GBps": "GB/s", "tflops": "TFLOP/s", "tok/s": "tok/s", "ms": "ms"}
MARKER = re.compile(r"<!--\s*results:table\b(?P<args>[^>]*?)-->(?P<body>.*?)<!--\s*/results:table\s*-->", re.S)
KEYS = ("suite", "cases", "peers", "records")
COLUMNS = ("case", "ours", "vs peers", "roofline", "check", "record")


Loader = Callable[[str], Sequence[dict[str, Any]]]  # suite -> its records


class TableError(ValueError):
    """A marker or a table request that cannot be rendered: the message names what was wrong."""


# ---- choosing records ----------------------------------------------------------------------------

def latest_by_case(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The newest record of each case (by ``time``; the later line wins a tie), in first-seen case order."""
    out: dict[Any, dict[str, Any]] = {}  # keyed by each record's "case" as stored
    for r in records:
        c = r.get("case")
        if c not in out or str(r.get("time") or "") >= str(out[c].get("time") or ""):
            out[c] = r
    return out


def select(records: Sequence[dict[str, Any]], suite: str, cases: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The suite's newest record per case, of ``cases`` in their order (all, in file order, when None)."""
    mine = [r for r in records if r.get("suite") == suite and isinstance(r.get("ours"), dict)]
    if not mine:
        raise TableError(f"no records of suite {suite!r}")
    latest = latest_by_case(mine)
    if not cases:
        return list(latest.values())
    missing = [c for c in cases if c not in latest]
    if missing:
        shown = "; ".join(list(latest)[:8]) + ("; ..." if len(latest) > 8 else "")
        raise TableError(f"no record of case {missing[0]!r} in suite {suite!r} (cases: {shown})")
    return [latest[c] for c in cases]


# ---- cells ---------------------------------------------------------------------------------------

def _num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}" if abs(x) < 10 else f"{x:.1f}"


def _ms(ms: float) -> str:
    return f"{ms / 1000:.2f} s" if ms >= 10_000 else f"{ms:.4g} ms"


def ours_cell(r: dict[str, Any]) -> str:
    ours = r["ours"]
    if "error" in ours:
        return "error"
    metric = r.get("metric") or "ms"
    fig = ours.get(metric) if metric != "ms" else None
    text = _ms(ours["ms"]) + (f", {_num(fig)} {UNITS.get(metric, metric)}" if isinstance(fig, (int, float)) else "")
    return text + (" (noisy)" if (r.get("stability") or {}).get("noisy") else "")


def short_reason(why: str) -> str:
    """A ratio_null reason in a few words for a table cell (the record keeps the whole reason)."""
    for prefix, short in (("the peer failed its correctness check", "failed its check"),
                          ("the peer was not checked", "unchecked"), ("ours failed", "ours failed its check"),
                          ("ours was not checked", "ours unchecked"), ("different work", "different work"),
                          ("the peer did not run", "did not run"), ("ours did not run", "ours did not run")):
        if why.startswith(prefix):
            return short
    return why.splitlines()[0][:40]


def peers_cell(r: dict[str, Any], peers: Sequence[str] | None = None) -> str:
    """``1.01x cublas (0.99-1.03); — eager-fp16 (failed its check)``: above 1, ours is faster."""
    names = [p for p in r["peers"] if peers is None or p in peers]
    ratio, iv, nulls = r.get("ratio") or {}, r.get("ratio_interval") or {}, r.get("ratio_null") or {}
    parts = []
    for p in names:
        if p in ratio:
            band = f" ({iv[p][0]:.2f}-{iv[p][1]:.2f})" if p in iv else ""
            parts.append(f"{ratio[p]:.2f}x {p}{band}")
        else:
            why = nulls.get(p) or (r["peers"][p].get("error") and "the peer did not run") or "no ratio"
            parts.append(f"— {p} ({short_reason(why)})")
    return "; ".join(parts) or "—"


def roofline_cell(r: dict[str, Any]) -> str:
    roof = r.get("roofline")
    if isinstance(roof, dict):
        return f"{100 * roof['fraction']:.0f}% {'memory' if roof.get('bound') == 'memory' else 'compute'}"
    return "— (withdrawn)" if "roofline" in (r.get("withdrawn") or {}) else "—"


def check_cell(r: dict[str, Any]) -> str:
    """The verdict in words: "ok 2.3e-03", "FAIL 0.31", "completed" (a run that finished, no accuracy
    judged), "withdrawn" (the check could not fail; the record says why)."""
    c = r.get("correct") or {}
    if "correct.ok" in (r.get("withdrawn") or {}):
        return "withdrawn (no valid check)"
    if c.get("against") == "completion":
        return "completed (no accuracy check)" if c.get("ok") else "FAIL (incomplete)"
    err = c.get("rel_err")
    shown = "" if err is None else f" {err:.1e}"
    return ("ok" if c.get("ok") else "FAIL") + shown


def record_cell(r: dict[str, Any]) -> str:
    """Where the figure lives, the commit and day it was measured, and (when the table was generated with the
    repository at hand, :func:`stale_loader`) how many commits have touched the code it times since."""
    git = r.get("git")
    sha = "no commit" if not git or git == "unknown" else git.split("-")[0][:7] + ("-dirty" if git.endswith("-dirty")
                                                                                   else "")
    note = f" {r[STALE_KEY]}" if r.get(STALE_KEY) else ""
    return f"{r.get('suite', '?')}.jsonl @ {sha}, {str(r.get('time') or '')[:10]}{note}"


# The staleness note a generated table carries (`results table --update` with the repository at hand): it moves
# with every commit to the timed code, so the check of a committed table compares the rest of the row.
STALE_KEY = "_stale"
STALE_NOTE = re.compile(r" \*\*stale\*\* \(\d+ commits? since\)")


def stale_loader(load: Loader, repo: Path, rev: str = "HEAD") -> Loader:
    """``load`` with each record's staleness filled in: "**stale** (N commits since)" when commits after the
    record's own touched the code its suite times (warpforge.results.provenance), nothing when current."""
    from warpforge.results.provenance import Group, check_group, resolve_commit

    head = resolve_commit(repo, rev)
    seen: dict[tuple[str, str | None], str | None] = {}

    def annotated(suite: str) -> list[dict[str, Any]]:
        out = []
        for r in load(suite):
            key = (str(r.get("suite")), r.get("git"))
            if key not in seen:
                g = check_group(Group(file="", suite=key[0], git=key[1]), repo, head) if head else None
                seen[key] = (f"**stale** ({g.commits} commit{'s' if g.commits != 1 else ''} since)"
                             if g is not None and g.status in ("stale", "dirty") and g.commits else None)
            out.append({**r, STALE_KEY: seen[key]} if seen[key] else r)
        return out

    return annotated


def row(r: dict[str, Any], peers: Sequence[str] | None = None) -> dict[str, str]:
    return dict(zip(COLUMNS, (r["case"], ours_cell(r), peers_cell(r, peers), roofline_cell(r), check_cell(r),
                              record_cell(r))))


def _format(rows: list[dict[str, str]], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=1)
    if fmt != "md":
        raise TableError(f"--format: expected md or json, got {fmt!r}")

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return "\n".join([line(COLUMNS), "|" + "---|" * len(COLUMNS), *(line(list(x.values())) for x in rows)])


def render_table(records: Sequence[dict[str, Any]], suite: str, cases: Sequence[str] | None = None,
                 peers: Sequence[str] | None = None, fmt: str = "md") -> str:
    """The suite's table: ``md`` (Markdown, what the README holds) or ``json`` (the same cells)."""
    return _format([row(r, peers) for r in select(records, suite, cases)], fmt)


def split_case(name: str, suites: Sequence[str]) -> tuple[str | None, str]:
    """``"llm: decode batch 1 ..."`` -> ("llm", "decode batch 1 ...") when llm is one of ``suites``."""
    head, sep, rest = name.partition(":")
    return (head.strip(), rest.strip()) if sep and head.strip() in suites else (None, name.strip())


def render_suites(load: Loader, suites: Sequence[str], cases: Sequence[str] | None = None,
                  peers: Sequence[str] | None = None, fmt: str = "md") -> str:
    """One table over one or several suites; with several, ``cases`` are required, each ``SUITE: CASE`` or
    a name found in exactly one of the suites."""
    if len(suites) == 1:
        return render_table(load(suites[0]), suites[0], [split_case(c, suites)[1] for c in cases or []] or None,
                            peers, fmt)
    return _format([row(r, peers) for r in pick(load, suites, cases)], fmt)


def pick(load: Loader, suites: Sequence[str], cases: Sequence[str] | None,
         missing_ok: bool = False) -> list[dict[str, Any]]:
    """The newest record of each of ``cases`` (each ``SUITE: CASE`` or a name found in exactly one of the
    suites), in their order. ``missing_ok``: leave out a case or suite these records lack (another device's
    records hold a subset of the README's cases) instead of raising TableError."""
    if not cases:
        raise TableError(f"a table over several suites ({', '.join(suites)}) needs its cases listed")

    def records(s: str) -> Sequence[dict[str, Any]]:
        try:
            return load(s)
        except TableError:
            if missing_ok:
                return []
            raise

    out = []
    for name in cases:
        suite, case = split_case(name, suites)
        if suite is None:
            hits = [s for s in suites if case in latest_by_case([r for r in records(s) if r.get("suite") == s])]
            if len(hits) != 1:
                if missing_ok and not hits:
                    continue
                raise TableError(f"case {case!r} is in {'none' if not hits else 'several'} of the suites "
                                 f"{', '.join(suites)}: write it as SUITE: CASE")
            suite = hits[0]
        try:
            out.append(select(records(suite), suite, [case])[0])
        except TableError:
            if not missing_ok:
                raise
    return out


# ---- markers -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Marker:
    suites: tuple[str, ...]
    cases: tuple[str, ...] | None
    peers: tuple[str, ...] | None
    line: int  # where the opening marker is (1-based), for messages
    records: str | None = None  # a records directory relative to the Markdown file (default: the caller's)

    def label(self) -> str:
        return f"line {self.line}: results:table suite={','.join(self.suites)}"

    def render(self, load: Loader, load_for: Callable[[str], Loader] | None = None) -> str:
        try:
            if self.records is not None:
                if load_for is None:
                    raise TableError(f"records={self.records} names a directory, but no file to resolve it from")
                load = load_for(self.records)
            return render_suites(load, self.suites, self.cases, self.peers)
        except TableError as e:
            raise TableError(f"{self.label()}: {e}") from None


def parse_marker(args: str, line: int) -> Marker:
    try:
        words = shlex.split(args)
    except ValueError as e:
        raise TableError(f"line {line}: results:table marker: {e} in {args.strip()!r}") from None
    kv: dict[str, str] = {}
    for w in words:
        key, eq, value = w.partition("=")
        if not eq or key not in KEYS:
            raise TableError(f"line {line}: results:table marker: expected key=value with a key of "
                             f"{', '.join(KEYS)}, got {w!r}")
        kv[key] = value

    def split(v: str | None, sep: str) -> tuple[str, ...] | None:
        items = tuple(x.strip() for x in (v or "").split(sep) if x.strip())
        return items or None

    suites = split(kv.get("suite"), ",")
    if suites is None:  # absent, empty or only commas ("suite=,")
        raise TableError(f"line {line}: results:table marker: suite=... is required")
    return Marker(suites, split(kv.get("cases"), ";"), split(kv.get("peers"), ","), line,
                  kv.get("records") or None)


def _blocks(text: str) -> list[tuple[re.Match, Marker]]:
    return [(m, parse_marker(m.group("args"), text.count("\n", 0, m.start()) + 1)) for m in MARKER.finditer(text)]


def markers(text: str) -> list[Marker]:
    """The results:table markers of a Markdown text, in order (what each generated table shows)."""
    return [mk for _, mk in _blocks(text)]


def _body(table: str) -> str:
    return "\n" + table + "\n"


def update_markdown(text: str, load: Loader, load_for: Callable[[str], Loader] | None = None
                    ) -> tuple[str, list[str]]:
    """``text`` with every marked table regenerated; and the labels of the tables that changed. A marker's
    ``records=DIR`` is read through ``load_for(DIR)``."""
    out, pos, changed = [], 0, []
    for m, mk in _blocks(text):
        body = _body(mk.render(load, load_for))
        if m.group("body") != body:
            changed.append(mk.label())
        out += [text[pos:m.start("body")], body]
        pos = m.end("body")
    out.append(text[pos:])
    return "".join(out), changed


def check_markdown(text: str, load: Loader, load_for: Callable[[str], Loader] | None = None) -> list[str]:
    """One message per marked table that differs from what the records give (empty: all agree)."""
    problems = []
    for m, mk in _blocks(text):
        try:
            want = _body(mk.render(load, load_for))
        except TableError as e:
            problems.append(str(e))
            continue
        body = STALE_NOTE.sub("", m.group("body"))
        if body != want:
            have = [x for x in body.strip().splitlines()]
            first = next((i for i, (a, b) in enumerate(zip(have, want.strip().splitlines())) if a != b),
                         min(len(have), len(want.strip().splitlines())))
            problems.append(f"{mk.label()}: the table disagrees with the records from its line {first + 1} "
                            f"(`warpforge results table --update FILE` regenerates it)")
    return problems


def count_markers(text: str) -> int:
    return len(MARKER.findall(text))


def dir_loader(records_dir: str | Path) -> Loader:
    """Records of a suite from ``records_dir/<suite>.jsonl`` (the committed records' layout)."""
    from warpforge.results.record import read_jsonl

    cache: dict[str, list[dict[str, Any]]] = {}
    root = Path(records_dir)

    def load(suite: str) -> list[dict[str, Any]]:
        if suite not in cache:
            path = root / f"{suite}.jsonl"
            if not path.is_file():
                raise TableError(f"no records of suite {suite!r}: {path} does not exist")
            cache[suite] = read_jsonl(path, validate=False)
        return cache[suite]

    return load


__all__ = ["COLUMNS", "MARKER", "Marker", "STALE_KEY", "STALE_NOTE", "TableError", "check_markdown", "count_markers",
           "dir_loader", "latest_by_case", "markers", "parse_marker", "pick", "render_suites", "render_table", "select",
           "split_case", "stale_loader", "update_markdown"]
