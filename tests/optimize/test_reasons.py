"""Failure reasons: kept whole in report.json without escape codes, first line in the table; exporters'
dumps in the log file, not on the terminal."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

from warpforge.optimize import report as report_mod
from warpforge.optimize.api import _try
from warpforge.optimize.backends import Candidate, _build_ort
from warpforge.optimize.cli import print_table
from warpforge.optimize.gate import DEFAULT_BUDGETS
from warpforge.optimize.logs import clean, first_line, logging_to

LONG = ("\x1b[96mThis is step 3/3\x1b[0m of a conversion that failed: "
        + " ".join(f"word{i}" for i in range(300)) + "\n  second line \x1b[1;31mred\x1b[0m\nthird line: the end")


def _failing_build(model, inputs):
    raise RuntimeError(LONG)


def test_a_long_coloured_reason_survives_whole_in_the_json_and_its_first_line_in_the_table():
    assert len(LONG) > 1000
    cand = Candidate("warpforge-fp32", "warpforge", "fp32", _failing_build)
    x = torch.randn(2, 3)
    rec = {"name": cand.name, "family": cand.family, "precision": "fp32", "about": "", "eligible": True}
    rec.update(_try(cand, torch.nn.Linear(3, 2), (x,), [(x,)], [x], "generic", DEFAULT_BUDGETS["fp32"],
                    torch.device("cpu"), {}, None))
    report = report_mod.make_report({"name": "m", "inputs": []}, {"device": "cpu"}, [rec], None,
                                    status="no_candidate")
    text = report_mod.to_json(report)
    assert "\x1b" not in text and "\\u001b" not in text
    reason = json.loads(text)["candidates"][0]["reason"]
    want = "build failed: RuntimeError: " + clean(LONG)
    assert reason == want and reason.endswith("third line: the end") and "word299" in reason
    assert "[96m" not in reason and "This is step 3/3 of a conversion" in reason
    # The table and the verdict carry the first line only, with no escape codes.
    buf = io.StringIO()
    print_table(json.loads(text), Console(file=buf, width=4000, color_system=None))
    shown = buf.getvalue()
    assert first_line(reason) in shown and "second line" not in shown and "\x1b" not in shown
    assert "(more in report.json)" in shown
    assert "second line" not in report["why"] and "word299" in report["why"]
    html = report_mod.to_html(report)
    assert "third line: the end" in html and "\x1b" not in html


def test_a_failing_onnx_export_does_not_flood_the_terminal(capfd, tmp_path):
    class NoOnnx(torch.nn.Module):  # linalg_eigh has no ONNX form: both exporters fail, the TorchScript one
        def forward(self, x):      # printing its whole traced graph
            y = x
            for _ in range(20):
                y = torch.tanh(y) + 1
            return torch.linalg.eigh(y @ y.transpose(-1, -2))[0]

    log = tmp_path / "optimize.log"
    with logging_to(log), pytest.raises(RuntimeError, match="ONNX export failed") as err:
        _build_ort("CPUExecutionProvider")(NoOnnx().eval(), (torch.randn(2, 5, 5),))
    out, errs = capfd.readouterr()
    assert len(out) + len(errs) < 200, (out + errs)[:2000]
    assert "\x1b" not in str(err.value) and str(log) in str(err.value)
    dump = log.read_text()
    assert "aten::linalg_eigh" in dump and dump.count("\n") > 50  # the exporters' output went here
