"""Which input dims may vary, and by how much: declared by the user, checked on every call.

A model is captured at its example inputs' shapes. The batch (dim 0) stays free as before; any other dim
varies only when declared, with a range, as torch.export's ``Dim`` does:

    --dynamic x.2=128:512,x.3=128:512          # dims 2 and 3 of the forward's argument x (its name in forward()'s
                                               # signature: nn.Sequential's is `input`), or 0.2,0.3 by position
    --dynamic ids.1=mask.1=8:128               # one dim shared by two inputs (a sequence and its mask)
    dynamic_shapes={"x": {2: (128, 512), 3: (128, 512)}}            # Python: by argument name or position
    dynamic_shapes=({2: Dim("H", min=128, max=512)},)               # torch.export's form; a Dim used twice is shared

Declared dims are symbolic in the torch.export capture (``Dim`` with the range) and in the ONNX export, the
validation set gains inputs at the range's two ends, and CUDA graphs are captured per distinct shape
(runtime.GraphBuckets). A call outside the declaration raises :class:`ShapeError` in one line naming the
input, the dim, its size, the captured shape and the declared range (or how to declare it).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

_SPEC = re.compile(r"^\s*(?P<targets>[^=:]+(?:=[^=:]+)*)=(?P<lo>\d+):(?P<hi>\d+)\s*$")


class ShapeError(ValueError):
    """A call's input shape is outside what the model was captured and declared for."""


@dataclass(frozen=True)
class DynamicDim:
    """One declared dim: its name, range, and the (input position, dim) pairs that share it."""

    name: str
    min: int
    max: int
    targets: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not (isinstance(self.min, int) and isinstance(self.max, int)) or not 1 <= self.min <= self.max:
            raise ValueError(f"dynamic dim {self.name}: the range must be MIN:MAX with 1 <= MIN <= MAX, got "
                             f"{self.min}:{self.max}")
        if not self.targets:
            raise ValueError(f"dynamic dim {self.name}: names no input dim")


