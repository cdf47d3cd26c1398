"""``optimize(model, example_inputs)``: try every candidate, gate each on accuracy, time the survivors,
return the fastest passing one.

    opt = warpforge.optimize(model, (x,))          # or warpforge.optimize.optimize(...)
    y = opt(x)                                      # runs the winner
    opt.report["winner"], opt.save("out/resnet")   # report dict; manifest + model + report files

The hot path, in order: check the model runs -> reference outputs on the validation inputs -> for each
candidate: build, run on every validation input, gate -> time the passing ones together (single
stream, then offline) -> pick the lowest p50 latency. A candidate that fails to build or run is
recorded as failed with its exception; it never stops the run. When none passes, :class:`NoCandidateError`
carries the report that says why each was rejected.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from warpforge._factory import accepts
from warpforge.results.ratio import Side, same_work_ratio
from warpforge.timing import NOISE_BOUND
from warpforge.optimize.backends import REFERENCE, Built, Candidate, forget_pipelines, select
from warpforge.optimize.capture import METHODS as CAPTURE_METHODS
from warpforge.optimize.gate import DEFAULT_BUDGETS, DEFAULT_PRECISIONS, KINDS, PRECISIONS, Budget, compare
from warpforge.optimize.logs import error_text, first_line
from warpforge.optimize.latency import PeakMemory, offline, single_stream_stable
from warpforge.optimize.regions import forget_plans
from warpforge.optimize.report import make_report
from warpforge.optimize.shapes import ShapeError, ShapeSpec
from warpforge.optimize.shapes import parse as parse_shapes
from warpforge.optimize.saved import save as save_winner

Progress = Callable[[str, int, int], None]  # (what is happening, steps done, steps in all)
N_RANDOM_VAL = 3  # fresh random inputs added to example_inputs when no val set is given
# On CUDA, a candidate that a passing one of the same family makes pointless (unless exhaustive=True):
# fp32 runs the same pipeline as fp16/bf16 with twice the bytes and without 16-bit tensor cores, so it can
# only be slower; bf16 runs the same kernels as fp16 at the same bytes and tensor-core rate with 3 fewer
# mantissa bits, so it is no faster and no more accurate. The 16-bit candidates are built first so that
# these are known before the slower ones would be built (on a fresh GPU a warpforge build is dominated by
# kernel tuning: MobileNetV2's fp32 build took 84 s there, its fp16 build 24 s).
DOMINATED_BY = {"fp32": ("fp16", "bf16"), "bf16": ("fp16",)}
BUILD_ORDER = {"fp16": 0, "bf16": 1, "fp32": 2}


class OptimizeError(ValueError):
    """The run could not produce a model; ``report`` says what happened."""

    def __init__(self, message: str, report: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.report = report


class BadInputError(OptimizeError):
    """The model, its inputs or the settings are unusable (the CLI exits 2)."""


class NoCandidateError(OptimizeError):
    """No candidate met the accuracy budget (the CLI exits 1); the report lists each rejection."""


class Optimized:
    """The winning candidate: call it like the original model. ``report`` is the full run's report."""

    def __init__(self, candidate: Candidate, built: Built, report: dict[str, Any], example_inputs: tuple,
                 kind: str, shapes: ShapeSpec | None = None) -> None:
        self.name = candidate.name
        self.family = candidate.family
        self.precision = candidate.precision
        self.built = built
        self.report = report
        self.example_inputs = example_inputs
        self.kind = kind
        self.shapes = shapes  # the captured shapes and declared dynamic dims: each call is checked against them

    @property
    def module(self) -> nn.Module | None:
        """The winner's module before compilation or graph capture (what ``save`` stores)."""
        return self.built.module

    def __call__(self, *args: Any) -> Any:
        if self.shapes is not None:
            self.shapes.check(args)  # ShapeError: one line naming the dim, its size and the declared range
        with torch.no_grad():
            return self.built.fn(*args)

    def save(self, directory: str | Path) -> Path:
        """Write manifest.json, the model, a check set and report.json/report.html under ``directory``."""
        return save_winner(self, directory)

    def __repr__(self) -> str:
        return f"Optimized({self.name!r}, report winner={self.report.get('winner')!r})"


def _as_inputs(x: Any, what: str) -> tuple:
    if isinstance(x, torch.Tensor):
        return (x,)
    if isinstance(x, (tuple, list)):
        return tuple(x)
    raise BadInputError(f"{what} must be a tensor or a tuple of the forward's arguments, got {type(x).__name__}")


def _to(inputs: tuple, device: torch.device) -> tuple:
    return tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)


