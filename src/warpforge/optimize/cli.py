"""The ``warpforge optimize MODEL`` command: resolve the model, run the search, print and write the result.

MODEL is a zoo name (``warpforge.zoo.names()``) or ``path/to/file.py:factory`` (also
``package.module:factory``). The factory contract: ``factory()`` returns ``(model, example_inputs)``
or a dict ``{"model", "example_inputs", "kind", "val"}``; it may take ``batch`` and ``device``
keyword arguments, which get ``--batch`` and ``--device``.

Exit codes: 0 a model was chosen and saved; 1 no candidate met the budget (the report is still written);
2 bad input (unknown model, a factory or model that fails, bad settings), one clear line on stderr.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from warpforge._factory import call_factory, load_factory


class ModelError(ValueError):
    """MODEL cannot be resolved; the message says why and what works."""


@dataclass
class Resolved:
    name: str
    model: torch.nn.Module
    inputs: tuple
    kind: str | None = None
    val: list[tuple] | None = None
    notes: list[str] = field(default_factory=list)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-")[:80] or "model"


def _from_factory(spec: str, batch: int | None, device: torch.device) -> Resolved:
    where, _, attr = spec.rpartition(":")
    factory = load_factory(where, attr, ModelError, "_warpforge_optimize_")
    offered = {"device": device} if batch is None else {"batch": batch, "device": device}
    out, kwargs = call_factory(factory, offered, spec, ModelError)
    notes = [] if batch is None or "batch" in kwargs else [f"--batch {batch} ignored: the factory takes no 'batch'"]
    if isinstance(out, dict):
        model, inputs = out.get("model"), out.get("example_inputs", out.get("inputs"))
        kind, val = out.get("kind"), out.get("val")
    elif isinstance(out, tuple) and len(out) == 2:
        (model, inputs), kind, val = out, None, None
    else:
        raise ModelError(f"{spec}: the factory returned {type(out).__name__}; expected (model, example_inputs) or "
                         "a dict with 'model' and 'example_inputs'")
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"{spec}: the factory's model is {type(model).__name__}, expected a torch.nn.Module")
    if inputs is None:
        raise ModelError(f"{spec}: the factory returned no example inputs")
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return Resolved(spec, model, inputs, kind, list(val) if val is not None else None, notes)


# The zoo's kinds that top-1 agreement applies to; detectors, BEV and planners are compared as tensors.
_ZOO_KIND = {"classifier": "classifier"}


def _from_zoo(name: str, batch: int | None, device: torch.device, random_weights: bool) -> Resolved:
    forms = "a zoo name or path/to/file.py:factory"
    try:
        zoo = importlib.import_module("warpforge.zoo")
    except ImportError as e:
        raise ModelError(f"{name!r}: the model zoo (warpforge.zoo) cannot be imported ({e}); give {forms}") from e
    if not callable(getattr(zoo, "names", None)) or not callable(getattr(zoo, "get", None)):
        raise ModelError(f"{name!r}: the model zoo (warpforge.zoo) is not available yet; "
                         "give path/to/file.py:factory")
    available = list(zoo.names())
    if name not in available:
        raise ModelError(f"unknown model {name!r}; the zoo has: {', '.join(available) or '(nothing yet)'}; "
                         "or give path/to/file.py:factory")
    kwargs: dict[str, Any] = {"device": device}
    if batch is not None:
        kwargs["batch"] = batch
    if random_weights:
        kwargs["pretrained"] = False
    try:
        spec = zoo.get(name, **kwargs)
    except ImportError as e:
        raise ModelError(f"{name}: {e} (or pass --random-weights)") from e
    except Exception as e:
        raise ModelError(f"{name}: building it failed: {type(e).__name__}: {e}") from e
    val = None
    if callable(getattr(spec, "val_inputs", None)):
        try:
            val = list(spec.val_inputs())
        except Exception as e:
            raise ModelError(f"{name}: its validation inputs failed: {type(e).__name__}: {e}") from e
    kind = _ZOO_KIND.get(getattr(spec, "kind", ""), "generic")
    notes = [f"weights: {spec.weights}"] if getattr(spec, "weights", None) else []
    return Resolved(name, spec.model, tuple(spec.example_inputs), kind, val, notes)


def resolve(model: str, *, batch: int | None, device: torch.device, random_weights: bool = False) -> Resolved:
    """The model, example inputs, kind and validation inputs MODEL names."""
    if ":" in model and not re.match(r"^[A-Za-z]:[\\/]", model):
        return _from_factory(model, batch, device)
    return _from_zoo(model, batch, device, random_weights)


def _fmt(v: Any, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def print_table(report: dict[str, Any], console) -> None:
    """Candidates as a table (measured figures), then one line per candidate that did not pass, with why."""
    from rich import box
    from rich.table import Table

    t = Table(title=f"warpforge optimize: {report['model'].get('name', '')}", title_justify="left",
              box=box.SIMPLE_HEAD, pad_edge=False)
    detector = report["model"].get("kind") == "detection"
    last = "detections" if detector else "top-1"  # detectors: the fraction of detections matched
    for col in ("candidate", "status", "p50 ms", "p99 ms", "items/s", "×eager", "×compile", "max rel", last):
        t.add_column(col, justify="left" if col in ("candidate", "status") else "right",
                     no_wrap=col == "candidate")
    colors = {"passed": "green", "rejected": "yellow", "failed": "red", "skipped": "dim"}
    for r in report["candidates"]:
        lat, acc, thr = r.get("latency", {}), r.get("accuracy", {}), r.get("throughput", {})
        win = r["name"] == report.get("winner")
        t.add_row(("* " if win else "") + r["name"], f"[{colors[r['status']]}]{r['status']}[/]",
                  _fmt(lat.get("p50_ms"), ".4g"), _fmt(lat.get("p99_ms"), ".4g"), _fmt(thr.get("items_per_s"), ".1f"),
                  _fmt(r.get("speedup_vs_eager"), ".2f"), _fmt(r.get("speedup_vs_compile"), ".2f"),
                  _fmt(acc.get("max_rel"), ".0e"), _fmt(acc.get("detections" if detector else "top1"), ".3f"),
                  style="bold" if win else None)
    console.print(t)
    warning = (report.get("settings", {}).get("host") or {}).get("warning")
    if warning:  # the machine was busy when the candidates were timed
        from rich.markup import escape

        console.print(f"  [yellow]{escape(warning)}[/]", highlight=False, markup=True)
    noisy = [r["name"] for r in report["candidates"] if r.get("latency", {}).get("noisy")]
    if noisy:
        console.print(f"  [yellow]noisy timings[/] (spread across rounds or p80/p20 above the bound after re-timing): "
                      f"{', '.join(noisy)}", highlight=False, markup=True)
    from rich.markup import escape

    from warpforge.optimize.logs import first_line

    for r in report["candidates"]:
        if r["status"] != "passed":  # the reason's first line; report.json has all of it
            reason = first_line(str(r.get("reason", "")))
            more = " (more in report.json)" if reason != str(r.get("reason", "")).strip() else ""
            console.print(f"  [{colors[r['status']]}]{r['name']} {r['status']}[/]: {escape(reason)}{more}",
                          highlight=False, markup=True)
    print_regions(report, console)
    cap = report.get("capture") or {}
    if cap.get("method"):
        ops, kept = sum(cap.get("aten_ops", {}).values()), sum(cap.get("aten_kept", {}).values())
        line = f"  capture ({report.get('graph_of')}): {cap['method']}"
        line += f", {ops} ATen operator calls, {kept} left as plain ATen calls" if ops else ""
        # regions: the whole-model errors are the root's reason in the list above
        line += (f"; torch.export was not used: {cap['export_error']}" if cap.get("export_error")
                 and cap["method"] != "regions" else "")
        console.print(line, highlight=False, markup=False)


def print_regions(report: dict[str, Any], console) -> None:
    """When the whole model did not capture: each optimized region, then each part left eager and why."""
    reg = report.get("regions")
    if not reg:
        return
    console.print(f"  regions ({report.get('graph_of')}): the whole model did not capture; "
                  f"{len(reg['regions'])} region(s) optimized, {reg['optimized_fraction']:.1%} of the parameters"
                  + (f", {reg['time_share']['share']:.0%} of a call's time in them"
                     if (reg.get("time_share") or {}).get("share") is not None else ""),
                  highlight=False, markup=False)
    for r in reg["regions"]:
        console.print(f"    optimized  {r['path']}  ({r['params']:,} params, {r['calls']} call(s), "
                      f"{r['captured_by']})", highlight=False, markup=False)
    for e in reg["eager"]:
        console.print(f"    eager      {e['path']}: {e['reason']}", highlight=False, markup=False)


def _err(console, msg: str) -> int:
    """One line on ``console`` (stderr) for bad input; -> exit status 2."""
    from rich.markup import escape

    console.print(f"[bold red]warpforge optimize:[/] {escape(msg)}", highlight=False, soft_wrap=True)
    return 2


def rebatch(val: list[tuple], batch: int) -> list[tuple]:
    """The same validation samples in tuples of ``batch`` (the last one may be smaller): fewer, larger calls.
    ``val`` is returned as it is unless every entry is a tuple of tensors of one arity, batched on dim 0."""
    if batch < 1:
        raise ValueError(f"val_batch: expected >= 1, got {batch}")
    arity = {len(v) if isinstance(v, tuple) else -1 for v in val}
    if len(arity) != 1 or -1 in arity or not all(isinstance(x, torch.Tensor) and x.dim() >= 1 for v in val for x in v):
        return val
    cols = [torch.cat(col) for col in zip(*val)]
    return list(zip(*(c.split(batch) for c in cols)))


def cli_optimize(model: str, *, batch: int | None = None, device: str = "auto", precisions: tuple[str, ...] = (),
                 backends: tuple[str, ...] = (), max_abs: float | None = None, max_rel: float | None = None,
                 min_cosine: float | None = None, min_top1: float | None = None, queries: int = 200,
                 warmup: int = 20, out: str | None = None, json_out: bool = False, random_weights: bool = False,
                 exhaustive: bool = False, capture: str = "auto", val_batch: int | None = None,
                 offline_calls: int = 50, dynamic: str | None = None, console=None) -> int:
    """``val_batch``: the validation samples regrouped in calls of this many (see :func:`rebatch`); the latency
    protocol still runs at the example's batch. ``offline_calls``: optimize()'s back-to-back throughput calls.
    ``dynamic``: ``--dynamic``'s declaration (optimize.shapes), e.g. "x.2=128:512,x.3=128:512"."""
    from warpforge._cli_support import make_console
    from warpforge.optimize.api import optimize
    from warpforge.optimize.gate import DEFAULT_BUDGETS, DEFAULT_PRECISIONS, PRECISIONS
    from rich.markup import escape

    from warpforge.optimize.logs import logging_to

    console = console or make_console()
    err_console = make_console(stderr=True)  # errors on stderr, whatever stdout carries
    if device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            return _err(err_console, "--device cuda: CUDA is not available on this machine")
    try:
        budgets = None
        if any(v is not None for v in (max_abs, max_rel, min_cosine, min_top1)):
            budgets = {p: DEFAULT_BUDGETS[p].with_overrides(max_abs=max_abs, max_rel=max_rel, min_cosine=min_cosine,
                                                            min_top1=min_top1) for p in PRECISIONS}
        resolved = resolve(model, batch=batch, device=dev, random_weights=random_weights)
        if val_batch is not None and resolved.val:
            resolved.val = rebatch(resolved.val, val_batch)
    except (ModelError, ValueError) as e:
        return _err(err_console, str(e))
    out_dir = Path(out) if out else Path("out") / "optimize" / _slug(model)
    if not json_out:
        shapes = ", ".join(str(tuple(x.shape)) for x in resolved.inputs if isinstance(x, torch.Tensor))
        console.print(f"optimizing [bold]{resolved.name}[/] on {dev}, inputs {shapes}"
                      + (f", dynamic {escape(dynamic)}" if dynamic else ""), highlight=False)
        for n in resolved.notes:
            console.print(f"  note: {n}", highlight=False)

    def run(progress_cb):
        return optimize(resolved.model, resolved.inputs, val=resolved.val, budget=budgets,
                        precisions=precisions or DEFAULT_PRECISIONS, backends=list(backends) or None,
                        kind=resolved.kind, device=dev, progress=progress_cb, queries=queries, warmup=warmup,
                        offline_calls=offline_calls, name=resolved.name, exhaustive=exhaustive, capture=capture,
                        dynamic_shapes=dynamic)

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return _err(err_console, f"--out {out_dir}: cannot create the directory ({e.strerror or e})")
    with logging_to(out_dir / "optimize.log"):  # exporters' dumps go there, not to this terminal
        return _search_and_save(run, json_out, console, err_console, out_dir)


