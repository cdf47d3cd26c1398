"""The INT8 rows' per-stage split (bench/suites/_vision_stages.py): node classification on CPU, times on CUDA."""

from __future__ import annotations

import pytest
import torch

from warpforge.bench.suites._vision_stages import _graph_module, _stage, stage_split
from warpforge.optimize.pipeline import optimize_graph
from warpforge.optimize.quant import quantize_model
from warpforge.optimize.runtime import CastIO



class _Net(torch.nn.Module):
    """stem (float: 3 channels) -> max pool -> a downsample bottleneck -> an identity one -> pool -> fc."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        nn = torch.nn
        self.stem, self.pool = nn.Conv2d(3, c, 3, 2, 1), nn.MaxPool2d(3, 2, 1)
        self.a = nn.ModuleList([nn.Conv2d(c, c, 1), nn.Conv2d(c, c, 3, 2, 1), nn.Conv2d(c, 2 * c, 1)])
        self.down = nn.Conv2d(c, 2 * c, 1, 2)
        self.b = nn.ModuleList([nn.Conv2d(2 * c, c, 1), nn.Conv2d(c, c, 3, 1, 1), nn.Conv2d(c, 2 * c, 1)])
        self.fc = nn.Linear(2 * c, 5)

    def forward(self, x):
        x = self.pool(torch.relu(self.stem(x)))
        h = torch.relu(self.a[1](torch.relu(self.a[0](x))))
        x = torch.relu(self.a[2](h) + self.down(x))
        h = torch.relu(self.b[1](torch.relu(self.b[0](x))))
        x = torch.relu(self.b[2](h) + x)
        return self.fc(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(x, 1), 1))


def _quantized(device="cpu"):
    torch.manual_seed(1)
    model = _Net().eval().to(device)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2)).to(device)
    gm, _ = optimize_graph(model, (x,))
    gm, _ = quantize_model(gm, [(x,)])
    return CastIO(gm, torch.float32).eval(), x


def test_every_node_gets_its_stage():
    mod, _ = _quantized()
    gm, dtype = _graph_module(mod)
    assert gm is mod.inner and dtype == torch.float32
    stages = {}
    for n in gm.graph.nodes:
        st = _stage(gm, n)
        if st is not None:
            stages[st] = stages.get(st, 0) + 1
    # 7 int8 convs (2 blocks: 3 + shortcut, 3), the float stem (storing int8: the max pool runs on codes, no
    # quantizer), the int8 fc; other: the input's layout copy, max pool, avg pool, flatten
    assert stages == {"int8 conv": 7, "float conv": 1, "linear": 1, "other": 4}, stages


def test_no_split_off_cuda():
    mod, x = _quantized()
    assert stage_split(mod, (x,)) is None


@pytest.mark.gpu
def test_gpu_split_sums_the_nodes():
    mod, x = _quantized("cuda")
    split = stage_split(mod, (x,))
    assert split["nodes"] == {"int8 conv": 7, "float conv": 1, "linear": 1, "other": 4}
    assert all(v > 0 for v in split["ms"].values())
    assert split["total_ms"] == pytest.approx(sum(split["ms"].values()), abs=1e-3)
