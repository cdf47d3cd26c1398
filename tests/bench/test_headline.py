"""The README's headline as terminal lines (what `warpforge demo` shows a CPU user): the cases the README's
marker names, from each device's committed records, with the commit and "stale" once the timed code changed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from warpforge.results.headline import checkout_root, headline_rows
from warpforge.results.tables import markers

from .conftest import fake_record

README = """# x

<!-- results:table suite=memory cases="copy; fill" peers="torch" -->
(generated)
<!-- /results:table -->
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_rows_per_device_with_commit_and_staleness(tmp_path):
    r = tmp_path / "repo"
    (r / "src/warpforge/kernels").mkdir(parents=True)
    (r / "benchmarks/results/h200").mkdir(parents=True)
    (r / "benchmarks/results/h100").mkdir(parents=True)
    _git(r, "init", "-q")
    _git(r, "config", "user.email", "t@example.com")
    _git(r, "config", "user.name", "t")
    (r / "src/warpforge/kernels/memory.py").write_text("x = 1\n")
    (r / "README.md").write_text(README)
    _git(r, "add", "-A")
    _git(r, "commit", "-q", "-m", "first")
    first = _git(r, "rev-parse", "HEAD")

    def write(device: str, cases: list[str]) -> None:
        recs = [dict(fake_record(c, suite="memory"), git=first) for c in cases + ["not in the readme"]]
        (r / f"benchmarks/results/{device}/memory.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs))

    write("h200", ["copy", "fill"])
    write("h100", ["fill"])  # another device holds a subset of the README's cases
    rows = headline_rows(r)
    assert [(x.device, x.case, x.status) for x in rows] == [("h200", "copy", "current"), ("h200", "fill", "current"),
                                                            ("h100", "fill", "current")]
    line = rows[0].line()
    assert line == f"h200  copy: {rows[0].ours}, 2.00x torch (commit {first[:8]})", line

    (r / "src/warpforge/kernels/memory.py").write_text("x = 2\n")  # the timed code moves on
    _git(r, "commit", "-q", "-am", "kernel change")
    rows = headline_rows(r)
    assert {x.status for x in rows} == {"stale"} and rows[0].line().endswith(f"(commit {first[:8]}, stale)")


def test_without_git_the_rows_still_come(tmp_path):
    r = tmp_path / "plain"  # a tarball of the repository: no .git
    (r / "benchmarks/results/h200").mkdir(parents=True)
    (r / "README.md").write_text(README)
    rec = dict(fake_record("copy", suite="memory"), git="abc1234")
    (r / "benchmarks/results/h200/memory.jsonl").write_text(json.dumps(rec) + "\n")
    rows = headline_rows(r)
    assert [(x.case, x.status) for x in rows] == [("copy", "")] and rows[0].line().endswith("(commit abc1234)")


def test_this_checkout_shows_the_readme_headline():
    root = checkout_root()
    assert root is not None and (root / "README.md").is_file()
    first = markers((root / "README.md").read_text())[0]
    device = Path(first.records).name if first.records else "h200"
    cases = first.cases
    rows = [x for x in headline_rows(root) if x.device == device]
    assert [f"{x.suite}: {x.case}" for x in rows] == list(cases)