def _search_and_save(run, json_out: bool, console, err_console, out_dir: Path) -> int:
    from warpforge.optimize import report as report_mod
    from warpforge.optimize.api import BadInputError, NoCandidateError

    try:
        if json_out:
            opt = run(None)
        else:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, transient=True) as bar:
                task = bar.add_task("starting", total=None)

                def progress_cb(what: str, done: int, total: int) -> None:
                    bar.update(task, description=what, completed=done, total=total)

                opt = run(progress_cb)
    except BadInputError as e:
        if e.report is not None:
            paths = report_mod.write(e.report, out_dir)
            err_console.print(f"report: {paths['html']}", highlight=False)
        return _err(err_console, str(e))
    except NoCandidateError as e:
        paths = report_mod.write(e.report, out_dir)
        if json_out:
            console.out(report_mod.to_json(e.report), highlight=False)
        else:
            print_table(e.report, console)
            console.print(f"[bold red]no candidate met the budget.[/] {e.report['why']}", highlight=False)
            console.print(f"report: {paths['html']}\njson:   {paths['json']}", highlight=False)
        return 1
    try:
        saved = opt.save(out_dir)
    except Exception as e:  # noqa: BLE001 - the search succeeded; say why the model could not be written
        report_mod.write(opt.report, out_dir)
        if not json_out:
            print_table(opt.report, console)
        err_console.print(f"[bold red]warpforge optimize:[/] {opt.name} won but could not be saved: "
                          f"{type(e).__name__}: {e}", highlight=False)
        return 1
    if json_out:
        console.out(report_mod.to_json(opt.report), highlight=False)
        return 0
    print_table(opt.report, console)
    console.print(f"[bold green]winner:[/] {opt.report['why']}", highlight=False)
    console.print(f"saved:  {saved}  (load with warpforge.optimize.load)\nreport: {saved / 'report.html'}\n"
                  f"json:   {saved / 'report.json'}", highlight=False)
    return 0


__all__ = ["ModelError", "Resolved", "cli_optimize", "print_regions", "print_table", "rebatch", "resolve"]