@dataclass(frozen=True)
class ShapeSpec:
    """The example inputs' shapes (None for a non-tensor argument), the forward's argument names, and the
    declared dims. With no dims declared it still checks calls: every dim but the batch as captured."""

    example: tuple[tuple[int, ...] | None, ...]
    arg_names: tuple[str, ...]
    dims: tuple[DynamicDim, ...] = ()
    _where: dict[tuple[int, int], DynamicDim] = field(default_factory=dict, compare=False, repr=False)
    # input shapes already checked and accepted: a call at one of them costs a tuple and a set lookup
    _accepted: set = field(default_factory=set, compare=False, repr=False)

    def __post_init__(self) -> None:
        for d in self.dims:
            for i, k in d.targets:
                shape = self.example[i] if 0 <= i < len(self.example) else None
                if shape is None:
                    raise ValueError(f"dynamic dim {d.name}: argument {i} is not a tensor input of the example")
                if not 0 <= k < len(shape):
                    raise ValueError(f"dynamic dim {d.name}: {self.label(i)} has {len(shape)} dims, no dim {k}")
                if not d.min <= shape[k] <= d.max:
                    raise ValueError(f"dynamic dim {d.name}: the example's {self.label(i)} dim {k} is {shape[k]}, "
                                     f"outside the declared range {d.min}:{d.max}")
                if (i, k) in self._where:
                    raise ValueError(f"dynamic dims: {self.label(i)} dim {k} is declared twice")
                self._where[(i, k)] = d

    @property
    def declared(self) -> bool:
        return bool(self.dims)

    def label(self, i: int) -> str:
        name = self.arg_names[i] if i < len(self.arg_names) else str(i)
        return f"input {name} (argument {i})" if name != str(i) else f"argument {i}"

    def dim_of(self, i: int, k: int) -> DynamicDim | None:
        return self._where.get((i, k))

    def batch_free(self, i: int) -> bool:
        """Dim 0 of input i varies freely (not declared: the batch, as before)."""
        return (i, 0) not in self._where

    # --- checking a call ---------------------------------------------------------------------------------

    def check(self, args: Sequence[Any]) -> None:
        """Raise :class:`ShapeError` (one line) when ``args`` do not fit the captured shapes and declared dims."""
        key = tuple(a.shape if isinstance(a, torch.Tensor) else None for a in args)
        if key in self._accepted:
            return
        self._check(args)
        if len(self._accepted) < 256:
            self._accepted.add(key)

    def _check(self, args: Sequence[Any]) -> None:
        if len(args) != len(self.example):
            raise ShapeError(f"the model takes {len(self.example)} argument(s), got {len(args)}")
        seen: dict[str, tuple[int, int, int]] = {}
        for i, (a, shape) in enumerate(zip(args, self.example)):
            if shape is None:
                continue
            if not isinstance(a, torch.Tensor):
                raise ShapeError(f"{self.label(i)} must be a tensor, got {type(a).__name__}")
            got = tuple(a.shape)
            if len(got) != len(shape):
                raise ShapeError(f"{self.label(i)} has shape {list(got)} ({len(got)} dims); the model was captured "
                                 f"at {list(shape)}")
            for k, (g, c) in enumerate(zip(got, shape)):
                d = self.dim_of(i, k)
                if d is None:
                    if g != c and not (k == 0 and self.batch_free(i)):
                        raise ShapeError(
                            f"{self.label(i)} has shape {list(got)}: dim {k} is {g}, but the model was captured at "
                            f"{list(shape)} and dim {k} is not declared dynamic; declare it with --dynamic "
                            f"{self.arg_names[i]}.{k}=MIN:MAX (Python: dynamic_shapes={{{self.arg_names[i]!r}: "
                            f"{{{k}: (MIN, MAX)}}}})")
                    continue
                if not d.min <= g <= d.max:
                    raise ShapeError(f"{self.label(i)} has shape {list(got)}: dim {k} is {g}, outside the declared "
                                     f"range {d.min}:{d.max} of {d.name} (captured at {list(shape)})")
                if d.name in seen and seen[d.name][2] != g:
                    j, kk, other = seen[d.name]
                    raise ShapeError(f"{d.name} is one dim shared by {self.label(j)} dim {kk} and {self.label(i)} "
                                     f"dim {k}, but they are {other} and {g}")
                seen.setdefault(d.name, (i, k, g))

    # --- what the exporters take ------------------------------------------------------------------------

    def export_shapes(self, nested: bool = False) -> tuple:
        """torch.export's ``dynamic_shapes``: each declared dim a ``Dim`` with its range (one object per shared
        dim), an undeclared batch ``Dim.AUTO``. ``nested``: for a ``forward(*args)``, one level deeper."""
        from torch.export import Dim

        objs = {d.name: Dim(_ident(d.name), min=d.min, max=d.max) for d in self.dims}
        specs = []
        for i, shape in enumerate(self.example):
            if shape is None or not shape:
                specs.append(None)
                continue
            spec = {0: Dim.AUTO} if self.batch_free(i) else {}
            spec.update({k: objs[d.name] for (j, k), d in self._where.items() if j == i})
            specs.append(spec)
        return (tuple(specs),) if nested else tuple(specs)

    def onnx_axes(self) -> dict[int, dict[int, str]]:
        """The TorchScript ONNX exporter's ``dynamic_axes``, by input position: the batch and declared dims."""
        out: dict[int, dict[int, str]] = {}
        for i, shape in enumerate(self.example):
            if shape:
                out[i] = {0: "batch"} if self.batch_free(i) else {}
                out[i].update({k: _ident(d.name) for (j, k), d in self._where.items() if j == i})
        return out

    # --- inputs at other sizes --------------------------------------------------------------------------

    def at_ends(self, inputs: tuple, gen: torch.Generator) -> list[tuple]:
        """Fresh inputs with every declared dim at its minimum, then at its maximum (the batch as in ``inputs``):
        what the gate and the capture check add, so a candidate is judged across the range."""
        out = []
        for end in ("min", "max"):
            sizes = {(i, k): getattr(d, end) for (i, k), d in self._where.items()}
            out.append(tuple(_resized(x, [sizes.get((i, k), n) for k, n in enumerate(x.shape)], gen)
                             if isinstance(x, torch.Tensor) else x for i, x in enumerate(inputs)))
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"dims": [{"name": d.name, "min": d.min, "max": d.max,
                          "targets": [f"{self.arg_names[i]}.{k}" for i, k in d.targets]} for d in self.dims],
                "example": [list(s) if s is not None else None for s in self.example],
                "arg_names": list(self.arg_names)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShapeSpec:
        names = tuple(data["arg_names"])
        dims = tuple(DynamicDim(d["name"], d["min"], d["max"], tuple(_target(t, names) for t in d["targets"]))
                     for d in data.get("dims", []))
        return cls(tuple(tuple(s) if s is not None else None for s in data["example"]), names, dims)

    def describe(self) -> str:
        """``x.2=128:512, x.3=128:512`` (the CLI's spelling), or "" with none declared."""
        return ", ".join("=".join(f"{self.arg_names[i]}.{k}" for i, k in d.targets) + f"={d.min}:{d.max}"
                         for d in self.dims)


