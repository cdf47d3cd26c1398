"""The accuracy gate: a candidate's outputs against the fp32 reference, judged against a budget.

    acc = compare(ref_outputs, cand_outputs, "classifier", batched=True)   # lists, one per val batch
    ok, reasons = acc.passes(Budget.for_precision("fp16"))

Metrics, over every floating output tensor of every validation batch:

* ``max_abs`` / ``mean_abs``: absolute error;
* ``max_rel``: per output tensor, max |cand - ref| over max |ref| (a relative error that does not blow
  up where the reference is near zero), worst tensor;
* ``min_cosine``: cosine similarity per sample (row along dim 0; the whole tensor when it has no batch
  dim), the worst sample;
* ``top1``: for ``kind == "classifier"``, the fraction of samples whose argmax over the last dim agrees
  (the classifier output is the first floating tensor with >= 2 dims, or the ``"logits"`` entry of a dict).
  With ``Budget.top1_tie``, samples whose reference is a near-tie (its two largest softmax probabilities
  less than that apart) are left out and counted in ``top1_ties``: any perturbation flips a coin there;
* ``detections``: for ``kind == "detection"`` (per-image ``{boxes, scores, labels}`` dicts), the fraction of
  detections matched both ways by label, box overlap and score (optimize/detection.py); the element-wise
  metrics then cover the matched pairs' boxes and scores (a changed detection count is no shape error);
* a user metric: ``Budget.metric(ref_output, cand_output) -> float`` per batch, averaged.

Integer and bool outputs must match exactly. A candidate with NaN or inf where the reference is finite,
or with a different output structure, shape or dtype, fails with that reason: never a silently wrong model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from warpforge.optimize.detection import Matching, is_detection_output, match

PRECISIONS = ("fp32", "fp16", "bf16", "int8", "fp8", "w8", "w4")
# What optimize() tries unless asked: int8 and fp8 need calibration, w8/w4 pay only where weights dominate.
DEFAULT_PRECISIONS = ("fp32", "fp16", "bf16")
# The dtype each precision computes its float parts in (int8, fp8: the layers left float run fp16 on CUDA;
# w8/w4: the activations are fp16 on CUDA; on CPU the int8 and w8/w4 candidates keep them fp32, see
# optimize/backends.py).
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.float16,
          "fp8": torch.float16, "w8": torch.float16, "w4": torch.float16}
KINDS = ("classifier", "generic", "detection")


@dataclass(frozen=True)
class Budget:
    """How far a candidate may stray from the fp32 reference; None leaves a metric unchecked."""

    max_abs: float | None = None
    max_rel: float | None = None      # max |err| / max |ref|, per output tensor
    min_cosine: float | None = None   # worst per-sample cosine similarity
    min_top1: float | None = None     # classifiers: fraction of argmax agreement
    top1_tie: float | None = None     # classifiers: leave out samples whose reference top-2 probabilities differ less
    min_detections: float | None = None  # detectors: fraction of detections matched (scores within max_rel)
    metric: Callable[[Any, Any], float] | None = field(default=None, compare=False)
    metric_name: str = "metric"
    metric_min: float | None = None   # the user metric's mean must be >= this ...
    metric_max: float | None = None   # ... and/or <= this

    def __post_init__(self) -> None:
        for name in ("max_abs", "max_rel"):
            v = getattr(self, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"Budget.{name} must be a finite number >= 0, got {v!r}")
        for name in ("min_cosine", "min_top1", "min_detections"):
            v = getattr(self, name)
            if v is not None and not (-1.0 <= v <= 1.0):
                raise ValueError(f"Budget.{name} must be in [-1, 1], got {v!r}")
        if self.top1_tie is not None and not (0.0 <= self.top1_tie < 1.0):
            raise ValueError(f"Budget.top1_tie must be in [0, 1), got {self.top1_tie!r}")
        if self.metric is not None and not callable(self.metric):
            raise ValueError(f"Budget.metric must be callable(reference_output, candidate_output) -> float, "
                             f"got {type(self.metric).__name__}")
        if self.metric is not None and self.metric_min is None and self.metric_max is None:
            raise ValueError("Budget.metric needs a threshold: metric_min and/or metric_max")
        if self.metric is None and (self.metric_min is not None or self.metric_max is not None):
            raise ValueError("Budget.metric_min/metric_max given without Budget.metric")

    @staticmethod
    def for_precision(precision: str) -> Budget:
        """Defaults per compute precision. fp32 candidates only reorder fp32 arithmetic (fused epilogues,
        other conv algorithms), so they must stay within 1e-3 of the output range; fp16 (10-bit mantissa)
        and bf16 (7-bit) round every activation, and the error grows with depth, hence the looser bars.
        Top-1 agreement allows a few near-tie flips per thousand samples. int8, fp8, w8, w4: see
        DEFAULT_BUDGETS."""
        if precision not in DEFAULT_BUDGETS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        return DEFAULT_BUDGETS[precision]

    def with_overrides(self, **kw: float | None) -> Budget:
        """A copy with the given (non-None) fields replaced."""
        return replace(self, **{k: v for k, v in kw.items() if v is not None})

    def widened_to(self, own_rel: float | None, own_cosine: float | None) -> Budget:
        """The bars at twice the framework's own error where that exceeds them: ``own_rel`` / ``own_cosine``
        are torch eager's max relative error and worst cosine at the same precision on the same inputs.
        Random-weight deep nets have no trained scale (ResNet-50's logits stray 3% in plain torch fp16), so
        there the question a bar can answer is whether a candidate is as accurate as the framework."""
        if own_rel is None or self.max_rel is None or 2 * own_rel <= self.max_rel:
            return self
        cos = (min(self.min_cosine, 1 - 2 * (1 - own_cosine)) if own_cosine is not None and self.min_cosine
               is not None else None)
        return self.with_overrides(max_rel=2 * own_rel, min_cosine=cos)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"max_abs": self.max_abs, "max_rel": self.max_rel, "min_cosine": self.min_cosine,
                             "min_top1": self.min_top1}
        if self.top1_tie is not None:
            d["top1_tie"] = self.top1_tie
        if self.min_detections is not None:
            d["min_detections"] = self.min_detections
        if self.metric is not None:
            d.update(metric=self.metric_name, metric_min=self.metric_min, metric_max=self.metric_max)
        return d


DEFAULT_BUDGETS = {
    # Detectors (min_detections): a matched pair's score may differ by max_rel; a few decisive detections per
    # hundred may change in 16-bit and lower precisions (a box whose NMS neighbour swapped rank).
    "fp32": Budget(max_rel=1e-3, min_cosine=0.99999, min_top1=0.999, min_detections=0.999),
    "fp16": Budget(max_rel=2e-2, min_cosine=0.999, min_top1=0.99, min_detections=0.98),
    "bf16": Budget(max_rel=5e-2, min_cosine=0.995, min_top1=0.98, min_detections=0.97),
    # W8A8 (warpforge-int8): every int8 layer adds ~0.4% (127 levels) of noise to its input, and the error
    # compounds with depth. MobileNetV2 with its ImageNet weights, calibrated on 6 bundled photos and
    # checked on 104 views of all 13 (CPU reference kernels): max_rel 0.07-0.12 and worst
    # per-sample cosine 0.979-0.988 across the max/percentile/MSE observers. The bars leave headroom
    # (0.2, 0.95) for other nets and calibration sets while rejecting a broken scale (cosine << 0.9).
    # Top-1 is the bar, 0.99, over samples whose fp32 decision is not a coin toss: a reference
    # whose two best classes are within 0.01 of probability (one of the 13 photos: 0.2455 vs 0.2441)
    # flips under any perturbation, fp16's included; such samples are counted in top1_ties, not judged.
    "int8": Budget(max_rel=0.2, min_cosine=0.95, min_top1=0.99, top1_tie=0.01, min_detections=0.95),
    # FP8 (warpforge-fp8): e4m3 keeps 3 mantissa bits, so each weight and each input value rounds by up to
    # 6.25% of itself (a per-channel / per-tensor scale only places the range); a layer's output error is a
    # few percent. Measured on CPU (the fp8 GEMM's torch reference on the same e4m3 operands, fp32 elsewhere),
    # max-calibrated static scales: the zoo planner (random xavier weights, 51 of its 55 linears in e4m3, 4
    # scenes) max_rel 0.13, worst cosine 0.994 (per-row dynamic scales: 0.125, 0.995); ViT-B/16 (random) 0.105,
    # 0.9955. The int8 bars fit the same noise level: headroom for the GPU's fp16 layers and other nets, while a
    # broken scale (cosine << 0.9) is rejected.
    "fp8": Budget(max_rel=0.2, min_cosine=0.95, min_top1=0.99, top1_tie=0.01, min_detections=0.95),
    # Weight-only int8 (warpforge-w8): per-channel int8 weights, each within half a step (0.4% of its row's
    # absmax); activations stay 16-bit. Measured as above (CPU references, fp32 activations): planner max_rel
    # 0.017, cosine 0.99995; ViT-B/16 0.012, 0.99992; MobileNetV2's ImageNet head on the 7 bundled views
    # 0.003 with top-1 kept. On the GPU the fp16 activations add fp16's own error (its bars: 0.02, 0.999), so:
    # max_rel 0.05 and cosine 0.998, fp16's bars plus about twice the measured weight error.
    "w8": Budget(max_rel=0.05, min_cosine=0.998, min_top1=0.99, top1_tie=0.01, min_detections=0.98),
    # Weight-only int4 (warpforge-w4, groups of 128, asymmetric): 16 levels per group, rounding noise about
    # 1/50 of a group's range per weight, ~10x w8's. Measured as above: planner max_rel 0.20 (trajectories) and
    # 0.23 (mode logits), worst cosine 0.951 (mode logits); ViT-B/16 0.21, 0.977; MobileNetV2's head alone
    # 0.028, 0.9988, top-1 kept on its 6 decisive views. Random-weight transformers are a hard case (no trained
    # structure), but a budget that rejects the planner would make w4 useless where it is meant to pay: max_rel
    # 0.35 and cosine 0.9 admit that noise and still reject a wrong scale or group minimum (cosine near 0); top-1
    # 0.98 over decisive samples. Tighten it (budget=) where the task metric is known.
    "w4": Budget(max_rel=0.35, min_cosine=0.9, min_top1=0.98, top1_tie=0.01, min_detections=0.9),
}


@dataclass
class Accuracy:
    """What :func:`compare` measured; ``errors`` are structural failures (NaN, shape, dtype, ...)."""

    max_abs: float = 0.0
    mean_abs: float = 0.0
    max_rel: float = 0.0
    min_cosine: float = 1.0
    top1: float | None = None          # classifiers only
    top1_ties: int = 0                 # near-tie samples left out of top1 (Budget.top1_tie)
    detections: float | None = None    # detectors only: fraction matched (optimize/detection.py)
    detection_ties: int = 0            # unmatched detections near the score floor, not judged
    metric: float | None = None        # the user metric's mean over batches
    metric_name: str | None = None
    n_values: int = 0                  # floating values compared
    n_samples: int = 0                 # samples behind top1
    errors: list[str] = field(default_factory=list)

    def passes(self, budget: Budget) -> tuple[bool, list[str]]:
        """(True, []) when every checked metric is within ``budget``; else False and one reason each."""
        reasons = list(self.errors)
        if not reasons:
            checks = [("max_abs", self.max_abs, budget.max_abs, "<="), ("max_rel", self.max_rel, budget.max_rel, "<="),
                      ("cosine", self.min_cosine, budget.min_cosine, ">="), ("top1", self.top1, budget.min_top1, ">="),
                      ("detections", self.detections, budget.min_detections, ">="),
                      (self.metric_name or "metric", self.metric, budget.metric_min, ">="),
                      (self.metric_name or "metric", self.metric, budget.metric_max, "<=")]
            for name, got, bar, op in checks:
                if bar is None or (got is None and name in ("top1", "detections")):
                    continue  # top1 is only measured for classifiers, detections for detectors
                if got is None or not math.isfinite(got) or (got > bar if op == "<=" else got < bar):
                    reasons.append(f"{name} {_fmt(got)} (budget {op} {_fmt(bar)})")
        return not reasons, reasons

    def as_dict(self) -> dict[str, Any]:
        d = {"max_abs": self.max_abs, "mean_abs": self.mean_abs, "max_rel": self.max_rel,
             "min_cosine": self.min_cosine, "top1": self.top1, "top1_ties": self.top1_ties, "n_values": self.n_values,
             "n_samples": self.n_samples, "errors": list(self.errors)}
        if self.detections is not None:
            d.update(detections=self.detections, detection_ties=self.detection_ties)
        if self.metric_name is not None:
            d[self.metric_name] = self.metric
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.6g}"


def leaves(out: Any, path: str = "out") -> list[tuple[str, Any]]:
    """(path, leaf) pairs of a nested tuple/list/dict output, in a stable order."""
    if isinstance(out, (tuple, list)):
        return [p for i, x in enumerate(out) for p in leaves(x, f"{path}[{i}]")]
    if isinstance(out, dict):
        return [p for k in out for p in leaves(out[k], f"{path}[{k!r}]")]
    return [(path, out)]


def _classifier_leaf(out: Any) -> torch.Tensor | None:
    if isinstance(out, dict) and isinstance(out.get("logits"), torch.Tensor):
        return out["logits"]
    for _, x in leaves(out):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 2:
            return x
    return None


def _structure(out: Any) -> Any:
    if isinstance(out, (tuple, list)):
        return (type(out).__name__, tuple(_structure(x) for x in out))
    if isinstance(out, dict):
        return ("dict", tuple((k, _structure(v)) for k, v in out.items()))
    return "tensor" if isinstance(out, torch.Tensor) else type(out).__name__


class _Tally:
    """Running sums over batches and leaves."""

    def __init__(self) -> None:
        self.acc = Accuracy()
        self.abs_sum = 0.0
        self.top1_hits = 0

    def leaf(self, path: str, ref: Any, cand: Any) -> None:
        a = self.acc
        if not isinstance(ref, torch.Tensor):
            if ref != cand:
                a.errors.append(f"{path}: non-tensor output {cand!r} differs from the reference's {ref!r}")
            return
        if not isinstance(cand, torch.Tensor):
            a.errors.append(f"{path}: candidate returned {type(cand).__name__}, the reference a tensor")
            return
        if cand.shape != ref.shape:
            a.errors.append(f"{path}: shape {tuple(cand.shape)}, the reference has {tuple(ref.shape)}")
            return
        if not ref.is_floating_point():
            if cand.dtype != ref.dtype or not torch.equal(cand.cpu(), ref.cpu()):
                a.errors.append(f"{path}: {ref.dtype} output differs from the reference (must match exactly)")
            return
        if not cand.is_floating_point():
            a.errors.append(f"{path}: dtype {cand.dtype}, the reference is {ref.dtype}")
            return
        r, c = ref.detach().double().cpu(), cand.detach().double().cpu()
        finite = torch.isfinite(r)
        bad = int((~torch.isfinite(c) & finite).sum())
        if bad:
            kinds = "NaN" if bool(torch.isnan(c).any()) else "inf"
            a.errors.append(f"{path}: {bad} non-finite value(s) ({kinds}) where the reference is finite")
            return
        if not bool(finite.all()):  # compare only where the reference is defined, and its NaN/inf must recur
            rn, cn = r[~finite], c[~finite]
            if not all(torch.equal(f(rn), f(cn)) for f in (torch.isnan, torch.isposinf, torch.isneginf)):
                a.errors.append(f"{path}: the reference's non-finite values are not reproduced")
                return
            r, c = torch.where(finite, r, 0.0), torch.where(finite, c, 0.0)
        if r.numel() == 0:
            return
        err = (c - r).abs()
        peak = r.abs().max().item()
        a.max_abs = max(a.max_abs, err.max().item())
        worst = err.max().item()
        a.max_rel = max(a.max_rel, worst / peak if peak > 0 else (0.0 if worst == 0 else math.inf))
        self.abs_sum += err.sum().item()
        a.n_values += r.numel()
        rows_r, rows_c = (r.reshape(r.shape[0], -1), c.reshape(c.shape[0], -1)) if r.dim() >= 2 else (r[None], c[None])
        a.min_cosine = min(a.min_cosine, _min_cosine(rows_r, rows_c))

    def top1(self, ref: Any, cand: Any, tie: float | None = None) -> None:
        r, c = _classifier_leaf(ref), _classifier_leaf(cand)
        if r is None:
            self.acc.errors.append("kind='classifier' but the reference output has no floating tensor of >= 2 dims")
            return
        if c is None or c.shape != r.shape:
            return  # the leaf comparison already reported it
        hits = (r.argmax(-1).cpu() == c.argmax(-1).cpu())
        if tie is not None and r.shape[-1] >= 2:
            p = torch.softmax(r.detach().double().cpu(), dim=-1).topk(2, dim=-1).values
            decisive = (p[..., 0] - p[..., 1]) >= tie
            self.acc.top1_ties += int((~decisive).sum())
            hits = hits[decisive]
        self.top1_hits += int(hits.sum())
        self.acc.n_samples += hits.numel()


def _min_cosine(r: torch.Tensor, c: torch.Tensor) -> float:
    """Worst row cosine; a zero row matches only a zero row (cosine 1), else 0."""
    nr, nc = r.norm(dim=1), c.norm(dim=1)
    dot = (r * c).sum(dim=1)
    cos = torch.where((nr > 0) & (nc > 0), dot / (nr * nc).clamp_min(1e-300), ((nr == 0) & (nc == 0)).double())
    return float(cos.clamp(-1.0, 1.0).min())


def compare(reference_outputs: Any, candidate_outputs: Any, kind: str = "generic", *, batched: bool = False,
            budget: Budget | None = None) -> Accuracy:
    """Accuracy of ``candidate_outputs`` against ``reference_outputs`` (see the module docstring).

    ``batched=True``: both are sequences with one model output per validation batch. ``budget`` supplies
    the user metric (when it has one).
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    refs: Sequence[Any] = reference_outputs if batched else [reference_outputs]
    cands: Sequence[Any] = candidate_outputs if batched else [candidate_outputs]
    if batched and len(refs) != len(cands):
        raise ValueError(f"batched compare: {len(refs)} reference outputs but {len(cands)} candidate outputs")
    t = _Tally()
    metric_values = []
    det = Matching() if kind == "detection" else None
    score_tol = budget.max_rel if budget is not None and budget.max_rel is not None else DEFAULT_BUDGETS["fp16"].max_rel
    for i, (ref, cand) in enumerate(zip(refs, cands)):
        prefix = f"val[{i}]." if batched and len(refs) > 1 else ""
        if det is not None:
            if not is_detection_output(ref):
                t.acc.errors.append("kind='detection' but the reference output is not a list of "
                                    "{boxes, scores, labels} dicts")
                break
            t.acc.errors += match(ref, cand, score_tol, det, prefix)
        elif _structure(ref) != _structure(cand):
            t.acc.errors.append(f"{prefix}output structure {_structure(cand)} differs from the reference's "
                                f"{_structure(ref)}")
            continue
        else:
            for (path, r), (_, c) in zip(leaves(ref), leaves(cand)):
                t.leaf(prefix + path, r, c)
        if kind == "classifier":
            t.top1(ref, cand, budget.top1_tie if budget is not None else None)
        if budget is not None and budget.metric is not None:
            try:
                metric_values.append(float(budget.metric(ref, cand)))
            except Exception as e:  # noqa: BLE001 - user code: its failure is this candidate's failure
                t.acc.errors.append(f"{prefix}user metric {budget.metric_name!r} raised {type(e).__name__}: {e}")
    acc = t.acc
    acc.mean_abs = t.abs_sum / acc.n_values if acc.n_values else 0.0
    if kind == "classifier" and acc.n_samples:
        acc.top1 = t.top1_hits / acc.n_samples
    if det is not None:
        acc.detections = det.fraction if det.fraction is not None else 1.0  # nothing decisive: nothing lost
        acc.detection_ties = det.ties
        if det.ref_rows:  # the element-wise metrics over the matched pairs' boxes and scores
            t.leaf("matched detections", torch.stack(det.ref_rows), torch.stack(det.cand_rows))
            acc.mean_abs = t.abs_sum / acc.n_values
    if budget is not None and budget.metric is not None:
        acc.metric_name = budget.metric_name
        acc.metric = sum(metric_values) / len(metric_values) if metric_values else None
    return acc


__all__ = ["Accuracy", "Budget", "DEFAULT_BUDGETS", "DEFAULT_PRECISIONS", "DTYPES", "KINDS", "PRECISIONS", "compare",
           "leaves"]
