"""What ``warpforge profile TARGET`` profiles: a factory in a file or module, or a benchmark case.

TARGET forms:
  ``path/to/file.py:factory``     a function in a Python file
  ``package.module:factory``      a function in an importable module
  ``bench:SUITE/CASE[@PEER]``     a case of a benchmark suite (ours, or the named peer), with the
                                  case's explicit FLOP and byte counts declared for the window
  ``llm:CHECKPOINT``              one decode step of warpforge's LLM engine (``--batch`` sequences,
                                  ``--prompt-len`` tokens of context), CUDA-graph replay on a GPU
  ``llm-prefill:CHECKPOINT``      one prefill of ``--batch`` fresh prompts of ``--prompt-len`` tokens
  ``NAME``                        a model of the zoo (``warpforge.zoo.names()``) at ``--batch``
  ``optimized:NAME``              the zoo model as ``warpforge optimize`` ships it: the fastest eager or
                                  warpforge candidate within the default budgets on the zoo's validation
                                  inputs (torch.compile candidates are left out: minutes to build), its
                                  CUDA graph replayed on a GPU and counted on its module
A factory returns a model or callable (inputs from ``--input-shape``), ``(model, inputs)``, or a dict
``{"fn", "inputs", "module", "count_fn", "work", "name"}`` for a callable that is not a module (an
engine step replaying CUDA graphs passes its eager twin as ``count_fn``). It may take
``input_shape`` (a list of shapes) and ``device`` keyword arguments.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from warpforge._factory import call_factory, load_factory

FORMS = ("path/to/file.py:factory", "package.module:factory", "bench:SUITE/CASE[@PEER]", "llm:CHECKPOINT",
         "llm-prefill:CHECKPOINT", "a zoo model NAME", "optimized:NAME")
OPTIMIZED_BACKENDS = ("eager", "warpforge")
LLM_DEFAULTS = {"decode": (8, 128), "prefill": (1, 512)}  # (batch, prompt tokens)


class TargetError(ValueError):
    """TARGET cannot be resolved; the message says why and what works."""


@dataclass
class Target:
    name: str
    fn: Callable[..., Any]
    inputs: tuple
    module: torch.nn.Module | None = None
    count_fn: Callable[..., Any] | None = None
    work: dict[str, Any] | None = None  # declared per-call {"flops", "bytes", "dtype"}
    notes: list[str] = field(default_factory=list)


def parse_shape(text: str) -> tuple[int, ...]:
    """"1,3,224,224" or "1x3x224x224" -> (1, 3, 224, 224)."""
    parts = [p for p in re.split(r"[x,\s]+", text.strip()) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise TargetError(f"--input-shape {text!r}: expected integers like 1,3,224,224 or 1x3x224x224") from None
    if not shape or any(d < 1 for d in shape):
        raise TargetError(f"--input-shape {text!r}: every dimension must be >= 1")
    return shape


def resolve(spec: str, *, input_shapes: list[tuple[int, ...]] | None = None, device: torch.device | None = None,
            batch: int | None = None, prompt_len: int | None = None, quick: bool = False) -> Target:
    """The callable, inputs and module for TARGET (see the module docstring). ``quick`` (``optimized:NAME``
    only): the search times each candidate with a short protocol (a dry run's; the gate is the same)."""
    dev = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    is_factory = ":" in spec and not spec.startswith(("bench:", "llm:", "llm-prefill:", "optimized:"))
    if input_shapes and not is_factory:  # it would be silently ignored
        raise TargetError(f"--input-shape: applies to path/file.py:factory targets only, not {spec!r} "
                          "(zoo and optimized: models take --batch, llm targets --batch and --prompt-len)")
    if spec.startswith("bench:"):
        return _bench(spec[len("bench:"):], dev)
    for prefix, phase in (("llm:", "decode"), ("llm-prefill:", "prefill")):
        if spec.startswith(prefix):
            return _llm(spec[len(prefix):], phase, dev, batch, prompt_len)
    if spec.startswith("optimized:"):
        return _optimized(spec[len("optimized:"):], dev, batch, quick)
    if ":" in spec:
        where, _, attr = spec.rpartition(":")
        factory = load_factory(where, attr, TargetError, "_warpforge_profile_target_")
        return _from_factory(spec, factory, input_shapes, dev)
    return _zoo(spec, dev, batch)


def _zoo(name: str, dev: torch.device, batch: int | None) -> Target:
    from warpforge import zoo

    if name not in zoo.names():
        raise TargetError(f"{name!r}: not a zoo model ({', '.join(zoo.names())}); "
                          f"TARGET can be one of: {', '.join(FORMS)}")
    try:
        spec = zoo.get(name, batch=batch or 1, device=dev)
    except (ImportError, ValueError) as e:  # a missing weights package names itself
        raise TargetError(f"{name}: {e}") from e
    return Target(name=f"{name} (batch {batch or 1}, {spec.weights} weights)", fn=spec.model,
                  inputs=tuple(spec.example_inputs), module=spec.model)


# optimize()'s latency protocol for the optimized: target (queries, warmup, offline calls); quick: a dry run's
OPTIMIZED_PROTOCOL = {False: (50, 10, 10), True: (4, 1, 2)}


def _optimized(name: str, dev: torch.device, batch: int | None, quick: bool = False) -> Target:
    from warpforge import zoo
    from warpforge.optimize import optimize

    plain = _zoo(name, dev, batch)  # checks the name
    spec = zoo.get(name, batch=batch or 1, device=dev)
    val = list(spec.val_inputs())
    budget, basis = None, "the default budgets"
    if spec.weights == "random" and dev.type == "cuda":
        budget = framework_budgets(spec.model, val)
        basis = "budgets widened to 2x torch eager's own error at each 16-bit precision (random weights)"
    queries, warmup, offline_calls = OPTIMIZED_PROTOCOL[quick]
    try:
        opt = optimize(spec.model, tuple(spec.example_inputs), val=val, budget=budget, backends=OPTIMIZED_BACKENDS,
                       device=dev, queries=queries, warmup=warmup, offline_calls=offline_calls, name=name)
    except Exception as e:
        raise TargetError(f"optimized:{name}: the optimizer failed: {type(e).__name__}: {e}") from e
    built = opt.built
    notes = [f"the optimizer chose {opt.name} (of its {', '.join(OPTIMIZED_BACKENDS)} candidates within {basis}; "
             f"{'CUDA graph replay' if built.cuda_graph else 'no CUDA graph'})"]
    return Target(name=f"{name} optimized: {opt.name} (batch {batch or 1}, {spec.weights} weights)", fn=opt,
                  inputs=plain.inputs, module=built.module, notes=notes,
                  count_fn=built.module if built.cuda_graph else None)  # a replay hides its operators


def framework_budgets(model: torch.nn.Module, val: list) -> dict[str, Any]:
    """{precision: Budget}: the defaults, with each 16-bit one widened to twice torch eager's own error at that
    precision on ``val`` (``Budget.widened_to``): what a random-weight model can be held to."""
    import copy

    from warpforge.optimize.gate import DEFAULT_BUDGETS, compare
    from warpforge.optimize.runtime import CastIO, strict_fp32

    with torch.no_grad(), strict_fp32():
        ref = [model(*v) for v in val]
    out = dict(DEFAULT_BUDGETS)
    for p, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        low = CastIO(copy.deepcopy(model).to(dtype), dtype).eval()
        with torch.no_grad():
            acc = compare(ref, [low(*v) for v in val], batched=True)
        out[p] = out[p].widened_to(None if acc.errors else acc.max_rel, None if acc.errors else acc.min_cosine)
        del low
    return out


def _to(x: Any, dev: torch.device) -> Any:
    return tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, x)


