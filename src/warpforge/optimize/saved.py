"""Save the optimizer's winner and load it back, without re-running the search.

A saved directory holds:

* ``manifest.json``: winner, family, precision, how the model is stored (``format``), what to redo on
  load (``recompile`` mode for torch.compile winners, ``cuda_graph`` capture), how a warpforge winner's graph
  was captured (``capture``: torch.export or torch.fx.symbolic_trace), passes applied, budget,
  accuracy, versions, device, and the input shapes/dtypes;
* the model: ``model.pt2`` (a ``torch.export`` ExportedProgram: needs none of the original Python code),
  ``model.pkl`` (a pickled module: warpforge winners, whose fused modules export would trace away, and
  models export refuses), or ``model.onnx`` (ONNX Runtime);
* ``code/``: with a pickle, a copy of each of the user's own modules the pickle names (a factory file, or a
  single-file module outside the installed libraries), listed in the manifest's ``code``. ``load`` imports a
  copy under its recorded name where no module of that name is importable, so the model reloads in a fresh
  process without the user's files (a factory file is imported under its own name when that shadows no other
  module: ``mymodels.Net``, not a mangled name);
* ``check.pt``: the example inputs and the winner's outputs on them. ``load`` runs them and refuses a
  model that no longer reproduces them, so a reload is never silently wrong;
* ``report.json`` and ``report.html``.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import shutil
import sys
import sysconfig
import types
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from warpforge.optimize import report as report_mod
from warpforge.optimize.backends import Built
from warpforge.optimize.gate import Budget, compare


class Winner(Protocol):
    """What :func:`save` reads of a search's result (``warpforge.optimize.Optimized`` is one)."""

    name: str
    family: str
    precision: str
    kind: str
    built: Built
    report: dict[str, Any]  # the run's report (optimize's): settings, model, candidates
    example_inputs: tuple

FORMAT_VERSION = 1
# Reload tolerance: a fresh process may pick other kernel tilings (autotuning) or cuDNN algorithms, whose
# summation order differs; anything beyond rounding of the compute precision is a wrong model.
_RELOAD_BUDGET = {"fp32": Budget(max_rel=1e-4, min_cosine=0.99999), "fp16": Budget(max_rel=1e-2, min_cosine=0.9999),
                  "bf16": Budget(max_rel=3e-2, min_cosine=0.999),
                  # int8: the saved scales and int8 weights come back as they were and the int32 sums are exact;
                  # only the fp16 layers and epilogues round (tiling and FMA contraction may differ)
                  "int8": Budget(max_rel=1e-2, min_cosine=0.9999),
                  # fp8, w8, w4: likewise the e4m3 / int8 / int4 weights and scales (fp8: the static input scales)
                  # come back as saved, nothing is re-calibrated; fp32 accumulation, fp16 layers and epilogues
                  # round, and a new process may tile (or split K) differently
                  "fp8": Budget(max_rel=1e-2, min_cosine=0.9999), "w8": Budget(max_rel=1e-2, min_cosine=0.9999),
                  "w4": Budget(max_rel=1e-2, min_cosine=0.9999)}


def _cpu(x: Any) -> Any:
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, x)


def _same_outputs(a: Any, b: Any) -> bool:
    acc = compare(_cpu(a), _cpu(b))
    return not acc.errors and acc.max_abs == 0.0


