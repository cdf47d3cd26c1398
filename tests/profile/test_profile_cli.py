"""``warpforge profile``: targets, outputs, --compare, and clear messages for bad input."""

from __future__ import annotations

import json
import textwrap

import pytest
from click.testing import CliRunner

from warpforge.cli import main

FACTORIES = textwrap.dedent('''
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 32)
            self.act = torch.nn.GELU()
            self.fc2 = torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    def pair():
        torch.manual_seed(0)
        return Net().eval(), (torch.randn(8, 16),)

    def bare():
        return Net().eval()

    def shaped(input_shape):
        return Net().eval(), torch.randn(*input_shape)

    def broken():
        def f(x):
            raise RuntimeError("boom")
        return f, (torch.randn(2),)

    def not_a_model():
        return 42
''')


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "wf_profile_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path / "wf_profile_factories.py"


def invoke(*args):
    return CliRunner().invoke(main, ["profile", *args], catch_exceptions=False)


def test_file_factory_writes_report(factories, tmp_path):
    out = tmp_path / "p"
    r = invoke(f"{factories}:pair", "--iters", "2", "--warmup", "1", "--out", str(out), "--trace")
    assert r.exit_code == 0, r.output
    assert "CPU run" in r.output and "fc1 / aten::linear" in r.output and "report:" in r.output
    d = json.loads((out / "report.json").read_text())
    assert d["counts"]["flops"] == 2 * 8 * 16 * 32 + 8 * 32 + 2 * 8 * 32 * 4  # fc1, gelu, fc2
    assert (out / "report.html").is_file() and (out / "trace.json.gz").is_file()


def test_module_factory_and_input_shape(factories, tmp_path):
    r = invoke("wf_profile_factories:shaped", "--input-shape", "4x16", "--iters", "1", "--warmup", "0",
               "--out", str(tmp_path / "s"))
    assert r.exit_code == 0, r.output
    r = invoke("wf_profile_factories:bare", "--input-shape", "3,16", "--iters", "1", "--warmup", "0",
               "--out", str(tmp_path / "b"))
    assert r.exit_code == 0, r.output
    d = json.loads((tmp_path / "b" / "report.json").read_text())
    assert d["counts"]["flops"] == 2 * 3 * 16 * 32 + 3 * 32 + 2 * 3 * 32 * 4


def test_bench_case_target_declares_its_work(tmp_path):
    r = invoke("bench:memory/copy fp32", "--iters", "2", "--warmup", "1", "--out", str(tmp_path / "c"))
    assert r.exit_code == 0, r.output
    d = json.loads((tmp_path / "c" / "report.json").read_text())
    assert d["target"].startswith("bench:memory/copy fp32") and d["target"].endswith("(ours)")
    from warpforge.bench.runner import load_suite

    case = next(c for c in load_suite("memory").build() if c.name.startswith("copy fp32"))
    dec = d["declared"]
    assert dec["bytes"] == case.bytes and dec["device_GBps"] == pytest.approx(
        case.bytes / (dec["device_us"] * 1e-6) / 1e9)
    assert "declared work" in r.output


@pytest.mark.parametrize("args,message", [
    (["resnet5O"], "not a zoo model"),
    (["optimized:resnet5O"], "not a zoo model"),
    (["{f}:broken"], "failed during warm-up: RuntimeError: boom"),
    (["{f}:bare"], "return (model, inputs) or pass --input-shape"),
    (["{f}:missing"], "no function 'missing'"),
    (["{f}:not_a_model"], "returned int"),
    (["/no/such/file.py:f"], "no such file"),
    (["{f}:pair", "--input-shape", "4xz"], "--input-shape '4xz'"),
    (["bench:memory/no such case"], "no case match"),
    (["bench:nosuite/x"], "unknown suite"),
    ([], "give a TARGET"),
])
def test_bad_input_exits_2_with_a_clear_message(factories, args, message):
    r = invoke(*[a.format(f=factories) for a in args], "--iters", "1", "--warmup", "1")
    assert r.exit_code == 2
    assert message in " ".join(r.output.split())


