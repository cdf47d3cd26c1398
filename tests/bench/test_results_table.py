"""`warpforge results table`: Markdown from records, and documents whose marked tables must agree with the
committed records (README.md and docs/*.md are checked here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from warpforge.results.record import write_jsonl
from warpforge.results.tables import (TableError, check_markdown, count_markers, dir_loader, parse_marker,
                                      render_suites, render_table, update_markdown)
from warpforge.cli import main

from .conftest import fake_record

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "benchmarks" / "results" / "h200"


def _rec(case: str, ms: float, peer_ms: float, time: str, suite: str = "kernels", **extra) -> dict:
    r = fake_record(case, ms=ms, peer_ms=peer_ms, suite=suite)
    r.update(time=time, git="0123456789abcdef", **extra)
    return r


@pytest.fixture
def records_dir(tmp_path) -> Path:
    d = tmp_path / "h200"
    a_old = _rec("a", 2.0, 2.0, "2026-01-01T00:00:00+00:00")
    a_new = _rec("a", 1.0, 2.0, "2026-01-02T00:00:00+00:00")
    b = _rec("b", 4.0, 2.0, "2026-01-02T00:00:00+00:00", stability={"noisy": True, "bound": 1.1})
    b["roofline"] = None
    b["withdrawn"] = {"roofline": {"value": {"fraction": 1.2}, "why": "ceiling below what ran"}}
    b["peers"]["failed"] = {**b["peers"]["torch"], "correct": {"rel_err": 0.3, "tol": 0.01, "ok": False}}
    b["ratio_null"] = {"failed": "the peer failed its correctness check (rel_err 0.3 > tol 0.01): it is no baseline"}
    write_jsonl(d / "kernels.jsonl", [a_old, b, a_new])
    write_jsonl(d / "llm.jsonl", [_rec("a", 10.0, 30.0, "2026-01-03T00:00:00+00:00", suite="llm")])
    return d


def test_the_record_cell_names_the_commit_and_staleness_drops_out_of_the_check():
    from warpforge.results.tables import STALE_KEY, STALE_NOTE, record_cell

    r = {"suite": "llm", "git": "0123456789abcdef-dirty", "time": "2026-01-03T00:00:00+00:00"}
    assert record_cell(r) == "llm.jsonl @ 0123456-dirty, 2026-01-03"
    assert record_cell({**r, "git": None}) == "llm.jsonl @ no commit, 2026-01-03"
    stale = record_cell({**r, STALE_KEY: "**stale** (12 commits since)"})
    assert stale.endswith("**stale** (12 commits since)") and STALE_NOTE.sub("", stale) == record_cell(r)


def test_render_newest_record_per_case(records_dir):
    md = render_table(dir_loader(records_dir)("kernels"), "kernels").splitlines()
    assert md[0] == "| case | ours | vs peers | roofline | check | record |" and md[1] == "|---|---|---|---|---|---|"
    assert md[2].startswith("| a | 1 ms") and "2.00x torch" in md[2]
    assert "kernels.jsonl @ " in md[2] and ", 2026-01-02" in md[2]
    assert md[3].startswith("| b | 4 ms") and "(noisy)" in md[3]
    assert "0.50x torch" in md[3] and "— failed (failed its check)" in md[3] and "— (withdrawn)" in md[3]
    assert len(md) == 4  # a's older record is not a row


def test_cases_in_order_peers_and_errors(records_dir):
    load = dir_loader(records_dir)
    md = render_table(load("kernels"), "kernels", ["b", "a"], peers=["torch"])
    assert [x.split(" | ")[0] for x in md.splitlines()[2:]] == ["| b", "| a"] and "failed" not in md
    with pytest.raises(TableError, match="no record of case 'c' in suite 'kernels'"):
        render_table(load("kernels"), "kernels", ["c"])
    with pytest.raises(TableError, match="no records of suite 'memory'"):
        load("memory")
    across = render_suites(load, ["kernels", "llm"], ["kernels: b", "llm: a"])
    assert "3.00x torch" in across.splitlines()[3]
    with pytest.raises(TableError, match="in several of the suites"):
        render_suites(load, ["kernels", "llm"], ["a"])


def test_markers_update_and_check(records_dir):
    doc = ("# Title\n\nIntro.\n\n<!-- results:table suite=kernels cases=\"b; a\" -->\nstale text\n"
           "<!-- /results:table -->\n\nMiddle.\n<!-- results:table suite=llm -->\n<!-- /results:table -->\nEnd.\n")
    load = dir_loader(records_dir)
    assert count_markers(doc) == 2
    problems = check_markdown(doc, load)
    assert len(problems) == 2 and "line 5: results:table suite=kernels" in problems[0]
    new, changed = update_markdown(doc, load)
    assert len(changed) == 2 and check_markdown(new, load) == []
    assert new.startswith("# Title\n\nIntro.\n\n") and new.endswith("<!-- /results:table -->\nEnd.\n")
    assert "| b | 4 ms" in new and "| a | 10 ms" in new
    assert update_markdown(new, load) == (new, [])  # a second run changes nothing
    tampered = new.replace("2.00x torch", "2.10x torch")  # a figure typed over the generated one
    assert "disagrees with the records from its line 4" in check_markdown(tampered, load)[0]


def test_a_marker_may_name_its_own_records(records_dir, tmp_path):
    """records=DIR (relative to the Markdown file): one document holds tables of several devices."""
    other = tmp_path / "h100"
    write_jsonl(other / "kernels.jsonl", [_rec("a", 0.5, 2.0, "2026-01-05T00:00:00+00:00")])
    doc = ("<!-- results:table suite=kernels cases=a -->\n<!-- /results:table -->\n"
           "<!-- results:table records=h100 suite=kernels cases=a -->\n<!-- /results:table -->\n")
    load_for = lambda rel: dir_loader(tmp_path / rel)  # noqa: E731
    new, changed = update_markdown(doc, dir_loader(records_dir), load_for)
    assert len(changed) == 2 and "| a | 1 ms" in new.split("records=h100")[0] and "| a | 0.5 ms" in new
    assert check_markdown(new, dir_loader(records_dir), load_for) == []
    with pytest.raises(TableError, match="records=h100 names a directory"):
        update_markdown(doc, dir_loader(records_dir))
    md = tmp_path / "README.md"
    md.write_text(doc)
    out = CliRunner().invoke(main, ["results", "table", "--update", str(md), "--records", str(records_dir)])
    assert out.exit_code == 0 and "| a | 0.5 ms" in md.read_text(), out.output


@pytest.mark.parametrize("args, msg", [
    ("cases=a", "suite=... is required"),
    ("suite=,", "suite=... is required"),  # only separators: no suite (a TypeError in Marker.label before)
    ("suite=kernels color=red", "got 'color=red'"),
    ('suite=kernels cases="a', "No closing quotation"),
])
def test_bad_markers_name_the_problem(args, msg):
    with pytest.raises(TableError, match=msg):
        parse_marker(args, 7)


def test_cli_table_update_and_check(records_dir, tmp_path):
    runner = CliRunner()
    out = runner.invoke(main, ["results", "table", "kernels", "--records", str(records_dir), "--cases", "a"])
    assert out.exit_code == 0 and out.stdout.count("\n") == 3 and "| a | 1 ms" in out.stdout
    out = runner.invoke(main, ["results", "table", "kernels", "--records", str(records_dir), "--format", "json"])
    assert out.exit_code == 0 and '"vs peers": "2.00x torch"' in out.stdout
    doc = tmp_path / "README.md"
    doc.write_text("<!-- results:table suite=kernels -->\n<!-- /results:table -->\n")
    out = runner.invoke(main, ["results", "table", "--check", str(doc), "--records", str(records_dir)])
    assert out.exit_code == 1 and "disagrees" in out.output
    out = runner.invoke(main, ["results", "table", "--update", str(doc), "--records", str(records_dir)])
    assert out.exit_code == 0 and "1 regenerated" in out.output and "| a | 1 ms" in doc.read_text()
    out = runner.invoke(main, ["results", "table", "--check", str(doc), "--records", str(records_dir)])
    assert out.exit_code == 0 and "agree" in out.output
    for bad, msg in ([["results", "table", "nope", "--records", str(records_dir)], "no records of suite 'nope'"],
                     [["results", "table"], "name a suite"],
                     [["results", "table", "kernels", "--update", str(doc)], "give no SUITE"],
                     [["results", "table", "--update", str(tmp_path / "none.md")], "no such file"]):
        out = runner.invoke(main, bad)
        assert out.exit_code == 2 and msg in out.output, out.output


def test_committed_documents_agree_with_the_committed_records():
    """Every table between results:table markers in the README and docs/ is what the records give."""
    load = dir_loader(COMMITTED)
    problems = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        problems += [f"{doc.relative_to(REPO)}: {p}" for p in check_markdown(
            doc.read_text(encoding="utf-8"), load, lambda rel, doc=doc: dir_loader(doc.parent / rel))]
    assert not problems, "\n".join(problems) + "\n(regenerate: warpforge results table --update FILE)"


def test_committed_suites_render():
    load = dir_loader(COMMITTED)
    for suite in ("kernels", "attention", "memory", "llm", "vision"):
        md = render_table(load(suite), suite).splitlines()
        assert len(md) >= 2 + len({r["case"] for r in load(suite)})
        assert all(len(re.findall(r"(?<!\\)\|", x)) == 7 for x in md)  # six cells, escaped pipes aside
