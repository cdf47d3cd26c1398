"""INT8 PTQ (warpforge.optimize.quant): observers, QuantLinearW8A8, QuantConv2d, quantize_linears, quantize_model (CPU).

On CPU tensors ``matmul_int8`` and ``conv2d_int8`` run their exact references (int8 products in float64,
fp32 epilogue), so these tests check the quantization itself; the kernels are tested in
tests/kernels/test_matmul_int8.py and tests/kernels/test_conv_int8.py (and here once through the interpreter).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from warpforge.kernels import force_triton
from warpforge.optimize.quant import (MaxObserver, MSEObserver, PercentileObserver, QuantConv2d, QuantLinearW8A8,
                                      QuantReport, quantize_linears, quantize_model)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mlp(gen) -> nn.Module:
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 96), nn.ReLU(), nn.Linear(96, 10))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


# ---- observers ------------------------------------------------------------------------------------
def test_max_observer_is_exact():
    obs = MaxObserver()
    obs.observe(torch.tensor([0.5, -3.25, 1.0]))
    obs.observe(torch.tensor([[2.0, -1.0]]))
    assert obs.threshold() == 3.25
    assert obs.scale() == pytest.approx(3.25 / 127, rel=1e-12)


def test_percentile_observer_ignores_a_single_outlier():
    x = torch.randn(200_000, generator=_gen(1))
    x[12345] = 1000.0
    obs = PercentileObserver(p=99.99)
    obs.observe(x[:100_000])
    obs.observe(x[100_000:])
    t = obs.threshold()
    assert 3.0 < t < 5.0, t  # |N(0,1)|'s 99.99th percentile is ~3.9; the outlier is far above
    with pytest.raises(ValueError, match="p:"):
        PercentileObserver(p=0)


def test_mse_observer_clips_a_heavy_tail():
    # Laplace-distributed activations: the MSE-optimal clip sits well below the largest value.
    u = torch.rand(100_000, generator=_gen(2)).clamp(1e-12, 1 - 1e-7) - 0.5
    x = -torch.sign(u) * torch.log1p(-2 * u.abs())  # Laplace(0, 1) by inverse CDF
    obs = MSEObserver()
    obs.observe(x)
    t, amax = obs.threshold(), float(x.abs().max())
    assert t < 0.8 * amax, (t, amax)
    s = t / 127

    def mse(scale):
        return float(((x / scale).round().clamp(-127, 127) * scale - x).square().mean())

    assert mse(s) < mse(amax / 127), "the chosen clip must beat no clipping"
    assert obs.errors is not None and float(obs.errors.min()) == pytest.approx(mse(s), rel=1e-4)


def test_mse_observer_keeps_a_uniform_range():
    x = torch.rand(50_000, generator=_gen(3)) * 2 - 1  # uniform: clipping only hurts
    obs = MSEObserver()
    obs.observe(x)
    assert obs.threshold() > 0.95 * float(x.abs().max())


def test_observers_need_data():
    for obs in (MaxObserver(), PercentileObserver(), MSEObserver()):
        with pytest.raises(ValueError, match="no activations observed"):
            obs.threshold()


# ---- module ---------------------------------------------------------------------------------------
def test_quant_linear_matches_linear():
    gen = _gen(4)
    lin = nn.Linear(48, 24)
    x = torch.randn(5, 3, 48, generator=gen)
    q = QuantLinearW8A8(lin, float(x.abs().max()) / 127)
    assert q.weight_q.dtype == torch.int8 and q.weight_q.shape == (24, 48) and q.weight_scale.shape == (24,)
    assert (q.weight_q.abs().amax(1) == 127).all(), "per-channel scales use the full range"
    y = q(x)
    assert y.shape == (5, 3, 24) and y.dtype == torch.float32
    assert _cosine(y, lin(x).detach()) > 0.9995
    assert q(x.half()).dtype == torch.float16
    with pytest.raises(ValueError, match="x:"):
        q(torch.randn(2, 47))
    with pytest.raises(ValueError, match="act_scale:"):
        QuantLinearW8A8(lin, 0.0)


def test_quant_linear_forward_through_the_int8_kernel():
    """The same module through the Triton kernel (interpreter): what runs on a GPU."""
    gen = _gen(5)
    lin = nn.Linear(64, 40)
    x = torch.randn(7, 64, generator=gen)
    q = QuantLinearW8A8(lin, float(x.abs().max()) / 127)
    ref = q(x)
    with force_triton():
        out = q(x)
    assert torch.equal(out, ref)


# ---- quantize_linears -----------------------------------------------------------------------------
@pytest.mark.parametrize("observer", ["max", "percentile", "mse"])
def test_quantize_mlp_keeps_accuracy(observer):
    gen = _gen(6)
    model = _mlp(gen)
    calib = [(torch.randn(32, 64, generator=gen),) for _ in range(8)]
    held_out = torch.randn(256, 64, generator=gen)
    with torch.no_grad():
        expect = model(held_out)
    qmodel, report = quantize_linears(model, calib, observer=observer)
    assert qmodel is model
    assert [type(m) for m in model] == [QuantLinearW8A8, nn.GELU, QuantLinearW8A8, nn.ReLU, QuantLinearW8A8]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with torch.no_grad():
        got = qmodel(held_out)
    assert _cosine(got, expect) > 0.999

    assert isinstance(report, QuantReport)
    assert [r.name for r in report.layers] == ["0", "2", "4"]
    for r, q in zip(report.layers, (model[0], model[2], model[4])):
        assert r.observer == observer and r.act_scale == pytest.approx(float(q.act_scale))
        assert r.threshold == pytest.approx(r.act_scale * 127)
        assert 0 < r.rel_err < 0.05 and r.cosine > 0.999 and r.max_abs_err > 0
    assert report.output_rel_err is not None and report.output_cosine > 0.999
    assert "0" in str(report) and observer in str(report)


def test_quantize_max_observer_scale_is_the_calibration_max():
    gen = _gen(7)
    model = _mlp(gen)
    calib = [(torch.randn(16, 64, generator=gen),), (torch.randn(4, 64, generator=gen) * 3,)]
    amax = max(float(x.abs().max()) for (x,) in calib)
    _, report = quantize_linears(model, calib)
    assert report.layers[0].act_scale == pytest.approx(amax / 127, rel=1e-6)


def test_quantize_shared_and_nested_linears_and_bare_linear():
    gen = _gen(8)
    shared = nn.Linear(16, 16)
    model = nn.Sequential(shared, nn.ReLU(), nn.Sequential(shared, nn.Linear(16, 4, bias=False)))
    calib = [(torch.randn(8, 16, generator=gen),)]
    model, report = quantize_linears(model, calib)
    assert isinstance(model[0], QuantLinearW8A8) and model[2][0] is model[0]
    assert isinstance(model[2][1], QuantLinearW8A8) and model[2][1].bias is None
    assert [r.name for r in report.layers] == ["0", "2.1"]

    bare = nn.Linear(16, 8)
    qbare, report = quantize_linears(bare, calib)
    assert isinstance(qbare, QuantLinearW8A8) and [r.name for r in report.layers] == [""]


def test_quantize_restores_training_modes():
    model = _mlp(_gen(9)).train()
    model[1].eval()  # a submodule left in eval mode stays there
    model, _ = quantize_linears(model, [(torch.randn(4, 64),)])
    assert model.training and not model[1].training and model[3].training


def test_quantize_rejects_bad_calibration_inputs():
    model = _mlp(_gen(10))
    with pytest.raises(ValueError, match=r"calib_inputs\[1\]: Linear '0' expects an input \[\.\.\., 64\]"):
        quantize_linears(model, [(torch.randn(4, 64),), (torch.randn(4, 63),)])
    assert all(isinstance(m, (nn.Linear, nn.GELU, nn.ReLU)) for m in model), "nothing swapped after an error"
    assert not model[0]._forward_pre_hooks, "hooks removed after an error"
    with pytest.raises(ValueError, match="calib_inputs: expected a non-empty list"):
        quantize_linears(model, [])
    with pytest.raises(ValueError, match=r"calib_inputs\[0\]: expected a tuple"):
        quantize_linears(model, [torch.randn(4, 64)])
    with pytest.raises(ValueError, match="observer:"):
        quantize_linears(model, [(torch.randn(4, 64),)], observer="minmax")
    with pytest.raises(ValueError, match="model:"):
        quantize_linears("mlp", [(torch.randn(4, 64),)])


# ---- convolutions: QuantConv2d, quantize_model ------------------------------------------------------
def _fused_graph(c: int = 16, seed: int = 0):
    """SmallNet through the warpforge pipeline (BN folded, FusedConv2d everywhere) and held-out inputs."""
    from warpforge.optimize.pipeline import optimize_graph

    from .nets import SmallNet, image, make

    model = make(SmallNet(c=c), seed=seed)
    gm, _ = optimize_graph(model, (image(n=2, hw=16),))
    calib = [(image(n=8, hw=16, seed=s),) for s in (11, 12)]
    return model, gm, calib, image(n=16, hw=16, seed=99)


def test_quant_conv_matches_conv():
    gen = _gen(11)
    conv = nn.Conv2d(16, 24, 3, stride=2, padding=1)
    x = torch.randn(2, 16, 9, 9, generator=gen)
    for unsigned, xin in ((False, x), (True, torch.relu(x))):
        levels = 255 if unsigned else 127
        q = QuantConv2d(conv, float(xin.abs().max()) / levels, unsigned=unsigned)
        assert q.weight_q.dtype == torch.int8 and q.weight_q.is_contiguous(memory_format=torch.channels_last)
        assert (q.weight_q.abs().amax((1, 2, 3)) == 127).all(), "per-channel scales use the full range"
        assert (q.weight_sum is not None) == unsigned and q.act_zero_point == (-128 if unsigned else 0)
        y = q(xin)
        assert y.shape == (2, 24, 5, 5) and y.dtype == torch.float32
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert _cosine(y, conv(xin).detach()) > 0.9995
    assert q(torch.relu(x).half()).dtype == torch.float16
    with pytest.raises(ValueError, match="act_scale:"):
        QuantConv2d(conv, 0.0)
    with pytest.raises(ValueError, match="conv: expected an nn.Conv2d or a FusedConv2d"):
        QuantConv2d(nn.Linear(3, 4), 0.1)
    with pytest.raises(ValueError, match="zero padding"):
        QuantConv2d(nn.Conv2d(4, 4, 3, padding="same"), 0.1)


def test_quant_conv_forward_through_the_int8_kernel():
    """A FusedConv2d (relu, residual) quantized with unsigned input and int8 output, on the Triton kernels
    (interpreter) and on the CPU references: the same int8 bits."""
    from warpforge.optimize.passes.fuse_conv import FusedConv2d

    gen = _gen(12)
    fused = FusedConv2d(nn.Conv2d(16, 16, 3, padding=1), "relu", has_residual=True)
    x = torch.rand(2, 16, 7, 5, generator=gen) * 6
    r = torch.randn(2, 16, 7, 5, generator=gen).contiguous(memory_format=torch.channels_last)
    q = QuantConv2d(fused, 6.0 / 255, unsigned=True)
    q.out_scale, q.out_zero_point = torch.tensor([0.05]), -128
    ref = q(x, r)
    with force_triton():
        out = q(x, r)
    assert out.dtype == torch.int8 and torch.equal(out, ref)
    y = (ref.float() + 128) * 0.05  # dequantized: the float layer's output (clipped to the int8 range)
    assert _cosine(y, fused(x, r).detach().clamp(max=255 * 0.05)) > 0.999


def test_quantize_model_on_the_fused_graph():
    from warpforge.optimize.passes.fuse_conv import FusedConv2d

    model, gm, calib, held_out = _fused_graph()
    with torch.no_grad():
        expect = model(held_out)
    qm, report = quantize_model(gm, calib)
    assert qm is gm
    kept = {k.name: k.reason for k in report.kept}
    assert set(kept) == {"stem_0_fused", "dw_0_fused"}
    assert "image stem" in kept["stem_0_fused"] and "depthwise" in kept["dw_0_fused"]
    assert isinstance(gm.stem_0_fused, FusedConv2d) and isinstance(gm.dw_0_fused, FusedConv2d)
    layers = {r.name: r for r in report.layers}
    assert set(layers) == {"block_conv1_fused", "block_conv2_fused", "pw_0_fused", "grouped_0_fused", "fc"}
    assert isinstance(gm.fc, QuantLinearW8A8) and isinstance(gm.grouped_0_fused, QuantConv2d)
    # unsigned: inputs after a ReLU/ReLU6 (stem -> conv1, relu -> conv2, dw's relu6 -> pw); SiLU's are signed
    assert {n for n, r in layers.items() if r.unsigned} == {"block_conv1_fused", "block_conv2_fused", "pw_0_fused"}
    # int8 out where a quantized conv feeds only another one's input (conv2 feeds the float dw conv, which
    # reads float)
    assert {n for n, r in layers.items() if r.int8_out} == {"block_conv1_fused", "pw_0_fused"}
    assert gm.block_conv1_fused.out_scale is not None and gm.block_conv2_fused.out_scale is None
    assert gm.block_conv1_fused.out_zero_point == -128 and gm.pw_0_fused.out_zero_point == 0
    # the float depthwise conv quantizes pw's input in its own epilogue (unsigned: pw reads a ReLU6)
    assert {k.name for k in report.kept if k.int8_out} == {"dw_0_fused"}
    assert torch.equal(gm.dw_0_fused.out_scale, gm.pw_0_fused.act_scale) and gm.dw_0_fused.out_zero_point == -128
    for r in report.layers:
        assert 0 < r.rel_err < 0.05 and r.cosine > 0.999, r
    with torch.no_grad():
        got = gm(held_out)
    assert _cosine(got, expect) > 0.999
    d = report.as_dict()
    assert [x["decision"] for x in d["layers"]] == ["int8"] * 5 and [x["decision"] for x in d["kept"]] == ["float"] * 2
    assert "kept float: depthwise" in str(report) and "-> int8 out" in str(report)


def test_fused_requantization_is_exact_on_cpu():
    """Storing int8 from the producer's epilogue quantizes the same fp32 value the consumer would."""
    _, gm_a, calib, held_out = _fused_graph(seed=3)
    _, gm_b, _, _ = _fused_graph(seed=3)
    quantize_model(gm_a, calib, requant=True)
    _, rep_b = quantize_model(gm_b, calib, requant=False)
    assert not any(r.int8_out for r in rep_b.layers)
    with torch.no_grad():
        assert torch.equal(gm_a(held_out), gm_b(held_out))


