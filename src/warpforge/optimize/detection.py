"""Detector outputs judged as detections, not as tensors.

A detector returns, per image, ``{"boxes": [K, 4], "scores": [K], "labels": [K]}`` after a score threshold,
top-k and NMS. Rounding in a 16-bit candidate moves a score across the threshold or swaps two near-equal
scores, so K and the order change while every real detection is still there: an element-wise comparison
would reject every 16-bit candidate of every detector. Here each reference detection is matched to a
candidate detection of the same label whose box overlaps it (IoU >= ``IOU_MIN``) and whose score is within
the budget's tolerance, greedily from the highest score, and the other way round. Detections scored within
``TIE`` of the lowest score either side kept are near the threshold or the top-k cut, where any
perturbation decides whether they survive: they are counted as ties, not judged (as the classifier gate
leaves out near-tie samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

KEYS = ("boxes", "scores", "labels")
IOU_MIN = 0.9   # a box that moved by more than a few percent of its size is another detection
TIE = 0.02      # score distance from the weakest kept detection below which survival is a coin toss


def is_detection_output(out: Any) -> bool:
    """A list/tuple of per-image dicts with boxes, scores and labels tensors (torchvision's convention)."""
    return (isinstance(out, (list, tuple)) and len(out) > 0
            and all(isinstance(d, dict) and all(isinstance(d.get(k), torch.Tensor) for k in KEYS) for d in out))


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of every box in a [N, 4] against every box in b [M, 4] (x1, y1, x2, y2) -> [N, M]."""
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp_min(0).prod(-1)
    area = lambda x: (x[:, 2:] - x[:, :2]).clamp_min(0).prod(-1)  # noqa: E731
    union = area(a)[:, None] + area(b)[None, :] - inter
    return torch.where(union > 0, inter / union.clamp_min(1e-12), torch.zeros_like(inter))


@dataclass
class Matching:
    matched: int = 0
    missed: int = 0       # decisive reference detections with no candidate counterpart
    extra: int = 0        # decisive candidate detections with no reference counterpart
    ties: int = 0         # unmatched detections near the threshold / top-k cut, not judged
    max_score_err: float = 0.0
    ref_rows: list[torch.Tensor] = field(default_factory=list)   # matched pairs as [x1, y1, x2, y2, score]
    cand_rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def fraction(self) -> float | None:
        judged = self.matched + self.missed + self.extra
        return self.matched / judged if judged else None


def match_image(ref: dict, cand: dict, score_tol: float, m: Matching) -> None:
    """Match one image's detections into ``m`` (see the module docstring)."""
    rb, rs, rl = (ref[k].detach().double().cpu() for k in KEYS)
    cb, cs, cl = (cand[k].detach().double().cpu() for k in KEYS)
    iou = box_iou(rb, cb) if len(rb) and len(cb) else torch.zeros(len(rb), len(cb), dtype=torch.float64)
    ok = (iou >= IOU_MIN) & (rl[:, None] == cl[None, :]) & ((rs[:, None] - cs[None, :]).abs() <= score_tol)
    used_c = torch.zeros(len(cb), dtype=torch.bool)
    used_r = torch.zeros(len(rb), dtype=torch.bool)
    for i in torch.argsort(rs, descending=True).tolist():
        cands = (ok[i] & ~used_c).nonzero().flatten()
        if len(cands):
            j = int(cands[torch.argmax(iou[i, cands])])
            used_c[j] = used_r[i] = True
            m.matched += 1
            m.max_score_err = max(m.max_score_err, float((rs[i] - cs[j]).abs()))
            m.ref_rows.append(torch.cat([rb[i], rs[i, None]]))
            m.cand_rows.append(torch.cat([cb[j], cs[j, None]]))
    lows = [float(x.min()) for x in (rs, cs) if len(x)]
    floor = min(lows) if lows else 0.0
    for scores, used, attr in ((rs, used_r, "missed"), (cs, used_c, "extra")):
        for s in scores[~used].tolist():
            if s < floor + TIE:
                m.ties += 1
            else:
                setattr(m, attr, getattr(m, attr) + 1)


def match(ref_out: Any, cand_out: Any, score_tol: float, m: Matching, prefix: str = "") -> list[str]:
    """Match one batch's outputs into ``m``; -> structural errors (one line each)."""
    if not is_detection_output(cand_out):
        return [f"{prefix}out: the candidate's output is not a list of {{boxes, scores, labels}} dicts"]
    if len(cand_out) != len(ref_out):
        return [f"{prefix}out: {len(cand_out)} images of detections, the reference has {len(ref_out)}"]
    errors = []
    for i, (r, c) in enumerate(zip(ref_out, cand_out)):
        bad = [k for k in ("boxes", "scores") if not bool(torch.isfinite(c[k]).all())]
        if bad:
            errors.append(f"{prefix}out[{i}]: non-finite {', '.join(bad)}")
            continue
        match_image(r, c, score_tol, m)
    return errors


__all__ = ["IOU_MIN", "KEYS", "TIE", "Matching", "box_iou", "is_detection_output", "match", "match_image"]
