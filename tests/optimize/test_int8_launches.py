"""How many kernels the warpforge-int8 graph launches on CUDA, against the fp16 graph (counted on CPU).

A ResNet-shaped net (stem, max pool, a downsample bottleneck, an identity bottleneck, pool, fc): every
int8 conv's input quantizer must live in its producer's epilogue (int8 out, or float + int8 out where a
residual add reads the float), the max pool's output is quantized once for both convs that read it, and
the int8 graph then launches only the pool's quantizer and the linear's more than the fp16 graph.
Before that fusion it launched one quantize kernel per int8 conv whose input was a block's output.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from warpforge.optimize.pipeline import optimize_graph
from warpforge.optimize.quant import quantize_model
from warpforge.profile.launches import record_launches

from .nets import image, make


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return torch.relu(h + (x if self.down is None else self.down(x)))


class TinyResNet(nn.Module):
    def __init__(self, c: int = 16, classes: int = 7) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, 2, 1, bias=False), nn.BatchNorm2d(c)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.block1 = Bottleneck(c, c, 2 * c, stride=2)
        self.block2 = Bottleneck(2 * c, c, 2 * c)
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn(self.stem(x))))
        x = self.block2(self.block1(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _graphs(seed: int = 0, int8_residual: bool = False):
    """The float and int8 graphs of TinyResNet. int8_residual off (the default is on): these tests are about
    the float residual path, where a block output read by int8 layers and a residual add is stored twice
    (dual out); the int8 residual stream has its own tests below."""
    model = make(TinyResNet(), seed=seed)
    calib = [(image(n=4, hw=32, seed=s),) for s in (5, 6)]
    fp, _ = optimize_graph(model, (image(n=2, hw=32),))
    q, _ = optimize_graph(model, (image(n=2, hw=32),))
    q, report = quantize_model(q, calib, int8_residual=int8_residual)
    return fp, q, report


def _launches(gm) -> dict[str, int]:
    x = image(n=2, hw=32, seed=9)
    with record_launches():
        gm(x)  # once-per-process work: conv2d_int8's padding row (a fill), weight repacks
    with record_launches() as log:
        gm(x)
    return {"total": log.count(), **log.by_name()}


def _bytes(gm) -> int:
    """Compulsory bytes of one forward (every tensor argument of every launch once), after a warm-up call."""
    x = image(n=2, hw=32, seed=9)
    gm(x)
    with record_launches() as log:
        gm(x)
    return log.summary()["bytes"]


def test_int8_graph_fuses_every_conv_input_quantizer():
    fp, q, report = _graphs()
    layers = {r.name: r for r in report.layers}
    # block1's output is read by block2's conv1 (int8) and block2's residual add (float): both from one epilogue
    dual = {n for n, r in layers.items() if r.dual_out}
    assert len(dual) == 1 and dual <= {"block1_conv3_fused", "block1_down_0_fused"}, dual
    assert all(layers[n].int8_out for n in dual)
    # conv1 -> conv2 -> conv3 inside each block: int8 only
    assert {"block1_conv1_fused", "block1_conv2_fused", "block2_conv1_fused", "block2_conv2_fused"} <= {
        n for n, r in layers.items() if r.int8_out and not r.dual_out}
    fp_n, q_n = _launches(fp), _launches(q)
    # the float stem stores int8 at the scale of the pool's readers (block1's conv1 and shortcut conv) and
    # the pool runs on the codes: one quantizer in all, the fc's input
    assert q_n.get("triton:_quantize_int8_kernel") == 1, q_n
    assert fp_n.get("triton:_quantize_int8_kernel") is None
    assert q_n["triton:_max_pool2d_kernel"] == fp_n["triton:_max_pool2d_kernel"] == 1
    # fp16's linear is one torch addmm; int8's is a quantizer and matmul_int8: +1
    assert q_n["total"] == fp_n["total"] + 1, (fp_n, q_n)


def test_fused_quantizers_are_exact_on_cpu():
    """int8 from the producer's epilogue (alone or beside the float output) is the int8 the consumer's own
    quantizer makes from the same fp32 tensor: bit-identical on CPU, where the float layers run fp32."""
    _, q_fused, _ = _graphs(seed=2)
    model = make(TinyResNet(), seed=2)
    q_plain, _ = optimize_graph(model, (image(n=2, hw=32),))
    q_plain, rep = quantize_model(q_plain, [(image(n=4, hw=32, seed=s),) for s in (5, 6)], requant=False,
                                  int8_residual=False)
    assert not any(r.int8_out or r.dual_out for r in rep.layers)
    x = image(n=3, hw=32, seed=10)
    with torch.no_grad():
        assert torch.equal(q_fused(x), q_plain(x))


def test_fused_graph_survives_a_pickle_round_trip():
    """The saved warpforge-int8 graph is a pickled GraphModule, re-traced on load: the dual-out conv's tuple
    and the pool's shared quantizer (a module, so the re-trace does not run it on proxies) come back."""
    import io

    _, q, _ = _graphs(seed=3)
    buf = io.BytesIO()
    torch.save(q, buf)
    buf.seek(0)
    q2 = torch.load(buf, weights_only=False)
    x = image(n=2, hw=32, seed=4)
    with torch.no_grad():
        assert torch.equal(q(x), q2(x))
    assert sum(bool(getattr(m, "dual_out", False)) for m in q2.modules()) == 1


