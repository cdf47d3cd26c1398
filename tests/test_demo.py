"""`warpforge demo` runs end to end on this machine and prints measured figures."""

from __future__ import annotations

import json

from click.testing import CliRunner

from warpforge.cli import main


def test_demo_runs_and_reports_measured_figures(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the optimizer step saves under ./out/demo
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
    assert (tmp_path / "out" / "demo" / "optimize-mobilenet_v2" / "report.html").is_file()
    # Generation with the real Gemma 3 270M: text, then the engine's own rates.
    assert "gemma3-270m" in text and "decode:" in text and "tok/s" in text
    res = CliRunner().invoke(main, ["results", "list", "--store", str(store)])
    assert res.exit_code == 0 and "memory" in res.output
