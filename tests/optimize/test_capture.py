import pytest
import torch
from torch import nn

from warpforge.optimize import capture

from .nets import DataDependent, SmallNet, WithEager, image, make


def test_traceable_model_is_fully_captured_and_equal():
    model, x = make(SmallNet()), image()
    cap = capture(model, (x,))
    assert cap.eager == {}
    assert cap.coverage()["traced_fraction"] == 1.0
    assert any(n.op == "call_module" and n.target == "block.conv1" for n in cap.module.graph.nodes)
    with torch.no_grad():
        assert torch.equal(cap.module(x), model(x))


def test_data_dependent_submodule_is_left_eager_and_reported():
    model, x = make(WithEager()), image()
    cap = capture(model, (x,))
    assert list(cap.eager) == ["odd"]
    assert "control flow" in cap.eager["odd"]
    cov = cap.coverage()
    assert cov["eager_modules"] == {"odd": cap.eager["odd"]}
    assert cov["params_eager"] == sum(p.numel() for p in model.odd.parameters()) > 0
    assert 0 < cov["traced_fraction"] < 1
    # Its neighbours are traced (the conv inside head is a graph node); odd is one leaf call.
    targets = [n.target for n in cap.module.graph.nodes if n.op == "call_module"]
    assert "odd" in targets and "head.0" in targets and "odd.conv" not in targets
    for sign in (1.0, -1.0):  # both branches of the eager module still work
        with torch.no_grad():
            assert torch.equal(cap.module(sign * x.abs()), model(sign * x.abs()))


def test_capture_copies_the_model():
    model, x = make(SmallNet()), image()
    cap = capture(model, (x,))
    assert cap.module.get_submodule("block.conv1") is not model.block.conv1
    cap.module.get_submodule("block.conv1").weight.data.zero_()
    assert model.block.conv1.weight.abs().sum() > 0


def test_untraceable_root_is_an_error():
    with pytest.raises(ValueError, match="cannot be traced"):
        capture(make(DataDependent(3)), (image(),))


def test_training_model_statistics_are_not_touched():
    model = make(SmallNet()).train()
    before = model.block.bn1.running_mean.clone()
    capture(model, (image(),))
    assert torch.equal(model.block.bn1.running_mean, before)


def test_bad_arguments():
    with pytest.raises(ValueError, match="example_inputs"):
        capture(nn.Linear(2, 2), torch.randn(1, 2))