def _ident(name: str) -> str:
    """A Dim name torch.export accepts (an identifier)."""
    out = re.sub(r"\W", "_", name)
    return out if out.isidentifier() else f"d_{out}"


def _target(text: str, names: tuple[str, ...]) -> tuple[int, int]:
    """``x.2`` or ``0.2`` -> (argument position, dim)."""
    arg, dot, dim = text.strip().rpartition(".")
    if not dot or not dim.isdigit() or not arg:
        raise ValueError(f"--dynamic: {text.strip()!r} must be ARG.DIM (an argument name or position, a dot, a dim "
                         f"number), e.g. {names[0] if names else 'x'}.2")
    if arg.isdigit():
        i = int(arg)
        if i >= len(names):
            raise ValueError(f"--dynamic: {text.strip()!r}: the model takes {len(names)} argument(s)")
        return i, int(dim)
    if arg not in names:
        # nn.Sequential's forward names its argument `input`, not `x`: say where names come from, and the
        # positional spelling that works whatever they are
        raise ValueError(f"--dynamic: {text.strip()!r}: no argument {arg!r}; the forward's arguments are "
                         f"{', '.join(names) or '(none)'} (names from forward()'s signature; by position: "
                         f"0.{dim} is dim {dim} of the first)")
    return names.index(arg), int(dim)


def _resized(x: torch.Tensor, shape: list[int], gen: torch.Generator) -> torch.Tensor:
    if list(x.shape) == shape:
        return x
    if x.is_floating_point():
        return torch.randn(shape, generator=gen).to(x.device, x.dtype)
    if x.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool().to(x.device)
    lo, hi = (int(x.min()), int(x.max())) if x.numel() else (0, 1)
    return torch.randint(lo, hi + 1, shape, generator=gen).to(x.device, x.dtype)


def arg_names(model: nn.Module, n: int) -> tuple[str, ...]:
    """The names of the forward's first ``n`` positional arguments (their positions past a ``*args``)."""
    names: list[str] = []
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            break
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    names = names[:n]
    return tuple(names) + tuple(str(i) for i in range(len(names), n))


