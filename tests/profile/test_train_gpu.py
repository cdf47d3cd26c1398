"""``profile --train`` on a GPU (CUDA events per phase, the measured memory peak): the bundled tiny GPT's
breakdown adds up and the profiler costs little. Skipped without CUDA."""

from __future__ import annotations

import pytest

from warpforge.profile.train import TrainConfig
from warpforge.profile.train_breakdown import PARTS
from warpforge.profile.train_cli import finalize
from warpforge.profile.train_run import profile_train

pytestmark = pytest.mark.gpu


def test_tiny_gpt_on_the_gpu():
    from warpforge.examples.tiny_gpt import factory

    d = finalize(profile_train(factory(size="small", device="cuda"), TrainConfig(steps=10, warmup=3)))
    assert d["meta"]["clock"] == "CUDA events"
    a = d["aggregate"]
    assert a["parts_error"] < 0.05 and all(a["mean"][k] >= 0 for k in PARTS)
    assert a["mean"]["forward"] > 0 and a["mean"]["backward"] > 0 and a["mean"]["optimizer"] > 0
    assert a["mean"]["step_ms"] == pytest.approx(d["timing"]["wall_ms"], rel=0.1)
    assert d["timing"]["overhead"] < 0.05
    assert d["h2d"]["pinned"] is True and d["h2d"]["bytes"] > 0
    assert d["memory"]["measured_peak_bytes"] >= d["memory"]["phases"]["forward"]["parameters"]
    assert d["mfu"] is not None and 0 < d["mfu"] < 1