def _from_factory(spec: str, factory: Callable, shapes: list[tuple[int, ...]] | None, dev: torch.device) -> Target:
    offered = {"input_shape": shapes if len(shapes) > 1 else shapes[0], "device": dev} if shapes else {"device": dev}
    out, kwargs = call_factory(factory, offered, spec, TargetError)
    if shapes and "input_shape" not in kwargs and not (callable(out) and not isinstance(out, (tuple, dict))):
        raise TargetError(f"--input-shape: {spec}'s factory takes no input_shape argument and returns its own "
                          "inputs, so the shape would be ignored; drop --input-shape, or give the factory an "
                          "input_shape parameter (or return the model alone)")
    if isinstance(out, dict):
        if not callable(out.get("fn")):
            raise TargetError(f"{spec}: a factory dict needs a callable under 'fn'")
        return Target(name=out.get("name", spec), fn=out["fn"], inputs=tuple(out.get("inputs", ())),
                      module=out.get("module"), count_fn=out.get("count_fn"), work=out.get("work"))
    if isinstance(out, tuple) and len(out) == 2 and callable(out[0]):
        model, inputs = out
        inputs = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    elif callable(out):
        model, inputs = out, None
    else:
        raise TargetError(f"{spec}: the factory returned {type(out).__name__}; expected a model, "
                          "(model, inputs) or a dict with 'fn'")
    notes = []
    if isinstance(model, torch.nn.Module):
        p = next(iter(model.parameters()), None)
        if p is not None and p.device != dev:
            model = model.to(dev)
            notes.append(f"model moved to {dev}")
    if inputs is None:
        if not shapes:
            raise TargetError(f"{spec}: the factory returned a model without inputs; return (model, inputs) "
                              "or pass --input-shape")
        p = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
        dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
        gen = torch.Generator(device="cpu").manual_seed(0)
        inputs = tuple(torch.randn(s, generator=gen).to(dev, dtype) for s in shapes)
    return Target(name=spec, fn=model, inputs=tuple(_to(tuple(inputs), dev)), notes=notes)