def _store_module(module: nn.Module, inputs: tuple, prefer: str, d: Path, want: Any, shapes: Any = None
                  ) -> tuple[str, str, str | None]:
    """(format, file name, note): torch.export when preferred and it reproduces the outputs, else pickle.
    ``shapes`` (optimize.shapes.ShapeSpec): the declared dynamic dims, exported symbolic (else pickled)."""
    note = None
    if prefer == "export":
        # Batch dim left to export (Dim.AUTO: dynamic unless the model fixes it), then fully static; with dims
        # declared dynamic, those in their ranges or nothing (a program fixed at one size would refuse them).
        from warpforge.optimize.backends import _var_positional
        from warpforge.optimize.runtime import dynamic_batch_shapes

        if shapes is not None and shapes.declared:
            tries = [(inputs, shapes.export_shapes(nested=_var_positional(module)))]
        else:
            # A batch of 1 always specializes, so a model optimized at batch 1 is first exported at batch 2 (the
            # example twice): the program then takes any batch, and is checked at the example's batch of 1 too.
            two = _batch_of_two(inputs)
            batch = dynamic_batch_shapes(module, inputs)
            tries = ([(two, batch)] if two is not None else []) + [(inputs, batch), (inputs, None)]
        for at, dynamic in tries:
            try:
                ep = torch.export.export(module, at, dynamic_shapes=dynamic)
                with torch.no_grad():
                    got = ep.module()(*inputs)
                    if at is not inputs and not _same_outputs(module(*at), ep.module()(*at)):
                        raise RuntimeError("the program exported at batch 2 differs from the module at batch 2")
                if not _same_outputs(want, got):
                    raise RuntimeError("the exported program's outputs differ from the module's")
                for end in shapes.at_ends(inputs, torch.Generator().manual_seed(0)) if dynamic is not None and \
                        shapes is not None and shapes.declared else []:
                    with torch.no_grad():
                        if not _same_outputs(module(*end), ep.module()(*end)):
                            raise RuntimeError("the exported program's outputs differ from the module's at "
                                               f"{[list(x.shape) for x in end if isinstance(x, torch.Tensor)]}")
                torch.export.save(ep, d / "model.pt2")
                # No range constraint: every dim specialized (a batch of 1 always is): fixed shapes.
                static = (None if ep.range_constraints
                          else "static shapes: the saved model takes the example shapes only")
                return "export", "model.pt2", static
            except Exception as e:  # noqa: BLE001 - export refuses many real models; pickle is the fallback
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                note = f"torch.export failed ({type(e).__name__}: {first}); pickled"
    elif prefer == "pickle":
        note = "pickled: torch.export would trace the warpforge kernels' dispatch instead of keeping the fused modules"
    try:
        torch.save(module, d / "model.pkl", pickle_module=_RecordingPickle)
    except Exception as e:
        raise ValueError(f"could not save the model: pickling failed ({type(e).__name__}: {e})"
                         + (f"; {note}" if note else "")) from e
    return "pickle", "model.pkl", note


def _batch_of_two(inputs: tuple) -> tuple | None:
    """``inputs`` with each tensor's batch of 1 doubled; None unless every tensor input has a batch of 1."""
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if not tensors or any(x.dim() == 0 or x.shape[0] != 1 for x in tensors):
        return None
    return tuple(torch.cat([x, x]) if isinstance(x, torch.Tensor) else x for x in inputs)


def _fixed_dims(ep: torch.export.ExportedProgram) -> list[tuple[int | None, ...] | None]:
    """Each user input's shape as the exported program fixes it (None: a dim it leaves free; None: not a
    tensor), in the order of the flattened call arguments."""
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    return [tuple(k if isinstance(k, int) else None for k in v.shape) if isinstance(v, torch.Tensor) else None
            for v in (vals.get(name) for name in ep.graph_signature.user_inputs)]


class _RecordingPickler(pickle.Pickler):
    """pickle's Pickler, noting the module of every class and function it stores by reference."""

    modules: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__"):
            mod = getattr(obj, "__module__", None)
            if isinstance(mod, str):
                _RecordingPickler.modules.add(mod)
        return NotImplemented


_RecordingPickle = types.ModuleType("pickle")  # what torch.save calls pickle_module: pickle, with ours
_RecordingPickle.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
_RecordingPickle.Pickler = _RecordingPickler


def _library_dirs() -> list[Path]:
    """Where installed code lives (the standard library, site-packages, warpforge itself): not the user's."""
    import warpforge

    paths = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return [Path(p).resolve() for p in paths if p] + [Path(warpforge.__file__).resolve().parent]


def _user_code(names: set[str]) -> list[tuple[str, Path]]:
    """(module name, file) of each single-file module among ``names`` that is the user's code: a factory file
    (imported by path, whatever its name) or a top-level module outside the installed libraries (a module of a
    package is not copied: the package must be importable where the model is loaded)."""
    from warpforge._factory import file_modules

    files, libs, out = file_modules(), _library_dirs(), []
    for name in sorted(names):
        mod = sys.modules.get(name)
        path = files.get(name) or getattr(mod, "__file__", None)
        if mod is None or name == "__main__" or path is None or Path(path).name == "__init__.py" or \
                ("." in name and name not in files):
            continue
        path = Path(path).resolve()
        if name in files or not any(path.is_relative_to(lib) for lib in libs):
            if path.suffix == ".py" and path.is_file():
                out.append((name, path))
    return out


