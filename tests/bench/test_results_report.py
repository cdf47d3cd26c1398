"""`warpforge results report`: the HTML dashboard is self-contained, marks regressions beyond the noise band,
covers the committed records, and renders in headless Chromium (screenshot kept under
``$WARPFORGE_TEST_ARTIFACTS``, default build/test-artifacts, for a person to look at)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from warpforge.results.history import Sourced, cases_of, committed_records
from warpforge.results.report_html import case_count, render_dashboard
from warpforge.cli import main

from .conftest import fake_record

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "benchmarks" / "results" / "h200"
ARTIFACTS = Path(os.environ.get("WARPFORGE_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))


def _rec(case: str, ms: float, day: int, iqr: float = 0.02) -> dict:
    r = fake_record(case, ms=ms, iqr=iqr, peer_ms=2.0, suite="kernels")
    r.update(time=f"2026-01-0{day}T00:00:00+00:00", git=f"{day:07x}")
    return r


def _items() -> list[Sourced]:
    """Case "steady" moves within its noise; case "<b>slower</b>" regresses 31% at its last run."""
    out = []
    for day, (a, b) in enumerate([(1.0, 1.0), (1.01, 0.99), (0.995, 1.3)], start=1):
        out += [Sourced(_rec("steady", a, day), f"store run {day}"),
                Sourced(_rec("<b>slower</b>", b, day), f"store run {day}")]
    return out


@pytest.fixture(scope="module")
def html() -> str:
    return render_dashboard(_items(), sources=["synthetic"], generated="test")


def test_dashboard_marks_the_regression_and_not_the_noise(html):
    assert case_count(html) == 2 and html.count('<svg id="plot-') == 2
    assert html.count('class="point regressed"') == 1 and html.count('<section class="case regressed"') == 1
    assert html.count('class="point"') == 5  # the other points, within their bands
    assert 'href="#c-kernels-b-slower-b"' in html and "slower +31.3%" in html
    assert html.count('class="band"') == 4  # one noise band per step


def test_dashboard_is_self_contained_and_escaped(html):
    assert "<script" not in html and "<link" not in html and " src=" not in html and "url(" not in html
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}
    assert "&lt;b&gt;slower&lt;/b&gt;" in html and "<b>slower" not in html


def test_dashboard_over_the_committed_records():
    items = committed_records(COMMITTED)
    page = render_dashboard(items, sources=[str(COMMITTED)])
    assert case_count(page) == len(cases_of(items)) > 100
    assert page.count('<svg id="plot-') == case_count(page)


def test_report_cli(tmp_path):
    out = CliRunner().invoke(main, ["results", "report", "--out", str(tmp_path / "dash"), "--records",
                                    str(COMMITTED / "kernels.jsonl"), "--no-git"])
    assert out.exit_code == 0, out.output
    page = (tmp_path / "dash" / "index.html").read_text()
    assert case_count(page) == len({r.record["case"] for r in committed_records(COMMITTED / "kernels.jsonl", False)})
    empty = tmp_path / "empty"
    empty.mkdir()
    out = CliRunner().invoke(main, ["results", "report", "--out", str(tmp_path / "x"), "--records", str(empty)])
    assert out.exit_code == 2 and "no records to show" in out.output


# ---- headless Chromium ---------------------------------------------------------------------------------

# The `chromium` fixture (found, or installed with apt when missing and allowed) is tests/conftest.py's.


def _run(exe: str, page: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp / 'chromium-profile'}", "--enable-logging=stderr", "--v=0", *extra, page.as_uri()]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_dashboard_renders_in_chromium(chromium, tmp_path, html):
    page = tmp_path / "index.html"
    page.write_text(html, encoding="utf-8")
    dom = _run(chromium, page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert not [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert dom.stdout.count('class="point regressed"') == 1 and dom.stdout.count("<circle") == 6
    shot = tmp_path / "results-dashboard.png"
    r = _run(chromium, page, tmp_path, f"--screenshot={shot}", "--window-size=1100,900")
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page, not a blank
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / shot.name)
