"""A saved model reloads in a fresh Python process that has only warpforge (no factory file on its path, no
tests package): a factory-file model (its file carried in the saved directory, imported under its own
name or under the longer name it was loaded by), a zoo model, and an ONNX Runtime winner."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from warpforge.optimize import optimize
from warpforge.optimize.cli import resolve

from .nets import SmallNet, image, make, tiny_zoo

FAST = dict(queries=3, warmup=1, offline_calls=2)
QUICK = dict(FAST, capture="fx")  # what is saved matters here, not how it was captured: FX is the quicker

FACTORY = '''
import torch
from torch import nn


class Odd(nn.Module):  # value-dependent control flow: FX leaves it eager, so the pickle holds this class
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.odd, self.fc = nn.Conv2d(3, 8, 3, padding=1), Odd(), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(self.odd(torch.relu(self.conv(x))).mean((2, 3)))


def factory(batch=2, device="cpu"):
    torch.manual_seed(0)
    return Net().eval().to(device), (torch.randn(batch, 3, 8, 8, device=device),)
'''

LOAD = textwrap.dedent("""
    import json, sys, torch, warpforge
    out = {}
    for name in sys.argv[1:]:
        try:
            m = warpforge.optimize.load(name)
            p = torch.load(name + '.probe.pt')
            got = m(*p['x'])
            torch.testing.assert_close(got, p['y'], rtol=1e-5, atol=1e-5)
            out[name] = 'ok ' + repr(m) + ' ' + type(m.module).__module__ if m.module is not None else 'ok ' + repr(m)
        except Exception as e:
            out[name] = f'{type(e).__name__}: {e}'
    print(json.dumps(out))
""")


def _save(opt, where, probe: tuple) -> None:
    opt.save(where)
    torch.save({"x": probe, "y": opt(*probe)}, f"{where}.probe.pt")


@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """Each saved model's result of load() in one fresh process, and the manifests."""
    root = tmp_path_factory.mktemp("saved")
    src = root / "user"
    src.mkdir()
    (src / "mymodels.py").write_text(FACTORY)
    (src / "json.py").write_text(FACTORY)  # its own name would shadow the standard library: a longer name
    dev = torch.device("cpu")
    for stem in ("mymodels", "json"):
        r = resolve(f"{src / stem}.py:factory", batch=2, device=dev)
        opt = optimize(r.model, r.inputs, backends=["warpforge"], **QUICK)
        assert opt.family == "warpforge"
        module = type(r.model).__module__  # imported under its own name, unless that shadows another module
        assert module == "mymodels" if stem == "mymodels" else module.startswith("_warpforge_optimize_"), module
        _save(opt, root / f"factory_{stem}", (-r.inputs[0].abs(),))  # the eager leaf's other branch
    model, inputs = tiny_zoo("mobilenet_v2")
    opt = optimize(model, inputs, backends=["warpforge"], **QUICK)
    assert opt.family == "warpforge"
    _save(opt, root / "zoo", tuple(x[:1] for x in inputs))
    if importlib_ok("onnxruntime"):
        opt = optimize(make(SmallNet()), (image(),), backends=["onnxruntime"], **FAST)
        assert opt.family == "onnxruntime", opt.report["why"]
        _save(opt, root / "ort", (image(n=3, seed=5),))
    for f in src.iterdir():  # the user's files are gone: the saved directory must carry what it needs
        f.unlink()
    src.rmdir()
    names = [p.name for p in root.iterdir() if p.is_dir()]
    run = subprocess.run([sys.executable, "-c", LOAD, *names], cwd=root, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    manifests = {n: json.loads((root / n / "manifest.json").read_text()) for n in names}
    return json.loads(run.stdout.strip().splitlines()[-1]), manifests


def importlib_ok(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_a_factory_file_model_reloads_in_a_fresh_process(reloaded):
    results, manifests = reloaded
    man = manifests["factory_mymodels"]
    assert man["format"] == "pickle" and man["code"] == [
        {"module": "mymodels", "file": "code/mymodels.py", "origin": man["code"][0]["origin"]}]
    assert results["factory_mymodels"] == "ok Loaded('warpforge-fp32', format='pickle') warpforge.optimize.runtime"


def test_a_factory_file_under_a_longer_name_reloads_too(reloaded):
    results, manifests = reloaded
    (entry,) = manifests["factory_json"]["code"]
    assert entry["module"] != "json" and entry["module"].startswith("_warpforge_optimize_")
    assert results["factory_json"].startswith("ok Loaded('warpforge-fp32'"), results["factory_json"]


def test_a_zoo_model_reloads_in_a_fresh_process(reloaded):
    results, manifests = reloaded
    assert manifests["zoo"]["format"] == "pickle" and manifests["zoo"]["code"] == []  # all of it is warpforge's
    assert results["zoo"].startswith("ok Loaded('warpforge-fp32', format='pickle')"), results["zoo"]


def test_an_onnxruntime_winner_reloads_in_a_fresh_process(reloaded):
    pytest.importorskip("onnxruntime")
    results, manifests = reloaded
    assert manifests["ort"]["format"] == "onnx"
    assert results["ort"] == "ok Loaded('onnxruntime-cpu', format='onnx')", results["ort"]