def _store_code(d: Path) -> list[dict[str, str]]:
    """Copy the user's modules the pickle refers to under ``d/code`` (see :func:`_user_code`)."""
    out = []
    for name, path in _user_code(_RecordingPickler.modules):
        (d / "code").mkdir(exist_ok=True)
        dest = d / "code" / f"{name}.py"
        shutil.copyfile(path, dest)
        out.append({"module": name, "file": f"code/{name}.py", "origin": str(path)})
    return out


def _import_code(d: Path, code: list[dict[str, str]]) -> None:
    """Make the saved user modules importable under their recorded names, where they are not already: a module
    named as its file imports from ``d/code`` (so its own imports of the others resolve), a factory file
    imported under a longer name loads from its copy."""
    from warpforge._factory import import_file

    missing = []
    for entry in code:
        name = entry["module"]
        if name in sys.modules:
            continue
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            found = None
        if found is None:
            missing.append(entry)
    if not missing:
        return
    for entry in missing:  # import_file puts d/code on sys.path, so one saved module's imports of another resolve
        name, path = entry["module"], d / entry["file"]
        if name in sys.modules:
            continue
        try:
            import_file(name, path)
        except Exception as e:  # an ImportError too: its message names what is missing
            raise ValueError(f"{path}: importing the saved copy of module {name} failed "
                             f"({type(e).__name__}: {e})") from e


