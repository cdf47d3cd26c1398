"""The HTML report: self-contained, escaped, chart drawn — and rendered by headless Chromium without errors.

Chromium comes from Debian's ``chromium`` package; the ``chromium`` fixture (tests/conftest.py) installs it when
missing and allowed (root with apt-get), else the browser tests skip with the reason. Screenshots are kept under
``$WARPFORGE_TEST_ARTIFACTS`` (default ``build/test-artifacts``) for a person to look at.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from profile_synth import H200, toy_model

from warpforge.profile import compare, profile
from warpforge.profile.analysis import LaunchCost, analyze
from warpforge.profile.api import Profile
from warpforge.profile.report import render_html

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("WARPFORGE_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))


def synthetic_gpu_profile(**over) -> Profile:
    """A GPU-shaped profile from the synthetic toy model (the CPU machine has no GPU trace to show)."""
    b = toy_model(iters=3)
    a = analyze(b.trace(), b.counts(), ceilings=H200, launch=LaunchCost(9.37, "probe (synthetic)"))
    meta = {"device": "NVIDIA H200 (synthetic timeline)", "device_type": "cuda", "torch": torch.__version__,
            "time": "2026-01-01T00:00:00+00:00", "iters": 3, "warmup": 5, "grad": False}
    return Profile(target=over.get("target", "toy_model <synthetic>"), meta=meta, analysis=a, counts=b.counts(),
                   window_ms=over.get("window_ms", 0.877), plain_ms=0.86, modules=[])


@pytest.fixture(scope="module")
def gpu_html() -> str:
    return render_html(synthetic_gpu_profile().as_dict())


@pytest.fixture(scope="module")
def cpu_profile():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
                            torch.nn.Linear(8 * 6 * 6, 10)).eval()
    return profile(m, torch.randn(2, 3, 6, 6), warmup=1, iters=2, name="tiny CNN (CPU)")


def test_self_contained(gpu_html, cpu_profile):
    for html in (gpu_html, render_html(cpu_profile.as_dict())):
        assert "<script" not in html and "<link" not in html and " src=" not in html and "url(" not in html
        # The only URL is the SVG namespace, which browsers never fetch.
        assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}


def test_roofline_has_ceilings_and_one_point_per_counted_operator(gpu_html):
    svg = gpu_html[gpu_html.index('<svg id="roofline"'):]
    svg = svg[:svg.index("</svg>")]
    d = synthetic_gpu_profile().as_dict()
    placed = [r for r in d["ops"][:200] if r.get("flops") and r.get("tflops")]
    assert svg.count('class="point op"') == len(placed) > 5
    assert "HBM 4.80 TB/s" in svg and "tf32 494 TFLOP/s" in svg and "fp32 67 TFLOP/s" in svg
    assert 'class="point model"' in svg


def test_names_are_escaped():
    p = synthetic_gpu_profile(target="<b>model & co</b>")
    html = render_html(p.as_dict())
    assert "&lt;b&gt;model &amp; co&lt;/b&gt;" in html and "<b>model" not in html
    assert "vectorized_elementwise_kernel&lt;4, MulFunctor&lt;float&gt;&gt;" in html


def test_compare_reports_what_moved():
    a = synthetic_gpu_profile().as_dict()
    b = synthetic_gpu_profile(window_ms=0.5).as_dict()
    b["ops"] = [dict(r, time_us=r["time_us"] / 2) if r["op"] == "aten::conv2d" else r for r in b["ops"]]
    b["findings"] = [f for f in b["findings"] if f["kind"] != "syncs"]
    c = compare(a, b)
    assert c["window"]["ratio"] == pytest.approx(0.5 / 0.877) and "faster" in c["window"]["change"]
    assert c["ops"][0]["name"] == "stem.conv / aten::conv2d" and c["ops"][0]["ratio"] == pytest.approx(0.5)
    assert c["findings"]["gone"] == ["syncs"]
    same = compare(a, a)
    assert same["window"]["change"] == "within noise"
    with pytest.raises(ValueError, match="not a warpforge profile"):
        compare({"tool": "other"}, a)


# ---- headless Chromium -------------------------------------------------------------------------------

def _run(exe: str, page: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={tmp / 'chromium-profile'}", "--enable-logging=stderr", "--v=0", *extra, page.as_uri()]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def _console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def test_console_check_catches_errors(chromium, tmp_path):
    """Control: a page that logs an error does show up, so a clean run means something."""
    page = tmp_path / "bad.html"
    page.write_text("<!DOCTYPE html><html><body><script>console.error('deliberate')</script></body></html>")
    assert any("deliberate" in line for line in _console_lines(_run(chromium, page, tmp_path, "--dump-dom").stderr))


@pytest.mark.parametrize("which", ["gpu-synthetic", "cpu"])
def test_report_renders_in_chromium(chromium, tmp_path, which, gpu_html, cpu_profile):
    if which == "cpu":
        page = cpu_profile.write(tmp_path / "cpu")["html"]
    else:
        page = tmp_path / "gpu" / "profile.html"
        page.parent.mkdir()
        page.write_text(gpu_html, encoding="utf-8")
    dom = _run(chromium, page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert not _console_lines(dom.stderr), _console_lines(dom.stderr)
    assert 'id="verdict"' in dom.stdout and '<table id="ops"' in dom.stdout
    if which == "gpu-synthetic":
        assert '<svg id="roofline"' in dom.stdout and dom.stdout.count('class="point op"') > 5
    else:
        assert 'id="no-roofline"' in dom.stdout and '<svg id="split"' in dom.stdout
    shot = tmp_path / f"profile-report-{which}.png"
    r = _run(chromium, page, tmp_path, f"--screenshot={shot}", "--window-size=1400,1000")
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page, not a blank
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / shot.name)
