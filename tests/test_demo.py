"""`warpforge demo` runs end to end on this machine and prints measured figures."""

from __future__ import annotations

import io
import json

import pytest
import torch
from click.testing import CliRunner

from warpforge.cli import main


@pytest.mark.slow  # probe, a bench suite, MobileNetV2's search on 270 views, Gemma 3 270M: ~2 min on an idle CPU
@pytest.mark.timeout(900)  # a loaded 2-core box runs it 2-3x slower; a hang still fails
def test_demo_runs_and_reports_measured_figures(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the optimizer step saves under ./out/demo
    monkeypatch.delenv("COLUMNS")  # output to a file, as a user's `warpforge demo > demo.txt` (conftest sets 200)
    store = tmp_path / "r.sqlite"
    out = CliRunner().invoke(main, ["demo", "--store", str(store)])
    assert out.exit_code == 0, out.output
    text = out.output
    assert "probe" in text and "memory" in text
    # The headline carries figures read back from the store: one line per memory case, each checked.
    bench_lines = [ln for ln in text.splitlines() if ln.strip().startswith("bench ")]
    assert len(bench_lines) >= 4
    assert all("correct=ok" in ln for ln in bench_lines)
    assert all("GB/s" in ln for ln in bench_lines)
    # The optimizer on the real MobileNetV2: a winner within budget, its accuracy, the saved model.
    flat = " ".join(text.split())  # rich wraps at the terminal width
    assert "winner: warpforge-fp32" in flat or "winner: eager-fp32" in flat, flat[-2000:]
    assert "top-1 agreement 1.000" in flat
    saved = tmp_path / "out" / "demo" / "optimize-mobilenet_v2"
    assert (saved / "report.html").is_file()
    rep = json.loads((saved / "report.json").read_text())
    ref = next(r for r in rep["candidates"] if r["name"] == "eager-fp32")
    if "ImageNet" in flat and not torch.cuda.is_available():  # real weights: every validation view (CPU: 30 per call)
        assert ref["accuracy"]["n_samples"] == 270 and rep["settings"]["val"] == "9 user batch(es)", rep["settings"]
    # Generation with the real Gemma 3 270M: text, then the engine's own rates.
    assert "gemma3-270m" in text and "decode:" in text and "tok/s" in text
    # One streamed request to the real server process, with what the client measured.
    assert "POST /v1/completions (stream)" in flat and "time to first token" in flat, flat[-3000:]
    assert "serve gemma3-270m over HTTP: TTFT" in flat and "tok/s decode" in flat
    # The procedural street rendered to a PNG, with its measured time per view.
    png = tmp_path / "out" / "demo" / "splat-street.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "ms per view" in flat
    res = CliRunner().invoke(main, ["results", "list", "--store", str(store)])
    assert res.exit_code == 0 and "memory" in res.output
    # the summary names the run it stored and read back; the committed GPU headline follows the CPU figures
    assert "the memory run is stored as run 1: warpforge results show 1" in flat
    assert "committed GPU figures" in flat and " h200 " in flat
    # off a terminal the section rules stay a window wide (tables keep whole rows)
    assert max(len(ln) for ln in text.splitlines() if ln.startswith("─")) <= 100


def _console():
    from rich.console import Console

    return Console(file=io.StringIO(), width=400)


def test_the_summary_reads_the_demos_own_run_not_the_latest(tmp_path):
    """Another process may store a run between the demo's bench and its summary: the summary reads its own."""
    from tests.bench.conftest import fake_record
    from warpforge.results.store import Store
    from warpforge.demo import _headline

    url = str(tmp_path / "r.sqlite")
    with Store(url) as store:
        mine = store.add_run("memory", [fake_record("copy", suite="memory")])
        store.add_run("other", [fake_record("someone else's case", suite="other")])  # stored after the demo's
    console = _console()
    _headline(console, url, mine)
    text = console.file.getvalue()
    assert "bench  copy:" in text and "someone else" not in text, text
    assert f"(the memory run is stored as run {mine}: warpforge results show {mine})" in text
    console = _console()
    _headline(console, url, None)  # --no-store, or the store failed
    assert "the memory run was not stored" in console.file.getvalue()


def test_the_committed_gpu_figures_follow_the_cpu_ones(monkeypatch):
    from warpforge.results import headline
    from warpforge.demo import _committed

    console = _console()
    _committed(console)
    lines = console.file.getvalue().splitlines()
    assert lines[0].startswith("  committed GPU figures, the README's headline") and len(lines) > 10, lines
    assert all(ln.startswith(("  h200  ", "  h100  ")) and "(commit " in ln for ln in lines[1:]), lines
    monkeypatch.setattr(headline, "checkout_root", lambda: None)  # installed from a wheel: no records
    console = _console()
    _committed(console)
    assert console.file.getvalue() == ("  committed GPU figures: not available (warpforge is installed without its "
                                       "repository's benchmarks/results/)\n")