def save(opt: Winner, directory: str | Path) -> Path:
    """Write the winner of ``opt`` under ``directory`` (see the module docstring); returns the directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    built = opt.built
    inputs = opt.example_inputs
    with torch.no_grad():
        want = built.fn(*inputs)
    rec = next(r for r in opt.report["candidates"] if r["name"] == opt.name)
    if built.save_format == "onnx":
        (d / "model.onnx").write_bytes(built.onnx_bytes or b"")
        fmt, file, note, code = "onnx", "model.onnx", None, []
    else:
        if built.module is None:
            raise ValueError(f"candidate {opt.name} has no module to save")
        with torch.no_grad():
            want_module = built.module(*inputs)
        _RecordingPickler.modules = set()
        shapes = getattr(opt, "shapes", None)
        fmt, file, note = _store_module(built.module, inputs, built.save_format, d, want_module, shapes)
        code = _store_code(d) if fmt == "pickle" else []
    env = report_mod.environment(opt.report["settings"]["device"])
    manifest = {
        "format_version": FORMAT_VERSION, "winner": opt.name, "family": opt.family, "precision": opt.precision,
        "kind": opt.kind, "format": fmt, "file": file, "format_note": note, "code": code,
        "recompile": built.recompile, "cuda_graph": built.cuda_graph, "onnx_provider": built.onnx_provider,
        "device": opt.report["settings"]["device"],
        "inputs": opt.report["model"]["inputs"],
        # the captured shapes and declared dynamic dims: load() checks every call against them
        "shapes": opt.shapes.as_dict() if getattr(opt, "shapes", None) is not None else None,
        "passes": [{"name": p["name"], "counts": p["counts"]} for p in built.details.get("passes", [])],
        "capture": built.details.get("capture", {}).get("method"),
        "budget": rec.get("budget"), "accuracy": rec.get("accuracy"), "latency": rec.get("latency"),
        "versions": {k: env.get(k) for k in ("warpforge", "torch", "triton", "cuda", "python")},
        "model": {k: opt.report["model"].get(k) for k in ("name", "class", "params")},
    }
    (d / "manifest.json").write_text(json.dumps(manifest, indent=2))
    torch.save({"inputs": _cpu(inputs), "outputs": _cpu(want)}, d / "check.pt")
    report_mod.write(opt.report, d)
    return d


class Loaded:
    """A saved winner, loaded: call it like the original model. ``manifest`` says what it is."""

    def __init__(self, fn: Any, module: nn.Module | None, manifest: dict[str, Any],
                 fixed: list[tuple[int | None, ...] | None] | None = None) -> None:
        from warpforge.optimize.shapes import ShapeSpec

        self.fn = fn
        self.module = module
        self.manifest = manifest
        self.shapes = ShapeSpec.from_dict(manifest["shapes"]) if manifest.get("shapes") else None
        self.fixed = fixed  # an exported program's fixed dims (_fixed_dims); torch's guard would say it cryptically

    def __call__(self, *args: Any) -> Any:
        if self.shapes is not None:
            self.shapes.check(args)  # ShapeError: one line naming the dim, its size and the declared range
        if self.fixed is not None:
            self._check_fixed(args)
        with torch.no_grad():
            return self.fn(*args)

    def _check_fixed(self, args: tuple) -> None:
        from warpforge.optimize.shapes import ShapeError

        for i, (a, want) in enumerate(zip(tree_flatten(args)[0], self.fixed or [])):
            if want is None or not isinstance(a, torch.Tensor):
                continue
            got = list(a.shape)
            k = next((k for k, (g, w) in enumerate(zip(got, want)) if w is not None and g != w), None)
            if k is None and len(got) == len(want):
                continue
            label = self.shapes.label(i) if self.shapes is not None else f"argument {i}"
            what = f"dim {k} is {got[k]}" if k is not None else f"{len(got)} dims"
            raise ShapeError(f"{label} has shape {got}: {what}, but the saved model was exported for "
                             f"{[w if w is not None else '*' for w in want]} (*: any size); optimize again with "
                             "example inputs of this shape")

    def __repr__(self) -> str:
        return f"Loaded({self.manifest['winner']!r}, format={self.manifest['format']!r})"


def load(directory: str | Path, *, device: str | torch.device | None = None, verify: bool = True) -> Loaded:
    """The saved winner under ``directory``, on ``device`` (default: the one it was optimized on).

    torch.compile winners are compiled again and CUDA-graph winners captured again (neither survives a
    process). ``verify`` runs the saved check inputs and raises ValueError when the outputs differ
    beyond rounding.
    """
    from warpforge.optimize.backends import OrtRunner
    from warpforge.optimize.runtime import GraphBuckets, static_cuda_inputs

    d = Path(directory)
    mpath = d / "manifest.json"
    if not mpath.is_file():
        raise ValueError(f"{d}: no manifest.json (not a directory written by Optimized.save)")
    manifest = json.loads(mpath.read_text())
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{d}: manifest format_version {manifest.get('format_version')!r}; this warpforge reads "
                         f"{FORMAT_VERSION}")
    dev = torch.device(device or manifest["device"])
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{d}: the model was saved for {manifest['device']}, but CUDA is not available here; "
                         "pass device='cpu' to load it on the CPU (fp16/bf16 and CUDA-graph winners need a GPU)")
    check = torch.load(d / "check.pt", weights_only=False)
    inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in check["inputs"])
    fmt, path = manifest["format"], d / manifest["file"]
    module: nn.Module | None = None
    fixed = None
    if fmt == "export":
        ep = torch.export.load(str(path))
        fixed = _fixed_dims(ep)
        module = ep.module()  # in inference mode already (no .eval() on it)
        if dev != torch.device(manifest["device"]):
            module.to(dev)
        fn: Any = module
    elif fmt == "pickle":
        _import_code(d, manifest.get("code") or [])
        try:
            module = torch.load(path, weights_only=False, map_location=dev)
        except (AttributeError, ModuleNotFoundError) as e:
            raise ValueError(f"{path}: the pickled model needs a class that cannot be imported here ({e}); "
                             "make the model's module importable, or save a model torch.export accepts") from e
        module.eval()
        fn = module
    elif fmt == "onnx":
        fn = OrtRunner(path.read_bytes(), manifest.get("onnx_provider") or "CPUExecutionProvider", inputs,
                       tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, check["outputs"]))
    else:
        raise ValueError(f"{d}: unknown model format {fmt!r}")
    if manifest.get("recompile"):
        fn = torch.compile(fn, mode=manifest["recompile"])
    if manifest.get("cuda_graph") and dev.type == "cuda" and static_cuda_inputs(inputs):
        fn = GraphBuckets(fn, inputs)
    loaded = Loaded(fn, module, manifest, fixed)
    if verify:
        got = loaded(*inputs)
        budget = _RELOAD_BUDGET.get(manifest["precision"], _RELOAD_BUDGET["fp32"])
        acc = compare(_cpu(check["outputs"]), _cpu(got))
        ok, reasons = acc.passes(budget)
        if not ok:
            raise ValueError(f"{d}: the loaded model does not reproduce its saved outputs ({'; '.join(reasons)})")
    return loaded


__all__ = ["Loaded", "load", "save"]
