"""FLOP formulas against hand counts, under inference_mode (composite ops) and no_grad (decomposed ops)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from warpforge.profile.flops import count
from warpforge.profile.formulas import attention_pairs

MODES = ["inference", "no_grad"]


def flops(fn, *inputs, mode: str = "inference", module=None) -> int:
    """Total counted FLOPs of one call (inference: composite ops reach the counter; no_grad: decomposed)."""
    ctx = torch.no_grad() if mode == "no_grad" else contextlib.nullcontext()
    with ctx:
        c = count(fn, *inputs, module=module, grad=mode == "no_grad")
    assert not c.uncounted, c.uncounted
    return c.flops


def r(*shape):
    return torch.randn(*shape)


@pytest.mark.parametrize("mode", MODES)
class TestMatmul:
    def test_mm(self, mode):
        assert flops(torch.mm, r(3, 5), r(5, 7), mode=mode) == 2 * 3 * 5 * 7

    def test_addmm_counts_no_bias(self, mode):
        assert flops(torch.addmm, r(7), r(3, 5), r(5, 7), mode=mode) == 2 * 3 * 5 * 7

    def test_bmm(self, mode):
        assert flops(torch.bmm, r(2, 3, 5), r(2, 5, 7), mode=mode) == 2 * 2 * 3 * 5 * 7

    def test_matmul_broadcast(self, mode):
        assert flops(torch.matmul, r(4, 3, 5), r(5, 7), mode=mode) == 2 * 4 * 3 * 5 * 7

    def test_matrix_vector(self, mode):
        assert flops(torch.matmul, r(3, 5), r(5), mode=mode) == 2 * 3 * 5

    def test_linear_3d_input(self, mode):
        lin = torch.nn.Linear(5, 7)
        assert flops(lin, r(2, 3, 5), mode=mode) == 2 * 2 * 3 * 5 * 7

    def test_baddbmm(self, mode):
        assert flops(torch.baddbmm, r(2, 3, 7), r(2, 3, 5), r(2, 5, 7), mode=mode) == 2 * 2 * 3 * 5 * 7

    def test_einsum_two_operands(self, mode):
        assert flops(lambda a, b: torch.einsum("bik,bkj->bij", a, b), r(2, 3, 5), r(2, 5, 7), mode=mode) == 420


@pytest.mark.parametrize("mode", MODES)
class TestConv:
    def test_conv2d_same_padding(self, mode):
        # out [2, 4, 8, 8]: each output element takes Cin * 3 * 3 = 27 multiply-adds
        conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        assert flops(conv, r(2, 3, 8, 8), mode=mode) == 2 * (2 * 4 * 8 * 8) * 27

    def test_conv2d_strided(self, mode):
        conv = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)  # out [2, 4, 4, 4]
        assert flops(conv, r(2, 3, 8, 8), mode=mode) == 2 * (2 * 4 * 4 * 4) * 27

    def test_depthwise_groups(self, mode):
        conv = torch.nn.Conv2d(4, 4, 3, padding=1, groups=4)  # each output sees 1 input channel
        assert flops(conv, r(1, 4, 8, 8), mode=mode) == 2 * (4 * 8 * 8) * 9

    def test_grouped(self, mode):
        conv = torch.nn.Conv2d(4, 6, 1, groups=2)  # Cin/g = 2
        assert flops(conv, r(1, 4, 5, 5), mode=mode) == 2 * (6 * 25) * 2

    def test_conv1d(self, mode):
        conv = torch.nn.Conv1d(3, 4, 3)  # out [2, 4, 8]
        assert flops(conv, r(2, 3, 10), mode=mode) == 2 * 64 * 9

    def test_conv_transpose2d(self, mode):
        # weight [Cin=4, Cout=2, 3, 3]: every input element scatters into Cout * 9 outputs
        w = r(4, 2, 3, 3)
        assert flops(lambda x: F.conv_transpose2d(x, w), r(1, 4, 5, 5), mode=mode) == 2 * (4 * 25) * (2 * 9)


def test_conv_matches_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1, groups=1), torch.nn.Conv2d(8, 8, 3, groups=4),
                            torch.nn.Flatten(), torch.nn.LazyLinear(5)).eval()
    x = r(2, 3, 9, 9)
    m(x)
    with torch.no_grad(), FlopCounterMode(display=False) as ref:
        m(x)
    assert flops(m, x, mode="no_grad") == ref.get_total_flops()
    assert flops(m, x, mode="inference") == ref.get_total_flops()


@pytest.mark.parametrize("mode", MODES)
class TestAttention:
    def test_dense(self, mode):
        q, k, v = r(2, 3, 5, 4), r(2, 3, 5, 4), r(2, 3, 5, 4)
        # 4 * B * H * Sq * Sk * D
        assert flops(F.scaled_dot_product_attention, q, k, v, mode=mode) == 4 * 2 * 3 * 5 * 5 * 4

    def test_causal_square(self, mode):
        q = r(2, 3, 5, 4)
        got = flops(lambda a: F.scaled_dot_product_attention(a, a, a, is_causal=True), q, mode=mode)
        assert got == 2 * (2 * 3) * 15 * (4 + 4)  # 1 + 2 + 3 + 4 + 5 = 15 pairs of 25: about half

    def test_causal_fewer_queries(self, mode):
        q, kv = r(1, 2, 3, 4), r(1, 2, 5, 4)
        got = flops(lambda a, b: F.scaled_dot_product_attention(a, b, b, is_causal=True), q, kv, mode=mode)
        assert got == 2 * 2 * (1 + 2 + 3) * 8  # torch's causal mask is top-left aligned

    def test_value_dim_differs(self, mode):
        q, k, v = r(1, 2, 5, 4), r(1, 2, 6, 4), r(1, 2, 6, 8)
        want = 2 * 2 * 30 * (4 + 8)  # QK^T over D = 4, PV over Dv = 8
        if mode == "inference":
            assert flops(F.scaled_dot_product_attention, q, k, v, mode=mode) == want
        else:  # torch's CPU math path: two bmm's carry exactly the attention FLOPs, softmax etc. count apart
            with torch.no_grad():
                c = count(F.scaled_dot_product_attention, q, k, v, grad=True)
            assert sum(x.flops for x in c.records if x.kind in ("matmul", "attention")) == want

    def test_grouped_query(self, mode):
        q, kv = r(1, 4, 5, 8), r(1, 2, 5, 8)
        got = flops(lambda a, b: F.scaled_dot_product_attention(a, b, b, enable_gqa=True), q, kv, mode=mode)
        assert got == 4 * 1 * 4 * 5 * 5 * 8  # the work is per query head


def test_attention_pairs_edges():
    assert attention_pairs(4, 4, False) == 16
    assert attention_pairs(4, 4, True) == 10
    assert attention_pairs(6, 4, True) == 10 + 2 * 4  # rows past Sk see all Sk keys
    assert attention_pairs(1, 9, True) == 1


@pytest.mark.parametrize("mode", MODES)
class TestPointwiseAndReductions:
    N = 4 * 6

    @pytest.mark.parametrize("fn", [torch.relu, F.gelu, F.silu, torch.exp, torch.tanh, torch.sigmoid,
                                    lambda x: x * 2.0, lambda x: x + x, lambda x: x.clamp(-1, 1)])
    def test_one_flop_per_element(self, mode, fn):
        assert flops(fn, r(4, 6), mode=mode) == self.N

    def test_in_place(self, mode):
        assert flops(lambda x: x.add_(1.0), r(4, 6), mode=mode) == self.N

    def test_broadcast_counts_outputs(self, mode):
        assert flops(torch.add, r(4, 6), r(6), mode=mode) == self.N

    def test_fused_multiply_add(self, mode):
        assert flops(torch.addcmul, r(4, 6), r(4, 6), r(4, 6), mode=mode) == 2 * self.N

    @pytest.mark.parametrize("fn,per", [(torch.sum, 1), (lambda x: x.mean(-1), 1), (lambda x: x.amax(-1), 1),
                                        (lambda x: x.argmax(-1), 1), (lambda x: x.var(-1), 3),
                                        (lambda x: torch.logsumexp(x, -1), 4), (lambda x: x.cumsum(-1), 1)])
    def test_reductions(self, mode, fn, per):
        assert flops(fn, r(4, 6), mode=mode) == per * self.N

    @pytest.mark.parametrize("fn", [lambda x: x.softmax(-1), lambda x: x.log_softmax(-1)])
    def test_softmax(self, mode, fn):
        assert flops(fn, r(4, 6), mode=mode) == 5 * self.N


@pytest.mark.parametrize("mode", MODES)
class TestNorms:
    def test_layer_norm_affine(self, mode):
        assert flops(torch.nn.LayerNorm(6), r(4, 6), mode=mode) == 24 * (5 + 2)

    def test_layer_norm_plain(self, mode):
        assert flops(torch.nn.LayerNorm(6, elementwise_affine=False), r(4, 6), mode=mode) == 24 * 5

    def test_rms_norm(self, mode):
        w = torch.ones(6)
        got = flops(lambda x: F.rms_norm(x, (6,), w, eps=1e-6), r(4, 6), mode=mode)
        if mode == "inference":
            assert got == 24 * (3 + 1)
        else:  # decomposed into pow, mean, add, rsqrt, mul, mul: each counted as itself
            assert got > 0

    def test_batch_norm_inference(self, mode):
        bn = torch.nn.BatchNorm2d(3).eval()
        assert flops(bn, r(2, 3, 4, 4), mode=mode) == 96 * 4

    def test_batch_norm_training(self, mode):
        bn = torch.nn.BatchNorm2d(3).train()
        assert flops(bn, r(2, 3, 4, 4), mode=mode) == 96 * 7 + 1  # + num_batches_tracked += 1

    def test_group_norm(self, mode):
        assert flops(torch.nn.GroupNorm(2, 4), r(2, 4, 3, 3), mode=mode) == 72 * 7


@pytest.mark.parametrize("mode", MODES)
class TestPools:
    def test_max_pool(self, mode):
        assert flops(torch.nn.MaxPool2d(2), r(1, 2, 4, 4), mode=mode) == 8 * 4

    def test_avg_pool_padded(self, mode):
        assert flops(torch.nn.AvgPool2d(3, stride=1, padding=1), r(1, 1, 4, 4), mode=mode) == 16 * 9

    def test_adaptive(self, mode):
        assert flops(torch.nn.AdaptiveAvgPool2d(1), r(2, 3, 4, 4), mode=mode) == 96


def test_data_movement_counts_no_flops_and_no_unknowns():
    c = count(lambda x, i: (torch.cat([x, x]), x.t().contiguous(), x.to(torch.float16), x[i], x.clone()),
              r(4, 6), torch.tensor([0, 2]))
    assert c.flops == 0 and not c.uncounted
    assert {rec.kind for rec in c.records} == {"movement"}


def test_unknown_op_listed_with_bytes():
    c = count(torch.fft.rfft, r(16))
    assert c.flops == 0
    assert sum(c.uncounted.values()) == 1
    (name,) = c.uncounted
    assert "fft" in name
    assert c.records[0].kind == "unknown" and c.records[0].bytes > 0


def test_ceilings_follow_dtype_and_kind():
    lin = torch.nn.Linear(8, 8).to(torch.bfloat16)
    c = count(lambda x: torch.relu(lin(x)), r(2, 8).to(torch.bfloat16))
    by = {rec.op: rec for rec in c.records}
    assert by["aten::linear"].ceiling == "bf16"
    assert by["aten::relu"].ceiling == "fp32"  # pointwise work runs on the CUDA cores
    c32 = count(torch.mm, r(2, 8), r(8, 8))
    assert c32.records[0].ceiling == "fp32"  # a CPU tensor has no TF32


def test_operators_filed_under_modules():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)
            self.act = torch.nn.ReLU()

        def forward(self, x):
            return self.act(self.fc(x)) + x

    m = torch.nn.Sequential(Block(), Block())
    c = count(m, r(2, 4))
    got = [(rec.module, rec.op) for rec in c.records]
    assert got == [("0.fc", "aten::linear"), ("0.act", "aten::relu"), ("0", "aten::add"),
                   ("1.fc", "aten::linear"), ("1.act", "aten::relu"), ("1", "aten::add")]
    assert c.module_calls["0.fc"] == 1 and c.module_calls[""] == 1