def _resolve_device(device: Any, model: nn.Module, inputs: tuple) -> torch.device:
    if device is None:
        p = next(iter(model.parameters()), None)
        t = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
        return p.device if p is not None else t.device if t is not None else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise BadInputError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BadInputError(f"device {device!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise BadInputError(f"device must be cpu or cuda, got {device!r}")
    return dev


def _budgets(budget: Budget | Mapping[str, Budget] | None) -> dict[str, Budget]:
    """One budget per precision: the defaults, one budget for all, or a per-precision mapping."""
    if budget is None:
        return dict(DEFAULT_BUDGETS)
    if isinstance(budget, Budget):
        return {p: budget for p in PRECISIONS}
    if isinstance(budget, Mapping):
        bad = [k for k in budget if k not in PRECISIONS or not isinstance(budget[k], Budget)]
        if bad:
            raise BadInputError(f"budget mapping must be {{precision: Budget}} with precisions {PRECISIONS}; "
                                f"bad keys {bad}")
        return {p: budget.get(p, DEFAULT_BUDGETS[p]) for p in PRECISIONS}
    raise BadInputError("budget must be a Budget, a {precision: Budget} mapping or None, "
                        f"got {type(budget).__name__}")


def _random_like(inputs: tuple, gen: torch.Generator) -> tuple:
    """Fresh inputs of the same shapes and dtypes: normal floats; integers within the example's range."""
    out = []
    for x in inputs:
        if not isinstance(x, torch.Tensor):
            out.append(x)
        elif x.is_floating_point():
            out.append(torch.randn(x.shape, generator=gen).to(x.device, x.dtype))
        elif x.dtype == torch.bool:
            out.append(torch.randint(0, 2, x.shape, generator=gen).bool().to(x.device))
        elif x.numel():
            lo, hi = int(x.min()), int(x.max())
            out.append(torch.randint(lo, hi + 1, x.shape, generator=gen).to(x.device, x.dtype))
        else:
            out.append(x.clone())
    return tuple(out)


def _check_val(val: Iterable[Any], example: tuple, device: torch.device, what: str = "val",
               shapes: ShapeSpec | None = None) -> list[tuple]:
    """Each validation (or calibration) batch shaped like the example inputs (the batch dim may differ, and the
    dims ``shapes`` declares dynamic within their ranges)."""
    out = []
    for i, v in enumerate(val):
        v = _as_inputs(v, f"{what}[{i}]")
        if len(v) != len(example):
            raise BadInputError(f"{what}[{i}] has {len(v)} argument(s); the example inputs have {len(example)}")
        for j, (a, e) in enumerate(zip(v, example)):
            if isinstance(e, torch.Tensor):
                if not isinstance(a, torch.Tensor):
                    raise BadInputError(f"{what}[{i}] argument {j} is {type(a).__name__}; the example input is a "
                                        "tensor")
                if shapes is not None and shapes.declared:
                    try:
                        shapes.check(v)
                    except ShapeError as err:
                        raise BadInputError(f"{what}[{i}]: {err}") from None
                elif a.dim() != e.dim() or a.shape[1:] != e.shape[1:]:
                    raise BadInputError(f"{what}[{i}] argument {j} has shape {tuple(a.shape)}; the example input has "
                                        f"{tuple(e.shape)}: every dimension but the batch (dim 0) must match")
                if a.is_floating_point() != e.is_floating_point():
                    raise BadInputError(f"{what}[{i}] argument {j} has dtype {a.dtype}; the example input has "
                                        f"{e.dtype}")
        out.append(_to(v, device))
    if not out:
        raise BadInputError(f"{what} is empty: give at least one batch of inputs, or None for the default")
    return out


def _infer_kind(out: Any, inputs: tuple) -> str:
    """classifier when the output is one [N, C] floating tensor (C >= 2) with N the inputs' batch; detection
    when it is a list of per-image {boxes, scores, labels} dicts (torchvision's detectors)."""
    from warpforge.optimize.detection import is_detection_output

    if is_detection_output(out):
        return "detection"
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() >= 1), None)
    if (isinstance(out, torch.Tensor) and out.is_floating_point() and out.dim() == 2 and out.shape[1] >= 2
            and first is not None and out.shape[0] == first.shape[0]):
        return "classifier"
    return "generic"


def _err(e: BaseException) -> str:
    """A candidate's failure, whole (report.json keeps every line; the table shows the first), no escape codes."""
    return error_text(e)


def _err1(e: BaseException) -> str:
    """The first line of a failure: what a one-line bad-input message carries."""
    return first_line(error_text(e))