def test_quantized_graph_on_the_triton_kernels_matches_the_references():
    _, gm, calib, held_out = _fused_graph(seed=4)
    quantize_model(gm, calib)
    x = held_out[:2]
    with torch.no_grad():
        ref = gm(x)
        with force_triton():
            got = gm(x)
    # The float layers (stem, depthwise) round differently on the Triton kernels, which can move an int8
    # code by one step downstream: close, not bit-identical.
    assert _cosine(got, ref) > 0.9999 and (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_quantize_model_options():
    _, gm, calib, _ = _fused_graph(seed=5)
    _, report = quantize_model(gm, calib, skip=("pw_0_fused",), min_channels=1, unsigned=False)
    kept = {k.name: k.reason for k in report.kept}
    assert kept == {"pw_0_fused": "skipped by request", "dw_0_fused": kept["dw_0_fused"]}
    assert "stem_0_fused" in {r.name for r in report.layers} and not any(r.unsigned for r in report.layers)

    _, gm, calib, _ = _fused_graph(seed=5)
    _, report = quantize_model(gm, calib, convs=False)
    assert [r.name for r in report.layers] == ["fc"] and report.kept == []

    model = _WithUnused()
    _, report = quantize_model(model, [(torch.randn(2, 16, 5, 5),)])
    assert [r.name for r in report.layers] == ["conv"] and report.layers[0].type == "Conv2d"
    assert [(k.name, k.reason) for k in report.kept] == [("unused", "not called on the calibration inputs")]
    assert isinstance(model.unused, nn.Conv2d) and isinstance(model.conv, QuantConv2d)
    with pytest.raises(ValueError, match=r"calib_inputs\[0\]: Conv2d '0' expects a float input \[N, 16, H, W\]"):
        quantize_model(nn.Sequential(nn.Conv2d(16, 8, 1)), [(torch.randn(2, 15, 5, 5),)])


def test_quantize_model_int8_stem_on_request():
    """min_channels=1: the 3x3/2 RGB stem runs int8 too (space-to-depth in the kernel), its signed image input
    quantized; the graph still matches the float model, and on the Triton kernels (interpreter) the
    references. By default it stays float."""
    model, gm, calib, held_out = _fused_graph(seed=6)
    with torch.no_grad():
        expect = model(held_out)
    _, report = quantize_model(gm, calib, min_channels=1)
    assert isinstance(gm.stem_0_fused, QuantConv2d) and gm.stem_0_fused.act_zero_point == 0  # the image is signed
    assert "stem_0_fused" in {r.name for r in report.layers}
    assert {k.name for k in report.kept} == {"dw_0_fused"}
    with torch.no_grad():
        got = gm(held_out)
        assert _cosine(got, expect) > 0.999
        with force_triton():
            tri = gm(held_out[:2])
    assert _cosine(tri, got[:2]) > 0.9999
    _, gm2, _, _ = _fused_graph(seed=6)
    _, report = quantize_model(gm2, calib)
    assert "image stem" in {k.name: k.reason for k in report.kept}["stem_0_fused"]


class _PoolStem(nn.Module):
    """ResNet's entrance in small: 7x7/2 stem + ReLU, 3x3/2 max pool, read by two convs (conv1, shortcut)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3), nn.BatchNorm2d(16), nn.ReLU())
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.conv1, self.short = nn.Conv2d(16, 16, 3, padding=1), nn.Conv2d(16, 32, 1)
        self.conv2 = nn.Conv2d(16, 32, 1)

    def forward(self, x):
        x = self.pool(self.stem(x))
        return torch.relu(self.conv2(torch.relu(self.conv1(x))) + self.short(x))


def test_int8_stem_feeds_an_int8_max_pool():
    """With the stem int8 (min_channels=1), its output is stored int8 at the pool readers' scale and the max pool
    runs on the codes (passes.pool.MaxPool2d): no float pool, no quantize kernel; the same result as the float
    pool quantized."""
    from warpforge.optimize.pipeline import optimize_graph
    from warpforge.optimize.passes.pool import MaxPool2d

    from .nets import image, make

    model = make(_PoolStem(), seed=2).eval()
    gm, _ = optimize_graph(model, (image(n=2, hw=32),))
    calib = [(image(n=4, hw=32, seed=s),) for s in (21, 22)]
    held_out = image(n=4, hw=32, seed=23)
    with torch.no_grad():
        expect = model(held_out)
    qm, report = quantize_model(gm, calib, min_channels=1)
    pools = [m for m in qm.modules() if isinstance(m, MaxPool2d)]
    assert len(pools) == 1 and not any(isinstance(m, nn.MaxPool2d) for m in qm.modules())
    stem = [m for m in qm.modules() if isinstance(m, QuantConv2d) and m.weight_q.shape[1] == 3][0]
    assert stem.out_scale is not None and stem.out_zero_point == -128  # unsigned: the readers take a ReLU's output
    assert "quantize" not in " ".join(str(n.target) for n in qm.graph.nodes)
    assert {r.name for r in report.layers if r.int8_out} >= {r.name for r in report.layers if "stem" in r.name}
    with torch.no_grad():
        got = qm(held_out)
        with force_triton():
            tri = qm(held_out[:2])
    assert _cosine(got, expect) > 0.999
    assert _cosine(tri, got[:2]) > 0.9999


def test_float_stem_feeds_an_int8_max_pool():
    """A float stem (the default): its epilogue stores int8 at the pool readers' scale and the max pool runs
    on the codes, as after an int8 stem; no quantize kernel. The codes are the float graph's (float stem
    output, float pool, quantizer) but for rounding ties: the float graph rounds to the stem's dtype first."""
    from warpforge.optimize.pipeline import optimize_graph
    from warpforge.optimize.passes.fuse_conv import FusedConv2d
    from warpforge.optimize.passes.pool import MaxPool2d
    from warpforge.optimize.quant import QuantizeInput

    from .nets import image, make

    model = make(_PoolStem(), seed=3).eval()
    gm, _ = optimize_graph(model, (image(n=2, hw=32),))
    calib = [(image(n=4, hw=32, seed=s),) for s in (24, 25)]
    qm, report = quantize_model(gm, calib)
    assert "image stem" in {k.name: k.reason for k in report.kept}[report.kept[0].name]
    stem = [m for m in qm.modules() if isinstance(m, FusedConv2d) and m.weight.shape[1] == 3][0]
    readers = [qm.conv1_fused, qm.short_fused]  # conv1 and the shortcut read the pool
    assert all(isinstance(r, QuantConv2d) for r in readers)
    assert all(torch.equal(r.act_scale, stem.out_scale) for r in readers)
    assert stem.out_zero_point == -128 == readers[0].act_zero_point  # a ReLU's output: unsigned
    assert not any(isinstance(m, QuantizeInput) for m in qm.modules())
    assert [type(m) for m in qm.modules() if isinstance(m, (nn.MaxPool2d, MaxPool2d))] == [MaxPool2d]
    x = image(n=4, hw=32, seed=26)
    with torch.no_grad():
        codes = qm.pool(stem(x))
        float_pool = nn.functional.max_pool2d(_float_stem(stem, x), 3, 2, 1)
        want = torch.round(float_pool / stem.out_scale).clamp(-128, 255) - 128
        assert codes.dtype == torch.int8
        assert (codes.float() - want).abs().max() <= 1  # a tie may round either way
        assert float((codes.float() == want).float().mean()) > 0.99
        expect, got = model(x), qm(x)
        with force_triton():
            tri = qm(x[:2])
    assert _cosine(got, expect) > 0.999
    assert _cosine(tri, got[:2]) > 0.9999