def test_unknown_name_lists_the_zoo_and_the_forms():
    r = invoke("resnet5O")
    text = " ".join(r.output.split())
    assert "path/to/file.py:factory" in text and "bench:SUITE/CASE" in text and "mobilenet_v2" in text


def test_zoo_model(tmp_path):
    r = invoke("planner", "--iters", "1", "--warmup", "1", "--out", str(tmp_path / "p"))
    assert r.exit_code == 0, r.output
    assert "planner (batch 1, random weights)" in " ".join(r.output.split())
    assert (tmp_path / "p" / "report.json").is_file()


def test_compare(factories, tmp_path):
    for name in ("a", "b"):
        r = invoke(f"{factories}:pair", "--iters", "1", "--warmup", "0", "--out", str(tmp_path / name))
        assert r.exit_code == 0, r.output
    r = invoke("--compare", str(tmp_path / "a"), str(tmp_path / "b" / "report.json"))  # a directory or its file
    assert r.exit_code == 0, r.output
    assert "window:" in r.output and "ops that moved most" in r.output
    bad = invoke("--compare", str(tmp_path / "a" / "report.json"), str(tmp_path / "nope.json"))
    assert bad.exit_code == 2 and "no such profile" in bad.output


def test_compare_labels_say_which_side_is_faster(factories, tmp_path):
    """B faster reads "B 1.25x faster"; ops only in A or B are "removed in B" / "added in B"; profiles of
    different targets get a warning; --json prints the comparison alone on stdout; an older run's
    profile.json is still read."""
    import shutil

    from warpforge.profile.compare import compare

    r = invoke(f"{factories}:pair", "--iters", "1", "--warmup", "0", "--out", str(tmp_path / "a"))
    assert r.exit_code == 0, r.output
    a = json.loads((tmp_path / "a" / "report.json").read_text())
    b = json.loads(json.dumps(a))
    b["target"] = "something else"
    b["timing"]["window_ms"] = a["timing"]["window_ms"] / 1.25
    b["ops"] = [dict(b["ops"][0], time_us=b["ops"][0]["time_us"] / 2)] + [
        dict(b["ops"][1], module="new.module", name="new.module / aten::new")]
    c = compare(a, b)
    assert c["window"]["change"] == "B 1.25x faster" and c["window"]["ratio"] == pytest.approx(0.8)
    by = {(r["name"], r["a_us"] > 0, r["b_us"] > 0): r["change"] for r in c["ops"]}
    assert by[(a["ops"][0]["name"], True, True)] == "B 2.00x faster"
    assert "removed in B" in by.values() and "added in B" in by.values()
    assert not c["same_target"] and c["summary"][0].startswith("warning: A and B profile different targets")
    assert compare(b, a)["window"]["change"] == "B 1.25x slower"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "report.json").write_text(json.dumps(b))
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(tmp_path / "a" / "report.json", old / "profile.json")  # what earlier versions wrote
    r = invoke("--compare", str(old), str(tmp_path / "b"), "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["window"]["change"] == "B 1.25x faster"
    assert "warning: A and B profile different targets" in r.stderr


def test_input_shape_that_would_be_ignored_is_an_error(factories):
    for target in (f"{factories}:pair", "planner"):
        r = invoke(target, "--input-shape", "4x16", "--iters", "1", "--warmup", "0")
        assert r.exit_code == 2 and r.stdout == "", r.output
        assert r.stderr.startswith("warpforge profile: --input-shape:") and r.stderr.count("\n") == 1


def test_json_prints_the_profile_alone_on_stdout(factories, tmp_path):
    r = invoke(f"{factories}:pair", "--iters", "1", "--warmup", "0", "--out", str(tmp_path / "j"), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["tool"] == "warpforge.profile" and "top 15 operators" in r.stderr
