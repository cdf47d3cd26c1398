"""``profile_train`` on CPU (host timers): the breakdown adds up, injected bottlenecks are named first, a
clean run has no finding at the threshold, and the ``--train`` command works end to end."""

from __future__ import annotations

import json
import time

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from warpforge.cli import main
from warpforge.profile.train import TrainConfig, TrainSetup
from warpforge.profile.train_breakdown import PARTS
from warpforge.profile.train_cli import finalize
from warpforge.profile.train_findings import THRESHOLD
from warpforge.profile.train_run import profile_train

SLEEP_S = 0.05


def _mlp(n_layers: int = 2, width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(n_layers):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _batches(n: int = 6, width: int = 64, batch: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


class SleepyLoader:
    """A loader that sleeps before each batch, as a slow disk or decoder would."""

    def __init__(self, batches, seconds: float):
        self.batches, self.seconds = batches, seconds

    def __iter__(self):
        for b in self.batches:
            time.sleep(self.seconds)
            yield b


def _setup(loader, model=None, **opt_kw) -> TrainSetup:
    model = model or _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, **opt_kw)
    return TrainSetup(loader=loader, model=model, optimizer=opt, loss_fn=nn.functional.cross_entropy)


@pytest.fixture(scope="module")
def clean():
    return finalize(profile_train(_setup(_batches(), foreach=True), TrainConfig(steps=8, warmup=2)))


def test_breakdown_adds_up_to_the_step(clean):
    a = clean["aggregate"]
    assert a["parts_error"] < 0.05
    for s in clean["steps"]:
        assert sum(s[k] for k in PARTS) == pytest.approx(s["step_ms"], rel=0.05)
        assert s["forward"] > 0 and s["backward"] > 0 and s["optimizer"] > 0
    # The steps' own clock against the wall clock around the whole instrumented loop.
    assert a["mean"]["step_ms"] == pytest.approx(clean["timing"]["wall_ms"], rel=0.05)
    assert a["share"]["other"] < 0.15  # the recorded phases cover the step


def test_clean_run_has_no_finding_at_the_threshold(clean):
    """Threshold: THRESHOLD (10%) of the step for time findings; memory findings stay below it by design."""
    assert [f["kind"] for f in clean["findings"] if f["severity"] >= THRESHOLD] == []
    assert clean["verdict"].startswith("No bottleneck above 10%")


def test_memory_and_layers(clean):
    mem = clean["memory"]
    params = sum(p.numel() * 4 for p in _mlp().parameters())
    assert mem["phases"]["forward"]["parameters"] == params
    assert mem["phases"]["optimizer"]["gradients"] == params
    assert mem["phases"]["forward"]["activations"] >= 256 * 64 * 4  # at least one saved [256, 64] fp32 input
    assert mem["peak_phase"] in ("forward", "backward", "optimizer") and "estimated" in mem["source"]
    assert {r["layer"] for r in clean["layers"]} == {"0", "2", "4"}
    matmuls = 2 * 256 * (64 * 64 * 2 + 64 * 10)  # the forward's three Linear layers on a batch of 256
    # 3x the forward (backward ~2x); ReLU and the loss add their elementwise FLOPs, about 1%.
    assert matmuls * 3 < clean["flops_per_step"] < matmuls * 3 * 1.02


def test_sleepy_loader_is_the_top_finding():
    d = finalize(profile_train(_setup(SleepyLoader(_batches(), SLEEP_S)), TrainConfig(steps=4, warmup=1)))
    top = d["findings"][0]
    assert top["kind"] == "starved_loader" and top["severity"] >= THRESHOLD
    assert d["aggregate"]["mean"]["data"] == pytest.approx(SLEEP_S * 1e3, rel=0.5)
    assert "num_workers" in top["advice"]
    assert d["verdict"] == top["text"]


def test_launch_bound_optimizer_named_and_fixed_by_foreach():
    many = nn.Sequential(*(nn.Linear(8, 8) for _ in range(40)))  # 80 small tensors, cheap compute
    data = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(4)]

    def run(**kw):
        opt = torch.optim.Adam(many.parameters(), lr=1e-3, **kw)
        s = TrainSetup(loader=data, model=many, optimizer=opt, loss_fn=nn.functional.mse_loss)
        return finalize(profile_train(s, TrainConfig(steps=3, warmup=1, plain=0)))

    slow = run(foreach=False)
    assert slow["findings"][0]["kind"] == "launch_bound_optimizer"
    assert "fused=True" in slow["findings"][0]["advice"] and "80 parameter tensors" in slow["findings"][0]["text"]
    assert "launch_bound_optimizer" not in [f["kind"] for f in run(foreach=True)["findings"]]


def test_step_callable_form_is_split_by_hooks():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)

    def step(batch):
        x, y = batch
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    d = profile_train(TrainSetup(loader=_batches(), step=step, model=model, optimizer=opt),
                      TrainConfig(steps=4, warmup=1, plain=0))
    m = d["aggregate"]["mean"]
    assert m["forward"] > 0 and m["backward"] > 0 and m["optimizer"] > 0
    assert d["aggregate"]["parts_error"] < 0.05


def test_setup_validation():
    with pytest.raises(ValueError, match="missing: optimizer, loss_fn"):
        TrainSetup(loader=[], model=_mlp())
    with pytest.raises(ValueError, match="--steps must be >= 1, got 0"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="the loader yields no batches"):
        profile_train(_setup([]), TrainConfig(steps=1, warmup=0))


def test_cli_tiny_gpt_example(tmp_path):
    out = tmp_path / "gpt"
    r = CliRunner().invoke(main, ["profile", "--train", "warpforge.examples.tiny_gpt:factory", "--steps", "3",
                                  "--warmup", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads((out / "report.json").read_text())
    assert d["kind"] == "train" and d["target"] == "tiny_gpt (tiny)"
    assert d["aggregate"]["parts_error"] < 0.05 and d["flops_per_step"] > 0
    assert (out / "report.html").read_text().count('class="seg"') >= 3 * 4
    assert "mean per step" in r.output and "report:" in r.output


@pytest.mark.parametrize("args, msg", [
    (["nowhere.py:factory"], "nowhere.py: no such file"),
    (["warpforge.examples.tiny_gpt:nope"], "no function 'nope'"),
    (["warpforge.examples.tiny_gpt:factory", "--size", "huge"], "size must be one of tiny, small, full"),
    (["warpforge.examples.tiny_gpt"], "expected path/to/train.py:factory"),
])
def test_cli_bad_input_is_one_line(args, msg):
    r = CliRunner().invoke(main, ["profile", "--train", *args, "--steps", "1"])
    assert r.exit_code == 2 and msg in r.output, r.output
    assert "Traceback" not in r.output


def test_resnet50_example_counts_its_flops():
    from warpforge.examples.resnet50 import factory

    s = factory(size="tiny", device="cpu")
    d = profile_train(s, TrainConfig(steps=1, warmup=0, plain=0))
    # ResNet-50: 4.1 GMACs per 224x224 image; at 64x64 (x(64/224)^2), batch 2, forward + ~2x backward.
    expected = 3 * 2 * 4.1e9 * (64 / 224) ** 2 * 2
    assert d["flops_per_step"] == pytest.approx(expected, rel=0.1)
    names = {r["layer"] for r in d["layers"]}
    assert {"conv1", "fc", "layer4.2.conv3"} <= names and len(names) == 53 + 53 + 1  # convs, norms, fc
    assert d["memory"]["phases"]["forward"]["parameters"] == sum(p.numel() * 4 for p in s.model.parameters())
