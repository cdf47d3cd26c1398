"""The accuracy gate on tensors whose errors are known by hand."""

import copy
import math

import pytest
import torch

from warpforge.optimize.gate import Budget, compare


def test_metrics_on_known_tensors():
    ref = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    cand = ref + torch.tensor([[0.1, 0.0], [0.0, -0.2]])
    acc = compare(ref, cand, "classifier")
    assert acc.max_abs == pytest.approx(0.2)
    assert acc.mean_abs == pytest.approx(0.3 / 4)
    assert acc.max_rel == pytest.approx(0.2 / 4.0)  # relative to the reference's max magnitude
    row0 = (1 * 1.1 + 2 * 2) / (math.hypot(1, 2) * math.hypot(1.1, 2))
    row1 = (3 * 3 + 4 * 3.8) / (math.hypot(3, 4) * math.hypot(3, 3.8))
    assert acc.min_cosine == pytest.approx(min(row0, row1), rel=1e-9)
    assert acc.top1 == 1.0 and acc.n_samples == 2 and acc.n_values == 4
    assert acc.passes(Budget(max_rel=0.06))[0]
    ok, reasons = acc.passes(Budget(max_rel=0.01, max_abs=0.1))
    assert not ok and reasons == ["max_abs 0.2 (budget <= 0.1)", "max_rel 0.05 (budget <= 0.01)"]


def test_top1_disagreement_and_generic_kind():
    ref = torch.tensor([[2.0, 1.0], [0.0, 1.0], [5.0, 0.0], [0.0, 3.0]])
    cand = torch.tensor([[1.0, 2.0], [0.0, 1.0], [5.0, 0.0], [0.0, 3.0]])  # sample 0 flips
    assert compare(ref, cand, "classifier").top1 == 0.75
    assert compare(ref, cand, "generic").top1 is None
    ok, reasons = compare(ref, cand, "classifier").passes(Budget(min_top1=0.9))
    assert not ok and reasons == ["top1 0.75 (budget >= 0.9)"]


def test_nested_outputs_and_batches():
    ref = [{"logits": torch.eye(3), "box": torch.ones(3, 4)}, {"logits": torch.eye(3) * 2, "box": torch.zeros(3, 4)}]
    cand = [{"logits": torch.eye(3), "box": torch.ones(3, 4) * 1.5},
            {"logits": torch.eye(3) * 2, "box": torch.zeros(3, 4)}]
    acc = compare(ref, cand, "classifier", batched=True)
    assert acc.max_abs == 0.5 and acc.max_rel == 0.5  # the box tensor: 0.5 / max |1|
    assert acc.top1 == 1.0 and acc.n_samples == 6  # the "logits" entry of each batch
    assert acc.errors == []


@pytest.mark.parametrize("bad,reason", [
    (float("nan"), "non-finite value(s) (NaN)"),
    (float("inf"), "non-finite value(s) (inf)"),
])
def test_non_finite_candidate_fails(bad, reason):
    ref = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))
    cand = ref.clone()
    cand[1, 2] = bad
    acc = compare(ref, cand)
    ok, reasons = acc.passes(Budget())  # even an empty budget: NaN is never within budget
    assert not ok and len(reasons) == 1 and reason in reasons[0] and "out" in reasons[0]


def test_structural_mismatches_fail_with_reasons():
    ref = torch.zeros(2, 3)
    assert "shape (3, 2)" in compare(ref, torch.zeros(3, 2)).errors[0]
    assert "structure" in compare((ref, ref), ref).errors[0]
    assert "int64" in compare(torch.arange(3), torch.arange(3) + 1).errors[0]  # integers must match exactly
    assert compare(torch.arange(3), torch.arange(3)).errors == []
    assert "dtype torch.int64" in compare(ref, torch.zeros(2, 3, dtype=torch.long)).errors[0]


def test_reference_non_finite_values_must_recur():
    ref = torch.tensor([1.0, float("nan"), 2.0])
    assert compare(ref, torch.tensor([1.0, float("nan"), 2.0])).errors == []
    assert compare(ref, torch.tensor([1.0, 0.0, 2.0])).errors  # NaN in the reference, a number in the candidate


def test_user_metric_hook():
    ref, cand = torch.ones(4, 2), torch.ones(4, 2) * 1.1
    budget = Budget(metric=lambda r, c: float((r - c).abs().mean()), metric_name="l1", metric_max=0.05)
    acc = compare([ref, ref], [cand, cand], batched=True, budget=budget)
    assert acc.metric == pytest.approx(0.1) and acc.as_dict()["l1"] == pytest.approx(0.1)
    ok, reasons = acc.passes(budget)
    assert not ok and reasons == ["l1 0.1 (budget <= 0.05)"]
    boom = Budget(metric=lambda r, c: 1 / 0, metric_min=0.0)
    assert "ZeroDivisionError" in compare(ref, cand, budget=boom).errors[0]


