"""The training report: JSON twin and self-contained HTML, rendered by headless Chromium without errors
(the same browser check as the inference report's)."""

from __future__ import annotations

import copy
import json
import re
import shutil

import pytest
import torch
from test_profile_report import ARTIFACTS, _console_lines, _run
from torch import nn

from warpforge.profile.train import TrainConfig, TrainSetup
from warpforge.profile.train_cli import finalize, write
from warpforge.profile.train_run import profile_train


@pytest.fixture(scope="module")
def merged() -> dict:
    """One CPU run, and a second rank made from it with a slow loader: a two-rank merged profile."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    data = [(torch.randn(16, 32), torch.randint(0, 4, (16,))) for _ in range(4)]
    d = profile_train(TrainSetup(loader=data, model=model, optimizer=opt, loss_fn=nn.functional.cross_entropy,
                                 name="<mlp> & co"), TrainConfig(steps=3, warmup=1, plain=2))
    r1 = copy.deepcopy(d)
    r1["meta"]["rank"] = 1
    r1["aggregate"]["mean"]["data"] += 10 * r1["aggregate"]["mean"]["step_ms"]
    r1["aggregate"]["mean"]["step_ms"] *= 11
    return finalize(d, [d, r1])


def test_json_twin_and_self_contained_html(merged, tmp_path):
    paths = write(merged, tmp_path)
    d = json.loads(paths["json"].read_text())
    assert d["verdict"] == merged["verdict"] and len(d["steps"]) == 3 and len(d["ranks"]) == 2
    html = paths["html"].read_text()
    assert "<script" not in html and " src=" not in html and "url(" not in html
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) <= {"http://www.w3.org/2000/svg"}
    assert "&lt;mlp&gt; &amp; co" in html and "<mlp>" not in html
    assert html.count('data-part="forward"') >= 3 + 2  # a segment per step and per rank


def test_training_report_renders_in_chromium(chromium, merged, tmp_path):
    page = write(merged, tmp_path / "train")["html"]
    dom = _run(chromium, page, tmp_path, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert not _console_lines(dom.stderr), _console_lines(dom.stderr)
    for mark in ('id="verdict"', '<svg id="steps-chart"', '<table id="phases"', '<svg id="ranks-chart"',
                 '<table id="ranks"', '<svg id="memory-chart"', '<table id="layers"'):
        assert mark in dom.stdout, mark
    assert 'data-kind="straggler"' in dom.stdout
    shot = tmp_path / "profile-train-report.png"
    r = _run(chromium, page, tmp_path, f"--screenshot={shot}", "--window-size=1400,1600")
    assert r.returncode == 0 and shot.is_file(), r.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # a rendered page, not a blank
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / shot.name)
