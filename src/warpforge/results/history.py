"""A case's figures over runs and commits, the noise band, and the regression gate.

Records come from two places: the results store (every run, SQLite or any SQLAlchemy URL) and committed
JSON-lines files, including every earlier version of those files in git, so the committed H200 records
carry their own history. The same record seen twice (the same suite, case, time and commit) counts once.

**Noise band.** A record's spread is how far its own repeats disagree: the larger of ours' p80/p20 and
the max/min of its round medians (the stability block's figures when it has one), minus 1. Two records of
a case differ beyond noise when ours' time moved by more than the larger spread of the two plus
:data:`FLOOR` (clock jitter that tiny spreads do not show). A record with a single repeat has no spread
of its own; it is given :data:`UNKNOWN_SPREAD`, the harness's own stability bound.

**Gate** (:func:`gate`): each case of a run against the same case of a baseline; the run fails when any
case is slower beyond its band, or failed its correctness check or failed to run where the baseline passed.
"""

from __future__ import annotations

import json
import math
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warpforge.results.tables import check_cell

FLOOR = 0.02  # the store's compare flag floor: below 2% two runs are "the same" whatever their spreads
UNKNOWN_SPREAD = 0.10  # warpforge.timing.NOISE_BOUND - 1: what one repeat is trusted to
REGRESSED = ("slower", "check failed", "failed to run")


@dataclass(frozen=True)
class Sourced:
    """A record and where it was read: ``store run 12``, ``kernels.jsonl@58080b5``, ``kernels.jsonl``."""

    record: dict[str, Any]
    source: str


def _identity(r: dict[str, Any]) -> tuple:
    ms = r.get("ours", {}).get("ms") if isinstance(r.get("ours"), dict) else None
    return (r.get("suite"), r.get("case"), r.get("time"), r.get("git"), ms)


def dedupe(items: Iterable[Sourced]) -> list[Sourced]:
    """The first of each record seen (callers list the newest version of a file first)."""
    seen: set[tuple] = set()
    out = []
    for s in items:
        key = _identity(s.record)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


# ---- reading -------------------------------------------------------------------------------------

def _parse_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # an old version of a file may hold a broken line; it is not this history's business
            if isinstance(rec, dict) and isinstance(rec.get("ours"), dict) and "case" in rec:
                out.append(rec)
    return out


def _jsonl_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(path.glob("*.jsonl"))
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"no records at {path} (expected a .jsonl file or a directory of them)")


