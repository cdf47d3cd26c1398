"""The image_input pass: a graph input read only by space-to-depth stems reaches them as the caller gave it
(fp32 NCHW), with no cast and no channels_last copy in front; the results are those of the cast-and-copy
graph, bit for bit (fp16 pipelines: the Triton kernels through the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from warpforge.optimize import optimize_graph
from warpforge.optimize.passes.image_input import ImageInput
from warpforge.optimize.pipeline import default_passes
from warpforge.optimize.runtime import CastIO

from .nets import conv_bn_act, image, make


class Stem(nn.Module):
    """ResNet's head at a test size: 7x7/2 conv + BN + ReLU on the image, 3x3/2 max pool, a 3x3 conv, a linear."""

    def __init__(self, c: int = 16, stem_stride: int = 2, also_reads_image: bool = False) -> None:
        super().__init__()
        self.stem = conv_bn_act(3, c, 7, stem_stride)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv = conv_bn_act(c, c, 3)
        self.fc = nn.Linear(c, 5)
        self.also_reads_image = also_reads_image

    def forward(self, x):
        y = self.fc(self.conv(self.pool(self.stem(x))).mean((2, 3)))
        return y + x.mean() if self.also_reads_image else y


def _fp16_graph(model: nn.Module, x: torch.Tensor, passes=None):
    return optimize_graph(model.half(), (x.half(),), passes, dtype=torch.float16)


def _entry_copies(gm: fx.GraphModule) -> int:
    return sum(n.op == "call_method" and n.target == "contiguous" for n in gm.graph.nodes)


def _reads_as_given(device: str, n: int, h: int, w: int) -> None:
    model = make(Stem()).to(device)
    x = torch.randn(n, 3, h, w, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        want32 = model(x)
    gm, report = _fp16_graph(model, x)
    changes = next(p for p in report["passes"] if p["name"] == "image_input")["changes"]
    assert gm.raw_inputs == (0,) and [c["action"] for c in changes] == ["handed"], changes
    assert "stem" in changes[0]["where"] and _entry_copies(gm) == 0
    old, _ = _fp16_graph(make(Stem()).to(device), x, [p for p in default_passes() if p.name != "image_input"])
    assert not hasattr(old, "raw_inputs") and _entry_copies(old) == 1  # the channels_last copy on entry
    with torch.no_grad():
        got = CastIO(gm, torch.float16)(x)  # fp32 NCHW in: the stem's pack casts it
        same = CastIO(old, torch.float16)(x)
    assert got.dtype == torch.float32 and torch.equal(got, same)
    assert (got - want32).abs().max() <= 2e-2 * want32.abs().max()


def test_the_stem_reads_the_fp32_image_as_given():
    _reads_as_given("cpu", 2, 19, 21)


@pytest.mark.gpu
def test_gpu_the_stem_reads_the_fp32_image_as_given():
    _reads_as_given("cuda", 3, 67, 61)


@pytest.mark.parametrize("variant", ["read-elsewhere", "stride-1", "fp32"])
def test_inputs_that_other_ops_read_stay_cast_and_copied(variant):
    """An input also read by something other than a stem, a first conv that is not a space-to-depth stem,
    an fp32 pipeline: no change (and CastIO casts every input as before)."""
    x = image(n=1, hw=17)
    if variant == "fp32":
        gm, report = optimize_graph(make(Stem()), (x,))
    else:
        model = make(Stem(also_reads_image=True) if variant == "read-elsewhere" else Stem(stem_stride=1))
        gm, report = _fp16_graph(model, x)
    changes = next(p for p in report["passes"] if p["name"] == "image_input")["changes"]
    assert changes == [] and not hasattr(gm, "raw_inputs") and _entry_copies(gm) == 1


def test_the_pass_leaves_non_graph_modules_alone():
    from warpforge.optimize.passes.base import PassContext

    m = nn.Conv2d(3, 4, 3)
    assert ImageInput().apply(m, PassContext(example_inputs=(torch.randn(1, 3, 8, 8),))) is m


def test_the_built_candidate_keeps_the_raw_input_through_copies_and_pickles():
    """The optimizer deep-copies pipeline graphs (its cache) and saves built modules by pickle: the raw input
    must survive both, or CastIO casts the image again (2026-12-04 on the H200: the suite's ResNet-50 still
    ran the cast and the channels_last copy, because ``copy.deepcopy`` of a GraphModule drops attributes
    its graph does not reference)."""
    import copy
    import pickle

    from warpforge.optimize.backends import _build_warpforge
    from warpforge.optimize.runtime import raw_inputs

    model = make(Stem())
    x = image(n=1, hw=17)
    gm, _ = _fp16_graph(copy.deepcopy(model), x)
    assert raw_inputs(copy.deepcopy(gm)) == (0,)  # through meta
    built = _build_warpforge("fp16")(model, (x,))
    assert built.module.raw_inputs == (0,) and _entry_copies(built.module.inner) == 0
    again = pickle.loads(pickle.dumps(built.module))
    assert copy.deepcopy(built.module).raw_inputs == (0,) and again.raw_inputs == (0,)
    with torch.no_grad():
        want = built.module(x)
        assert want.dtype == torch.float32 and torch.equal(again(x), want)
