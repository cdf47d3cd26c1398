import pytest
import torch
from torch import nn

from warpforge.optimize import (FoldBatchNorm, FuseConvEpilogue, FusedConv2d, PassContext, Pipeline,
                                capture, optimize_graph)

from .nets import SmallNet, WithEager, image, make


def test_optimize_graph_default_pipeline():
    model, x = make(SmallNet()).train(), image()  # optimize_graph works on an eval copy and restores the flag
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt, report = optimize_graph(model, (x,))
    assert model.training
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert [p["name"] for p in report["passes"]] == [
        "fold_bn", "channels_last", "fuse_conv", "image_input", "max_pool", "attention"]
    counts = {p["name"]: p["counts"] for p in report["passes"]}
    assert counts == {"fold_bn": {"folded": 7}, "channels_last": {"converted": 5}, "fuse_conv": {"fused": 6},
                      "image_input": {}, "max_pool": {}, "attention": {}}
    assert all(c["where"] for p in report["passes"] for c in p["changes"])
    assert report["capture"]["traced_fraction"] == 1.0
    assert report["max_abs_diff"] < 1e-5
    assert sum(isinstance(m, FusedConv2d) for m in opt.modules()) == 6
    x2 = image(n=3, seed=7)  # fresh inputs, other batch size
    with torch.no_grad():
        torch.testing.assert_close(opt(x2), model.eval()(x2), rtol=1e-5, atol=1e-5)


def test_eager_submodule_survives_the_pipeline():
    model, x = make(WithEager()), image()
    opt, report = optimize_graph(model, (x,))
    assert list(report["capture"]["eager_modules"]) == ["odd"]
    assert report["max_abs_diff"] < 1e-5
    assert isinstance(opt.get_submodule("odd.conv"), nn.Conv2d)  # inside the eager leaf: untouched
    for sign in (1.0, -1.0):
        with torch.no_grad():
            torch.testing.assert_close(opt(sign * x.abs()), model(sign * x.abs()), rtol=1e-5, atol=1e-5)


def test_pipeline_results_per_pass_and_custom_list():
    model, x = make(SmallNet()), image()
    _, report = optimize_graph(model, (x,), passes=[FoldBatchNorm()])
    assert [p["name"] for p in report["passes"]] == ["fold_bn"]
    ctx = PassContext(example_inputs=(x,))
    gm = capture(model, (x,)).module
    _, results = Pipeline([FoldBatchNorm(), FuseConvEpilogue()]).run(gm, ctx)
    assert [r.name for r in results] == ["fold_bn", "fuse_conv"]
    assert [r.counts for r in results] == [{"folded": 7}, {"fused": 6}]
    assert [c for r in results for c in r.changes] == ctx.changes
    assert str(results[0].changes[0]) == "[fold_bn] folded stem.1 -> stem.0: BatchNorm2d(8) into Conv2d"
    with pytest.raises(ValueError, match="passes must"):
        Pipeline([object()])


def test_context_validates():
    with pytest.raises(ValueError, match="example_inputs"):
        PassContext(example_inputs=[torch.ones(1)])
    with pytest.raises(ValueError, match="dtype"):
        PassContext(example_inputs=(), dtype=torch.int8)


def test_optimized_model_through_the_triton_kernels(triton_on_cpu):
    """The fused modules' arguments are valid for the kernels themselves, not only the torch reference
    (CPU: Triton's interpreter, so the net is tiny)."""
    model, x = make(SmallNet(c=4, classes=3)), image(n=1, hw=6)
    opt, _ = optimize_graph(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_optimized_model_on_gpu(dtype):
    model, x = make(SmallNet(c=16)), image(n=4, hw=32)
    model, x = model.to("cuda", dtype), x.to("cuda", dtype)
    opt, report = optimize_graph(model, (x,), dtype=dtype)
    assert report["passes"][2]["counts"] == {"fused": 6}
    with torch.no_grad():
        want = make(SmallNet(c=16)).double()(image(n=4, hw=32).double())
        got = opt(x).double().cpu()
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # fp16 storage between six convs
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_public_api_exports_exist():
    import warpforge.optimize as api
    import warpforge.optimize.passes as passes

    for mod in (api, passes):
        assert mod.__all__ and all(hasattr(mod, name) for name in mod.__all__)