def _kept(f: Path, from_dir: bool, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # A suite's committed records are <suite>.jsonl; other files in a results directory hold experiments
    # (an A/B of a setting, say) whose records do not say what they changed, so they are no part of a history.
    return [r for r in records if r.get("suite") == f.stem] if from_dir else records


def read_records(path: str | Path) -> list[Sourced]:
    """Bench records of a .jsonl file, or of a directory's ``<suite>.jsonl`` files (their own suite's records;
    lines that are not bench records are skipped)."""
    p = Path(path)
    return [Sourced(r, f.name) for f in _jsonl_files(p)
            for r in _kept(f, p.is_dir(), _parse_lines(f.read_text("utf-8")))]


def git_versions(path: str | Path, limit: int = 200) -> list[Sourced]:
    """Records of every committed version of the .jsonl files at ``path``, newest commit first (nothing
    outside a git checkout)."""
    out: list[Sourced] = []
    from_dir = Path(path).is_dir()
    for f in _jsonl_files(Path(path)):
        cwd = f.resolve().parent
        try:
            log = subprocess.run(["git", "-C", str(cwd), "log", f"-n{limit}", "--format=%H", "--", f.name],
                                 capture_output=True, text=True, timeout=60)
            top = subprocess.run(["git", "-C", str(cwd), "rev-parse", "--show-prefix"], capture_output=True,
                                 text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return out
        if log.returncode != 0 or top.returncode != 0:
            continue
        rel = top.stdout.strip() + f.name
        for sha in log.stdout.split():
            show = subprocess.run(["git", "-C", str(cwd), "show", f"{sha}:{rel}"], capture_output=True, text=True,
                                  timeout=60)
            if show.returncode == 0:
                out += [Sourced(r, f"{f.name}@{sha[:7]}") for r in _kept(f, from_dir, _parse_lines(show.stdout))]
    return out


def committed_records(path: str | Path, with_git: bool = True) -> list[Sourced]:
    """The files as they are now, then every earlier committed version; each record once."""
    now = read_records(path)
    return dedupe(now + (git_versions(path) if with_git else []))


def store_records(store: Any, case: str | None = None, suite: str | None = None) -> list[Sourced]:
    """Every stored record (of ``case`` / ``suite`` when given), labelled by run."""
    return [Sourced(rec, f"store run {run['id']}") for run, rec in store.case_records(case=case, suite=suite)]


# ---- figures of one record -----------------------------------------------------------------------

def spread(rec: dict[str, Any]) -> float | None:
    """Ours' relative spread (see the module docstring); None when the record has a single repeat; inf
    when the stability block says unbounded."""
    ours = rec.get("ours") or {}
    if "error" in ours or not ours.get("ms"):
        return None
    vals: list[float] = []
    stab = ((rec.get("stability") or {}).get("spread") or {}).get("ours")
    if isinstance(stab, dict):
        for k in ("rounds", "p80_p20"):
            if k in stab:
                vals.append(math.inf if stab[k] is None else float(stab[k]) - 1.0)
    p20, p80 = ours.get("p20_ms"), ours.get("p80_ms")
    if isinstance(p20, (int, float)) and isinstance(p80, (int, float)) and p80 > p20:
        vals.append(p80 / p20 - 1.0 if p20 > 0 else math.inf)
    rounds = [x for x in ours.get("rounds_ms") or [] if isinstance(x, (int, float))]
    if len(rounds) >= 2:
        vals.append(max(rounds) / min(rounds) - 1.0 if min(rounds) > 0 else math.inf)
    return max(vals) if vals else None


def noise_band(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The relative change of ours' time beyond which ``b`` differs from ``a``."""
    sa, sb = spread(a), spread(b)
    return max(UNKNOWN_SPREAD if sa is None else sa, UNKNOWN_SPREAD if sb is None else sb) + FLOOR


@dataclass
class Point:
    """One record of a case, as the history shows it."""

    suite: str
    case: str
    time: str
    git: str | None
    source: str
    ms: float | None
    p20_ms: float | None
    p80_ms: float | None
    ok: bool
    noisy: bool
    ratio: dict[str, float]
    ratio_interval: dict[str, list[float]]
    ratio_null: dict[str, str]
    fraction: float | None
    bound: str | None
    spread: float | None
    flag: str = ""  # against the previous point: "slower", "faster", "check failed", "failed to run", ""
    change: float | None = None  # ms / previous ms
    band: float | None = None
    check: str = ""  # the verdict in words, as tables show it ("ok 2.3e-03", "withdrawn (no valid check)", ...)
    record: dict[str, Any] = field(default_factory=dict, repr=False)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "record"}
        d["spread"] = None if d["spread"] is None or math.isinf(d["spread"]) else d["spread"]
        return d


def point(s: Sourced) -> Point:
    r = s.record
    ours = r.get("ours") or {}
    roof = raw if isinstance(raw := r.get("roofline"), dict) else {}
    sp = spread(r)
    return Point(suite=str(r.get("suite")), case=str(r.get("case")), time=str(r.get("time") or ""), git=r.get("git"),
                 source=s.source, ms=None if "error" in ours else ours.get("ms"), p20_ms=ours.get("p20_ms"),
                 p80_ms=ours.get("p80_ms"), ok=bool((r.get("correct") or {}).get("ok")),
                 noisy=bool((r.get("stability") or {}).get("noisy")), ratio=dict(r.get("ratio") or {}),
                 ratio_interval=dict(r.get("ratio_interval") or {}), ratio_null=dict(r.get("ratio_null") or {}),
                 fraction=roof.get("fraction"), bound=roof.get("bound"), spread=sp, check=check_cell(r), record=r)


def _setup(r: dict[str, Any]) -> tuple[Any, Any]:
    dev = raw if isinstance(raw := r.get("device"), dict) else {}
    return dev.get("name"), dev.get("knobs") or {}


def judge(base: dict[str, Any], cur: dict[str, Any]) -> tuple[str, float | None, float | None]:
    """(flag, cur ms / base ms, band) of ``cur`` against ``base``: "slower"/"faster" beyond the band, "check
    failed" / "failed to run" where the base passed and ran, "other device" / "other settings" where the two
    ran on different devices or under different settings (never compared), "" within the noise or when
    nothing compares."""
    (base_dev, base_knobs), (cur_dev, cur_knobs) = _setup(base), _setup(cur)
    if base_dev != cur_dev:
        return "other device", None, None
    if base_knobs != cur_knobs:
        return "other settings", None, None
    bo, co = base.get("ours") or {}, cur.get("ours") or {}
    base_ok, cur_ok = bool((base.get("correct") or {}).get("ok")), bool((cur.get("correct") or {}).get("ok"))
    if "error" in co and "error" not in bo:
        return "failed to run", None, None
    if base_ok and not cur_ok and "error" not in co:
        return "check failed", None, None
    if "error" in bo or "error" in co or not bo.get("ms") or not co.get("ms"):
        return "", None, None
    change, band = co["ms"] / bo["ms"], noise_band(base, cur)
    if change - 1.0 > band:
        return "slower", change, band
    if 1.0 / change - 1.0 > band:
        return "faster", change, band
    return "", change, band


def history(items: Iterable[Sourced], case: str, suite: str | None = None) -> list[Point]:
    """The points of one case, oldest first, each judged against the one before it."""
    pts = sorted((point(s) for s in dedupe(items)
                  if s.record.get("case") == case and (suite is None or s.record.get("suite") == suite)),
                 key=lambda p: p.time)
    for prev, cur in zip(pts, pts[1:]):
        cur.flag, cur.change, cur.band = judge(prev.record, cur.record)
    return pts


def cases_of(items: Iterable[Sourced]) -> list[tuple[str, str]]:
    """(suite, case) of every record, in first-seen order."""
    seen: dict[tuple[str, str], None] = {}
    for s in items:
        seen.setdefault((str(s.record.get("suite")), str(s.record.get("case"))), None)
    return list(seen)


def find_case(items: Sequence[Sourced], case: str, suite: str | None = None) -> tuple[str, str]:
    """(suite, case) for a name given on the command line: exact, else the one case containing it.
    Raises LookupError naming the candidates."""
    known = [k for k in cases_of(items) if suite is None or k[0] == suite]
    exact = [k for k in known if k[1] == case]
    hits = exact or [k for k in known if case in k[1]]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise LookupError(f"no case named {case!r}" + (f" in suite {suite!r}" if suite else "")
                          + f" ({len(known)} cases known; `warpforge results table SUITE` lists a suite's)")
    shown = "; ".join(f"{s}: {c}" for s, c in hits[:6]) + ("; ..." if len(hits) > 6 else "")
    raise LookupError(f"{case!r} matches {len(hits)} cases ({shown}); give the exact name or --suite")


# ---- the gate ------------------------------------------------------------------------------------

@dataclass
class GateRow:
    suite: str
    case: str
    base_ms: float | None
    ms: float | None
    change: float | None
    band: float | None
    flag: str  # a judge() flag, "missing" (in the baseline only) or "new" (in the run only)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _newest(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        key = (str(r.get("suite")), str(r.get("case")))
        if key not in out or str(r.get("time") or "") >= str(out[key].get("time") or ""):
            out[key] = r
    return out


def gate(baseline: Iterable[dict[str, Any]], run: Iterable[dict[str, Any]]) -> list[GateRow]:
    """One row per case of either side (each side's newest record of a case); see :func:`judge`."""
    base, cur = _newest(baseline), _newest(run)
    rows = []
    for key in list(base) + [k for k in cur if k not in base]:
        b, c = base.get(key), cur.get(key)
        if b is None or c is None:
            rows.append(GateRow(*key, base_ms=(b or {}).get("ours", {}).get("ms"),
                                ms=(c or {}).get("ours", {}).get("ms"), change=None, band=None,
                                flag="new" if b is None else "missing"))
            continue
        flag, change, band = judge(b, c)
        rows.append(GateRow(*key, base_ms=b["ours"].get("ms"), ms=c["ours"].get("ms"), change=change, band=band,
                            flag=flag))
    return rows


def regressions(rows: Sequence[GateRow]) -> list[GateRow]:
    return [r for r in rows if r.flag in REGRESSED]


__all__ = ["FLOOR", "REGRESSED", "UNKNOWN_SPREAD", "GateRow", "Point", "Sourced", "cases_of", "committed_records",
           "dedupe", "find_case", "gate", "git_versions", "history", "judge", "noise_band", "point", "read_records",
           "regressions", "spread", "store_records"]