def optimize(model: nn.Module, example_inputs: Any, *, val: Iterable[Any] | None = None,
             calib: Iterable[Any] | None = None,
             budget: Budget | Mapping[str, Budget] | None = None, precisions: Sequence[str] = DEFAULT_PRECISIONS,
             backends: Sequence[str] | None = None, kind: str | None = None, device: Any = None,
             progress: Progress | None = None, queries: int = 200, warmup: int = 20, offline_calls: int = 50,
             name: str | None = None, seed: int = 0, precision_fallback: bool = True,
             exhaustive: bool = False, capture: str = "auto", dynamic_shapes: Any = None) -> Optimized:
    """The fastest candidate whose outputs stay within ``budget`` of the fp32 model (module docstring).

    model: an ``nn.Module`` (a private fp32 eval-mode copy is used; the original is not modified).
    example_inputs: a tensor or tuple of forward arguments; latency is measured at their shapes.
    val: validation batches (each a tensor or tuple shaped like example_inputs, any batch size);
        default: example_inputs plus 3 fresh random inputs of the same shapes.
    calib: calibration batches for the int8 and fp8 candidates (shaped like val); default: the val batches
        the user gave (then the gate judges them on their own calibration data: pass calib for a held-out
        check), else example_inputs alone. Random inputs are never used to calibrate.
    budget: one :class:`Budget` for all, ``{precision: Budget}``, or None for the per-precision defaults.
    precisions / backends: which candidates (see ``backends.select``; "int8", "fp8" and the weight-only
        "w8" / "w4" are tried only when listed).
        kind: "classifier" adds top-1 agreement; "detection" matches detections (boxes, scores, labels)
        instead of comparing tensors; None infers it from the output. queries / warmup: single-stream
        protocol; offline_calls: back-to-back calls for throughput.
    precision_fallback: a fp16/bf16 warpforge candidate over budget gets the layers that put it there
        kept in fp32, found by bisection over its layers (``warpforge.optimize.precision``), and is gated
        again; warpforge-int8 over budget gets the fewest quantized layers found to need it kept in its
        float dtype (fp16 on CUDA, fp32 on CPU), searched over the layers ranked by the output's error with
        only that layer int8, and rebuilt without them. The search (layers kept, trials) is in the
        candidate's report record.
    exhaustive: build every selected candidate. By default, on CUDA, a non-eager candidate is skipped (its
        record says by which one) when a candidate of its family at a faster precision passed the gate
        with no layer kept at a higher precision: fp32 after fp16 or bf16, bf16 after fp16
        (``DOMINATED_BY``); 16-bit candidates are built first.
    capture: how the warpforge candidates capture the model: "auto" (torch.export, FX when export fails;
        the report's "capture" says which and why), "export" (a failed export fails those builds) or "fx".
    dynamic_shapes: input dims besides the batch that may vary, with their ranges (optimize.shapes):
        ``"x.2=128:512,x.3=128:512"``, ``{"x": {2: (128, 512)}}`` or torch.export's ``({2: Dim("H", min=128,
        max=512)},)``. They stay symbolic in the capture and ONNX export, the default validation set gains
        random inputs at both ends of the ranges, and the returned model (and a saved one) checks every call:
        a dim outside its range, or an undeclared one that differs from the example, raises ShapeError.
    """
    t_start = time.perf_counter()
    notes: list[str] = []
    if not isinstance(model, nn.Module):
        raise BadInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    inputs = _as_inputs(example_inputs, "example_inputs")
    if kind is not None and kind not in KINDS:
        raise BadInputError(f"kind must be one of {KINDS} or None, got {kind!r}")
    for arg, v in (("queries", queries), ("offline_calls", offline_calls)):
        if not isinstance(v, int) or v < 1:
            raise BadInputError(f"{arg} must be an integer >= 1, got {v!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise BadInputError(f"warmup must be an integer >= 0, got {warmup!r}")
    if capture not in CAPTURE_METHODS:
        raise BadInputError(f"capture must be one of {CAPTURE_METHODS}, got {capture!r}")
    dev = _resolve_device(device, model, inputs)
    try:
        shapes = parse_shapes(dynamic_shapes, model, inputs)
    except ValueError as e:
        raise BadInputError(str(e)) from None
    budgets = _budgets(budget)
    try:
        plan = select(dev, list(precisions), list(backends) if backends is not None else None)
    except ValueError as e:
        raise BadInputError(str(e)) from None
    if model.training:
        notes.append("the model was in training mode; it is optimized for inference (eval mode)")
    try:
        base = copy.deepcopy(model).float().eval().to(dev)
    except Exception as e:  # noqa: BLE001 - user models can refuse deepcopy or the device
        raise BadInputError(f"could not copy the model to {dev} in fp32: {_err1(e)}") from e
    inputs = _to(inputs, dev)
    model_info = {"name": name or type(model).__name__, "class": f"{type(model).__module__}.{type(model).__qualname__}",
                  "params": sum(p.numel() for p in base.parameters()),
                  "inputs": [{"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}
                             if isinstance(x, torch.Tensor) else {"value": repr(x)} for x in inputs]}
    settings = {"device": str(dev), "precisions": list(precisions), "backends": list(backends) if backends else None,
                "queries": queries, "warmup": warmup, "offline_calls": offline_calls, "capture": capture,
                "dynamic_shapes": shapes.describe() or None,
                "budgets": {p: b.as_dict() for p, b in budgets.items()}}

    def fail(cls: type[OptimizeError], message: str, records: list[dict[str, Any]] | None = None) -> OptimizeError:
        report = make_report(model_info, settings, records or [], None, status="bad_input"
                             if cls is BadInputError else "no_candidate", error=message, notes=notes,
                             elapsed_s=time.perf_counter() - t_start)
        return cls(message, report)

    # 1. The model must run on its example inputs (the reference candidate is the model in fp32).
    ref_cand = next(c for c, _ in plan if c.name == REFERENCE)
    try:
        ref = ref_cand.build(base, inputs)
        with torch.no_grad():
            ref_example_out = ref(*inputs)
    except Exception as e:  # noqa: BLE001
        raise fail(BadInputError, f"the model does not run on its example inputs: {_err1(e)}") from e
    if kind is None:
        kind = _infer_kind(ref_example_out, inputs)
        model_info["kind_inferred"] = True
    model_info["kind"] = kind

    # 2. Reference outputs on the validation inputs.
    if val is None:
        gen = torch.Generator().manual_seed(seed)
        val_inputs = [inputs] + [_random_like(inputs, gen) for _ in range(N_RANDOM_VAL)]
        settings["val"] = f"example inputs + {N_RANDOM_VAL} random batches of the same shapes"
        if shapes.declared:  # judged across the declared ranges, not at the example's sizes alone
            val_inputs += shapes.at_ends(inputs, gen)
            settings["val"] += f" + 2 random batches at the ends of the dynamic ranges ({shapes.describe()})"
    else:
        try:
            val_inputs = _check_val(val, inputs, dev, shapes=shapes)
        except BadInputError as e:
            raise fail(BadInputError, str(e)) from None
        settings["val"] = f"{len(val_inputs)} user batch(es)"
    ref_outs = []
    for i, v in enumerate(val_inputs):
        try:
            with torch.no_grad():
                ref_outs.append(ref(*v))
        except Exception as e:  # noqa: BLE001
            if val is None and shapes.declared and i >= len(val_inputs) - 2:  # the inputs at_ends() added
                shown = [list(x.shape) for x in v if isinstance(x, torch.Tensor)]
                end = "min" if i == len(val_inputs) - 2 else "max"
                raise fail(BadInputError, f"the model does not run at the {end}"
                                          f" of its declared dynamic dims ({shapes.describe()}; input shapes {shown}): "
                                          f"{_err1(e)}") from e
            raise fail(BadInputError, f"the model does not run on val[{i}]: {_err1(e)}") from e

    # 3. Calibration inputs for the candidates that quantize activations at static scales (int8, fp8).
    calib_inputs = None
    calibrated = [c.name for c, skip in plan if c.needs_calib and skip is None]
    if calibrated:
        who = " and ".join(calibrated) + (" was" if len(calibrated) == 1 else " were")
        if calib is not None:
            try:
                calib_inputs = _check_val(calib, inputs, dev, what="calib", shapes=shapes)
            except BadInputError as e:
                raise fail(BadInputError, str(e)) from None
            settings["calib"] = f"{len(calib_inputs)} user calibration batch(es)"
        elif val is not None:
            calib_inputs = val_inputs
            settings["calib"] = f"the {len(val_inputs)} val batch(es) (no calib given)"
            notes.append(f"{who} calibrated on the validation batches the gate judges with (no calib= given): "
                         "pass calib= for a held-out accuracy check")
        else:
            calib_inputs = [inputs]
            settings["calib"] = "the example inputs (no calib or val given)"
            notes.append(f"{who} calibrated on the example inputs alone (no calib= or val= given); "
                         "the scales fit real data only if these are real data")

    # 4. Build, run and gate each candidate (records stay in the plan's order; on CUDA the 16-bit ones build first).
    todo = [c for c, skip in plan if skip is None]
    total, done = len(todo) + 1, 0
    records: list[dict[str, Any]] = []
    live: dict[str, tuple[Candidate, Built]] = {}
    for cand, skip in plan:
        records.append({"name": cand.name, "family": cand.family, "precision": cand.precision,
                        "about": cand.about, "eligible": cand.name != REFERENCE or backends is None
                        or "eager" in backends or REFERENCE in backends})
        if skip is not None:
            records[-1].update(status="skipped", reason=skip)
    prune = dev.type == "cuda" and not exhaustive
    for i in _build_order(plan, prune):
        cand, skip = plan[i]
        rec = records[i]
        if skip is not None:
            continue
        by = _dominated(cand, records) if prune else None
        if by is not None:
            rec.update(status="skipped", reason=f"not built: {by} passed the gate, and {cand.precision} in the "
                                                f"same pipeline cannot beat it ({_WHY[cand.precision]}; "
                                                "exhaustive=True / --exhaustive builds it)")
            done += 1
            continue
        if progress:
            progress(f"building {cand.name}", done, total)
        rec.update(_try(cand, base, inputs, val_inputs, ref_outs, kind, budgets[cand.precision], dev, live,
                        ref if cand.name == REFERENCE else None, calib_inputs, precision_fallback, capture,
                        shapes if shapes.declared else None))
        done += 1
    forget_pipelines(base)  # every candidate is built: the memoized pipeline graphs go back
    forget_plans(base)  # and the region plans (optimize.regions)
    # 5. Time the passing ones together, then offline throughput each; on a busy machine say so first.
    from warpforge.results.host import check_host

    host = check_host(dev)
    settings["host"] = host.as_dict()
    if host.warning:
        notes.append(host.warning)
    if progress:
        progress(f"timing {len(live)} passing candidate(s)", done, total)
    settings["timing_attempts"] = _time(live, records, inputs, dev, queries, warmup, offline_calls)
    noisy = [r["name"] for r in records if r.get("latency", {}).get("noisy")]
    if noisy:
        notes.append(f"noisy timings (spread above {NOISE_BOUND:.2f} after re-timing): {', '.join(noisy)}; "
                     "their speedups are given with their range across rounds")
    if progress:
        progress("done", total, total)
    ranked = sorted((r for r in records if r["status"] == "passed" and r["eligible"] and "latency" in r),
                    key=lambda r: r["latency"]["p50_ms"])
    winner = ranked[0]["name"] if ranked else None
    report = make_report(model_info, settings, records, winner, status="ok" if winner else "no_candidate",
                         notes=notes, elapsed_s=time.perf_counter() - t_start)
    if winner is None:
        raise NoCandidateError(report["why"], report)
    cand, built = live[winner]
    for n in [n for n in live if n != winner]:
        del live[n]  # the losers' memory goes back
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return Optimized(cand, built, report, inputs, kind, shapes)


_WHY = {"fp32": "twice the bytes, no 16-bit tensor cores", "bf16": "the same kernels, bytes and tensor-core rate "
                                                                  "as fp16, with 3 fewer mantissa bits"}


def _build_order(plan: list[tuple[Candidate, str | None]], prune: bool) -> list[int]:
    """Indices into ``plan`` in build order: as planned, or (pruning) 16-bit first, fp16 before bf16, fp32 last."""
    return sorted(range(len(plan)), key=lambda i: BUILD_ORDER.get(plan[i][0].precision, 0) if prune else 0)


def _dominated(cand: Candidate, records: list[dict[str, Any]]) -> str | None:
    """The passing candidate of ``cand``'s family that makes building it pointless (``DOMINATED_BY``), if any."""
    if cand.family == "eager" or cand.name == REFERENCE:
        return None
    for r in records:
        if (r.get("family") == cand.family and r.get("precision") in DOMINATED_BY.get(cand.precision, ())
                and r.get("status") == "passed" and "precision_fallback" not in r):  # passed as built
            return r["name"]
    return None


def _try(cand: Candidate, base: nn.Module, inputs: tuple, val_inputs: list[tuple], ref_outs: list[Any], kind: str,
         budget: Budget, dev: torch.device, live: dict[str, tuple[Candidate, Built]],
         prebuilt: Built | None, calib: list[tuple] | None = None, precision_fallback: bool = True,
         capture: str = "auto", shapes: ShapeSpec | None = None) -> dict[str, Any]:
    """Build and gate one candidate; its record fields. Keeps it in ``live`` when it passes."""
    rec: dict[str, Any] = {"budget": budget.as_dict()}
    options: dict[str, Any] = {"capture": capture} if cand.family == "warpforge" and accepts(cand.build, "capture") \
        else {}
    if shapes is not None and accepts(cand.build, "shapes"):
        options["shapes"] = shapes
    with PeakMemory(dev) as mem:
        t0 = time.perf_counter()
        try:
            if prebuilt is not None:
                built = prebuilt
            elif cand.needs_calib:
                built = cand.build(base, inputs, calib=calib, **options)
            else:
                built = cand.build(base, inputs, **options)
        except Exception as e:  # noqa: BLE001 - a candidate's failure is recorded, never fatal
            return {"status": "failed", "reason": f"build failed: {_err(e)}"}
        rec["build_s"] = time.perf_counter() - t0
        rec["cuda_graph"] = built.cuda_graph
        rec["details"] = built.details
        outs = []
        try:
            with torch.no_grad():
                for v in val_inputs:
                    outs.append(built(*v))
        except Exception as e:  # noqa: BLE001
            return {**rec, "status": "failed", "reason": f"run failed on val[{len(outs)}]: {_err(e)}"}
    rec["peak_memory_bytes"] = mem.bytes
    acc = compare(ref_outs, outs, kind, batched=True, budget=budget)
    ok, reasons = acc.passes(budget)
    rec["accuracy"] = acc.as_dict()
    if not ok:
        rejected = {**rec, "status": "rejected", "reason": "; ".join(reasons), "reasons": reasons}
        if precision_fallback and cand.family == "warpforge" and cand.precision in ("fp16", "bf16"):
            return fp32_fallback(cand, base, inputs, val_inputs, ref_outs, kind, budget, dev, live, built,
                                 rejected, capture, shapes)
        if precision_fallback and cand.family == "warpforge" and cand.precision == "int8" and calib:
            return int8_fallback(cand, base, inputs, val_inputs, ref_outs, kind, budget, live, built, rejected,
                                 calib, capture, shapes)
        return rejected
    live[cand.name] = (cand, built)
    return {**rec, "status": "passed", "reason": "within budget"}


def fp32_fallback(cand: Candidate, base: nn.Module, inputs: tuple, val_inputs: list[tuple],
                      ref_outs: list[Any], kind: str, budget: Budget, dev: torch.device,
                      live: dict[str, tuple[Candidate, Built]], built: Built, rejected: dict[str, Any],
                      capture: str = "auto", shapes: ShapeSpec | None = None) -> dict[str, Any]:
    """Per-layer precision fallback (``optimize.precision``): a 16-bit warpforge candidate over budget keeps
    the layers the bisection finds in fp32 and is gated again; the search is recorded either way."""
    from warpforge.optimize.backends import _maybe_graph, _pipeline, layer_precisions
    from warpforge.optimize.capture import EXPORT, FX
    from warpforge.optimize.pipeline import float_passes
    from warpforge.optimize.precision import layer_names, search, with_fp32_layers
    from warpforge.optimize.runtime import CastIO

    low = getattr(built, "module", None)
    if not isinstance(low, CastIO):
        return {**rejected, "precision_fallback": {"note": "not a cast pipeline module: no per-layer fallback"}}
    dtype = low.dtype
    try:
        # The fp32 twins must sit at the same module paths: capture them the way the 16-bit graph was, and run
        # the candidate's passes.
        method = {EXPORT: "export", FX: "fx"}.get(built.details.get("capture", {}).get("method"), capture)
        gm32, _ = _pipeline(base, inputs, torch.float32, method, float_passes(), shapes)
        names = layer_names(low.inner)
    except Exception as e:  # noqa: BLE001 - the fallback is an extra: its failure leaves the rejection as it was
        return {**rejected, "precision_fallback": {"note": f"not attempted: {_err(e)}"}}

    def run(kept: list[str]) -> list[Any]:
        mod = CastIO(with_fp32_layers(low.inner, gm32, kept, dtype), dtype).eval()
        with torch.no_grad():
            return [mod(*v) for v in val_inputs]

    def passes(kept: list[str]) -> tuple[bool, str]:
        ok, reasons = compare(ref_outs, run(kept), kind, batched=True, budget=budget).passes(budget)
        return ok, "; ".join(reasons)

    try:
        found = search(names, passes)
    except Exception as e:  # noqa: BLE001
        return {**rejected, "precision_fallback": {"note": f"search failed: {_err(e)}"}}
    info = found.as_dict()
    if not found.kept:
        return {**rejected, "precision_fallback": info}
    mod = CastIO(with_fp32_layers(low.inner, gm32, found.kept, dtype), dtype).eval()
    details = {**built.details, "layers": layer_precisions(mod), "precision_fallback": info}
    details["fallbacks"] = list(built.details.get("fallbacks", [])) + [
        {"what": name, "reason": f"kept fp32: {cand.precision} put the model over budget "
                                 f"({rejected['reason']}); bisection over {len(names)} layers"} for name in found.kept]
    fn, graphed = _maybe_graph(mod, inputs, details)
    fixed = Built(fn=fn, module=mod, save_format=built.save_format, cuda_graph=graphed, details=details)
    return _regate(cand, fixed, val_inputs, ref_outs, kind, budget, live, rejected, info,
                   f"within budget with {len(found.kept)} of {len(names)} layers kept fp32 (per-layer fallback)")


def int8_fallback(cand: Candidate, base: nn.Module, inputs: tuple, val_inputs: list[tuple], ref_outs: list[Any],
                  kind: str, budget: Budget, live: dict[str, tuple[Candidate, Built]], built: Built,
                  rejected: dict[str, Any], calib: list[tuple], capture: str = "auto",
                  shapes: ShapeSpec | None = None) -> dict[str, Any]:
    """Per-layer float fallback of warpforge-int8 over budget: the fewest quantized layers found to need it
    are kept in the candidate's float dtype (fp16 on CUDA, fp32 on CPU) and the candidate is rebuilt
    without them (``backends.int8_builder``); the search is recorded either way.

    The layers are ranked by sensitivity: the model output's relative error on the calibration inputs
    with only that layer int8 (one rebuild per layer on the calibration set, which quantize_model measures
    anyway: ``output_rel_err``), worst first; by each layer's own error (``rel_err``) when the output is
    not a tensor. On MobileNetV2 the two orders differ a lot: an expansion conv with the smallest own
    error (0.0035) moves the logits by 4%, more than any other layer. ``precision.search_ranked`` then
    finds the shortest passing prefix; each trial requantizes the pipeline graph with those layers float
    and runs the validation batches (no CUDA graph), stopping after the first batch from which the budget
    is missed for certain (:func:`_already_over`). Shorter prefixes of the kept layers are then tried with
    bias correction (``precision.shorten_prefix``: one trial when the one-shorter prefix fails), and a
    shorter one that passes is the result (the correction is recorded under
    ``precision_fallback.bias_correction``): on ResNet-50 that keeps fewer layers float, while building every
    int8 candidate with bias correction made the search on the real MobileNetV2 keep more (figures in
    benchmarks/notes/optimize.md). The
    trial build that passed is the one returned; where it can replay as a CUDA graph it is captured and gated
    again as it will run."""
    from warpforge.optimize.backends import _maybe_graph, int8_builder
    from warpforge.optimize.precision import search_ranked, shorten_prefix

    quant = built.details.get("quant") or {}
    layers = [layer for layer in quant.get("layers", []) if layer.get("name")]
    if not layers:
        return {**rejected, "precision_fallback": {"note": "no named int8 layer: no per-layer fallback"}}
    names = [layer["name"] for layer in layers]
    float_dtype = quant.get("float_dtype", "float")
    try:
        rebuild = int8_builder(base, inputs, calib, quant.get("observer", "max"), capture, shapes)
        sensitivity = {}
        for name in names:  # only this layer int8: its effect on the output (calibration inputs)
            alone = rebuild({n: "sensitivity probe" for n in names if n != name}, graph=False)
            sensitivity[name] = alone.details["quant"]["output_rel_err"]
    except Exception as e:  # noqa: BLE001 - the fallback is an extra: its failure leaves the rejection as it was
        return {**rejected, "precision_fallback": {"note": f"not attempted: {_err(e)}"}}
    if all(v is not None for v in sensitivity.values()):
        score, ranked_by = sensitivity, "the output's error with only that layer int8 (calibration inputs)"
    else:
        score = {layer["name"]: layer["rel_err"] for layer in layers}
        ranked_by = "their own int8 error (rel_err, calibration inputs)"
    ranked = sorted(names, key=lambda n: -score[n])

    def why(name: str) -> str:
        return (f"kept {float_dtype} by the accuracy fallback: with every layer int8 the model was over budget "
                f"({rejected['reason']}); the search over the layers ranked by {ranked_by} (this one: "
                f"{score[name]:.3g}) found it needed")

    passed: dict[frozenset[str], tuple[Built, Any]] = {}  # each passing trial's build and accuracy

    decisive = compare(ref_outs, ref_outs, kind, batched=True, budget=budget).n_samples  # what top-1 judges

    def passes(kept: list[str], bias_correction: bool = False) -> tuple[bool, str]:
        trial = rebuild({n: why(n) for n in kept}, graph=False, bias_correction=bias_correction)
        outs = []
        with torch.no_grad():
            for i, v in enumerate(val_inputs):
                outs.append(trial(*v))
                if i + 1 < len(val_inputs):  # a miss the remaining batches cannot undo ends the trial early
                    part = compare(ref_outs[:i + 1], outs, kind, batched=True, budget=budget)
                    if _already_over(part, budget, decisive):
                        why_not = "; ".join(part.passes(budget)[1]) or f"top-1 misses exceed what {decisive} allow"
                        return False, f"{why_not} (stopped after {i + 1} of {len(val_inputs)} val batches)"
        acc = compare(ref_outs, outs, kind, batched=True, budget=budget)
        ok, reasons = acc.passes(budget)
        if ok:
            passed[(frozenset(kept), bias_correction)] = (trial, acc)
        return ok, "; ".join(reasons)

    try:
        found = search_ranked(ranked, passes, kept_as="float", ranked_by=ranked_by)
    except Exception as e:  # noqa: BLE001
        return {**rejected, "precision_fallback": {"note": f"search failed: {_err(e)}"}}
    info = {**found.as_dict(), "float_dtype": float_dtype, "ranked_by": ranked_by,
            "ranked": [{"layer": n, "score": score[n]} for n in ranked]}
    if not found.kept:
        return {**rejected, "precision_fallback": info}
    kept, corrected = found.kept, False
    try:  # fewer layers float with the weight rounding's mean shift corrected?
        short = shorten_prefix(found.kept, lambda k: passes(k, bias_correction=True), kept_as="float")
    except Exception as e:  # noqa: BLE001 - an extra: its failure leaves the search's result as it was
        info["bias_correction"] = {"chosen": False, "note": f"failed: {_err(e)}"}
    else:
        info["bias_correction"] = {**short.as_dict(), "chosen": short.kept is not None}
        if short.kept is not None:
            kept, corrected = short.kept, True
            info["kept_float"] = kept
            info["note"] = f"{found.note}; with bias correction {short.note}"
    # The searches end on a set that passed: the build that passed is the one returned (never a rebuild).
    fixed, acc = passed[(frozenset(kept), corrected)]
    passed.clear()  # the other passing trials' models go back
    if not fixed.details["quant"]["layers"]:
        info["note"] = (f"{found.note}: within budget only with every int8 layer kept {float_dtype}, which leaves "
                        "no int8 candidate (the float pipeline is its own candidate)")
        return {**rejected, "precision_fallback": info}
    fixed.details["precision_fallback"] = info
    reason = (f"within budget with {len(kept)} of {len(ranked)} int8 layers kept {float_dtype} "
              f"(per-layer fallback{', bias-corrected calibration' if corrected else ''})")
    fn, graphed = _maybe_graph(fixed.module, inputs, fixed.details)
    if graphed:  # replayed as a CUDA graph: gated again as it will run
        fixed = Built(fn=fn, module=fixed.module, save_format=fixed.save_format, cuda_graph=True,
                      details=fixed.details)
        return _regate(cand, fixed, val_inputs, ref_outs, kind, budget, live, rejected, info, reason)
    rec = {**rejected, "accuracy": acc.as_dict(), "details": fixed.details, "cuda_graph": False,
           "precision_fallback": info, "accuracy_all_low_precision": rejected["accuracy"]}
    rec.pop("reasons", None)
    live[cand.name] = (cand, fixed)
    return {**rec, "status": "passed", "reason": reason}


def _already_over(part: Any, budget: Budget, decisive: int) -> bool:
    """True when the accuracy of the first val batches already misses a bar that more batches cannot bring
    back: an output error, max_abs / max_rel over (they only grow), the worst cosine under (it only
    drops), or more top-1 misses than ``decisive`` samples in all allow. The user metric (a mean) never
    ends a trial early."""
    if part.errors:
        return True
    if budget.max_abs is not None and part.max_abs > budget.max_abs:
        return True
    if budget.max_rel is not None and part.max_rel > budget.max_rel:
        return True
    if budget.min_cosine is not None and part.min_cosine < budget.min_cosine:
        return True
    if budget.min_top1 is not None and part.top1 is not None:
        misses = part.n_samples - round(part.top1 * part.n_samples)
        return misses > (1 - budget.min_top1) * decisive + 1e-9
    return False


def _regate(cand: Candidate, fixed: Built, val_inputs: list[tuple], ref_outs: list[Any], kind: str, budget: Budget,
            live: dict[str, tuple[Candidate, Built]], rejected: dict[str, Any], info: dict[str, Any],
            passed_reason: str) -> dict[str, Any]:
    """Gate a fallback's final build (as it will run: graphed where it can be); live when it passes."""
    with torch.no_grad():
        outs = [fixed(*v) for v in val_inputs]
    acc = compare(ref_outs, outs, kind, batched=True, budget=budget)
    ok, reasons = acc.passes(budget)
    rec = {**rejected, "accuracy": acc.as_dict(), "details": fixed.details, "cuda_graph": fixed.cuda_graph,
           "precision_fallback": info, "accuracy_all_low_precision": rejected["accuracy"]}
    if not ok:  # the final build disagrees with the search's trials: keep the rejection, say so
        return {**rec, "status": "rejected", "reason": "; ".join(reasons), "reasons": reasons}
    rec.pop("reasons", None)
    live[cand.name] = (cand, fixed)
    return {**rec, "status": "passed", "reason": passed_reason}


def _time(live: dict[str, tuple[Candidate, Built]], records: list[dict[str, Any]], inputs: tuple,
          dev: torch.device, queries: int, warmup: int, offline_calls: int) -> int:
    """Single-stream latency of every live candidate (interleaved, re-timed while noisy), then offline
    throughput each; speedups against eager-fp32 and the fastest torch.compile candidate, each through the
    ratio rule of warpforge.results.ratio (both passed their gate) with its range across rounds. Returns the
    timing attempts."""
    by_name = {r["name"]: r for r in records}
    fns = {n: b.fn for n, (_, b) in live.items()}
    attempts = 1
    try:
        lat, attempts = single_stream_stable(fns, inputs, queries=queries, warmup=warmup, device=dev)
    except Exception:  # noqa: BLE001 - find which one failed: time them one by one
        lat = {}
        for n, fn in list(fns.items()):
            try:
                lat[n] = single_stream_stable({n: fn}, inputs, queries=queries, warmup=warmup, device=dev)[0][n]
            except Exception as e:  # noqa: BLE001
                by_name[n].update(status="failed", reason=f"timing failed: {_err(e)}")
                del live[n]
    for n, stats in lat.items():
        by_name[n]["latency"] = stats.as_dict()
        try:
            by_name[n]["throughput"] = offline(live[n][1].fn, inputs, calls=offline_calls,
                                               warmup=min(warmup, 5), device=dev).as_dict()
        except Exception as e:  # noqa: BLE001
            by_name[n].update(status="failed", reason=f"offline timing failed: {_err(e)}")
            del live[n]
    eager = by_name.get(REFERENCE)
    compiled = [r for r in records if r["family"] == "torch.compile" and "latency" in r and r["status"] == "passed"]
    best_compile = min(compiled, key=lambda r: r["latency"]["p50_ms"]) if compiled else None
    for r in records:
        if "latency" not in r:
            continue
        for key, base in (("speedup_vs_eager", eager), ("speedup_vs_compile", best_compile)):
            if base is None or "latency" not in base:
                r[key] = None  # nothing of that kind was measured
                continue
            got = same_work_ratio(_side(r), _side(base))
            r[key] = got.value
            if got.interval is not None:
                r[f"{key}_range"] = list(got.interval)
            if got.value is None:
                r.setdefault("speedup_null", {})[key] = got.why
    return attempts


def _side(r: dict[str, Any]) -> Side:
    """A candidate as the ratio rule sees it: its p50, its round medians, whether it passed its gate."""
    lat = r["latency"]
    p50 = lat.get("p50_ms")
    ok = r.get("status") == "passed"
    return Side(ms=p50 if isinstance(p50, (int, float)) and math.isfinite(p50) else None, ok=ok,
                rounds_ms=tuple(lat.get("rounds_ms") or ()), check="" if ok else str(r.get("reason", ""))[:200])


__all__ = ["BadInputError", "NoCandidateError", "OptimizeError", "Optimized", "optimize"]
