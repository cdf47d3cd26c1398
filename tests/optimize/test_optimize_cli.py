"""``warpforge optimize MODEL``: a factory file end to end, and each kind of bad input with its exit code."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from warpforge.cli import main

FAST = ["--queries", "4", "--warmup", "1"]

NET = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def factory(batch=2, device="cpu"):
    torch.manual_seed(0)
    return Net().eval().to(device), torch.randn(batch, 3, 10, 10, device=device)
'''


def _write(tmp_path, body: str, name: str = "model.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_factory_file_end_to_end(tmp_path):
    path = _write(tmp_path, NET)
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["optimize", f"{path}:factory", "--batch", "3", "--backend", "warpforge",
                                    "--out", str(out), *FAST])
    assert res.exit_code == 0, res.output
    assert "winner:" in res.output and "warpforge-fp32" in res.output
    for f in ("manifest.json", "model.pkl", "check.pt", "report.json", "report.html"):
        assert (out / f).is_file(), f
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "ok" and rep["winner"] == "warpforge-fp32"
    assert rep["model"]["inputs"] == [{"shape": [3, 3, 10, 10], "dtype": "float32"}]
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "warpforge-fp32" in html and "<script" not in html
    assert "http://" not in html and "https://" not in html  # self-contained
    # The pickled graph reloads in a fresh process that cannot import model.py (cwd elsewhere, not on the path).
    code = ("import torch, warpforge; m = warpforge.optimize.load(r'%s'); c = torch.load(r'%s');"
            "torch.testing.assert_close(m(*c['inputs']), c['outputs']); print('ok')") % (out, out / "check.pt")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path.parent, capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]


def test_json_flag_prints_the_report(tmp_path):
    path = _write(tmp_path, NET)
    res = CliRunner().invoke(main, ["optimize", f"{path}:factory", "--backend", "eager", "--json",
                                    "--out", str(tmp_path / "o"), *FAST])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["winner"] == "eager-fp32" and rep["candidates"][0]["latency"]["n"] == 4


@pytest.mark.parametrize("body,args,message", [
    (None, ["no_such_model"], "unknown model 'no_such_model'; the zoo has: "),
    ("def factory():\n    raise RuntimeError('weights missing')\n", [],
     "the factory raised RuntimeError: weights missing"),
    ("import torch\ndef factory():\n    return torch.nn.Linear(4, 2), torch.ones(3, 5)\n", [],
     "does not run on its example inputs"),
    ("def factory():\n    return 42\n", [], "expected (model, example_inputs)"),
    (None, ["missing.py:factory"], "no such file"),
])
def test_bad_input_exits_2_with_a_clear_message(tmp_path, body, args, message):
    if body is not None:
        args = [f"{_write(tmp_path, body)}:factory"]
    res = CliRunner().invoke(main, ["optimize", *args, "--out", str(tmp_path / "o"), *FAST])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output


def test_bad_budget_and_device_exit_2(tmp_path):
    path = _write(tmp_path, NET)
    res = CliRunner().invoke(main, ["optimize", f"{path}:factory", "--max-rel", "-1", *FAST])
    assert res.exit_code == 2 and "max_rel must be a finite number >= 0" in res.output


def test_no_candidate_meets_the_budget_exits_1_with_the_report(tmp_path):
    # Outputs that change on every call: no candidate reproduces the reference.
    path = _write(tmp_path, NET + '''

class Noisy(Net):
    def forward(self, x):
        y = super().forward(x)
        return y + torch.randn_like(y)


def noisy():
    torch.manual_seed(0)
    return Noisy().eval(), torch.randn(2, 3, 10, 10)
''')
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["optimize", f"{path}:noisy", "--backend", "warpforge", "--out", str(out), *FAST])
    assert res.exit_code == 1, res.output
    assert "no candidate met the budget" in res.output
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "no_candidate" and rep["winner"] is None
    assert (out / "report.html").is_file() and not (out / "manifest.json").exists()
    by = {r["name"]: r for r in rep["candidates"]}
    assert by["eager-fp32"]["status"] == "rejected" and "max_rel" in by["eager-fp32"]["reason"]
    # capture itself notices that the traced copy does not reproduce the model: its submodules are optimized as
    # regions (optimize.regions), the root's noise stays eager, and the gate rejects the result as it does eager's
    wf = by["warpforge-fp32"]
    assert wf["status"] == "rejected" and "max_rel" in wf["reason"]
    root = next(e for e in wf["details"]["regions"]["eager"] if e["path"] == "(root)")
    assert "does not reproduce" in root["reason"]


def test_cli_precision_choices_are_the_gate_s():
    """`warpforge optimize --precision` offers exactly what the gate budgets (spelled out for a fast --help)."""
    from warpforge.cli import OPTIMIZE_PRECISIONS
    from warpforge.optimize.gate import PRECISIONS

    assert tuple(OPTIMIZE_PRECISIONS) == tuple(PRECISIONS)


def test_rebatch_keeps_every_sample_in_order():
    """cli_optimize(val_batch=): the demo checks MobileNetV2's 270 views 30 per call on a CPU."""
    import torch

    from warpforge.optimize.cli import rebatch

    val = [(torch.arange(i * 2, i * 2 + 2)[:, None].float(), torch.tensor([i, i])) for i in range(5)]  # 10 samples
    got = rebatch(val, 4)
    assert [len(x) for x, _ in got] == [4, 4, 2] and all(len(v) == 2 for v in got)
    assert torch.equal(torch.cat([x for x, _ in got]).flatten(), torch.arange(10).float())
    assert torch.equal(torch.cat([i for _, i in got]), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4]))
    odd = [(torch.ones(2, 3), {"mask": None})]  # not all tensors: left as it is
    assert rebatch(odd, 4) is odd
    with pytest.raises(ValueError, match="val_batch"):
        rebatch(val, 0)