def parse(declared: Any, model: nn.Module, inputs: tuple) -> ShapeSpec:
    """The :class:`ShapeSpec` of ``declared`` (module docstring: a CLI string, a mapping by argument name or
    position, or torch.export's per-argument sequence; None: nothing declared) for ``model`` at ``inputs``.
    ValueError names what is wrong."""
    example = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in inputs)
    names = arg_names(model, len(inputs))
    if declared is None:
        return ShapeSpec(example, names)
    if isinstance(declared, str):
        return ShapeSpec(example, names, _parse_text(declared, names))
    if isinstance(declared, Mapping):
        per_arg = {_arg_index(k, names): v for k, v in declared.items()}
    elif isinstance(declared, Sequence):
        if len(declared) != len(inputs):
            raise ValueError(f"dynamic_shapes has {len(declared)} entries; the model takes {len(inputs)} argument(s)")
        per_arg = dict(enumerate(declared))
    else:
        raise ValueError(f"dynamic_shapes must be a string like 'x.2=128:512', a mapping or a sequence, got "
                         f"{type(declared).__name__}")
    groups: dict[int, tuple[str, int, int, list[tuple[int, int]]]] = {}  # id(Dim) -> shared
    dims = []
    for i, spec in sorted(per_arg.items()):
        if spec is None:
            continue
        if not isinstance(spec, Mapping):
            raise ValueError(f"dynamic_shapes for argument {names[i]}: expected {{dim: (MIN, MAX) or Dim}}, got "
                             f"{type(spec).__name__}")
        for k, rng in spec.items():
            if not isinstance(k, int):
                raise ValueError(f"dynamic_shapes for argument {names[i]}: dim {k!r} must be an int")
            label = f"{names[i]}.{k}"
            if isinstance(rng, tuple) and len(rng) == 2 and all(isinstance(v, int) for v in rng):
                dims.append(DynamicDim(label, rng[0], rng[1], ((i, k),)))
            elif _is_dim(rng):
                if rng.max is None or rng.max >= 2 ** 62:
                    raise ValueError(f"dynamic_shapes {label}: Dim {rng.__name__!r} needs a max= (the range CUDA "
                                     "graphs and the gate are built for)")
                group = groups.setdefault(id(rng), (rng.__name__, max(int(rng.min), 1), int(rng.max), []))
                group[3].append((i, k))
            else:
                raise ValueError(f"dynamic_shapes {label}: expected (MIN, MAX) or torch.export.Dim('name', min=, "
                                 f"max=), got {rng!r}")
    dims += [DynamicDim(name, lo, hi, tuple(t)) for name, lo, hi, t in groups.values()]
    return ShapeSpec(example, names, tuple(dims))


def _is_dim(x: Any) -> bool:
    return hasattr(x, "__name__") and hasattr(x, "min") and hasattr(x, "max") and not isinstance(x, (type, tuple))


def _arg_index(key: Any, names: tuple[str, ...]) -> int:
    if isinstance(key, int) and 0 <= key < len(names):
        return key
    if isinstance(key, str) and key in names:
        return names.index(key)
    raise ValueError(f"dynamic_shapes: no argument {key!r}; the forward's arguments are {', '.join(names)}")


def _parse_text(text: str, names: tuple[str, ...]) -> tuple[DynamicDim, ...]:
    dims = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = _SPEC.match(part)
        if m is None:
            raise ValueError(f"--dynamic: {part!r} must be ARG.DIM=MIN:MAX (ARG: the forward's argument name or "
                             "position; ARG.DIM=ARG.DIM=MIN:MAX for one dim shared by several inputs)")
        targets = tuple(_target(t, names) for t in m["targets"].split("="))
        # named by the forward's argument names whichever way it was written (0.2 and input.2 are one dim)
        dims.append(DynamicDim("=".join(f"{names[i]}.{k}" for i, k in targets), int(m["lo"]), int(m["hi"]), targets))
    if not dims:
        raise ValueError("--dynamic: nothing declared; expected ARG.DIM=MIN:MAX[,...]")
    return tuple(dims)


__all__ = ["DynamicDim", "ShapeError", "ShapeSpec", "arg_names", "parse"]
