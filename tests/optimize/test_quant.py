"""INT8 PTQ of nn.Linear (warpforge.optimize.quant): observers, QuantLinearW8A8, quantize_linears (CPU).

On CPU tensors ``matmul_int8`` runs its exact reference (int8 product in float64, fp32 epilogue), so
these tests check the quantization itself; the kernel is tested in tests/kernels/test_matmul_int8.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from warpforge.kernels import force_triton
from warpforge.optimize.quant import (MaxObserver, MSEObserver, PercentileObserver, QuantLinearW8A8, QuantReport,
                                      quantize_linears)


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