def _float_stem(stem, x):
    """The stem FusedConv2d's float output (its int8 store switched off for the call)."""
    scale, zero = stem.out_scale, stem.out_zero_point
    stem.out_scale, stem.out_zero_point = None, 0
    try:
        return stem(x)
    finally:
        stem.out_scale, stem.out_zero_point = scale, zero


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.unused = nn.Conv2d(16, 8, 1), nn.Conv2d(16, 8, 1)  # the second is never called

    def forward(self, x):
        return torch.relu(self.conv(x))


@pytest.mark.parametrize("groups", [1, 2])
def test_weight_bias_correction_cancels_the_mean_shift(groups):
    """For a 1x1 conv (no padding) and a linear, the correction is exactly minus the mean output shift the
    int8 weight's rounding causes on the calibration inputs."""
    from warpforge.optimize.quant import weight_bias_correction

    gen = _gen(21)
    conv = nn.Conv2d(8, 6, 1, groups=groups)
    x = torch.randn(3, 8, 5, 7, generator=gen) + torch.linspace(-2, 3, 8)[None, :, None, None]  # channel means
    q = QuantConv2d(conv, float(x.abs().max()) / 127)
    w_deq = q.weight_q.float() * q.weight_scale[:, None, None, None]
    shift = (nn.functional.conv2d(x, w_deq, groups=groups) - nn.functional.conv2d(x, conv.weight.detach(),
                                                                                   groups=groups)).mean((0, 2, 3))
    corr = weight_bias_correction(q, conv.weight, groups, x.mean((0, 2, 3)))
    torch.testing.assert_close(corr, -shift, rtol=1e-4, atol=1e-6)
    assert shift.abs().max() > 1e-4  # there is a shift to cancel
    lin = nn.Linear(8, 5)
    xl = torch.randn(40, 8, generator=gen) + 1.5
    ql = QuantLinearW8A8(lin, float(xl.abs().max()) / 127)
    shift_l = (xl @ (ql.weight_q.float() * ql.weight_scale[:, None]).t() - xl @ lin.weight.detach().t()).mean(0)
    torch.testing.assert_close(weight_bias_correction(ql, lin.weight, 1, xl.mean(0)), -shift_l, rtol=1e-4, atol=1e-6)


def test_quantize_model_bias_correction_moves_the_biases():
    _, gm_a, calib, held_out = _fused_graph(seed=5)
    _, gm_b, _, _ = _fused_graph(seed=5)
    quantize_model(gm_a, calib, bias_correction=False)
    quantize_model(gm_b, calib, bias_correction=True)
    qa = {n: m for n, m in gm_a.named_modules() if isinstance(m, (QuantConv2d, QuantLinearW8A8))}
    qb = {n: m for n, m in gm_b.named_modules() if isinstance(m, (QuantConv2d, QuantLinearW8A8))}
    assert qa.keys() == qb.keys() and qa
    moved = [n for n in qa if not torch.equal(qa[n].bias, qb[n].bias)]
    assert moved == list(qa), moved  # every int8 layer's bias absorbed a correction
    assert all(torch.equal(qa[n].weight_q, qb[n].weight_q) for n in qa)  # the weights are not touched
