"""Dynamic dims beyond the batch: declared with ranges, captured symbolic, right across the range; a call
outside it (or changing an undeclared dim) gets a one-line error naming the dim, its size, the captured shape
and the declared range."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn

from warpforge.cli import main
from warpforge.optimize import load, optimize
from warpforge.optimize.api import BadInputError
from warpforge.optimize.runtime import GraphBuckets
from warpforge.optimize.shapes import ShapeError, parse

from .nets import SmallNet, image, make

FAST = dict(queries=3, warmup=1, offline_calls=2)


class TinyTransformer(nn.Module):
    """Token ids [B, T] -> logits [B, T, V]: learned positions sliced to T, causal SDPA, GELU MLP."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4, max_len: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, max_len, d) * 0.1)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):  # [B, T] int64
        b, t = ids.shape
        x = self.emb(ids) + self.pos[:, :t]
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(x)


def test_a_convnet_at_three_resolutions_in_the_declared_range_and_one_outside(tmp_path):
    model, x = make(SmallNet()), image(n=2, hw=24)
    opt = optimize(model, (x,), dynamic_shapes="x.2=16:48,x.3=16:48", backends=["warpforge"], **FAST)
    assert opt.name == "warpforge-fp32"
    assert opt.report["capture"]["method"] == "torch.export" and opt.report["capture"]["export_error"] is None
    assert "2 random batches at the ends of the dynamic ranges (x.2=16:48, x.3=16:48)" in opt.report["settings"]["val"]
    opt.save(tmp_path)
    loaded = load(tmp_path)
    for i, (h, w) in enumerate(((16, 16), (33, 40), (48, 48))):
        z = torch.randn(3, 3, h, w, generator=torch.Generator().manual_seed(i))
        with torch.no_grad():
            want = model(z)
        torch.testing.assert_close(opt(z), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(loaded(z), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError) as err:
        opt(image(n=2, hw=64))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("input x (argument 0) has shape [2, 3, 64, 64]: dim 2 is 64, outside the declared range "
                          "16:48 of x.2 (captured at [2, 3, 24, 24])"), msg
    with pytest.raises(ShapeError, match=r"dim 2 is 64, outside the declared range 16:48"):
        loaded(image(n=2, hw=64))
    with pytest.raises(ShapeError, match=r"dim 1 is 4, but the model was captured at \[2, 3, 24, 24\] and dim 1 is "
                                         r"not declared dynamic; declare it with --dynamic x.1=MIN:MAX"):
        opt(torch.randn(2, 4, 24, 24))


def test_a_transformer_at_three_sequence_lengths_and_one_outside():
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    opt = optimize(model, (ids,), dynamic_shapes={"ids": {1: (4, 64)}}, backends=["warpforge"], **FAST)
    assert opt.name == "warpforge-fp32" and opt.report["capture"]["method"] == "torch.export"
    assert any(p["name"] == "fuse_linear" and p["counts"] for p in opt.report["passes"])  # really rewritten
    for t in (4, 23, 64):
        z = torch.randint(0, 50, (3, t), generator=torch.Generator().manual_seed(t))
        with torch.no_grad():
            torch.testing.assert_close(opt(z), model(z), rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError, match=r"^input ids \(argument 0\) has shape \[2, 65\]: dim 1 is 65, outside the "
                                         r"declared range 4:64 of ids.1 \(captured at \[2, 16\]\)$"):
        opt(torch.randint(0, 50, (2, 65)))


def test_an_undeclared_resolution_gets_the_clear_error_not_a_raw_one():
    model, x = make(SmallNet()), image(n=2, hw=12)
    opt = optimize(model, (x,), backends=["warpforge"], **FAST)
    opt(image(n=5, hw=12))  # the batch stays free
    with pytest.raises(ShapeError, match=r"dim 2 is 16, but the model was captured at \[2, 3, 12, 12\] and dim 2 is "
                                         r"not declared dynamic; declare it with --dynamic x.2=MIN:MAX \(Python: "
                                         r"dynamic_shapes=\{'x': \{2: \(MIN, MAX\)\}\}\)"):
        opt(image(n=2, hw=16))


def test_onnxruntime_exports_the_declared_dims_symbolic():
    pytest.importorskip("onnxruntime")
    model, x = make(SmallNet()), image(n=2, hw=24)
    opt = optimize(model, (x,), dynamic_shapes=({2: torch.export.Dim("H", min=16, max=40)},),
                   backends=["onnxruntime"], **FAST)
    rec = next(r for r in opt.report["candidates"] if r["family"] == "onnxruntime")
    assert opt.family == "onnxruntime", rec.get("reason")
    shape = rec["details"]["input_shapes"][0]
    assert isinstance(shape[0], str) and isinstance(shape[2], str) and shape[1] == 3 and shape[3] == 24, shape
    z = torch.randn(1, 3, 37, 24)
    with torch.no_grad():
        torch.testing.assert_close(opt(z), model(z), rtol=1e-5, atol=1e-5)


def test_declarations_that_cannot_hold_are_refused_in_one_line():
    model, x = make(SmallNet()), image(n=2, hw=24)
    cases = [("x.9=1:2", "no dim 9"), ("y.2=16:48", "no argument 'y'; the forward's arguments are x"),
             ("x.2=30:48", "the example's input x (argument 0) dim 2 is 24, outside the declared range 30:48"),
             ("x.2=48:16", "1 <= MIN <= MAX"), ("x2=1:4", "must be ARG.DIM"), ("x.2=16-48", "must be ARG.DIM=MIN:MAX"),
             ({"x": {2: torch.export.Dim("H")}}, "needs a max=")]
    for spec, why in cases:
        with pytest.raises(ValueError, match=None) as err:
            parse(spec, model, (x,))
        assert why in str(err.value) and "\n" not in str(err.value), (spec, str(err.value))
    with pytest.raises(BadInputError, match="no dim 9"):
        optimize(model, (x,), dynamic_shapes="x.9=1:2", backends=["eager"], **FAST)

    class FixedWindow(nn.Module):  # its code fixes dim 2 at 24, whatever the declaration says
        def forward(self, x):
            return x.reshape(x.shape[0], 3, 4, 6).sum(-1)

    with pytest.raises(BadInputError, match=r"^the model does not run at the min of its declared dynamic dims "
                                            r"\(x.2=8:48; input shapes \[\[2, 3, 8\]\]\): RuntimeError: shape"):
        optimize(FixedWindow(), (torch.randn(2, 3, 24),), dynamic_shapes="x.2=8:48", backends=["eager"], **FAST)
    shared = parse("x.2=x.3=16:48", model, (x,))
    with pytest.raises(ShapeError, match="x.2=x.3 is one dim shared by input x .* dim 2 and input x .* dim 3, but "
                                         "they are 16 and 20"):
        shared.check((torch.randn(1, 3, 16, 20),))
    shared.check((torch.randn(5, 3, 40, 40),))


def test_an_argument_is_named_as_forward_names_it_or_given_by_position():
    """nn.Sequential's forward is forward(self, input): `x.2` is not its argument, `input.2` and `0.2` are."""
    seq = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU())
    x = image(n=2, hw=24)
    by_name, by_position = parse("input.2=16:48,input.3=16:48", seq, (x,)), parse("0.2=16:48,0.3=16:48", seq, (x,))
    assert by_name == by_position and by_name.describe() == "input.2=16:48, input.3=16:48"
    with pytest.raises(ValueError) as err:
        parse("x.2=16:48", seq, (x,))
    assert str(err.value) == ("--dynamic: 'x.2': no argument 'x'; the forward's arguments are input (names from "
                              "forward()'s signature; by position: 0.2 is dim 2 of the first)")
    with pytest.raises(ValueError, match="the model takes 1 argument"):
        parse("1.2=16:48", seq, (x,))


