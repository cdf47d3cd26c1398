"""The README's headline figures as terminal lines: the committed GPU records, and whether they are stale.

A CPU user of `warpforge demo` measures CPU figures only; the GPU figures the README shows are in the
checkout's committed records, ``benchmarks/results/<device>/<suite>.jsonl``. The README's results:table
marker (results.tables) says which cases make the headline; the same marker picks the rows here, per device
directory that holds them, each with the commit it was measured at and "stale" when the code it timed changed
since (results.provenance, as `warpforge results stale` says it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RESULTS = Path("benchmarks") / "results"


@dataclass(frozen=True)
class HeadlineRow:
    device: str  # the records' directory: h200, h100
    suite: str
    case: str
    ours: str  # results.tables.ours_cell: "1.389 ms, 792 TFLOP/s"
    peers: str  # results.tables.peers_cell: "1.00x cublas"
    commit: str | None  # the record's git sha (a "-dirty" suffix kept)
    status: str  # current, stale, dirty, unknown commit, no source map; "" when git could not say

    def line(self) -> str:
        """``h200  bfloat16 matmul M8192 N8192 K8192: 1.389 ms, 792 TFLOP/s, 1.00x cublas (commit 623e205c, stale)``."""
        commit = f"commit {self.commit[:8]}" if self.commit else "no commit"
        status = "" if self.status in ("", "current") else f", {self.status}"
        peers = "" if self.peers == "—" else f", {self.peers}"
        return f"{self.device}  {self.case}: {self.ours}{peers} ({commit}{status})"


def checkout_root() -> Path | None:
    """The repository this warpforge runs from (an editable install, or PYTHONPATH=src), or None when it is
    installed without one: a wheel carries neither the README nor the records."""
    root = Path(__file__).resolve().parents[3]  # src/warpforge/results/headline.py -> the checkout
    return root if (root / RESULTS).is_dir() and (root / "README.md").is_file() else None


def headline_rows(root: Path) -> list[HeadlineRow]:
    """The cases of the README's first results:table, from each device directory under benchmarks/results/
    that holds them (the device with the most first)."""
    from warpforge.results import provenance
    from warpforge.results.tables import TableError, dir_loader, markers, ours_cell, peers_cell, pick, select

    found = markers((root / "README.md").read_text(encoding="utf-8"))
    if not found:
        return []
    mk = found[0]
    repo: Path | None
    head: str | None
    try:
        repo = provenance.repo_root(root)
        head = provenance.resolve_commit(repo, "HEAD")
    except provenance.GitError:
        repo = head = None
    checked: dict[tuple[str, str | None], str] = {}  # (suite, git) -> status: two git calls per commit, not per row

    def status(suite: str, git: str | None) -> str:
        if repo is None or head is None:
            return ""
        if (suite, git) not in checked:
            g = provenance.check_group(provenance.Group(file="", suite=suite, git=git), repo, head)
            checked[(suite, git)] = g.status
        return checked[(suite, git)]

    per_device = []
    for folder in sorted(p for p in (root / RESULTS).iterdir() if p.is_dir()):
        load = dir_loader(folder)
        if mk.cases:
            records = pick(load, mk.suites, mk.cases, missing_ok=True)
        else:  # one suite, every case
            try:
                records = select(load(mk.suites[0]), mk.suites[0])
            except TableError:
                records = []
        rows = [HeadlineRow(folder.name, r["suite"], r["case"], ours_cell(r), peers_cell(r, mk.peers), r.get("git"),
                            status(r["suite"], r.get("git"))) for r in records]
        if rows:
            per_device.append(rows)
    per_device.sort(key=len, reverse=True)
    return [row for rows in per_device for row in rows]


__all__ = ["HeadlineRow", "checkout_root", "headline_rows"]
