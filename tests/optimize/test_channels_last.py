import torch
from torch import nn

from warpforge.optimize import ChannelsLast, PassContext, capture

from .nets import SmallNet, image, make


def test_graph_weights_and_inputs_converted():
    model, x = make(SmallNet()), image()
    gm = capture(model, (x,)).module
    ctx = PassContext(example_inputs=(x,))
    gm = ChannelsLast().apply(gm, ctx)
    converted = [c.where for c in ctx.changes if c.action == "converted"]
    # 3x3 dense convs change layout; depthwise [C,1,3,3] and 1x1 weights are already both layouts.
    assert set(converted) == {"stem.0.weight", "block.conv1.weight", "block.conv2.weight", "grouped.0.weight",
                              "input x"}
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in gm.parameters() if p.dim() == 4)
    assert ctx.example_inputs[0].is_contiguous(memory_format=torch.channels_last)
    node = next(n for n in gm.graph.nodes if n.op == "call_method" and n.target == "contiguous")
    assert node.kwargs["memory_format"] == torch.channels_last
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-5)
    # A second run finds nothing left to convert.
    ChannelsLast().apply(gm, ctx2 := PassContext(example_inputs=(x,)))
    assert ctx2.changes == []


def test_plain_module():
    model, x = make(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())), image()
    ctx = PassContext(example_inputs=(x,))
    out = ChannelsLast().apply(model, ctx)
    assert out is model and [c.where for c in ctx.changes] == ["0.weight"]
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)