def bench_case(suite_name: str, case_name: str, *, quick: bool = False):
    """The case of a benchmark suite named ``case_name`` exactly, else the one case whose name contains it."""
    from warpforge.bench.runner import UnknownSuiteError, load_suite

    try:
        suite = load_suite(suite_name)
    except UnknownSuiteError as e:
        raise TargetError(str(e)) from None
    cases = suite.build(quick=quick)
    exact = [c for c in cases if c.name == case_name]
    match = exact or [c for c in cases if case_name in c.name]
    if len(match) != 1:
        names = ", ".join(repr(c.name) for c in (match or cases)[:12])
        raise TargetError(f"{'no case' if not match else 'several cases'} match {case_name!r} in suite "
                          f"{suite_name!r}: {names}")
    return match[0]


def case_work(case) -> dict[str, Any]:
    """What one call of a benchmark case does, as the case declares it: the profile's ``work``."""
    return {"flops": float(case.flops), "bytes": float(case.bytes), "dtype": str(case.dtype).removeprefix("torch."),
            "metric": case.metric, "cuda_graph": case.cuda_graph}


def _bench(rest: str, dev: torch.device) -> Target:
    body, _, peer = rest.partition("@")
    suite_name, _, case_name = body.partition("/")
    if not suite_name or not case_name:
        raise TargetError(f"bench:{rest}: expected bench:SUITE/CASE[@PEER], e.g. 'bench:memory/copy fp32 1GiB'")
    try:
        case = bench_case(suite_name, case_name)
    except TargetError as e:
        raise TargetError(f"bench:{rest}: {e}") from None
    fn = case.ours
    label = "ours"
    if peer:
        if peer not in case.peers:
            raise TargetError(f"bench:{rest}: case {case.name!r} has no peer {peer!r} (peers: {', '.join(case.peers)})")
        fn, label = case.peers[peer], peer
    gen = torch.Generator(device=dev).manual_seed(0)
    inputs = tuple(case.make_inputs(gen, dev))
    return Target(name=f"bench:{suite_name}/{case.name} ({label})", fn=fn, inputs=inputs, work=case_work(case))


def _llm(path: str, phase: str, dev: torch.device, batch: int | None, prompt_len: int | None) -> Target:
    from warpforge.profile.llm_target import llm_engine, llm_step

    b, n = LLM_DEFAULTS[phase]
    batch, prompt_len = batch or b, prompt_len or n
    if not Path(path).exists():
        raise TargetError(f"llm:{path}: no such checkpoint (an HF checkpoint directory or a .gguf file)")
    try:
        engine = llm_engine(path, batch=batch, prompt_len=prompt_len, device=dev, prefill=phase == "prefill")
        d = llm_step(engine, phase, batch=batch, prompt_len=prompt_len)
    except (ValueError, OSError, RuntimeError) as e:
        raise TargetError(f"llm:{path}: {type(e).__name__}: {e}") from e
    return Target(name=f"{d['name']} ({Path(path).name})", fn=d["fn"], inputs=(), module=d["module"],
                  count_fn=d["count_fn"])