def test_the_cli_takes_dynamic_and_says_a_bad_one_in_one_line(tmp_path):
    (tmp_path / "m.py").write_text(
        "import torch\n"
        "def factory(batch=2):\n"
        "    torch.manual_seed(0)\n"
        "    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), "
        "torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).eval()\n"
        "    return net, (torch.randn(batch, 3, 16, 16),)\n")
    runner = CliRunner()
    bad = runner.invoke(main, ["optimize", f"{tmp_path / 'm.py'}:factory", "--dynamic", "inp.2=8:32",
                               "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2, bad.output
    assert "--dynamic: 'inp.2': no argument 'inp'; the forward's arguments are input" in bad.output, bad.output
    ok = runner.invoke(main, ["optimize", f"{tmp_path / 'm.py'}:factory", "--dynamic", "0.2=8:32", "--dynamic",
                              "0.3=8:32", "--backend", "eager", "--queries", "3", "--warmup", "1",
                              "--out", str(tmp_path / "ok"), "--json"])
    assert ok.exit_code == 0, ok.output
    man = json.loads((tmp_path / "ok" / "manifest.json").read_text())
    assert [d["targets"] for d in man["shapes"]["dims"]] == [["input.2"], ["input.3"]]
    assert man["format"] == "export"  # the exported program keeps the dims symbolic
    loaded = load(tmp_path / "ok")
    z = torch.randn(1, 3, 8, 31)
    torch.testing.assert_close(loaded(z), loaded.module(z), rtol=0, atol=0)


def test_graph_buckets_capture_a_graph_per_shape_and_drop_the_least_recently_used():
    """The bucketing logic on the CPU, with a stand-in for CUDA-graph capture."""
    captured = []

    def capture(fn, args):
        if args[0].shape[0] == 7:
            raise RuntimeError("capture failed")
        captured.append(tuple(args[0].shape))
        return lambda *a: fn(*a) + 1000  # tells a replay from an uncaptured call

    fn = lambda x: x * 2  # noqa: E731
    b = GraphBuckets(fn, (torch.ones(2, 3),), max_graphs=3, capture=capture, capturable=lambda args: True)
    assert captured == [(2, 3)]
    for n in (4, 5, 4, 6):  # 4 and 5 captured; 4 used again; 6 pushes 5 (least recent) out, never the example's
        assert b(torch.ones(n, 3)).max() == 1002
    assert captured == [(2, 3), (4, 3), (5, 3), (6, 3)]
    assert b.shapes() == [[[2, 3]], [[4, 3]], [[6, 3]]]
    assert b(torch.ones(2, 3)).max() == 1002 and len(captured) == 4  # the example's graph stays
    assert b(torch.ones(7, 3)).max() == 2 and b(torch.ones(7, 3)).max() == 2  # failed: runs uncaptured, tried once
    assert list(b.failed) == [((((7, 3)), torch.float32, torch.device("cpu")),)]
    assert b(torch.ones(5, 3)).max() == 1002 and captured[-1] == (5, 3)  # dropped earlier: captured again
    no_graph = GraphBuckets(fn, (torch.ones(2, 3),), capture=capture, capturable=lambda args: args[0].shape[0] < 8)
    assert no_graph(torch.ones(9, 3)).max() == 2  # not capturable (on the GPU: a CPU tensor): runs as is


@pytest.mark.gpu
def test_gpu_graphs_per_shape_across_the_declared_range():
    model, x = make(SmallNet(c=16)), image(n=2, hw=32).cuda()
    opt = optimize(model, (x,), device="cuda", precisions=["fp16"], backends=["warpforge"],
                   dynamic_shapes="x.2=24:64,x.3=24:64", queries=10, warmup=2)
    assert opt.name == "warpforge-fp16" and opt.built.cuda_graph
    model = model.cuda()
    for hw in (24, 40, 64):
        z = image(n=2, hw=hw, seed=hw).cuda()
        with torch.no_grad():
            want = model(z)
        # fp16 compute against the fp32 model: the fp16 budget's order of error
        torch.testing.assert_close(opt(z), want, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(opt(z), want, rtol=2e-2, atol=2e-2)  # the replay of the graph captured above
    graphed = opt.built.fn.shapes()
    assert all([[2, 3, hw, hw]] in graphed for hw in (24, 40, 64)), graphed
    with pytest.raises(ShapeError, match="outside the declared range 24:64"):
        opt(image(n=2, hw=80).cuda())