def test_errors_go_to_stderr_and_results_to_stdout(tmp_path):
    res = CliRunner().invoke(main, ["optimize", "no_such_model", *FAST])
    assert res.exit_code == 2 and res.stdout == ""
    assert res.stderr.startswith("warpforge optimize: unknown model 'no_such_model'")


def test_cpu_skips_say_why_in_cli_terms_and_dtype_spellings_are_both_accepted(tmp_path):
    """fp16 spelled float16 works; the skip reasons name CLI flags, not Python; in the HTML report the
    skipped candidates are one row (reasons on hover and as footnotes), not one row each."""
    path = _write(tmp_path, NET)
    out = tmp_path / "o"
    res = CliRunner().invoke(main, ["optimize", f"{path}:factory", "--precision", "fp32", "--precision", "float16",
                                    "--precision", "bfloat16", "--out", str(out), *FAST])
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "report.json").read_text())
    by = {r["name"]: r for r in rep["candidates"]}
    assert by["eager-fp16"]["status"] == "skipped" and by["eager-bf16"]["status"] == "skipped"
    assert "convolutions" not in by["eager-fp16"]["reason"]  # the model's kind does not matter
    assert "--backend torch.compile" in by["torch.compile-fp32"]["reason"]
    page = (out / "report.html").read_text()
    skipped = [r["name"] for r in rep["candidates"] if r["status"] == "skipped"]
    assert len(skipped) >= 4 and page.count('<tr class="skipped">') == 1
    assert all(page.count(f"<code>{n}</code>") == 0 for n in skipped)  # no row of their own
    assert all(f'">{n}</code><sup>' in page for n in skipped) and 'title="fp16 on CPU:' in page
    assert '<ol class="muted footnotes">' in page


def test_latency_chart_is_scaled_to_the_p50s():
    import re

    from warpforge.optimize.report import _latency_svg

    cands = [{"name": "a", "latency": {"p50_ms": 1.0, "p99_ms": 1.1}},
             {"name": "b", "latency": {"p50_ms": 1.2, "p99_ms": 100.0}}]  # one noisy tail
    svg = _latency_svg({"candidates": cands, "winner": "a"})
    widths = [float(w) for w in re.findall(r'class="p50" x="[\d.]+" y="[\d.]+" width="([\d.]+)"', svg)]
    assert len(widths) == 2 and widths[1] >= 0.75 * 560 and widths[0] / widths[1] == pytest.approx(1 / 1.2, rel=1e-2)
    assert "<path" in svg and "(p99 100)" in svg  # the clipped whisker ends in an arrow, its figure still shown
