"""Channel equalization along linear residual streams (optimize/equalize.py): exact in float, finds
MobileNetV2's seven streams, leaves the source model's weights alone, refuses streams read by anything else."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from warpforge.optimize.equalize import equalize_streams, find_streams
from warpforge.optimize.pipeline import optimize_graph
from warpforge.optimize.quant import quantize_model


@pytest.fixture(scope="module")
def mnv2_graph():
    """MobileNetV2 (random weights) captured and fused once for the module; tests take deep copies."""
    from warpforge.models import get

    torch.manual_seed(0)
    model = get("mobilenet_v2", pretrained=False).model.eval()
    x = torch.randn(2, 3, 32, 32)
    gm, _ = optimize_graph(model, (x,))
    return model, gm, x


def _mnv2(graph):
    model, gm, x = graph
    return model, copy.deepcopy(gm), x


def test_mobilenet_v2_streams_rescale_exactly(mnv2_graph):
    model, gm, x = _mnv2(mnv2_graph)
    streams = find_streams(gm)
    # one stream per stage: the 16-, 24-, 32-, 64-, 96-, 160- and 320-channel bottleneck outputs
    assert [len(s.nodes) for s in streams] == [1, 2, 3, 4, 3, 3, 1]
    assert [s.writers[0].weight.shape[0] for s in streams] == [16, 24, 32, 64, 96, 160, 320]
    with torch.no_grad():
        before = gm(x)
    src = {id(p) for p in model.parameters()}
    gm_params_before = {n: p.detach().clone() for n, p in gm.named_parameters()}
    rep = equalize_streams(gm, [(torch.randn(4, 3, 32, 32),)], alpha=0.5)
    assert len(rep) == 7 and all(r["spread_before"] > 1.0 and r["spread_after"] > 0 for r in rep)
    with torch.no_grad():
        after = gm(x)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4 * float(before.abs().max()))
    changed = [n for n, p in gm.named_parameters() if not torch.equal(p.detach(), gm_params_before[n])]
    assert changed and not any(id(p) in src for n, p in gm.named_parameters() if n in changed)


def test_full_migration_evens_the_stream_channels(mnv2_graph):
    """alpha=1 puts all of each channel's range into the readers: every stream channel then has the same
    range on the calibration inputs (measured again after the rescale)."""
    _, gm, _ = _mnv2(mnv2_graph)
    calib = [(torch.randn(4, 3, 32, 32),)]
    rep = equalize_streams(gm, calib, alpha=1.0)
    assert all(r["spread_after"] == pytest.approx(1.0, rel=1e-3) for r in rep), rep
    again = equalize_streams(copy.deepcopy(gm), calib, alpha=1.0)  # measures the rescaled ranges
    assert all(r["spread_before"] == pytest.approx(1.0, rel=1e-3) for r in again), again


class _Tapped(nn.Module):
    """A projection whose output is read by a pool as well as by a 1x1 conv: not a linear stream."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.expand = nn.Conv2d(8, 6, 1), nn.Conv2d(6, 12, 1)

    def forward(self, x):
        y = self.proj(x)
        return self.expand(y).mean() + y.amax()


def test_a_stream_read_by_anything_else_is_left_alone():
    gm, _ = optimize_graph(_Tapped().eval(), (torch.randn(1, 8, 5, 5),))
    assert find_streams(gm) == []
    assert equalize_streams(gm, [(torch.randn(1, 8, 5, 5),)]) == []
    with pytest.raises(ValueError, match="alpha"):
        equalize_streams(gm, [], alpha=2.0)


def test_quantize_model_equalize_option_reports_the_streams(mnv2_graph):
    _, gm, _ = _mnv2(mnv2_graph)
    calib = [(torch.randn(4, 3, 32, 32),)]
    _, rep = quantize_model(gm, calib, equalize=True)
    assert len(rep.equalized) == 7 and rep.as_dict()["equalized"] == rep.equalized
    _, gm2, _ = _mnv2(mnv2_graph)
    _, rep2 = quantize_model(gm2, calib, equalize=False)
    assert rep2.equalized == [] and "equalized" not in rep2.as_dict()