def test_int8_residual_stream_stores_block_outputs_once():
    """int8_residual: block1's output (read by block2's conv1 and its residual add) is stored as int8 only and
    block2's conv3 reads it dequantized; block1's shortcut conv, read only as a residual, goes int8 at its own
    calibrated scale. No float + int8 pair is left, the launches stay as many, the compulsory bytes drop, and
    the output stays close to the float-residual graph's."""
    from warpforge.optimize.quant import QuantConv2d

    model = make(TinyResNet(), seed=5)
    calib = [(image(n=4, hw=32, seed=s),) for s in (5, 6)]
    plain, _ = optimize_graph(model, (image(n=2, hw=32),))
    plain, _ = quantize_model(plain, calib, int8_residual=False)
    q, _ = optimize_graph(model, (image(n=2, hw=32),))
    q, report = quantize_model(q, calib, int8_residual=True)
    layers = {r.name: r for r in report.layers}
    assert not any(r.dual_out for r in report.layers)
    readers = {n for n, m in q.named_modules() if isinstance(m, QuantConv2d) and m.residual_scale is not None}
    assert readers == {"block1_conv3_fused", "block2_conv3_fused"}, readers
    # block2 reads block1's output at block2's conv1 scale (one int8 tensor for both readers)
    assert torch.equal(q.block2_conv3_fused.residual_scale, q.block2_conv1_fused.act_scale)
    assert q.block2_conv3_fused.residual_zero_point == -128  # a ReLU's output: unsigned
    # block1's shortcut conv: int8 only, at the scale calibrated on its float output
    assert layers["block1_down_0_fused"].int8_out
    assert torch.equal(q.block1_conv3_fused.residual_scale, q.block1_down_0_fused.out_scale)
    scale, unsigned = q.block1_conv3_fused.residual_calib
    assert not unsigned and float(q.block1_down_0_fused.out_scale) == pytest.approx(scale)
    assert _launches(q)["total"] == _launches(plain)["total"]
    assert _bytes(q) < _bytes(plain), (_bytes(q), _bytes(plain))
    x = image(n=8, hw=32, seed=10)
    with torch.no_grad():
        ref, a, b = model(x), plain(x), q(x)
    rel = lambda y: float((y - ref).abs().max() / ref.abs().max())  # noqa: E731
    assert rel(b) < max(2 * rel(a), 0.05), (rel(a), rel(b))
    assert not torch.equal(a, b)  # the residuals are read int8: not the float-residual graph


def test_float_shortcut_stores_the_int8_residual():
    """A shortcut conv kept float (skip=, as the accuracy fallback does) and read only as an int8 layer's
    residual stores int8 at that reader's residual scale, as an int8 shortcut does: the reader takes int8
    residual codes, not an fp16 tensor, and the output stays close to the float-residual graph's."""
    from warpforge.optimize.passes.fuse_conv import FusedConv2d
    from warpforge.optimize.quant import QuantConv2d

    model = make(TinyResNet(), seed=5)
    calib = [(image(n=4, hw=32, seed=s),) for s in (5, 6)]
    q, _ = optimize_graph(model, (image(n=2, hw=32),))
    q, report = quantize_model(q, calib, int8_residual=True, skip=("block1_down_0_fused",))
    down, conv3 = q.block1_down_0_fused, q.block1_conv3_fused
    assert isinstance(down, FusedConv2d) and isinstance(conv3, QuantConv2d)
    assert down.out_scale is not None and torch.equal(conv3.residual_scale, down.out_scale)
    assert conv3.residual_zero_point == down.out_zero_point
    scale, unsigned = conv3.residual_calib
    assert float(down.out_scale) == pytest.approx(scale) and down.out_zero_point == (-128 if unsigned else 0)
    x = image(n=3, hw=32, seed=12)
    seen = []
    hook = down.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    with torch.no_grad():
        ref, got = model(x), q(x)
    hook.remove()
    assert seen == [torch.int8]
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert rel < 0.05, rel


def test_int8_residual_graph_on_the_triton_kernels():
    """The int8-residual graph through the Triton kernels (interpreter) against its CPU reference path."""
    from warpforge.kernels._dispatch import force_triton

    model = make(TinyResNet(), seed=6)
    q, _ = optimize_graph(model, (image(n=2, hw=32),))
    q, _ = quantize_model(q, [(image(n=4, hw=32, seed=s),) for s in (5, 6)], int8_residual=True)
    x = image(n=2, hw=32, seed=11)
    with torch.no_grad():
        ref = q(x)
        with force_triton():
            got = q(x)
    # the float stem rounds differently on the Triton kernel, which can move an int8 code one step downstream
    assert float(torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0)) > 0.9999
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_int8_residual_is_the_default():
    """On by default since the H200 measurement (2026-12-02); int8_residual=False turns it off."""
    model = make(TinyResNet(), seed=1)
    calib = [(image(n=4, hw=32, seed=s),) for s in (5, 6)]

    def report(**kw):
        q, _ = optimize_graph(model, (image(n=2, hw=32),))
        return [(r.name, r.int8_out, r.dual_out) for r in quantize_model(q, calib, **kw)[1].layers]

    default, on, off = report(), report(int8_residual=True), report(int8_residual=False)
    assert default == on and on != off
