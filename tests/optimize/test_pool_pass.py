"""passes/pool.py: nn.MaxPool2d onto the pool kernel, outputs unchanged; pools it cannot run are left."""

from __future__ import annotations

import torch
from torch import nn

from warpforge.kernels import force_triton
from warpforge.optimize.passes.pool import MaxPool2d
from warpforge.optimize.pipeline import optimize_graph


class _Pools(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.ceil = nn.MaxPool2d(2, ceil_mode=True)  # not the kernel's: stays torch's

    def forward(self, x):
        return self.ceil(self.pool(torch.relu(self.conv(x))))


def test_max_pool_pass_replaces_and_keeps_outputs():
    torch.manual_seed(0)
    model = _Pools().eval()
    x = torch.randn(2, 3, 15, 13)
    gm, report = optimize_graph(model, (x,))
    assert isinstance(gm.pool, MaxPool2d) and type(gm.ceil) is nn.MaxPool2d
    changes = [c for p in report["passes"] if p["name"] == "max_pool" for c in p["changes"]]
    assert {c["action"] for c in changes} == {"replaced", "skipped"}
    with torch.no_grad():
        assert torch.allclose(gm(x), model(x), atol=1e-5)  # the fused conv rounds its own way
        y = torch.relu(model.conv(x)).contiguous(memory_format=torch.channels_last)
        want = model.pool(y)
        assert torch.equal(gm.pool(y), want)
        with force_triton():  # the kernel itself (interpreter on CPU)
            assert torch.equal(gm.pool(y), want)
