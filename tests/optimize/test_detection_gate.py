"""The detector gate: detections matched by label, box overlap and score, both ways; near-floor ties not judged."""

from __future__ import annotations

import math

import pytest
import torch

from warpforge.optimize.api import _infer_kind
from warpforge.optimize.detection import box_iou
from warpforge.optimize.gate import Budget, compare


def _dets(boxes, scores, labels):
    return {"boxes": torch.tensor(boxes, dtype=torch.float32), "scores": torch.tensor(scores),
            "labels": torch.tensor(labels)}


REF = [_dets([[0, 0, 10, 10], [20, 20, 40, 50], [5, 5, 9, 30], [60, 0, 70, 8]], [0.9, 0.8, 0.6, 0.21], [1, 2, 1, 3]),
       _dets([[1, 1, 5, 5]], [0.7], [0])]
FP16 = Budget.for_precision("fp16")


def _acc(cand, budget=FP16):
    return compare([REF], [cand], "detection", batched=True, budget=budget)


def test_box_iou_against_hand_values():
    a = torch.tensor([[0.0, 0, 10, 10]])
    b = torch.tensor([[0.0, 0, 10, 10], [5, 0, 15, 10], [20, 20, 30, 30], [0, 0, 0, 0]])
    assert torch.allclose(box_iou(a, b), torch.tensor([[1.0, 50 / 150, 0.0, 0.0]]))


def test_same_detections_in_another_order_with_rounded_scores_pass():
    perm = [2, 0, 3, 1]
    d = REF[0]
    cand0 = {k: v[perm].clone() for k, v in d.items()}
    cand0["scores"] = cand0["scores"] + torch.tensor([0.004, -0.003, 0.002, 0.001])
    cand0["boxes"] = cand0["boxes"] + 0.05
    acc = _acc([cand0, REF[1]])
    ok, reasons = acc.passes(FP16)
    assert ok, reasons
    assert acc.detections == 1.0 and acc.as_dict()["detections"] == 1.0
    assert acc.max_abs == pytest.approx(0.05, abs=1e-5)  # the boxes' shift, over the matched pairs
    assert acc.n_values == 5 * 5 and 0.9999 < acc.min_cosine <= 1.0


def test_a_lost_decisive_detection_fails_and_a_lost_near_floor_one_is_a_tie():
    lost_strong = [{k: v[[1, 2, 3]] for k, v in REF[0].items()}, REF[1]]  # the 0.9 box is gone
    acc = _acc(lost_strong)
    ok, reasons = acc.passes(FP16)
    assert not ok and acc.detections == pytest.approx(4 / 5)
    assert any(r.startswith("detections 0.8 (budget >= 0.98)") for r in reasons), reasons
    lost_mid = [{k: v[[0, 1, 3]] for k, v in REF[0].items()}, REF[1]]  # 0.6: well above the weakest kept
    assert not _acc(lost_mid).passes(FP16)[0]
    lost_weak = [{k: v[[0, 1, 2]] for k, v in REF[0].items()}, REF[1]]  # 0.21: the weakest kept, at the cut
    acc = _acc(lost_weak)
    assert acc.passes(FP16)[0] and acc.detection_ties == 1
    # A swap at the cut: each side keeps a different weakest detection; neither is judged.
    weak_pair = [_dets([[0, 0, 10, 10], [60, 0, 70, 8]], [0.9, 0.21], [1, 3])]
    acc = compare([weak_pair], [[_dets([[0, 0, 10, 10], [30, 30, 35, 35]], [0.9, 0.215], [1, 2])]], "detection",
                  batched=True, budget=FP16)
    assert acc.detections == 1.0 and acc.detection_ties == 2 and acc.passes(FP16)[0]


@pytest.mark.parametrize("change, why", [
    (lambda d: d.update(labels=torch.tensor([1, 2, 2, 3])), "a label changed"),
    (lambda d: d.update(scores=d["scores"] + torch.tensor([0.0, 0.05, 0.0, 0.0])), "a score beyond max_rel"),
    (lambda d: d["boxes"].__setitem__(0, torch.tensor([0.0, 0, 10, 14])), "a box moved to IoU < 0.9"),
])
def test_changed_label_score_or_box_is_not_a_match(change, why):
    d = {k: v.clone() for k, v in REF[0].items()}
    change(d)
    acc = _acc([d, REF[1]])
    assert acc.detections < 1.0 and not acc.passes(FP16)[0], why


def test_structure_and_non_finite_errors():
    assert "not a list of" in _acc([torch.zeros(3)]).errors[0]
    assert "1 images of detections, the reference has 2" in _acc([REF[0]]).errors[0]
    bad = {k: v.clone() for k, v in REF[0].items()}
    bad["scores"][1] = math.nan
    assert "non-finite scores" in _acc([bad, REF[1]]).errors[0]
    acc = _acc(REF)
    assert acc.max_rel == 0.0 and acc.detections == 1.0 and acc.passes(Budget.for_precision("fp32"))[0]


def test_kind_is_inferred_from_a_detector_output():
    assert _infer_kind(REF, (torch.zeros(2, 3, 8, 8),)) == "detection"
    assert _infer_kind(torch.zeros(2, 10), (torch.zeros(2, 3, 8, 8),)) == "classifier"