def test_budget_validates_and_defaults():
    with pytest.raises(ValueError, match="max_rel"):
        Budget(max_rel=-1)
    with pytest.raises(ValueError, match="min_cosine"):
        Budget(min_cosine=2)
    with pytest.raises(ValueError, match="threshold"):
        Budget(metric=lambda r, c: 0.0)
    with pytest.raises(ValueError, match="precision"):
        Budget.for_precision("int4")
    with pytest.raises(ValueError, match="top1_tie"):
        Budget(top1_tie=1.0)
    fp32, fp16, bf16, int8 = (Budget.for_precision(p) for p in ("fp32", "fp16", "bf16", "int8"))
    assert fp32.max_rel < fp16.max_rel < bf16.max_rel < int8.max_rel
    assert int8.min_top1 == 0.99 and int8.top1_tie == 0.01  # the bar, near-ties left out
    assert all(b.top1_tie is None for b in (fp32, fp16, bf16))
    assert fp16.with_overrides(max_rel=0.5, min_cosine=None).max_rel == 0.5
    assert fp16.with_overrides(max_rel=0.5).min_cosine == fp16.min_cosine


def test_top1_near_ties_are_counted_not_judged():
    ref = torch.tensor([[2.0, 1.0, 0.0], [1.0, 1.002, -3.0], [0.0, 4.0, 1.0], [3.0, 0.0, 2.8]])
    cand = torch.tensor([[2.0, 1.0, 0.0], [1.01, 1.0, -3.0], [0.0, 4.0, 1.0], [2.9, 0.0, 3.0]])  # rows 1, 3 flip
    plain = compare(ref, cand, "classifier")
    assert plain.top1 == 0.5 and plain.top1_ties == 0
    tie = Budget(min_top1=0.99, top1_tie=0.01)
    acc = compare(ref, cand, "classifier", budget=tie)
    # row 1: softmax probabilities 0.4960 vs 0.4950 (a tie, left out); row 3: 0.53 vs 0.44 (judged, flipped)
    assert acc.top1_ties == 1 and acc.n_samples == 3 and acc.top1 == pytest.approx(2 / 3)
    ok, reasons = acc.passes(tie)
    assert not ok and reasons == ["top1 0.666667 (budget >= 0.99)"]
    assert acc.as_dict()["top1_ties"] == 1 and tie.as_dict()["top1_tie"] == 0.01
    assert compare(ref[:3], cand[:3], "classifier", budget=tie).top1 == 1.0


def test_budget_widens_to_twice_the_frameworks_own_error_only_where_that_exceeds_it():
    from warpforge.optimize.gate import DEFAULT_BUDGETS

    b = DEFAULT_BUDGETS["fp16"]  # max_rel 2e-2, cosine 0.999
    assert b.widened_to(0.005, 0.9999) is b and b.widened_to(None, None) is b
    w = b.widened_to(0.03, 0.998)
    assert w.max_rel == 0.06 and w.min_cosine == pytest.approx(0.996) and w.min_top1 == b.min_top1
    assert b.widened_to(0.03, 0.99999).min_cosine == b.min_cosine  # never tighter than the default


def test_framework_budgets_measure_torch_eager_at_each_16_bit_precision():
    """Each 16-bit budget is the default widened to torch eager's own error at that precision on val."""
    from warpforge.optimize.gate import DEFAULT_BUDGETS, compare
    from warpforge.profile.targets import framework_budgets

    torch.manual_seed(0)
    shift, back = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    with torch.no_grad():  # x + 256 then - 256: 16-bit rounding at 256 swamps the O(1) result
        shift.bias.add_(256.0)
        back.weight.copy_(torch.eye(64))
        back.bias.fill_(-256.0)
    model = torch.nn.Sequential(shift, back).eval()
    val = [(torch.randn(4, 64),) for _ in range(2)]
    got = framework_budgets(model, val)
    assert got["fp32"] == DEFAULT_BUDGETS["fp32"]
    with torch.no_grad():
        ref = [model(*v) for v in val]
        for p, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            low = copy.deepcopy(model).to(dtype)
            own = compare(ref, [low(v[0].to(dtype)).float() for v in val], batched=True)
            assert got[p] == DEFAULT_BUDGETS[p].widened_to(own.max_rel, own.min_cosine), p
    assert got["bf16"].max_rel > DEFAULT_BUDGETS["bf16"].max_rel  # this net is one the widening is for
