"""Layering (docs/design.md): which part may import which, and no import cycles among warpforge's modules."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "warpforge"

# ---- which part may import which --------------------------------------------------------------------------
# A part is a top-level package or module of warpforge; the benchmark suites are a part of their own. Each
# part lists the parts it may import (its own modules always). The rules form a DAG (checked below), so a
# pair of parts can never import each other, and a new edge is a decision made here, not an accident.
# The floor: shared helpers every part may use; they import no part (``_cli_support`` reads settings).
FLOOR = {"warpforge", "settings", "dtypes", "timing", "_validate", "_lazy", "_factory", "_cli_support", "_html"}
MAY_IMPORT: dict[str, set[str]] = {
    "warpforge": set(),  # the package itself: its version, and the optimizer on first attribute access
    "settings": set(), "dtypes": set(), "timing": set(), "_validate": set(), "_lazy": set(), "_factory": set(),
    "_html": set(),
    "_cli_support": {"settings"},
    "kernels": {"settings"},  # torch and triton only (test_kernels_import_only_torch_triton_and_stdlib)
    "hw": FLOOR | {"kernels"},
    # the results system: records and their ratio rule, the store, history, tables, the report, the host's state.
    # It reads records and never runs a case: the floor alone, so the harness and every product can use it.
    "results": set(FLOOR),
    # bench's harness, load generator and commands: product-free, so any product can use them
    "bench": FLOOR | {"kernels", "hw", "results"},
    "zoo": FLOOR | {"kernels"},  # the vision model zoo (the decoder architectures are llm.models)
    "llm": FLOOR | {"kernels"},
    "splat": FLOOR | {"kernels"},
    "serve": FLOOR | {"kernels", "llm"},
    # the optimizer's figures are the results part's ratios and host description
    "optimize": FLOOR | {"kernels", "hw", "results", "zoo"},
    # profile's targets are the products' models (an engine step, a zoo model, an optimized artifact) and the
    # bench's kernel cases (loaded through bench's runner); its host check is the results part's
    "profile": FLOOR | {"kernels", "hw", "results", "bench", "zoo", "llm", "optimize"},
    # the suites measure the products against their peers, through bench's harness
    "bench.suites": FLOOR | {"kernels", "hw", "results", "bench", "zoo", "llm", "serve", "splat", "optimize",
                             "profile"},
    "examples": FLOOR | {"kernels", "zoo", "optimize", "profile"},
    "demo": FLOOR | {"kernels", "hw", "results", "bench", "zoo", "llm", "serve", "splat", "optimize", "profile"},
    "cli": FLOOR | {"kernels", "hw", "results", "bench", "bench.suites", "zoo", "llm", "serve", "splat",
                    "optimize", "profile", "demo"},
    "__main__": {"cli"},
}
# Single module edges that cross the rules above, each with its reason.
ALLOWED_EDGES = {
    # The runner finds suites by walking the (empty) suites package and imports each by name.
    ("warpforge.bench.runner", "warpforge.bench.suites"): "suite discovery",
    # `warpforge bench serve` is the serve suite's command: without --url it runs the suite, and a GGUF given as
    # --tokenizer is read through the suite module (which may import warpforge.llm; the command may not).
    ("warpforge.bench.serve_cli", "warpforge.bench.suites.serve"): "the serve suite's command",
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _part(module: str) -> str:
    """warpforge.llm.engine -> llm; warpforge.bench.suites.llm -> bench.suites; warpforge -> warpforge."""
    names = module.split(".")[1:]
    if names[:2] == ["bench", "suites"] and len(names) > 2:
        return "bench.suites"
    return names[0] if names else "warpforge"


# ---- private names stay in their part -----------------------------------------------------------------------
# Another part's ``_module`` or ``_name`` is its implementation: import its public API instead. The floor's
# modules are private to warpforge, not to a part (every part may use them). Reach-ins not yet removed are
# listed (the test fails on one that is gone, so the list only shrinks).
PENDING_REACH_INS: set[str] = set()


def _private_reach_ins(path: Path, module: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] != "warpforge" or _part(name) == _part(module) or (len(parts) > 1 and parts[1] in FLOOR):
                continue
            if any(p.startswith("_") and not p.startswith("__") for p in parts[2:]):
                out.append(f"{module} imports {name}")
    return out


def test_no_part_imports_another_parts_private_names():
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        if bad := _private_reach_ins(path, module):
            found[module] = bad
    new = [line for module, lines in found.items() if module not in PENDING_REACH_INS for line in lines]
    assert not new, "private names of another part:\n" + "\n".join(new)
    gone = sorted(PENDING_REACH_INS - set(found))
    assert not gone, f"no longer reaching in: remove from PENDING_REACH_INS: {gone}"


def test_kernels_import_only_torch_triton_and_stdlib():
    import sys

    allowed = {"torch", "triton", "warpforge", "numpy"} | set(sys.stdlib_module_names)
    bad = []
    for path in sorted((SRC / "kernels").rglob("*.py")):
        for name in _imports(path):
            top = name.split(".")[0]
            if top not in allowed:
                bad.append(f"{path.relative_to(SRC)} imports {name}")
            sub = name.split(".")[1] if top == "warpforge" and "." in name else None
            if sub is not None and sub not in {"kernels", "settings"}:
                bad.append(f"{path.relative_to(SRC)} imports {name} (kernels import only warpforge.kernels)")
    assert not bad, "\n".join(bad)


def test_timing_is_at_the_bottom():
    """The timing primitives are shared by hw (probe), bench and optimize: they import torch, numpy and the
    standard library only."""
    import sys

    allowed = {"torch", "numpy"} | set(sys.stdlib_module_names)
    bad = [n for n in _imports(SRC / "timing.py") if n.split(".")[0] not in allowed]
    assert not bad, "\n".join(bad)


# ---- import cycles ----------------------------------------------------------------------------------------
# Every import statement counts: at module level, under TYPE_CHECKING and inside functions (an import moved
# into a function still ties the two modules together; it only hides the cycle from Python's loader).
# Cycles not yet untangled, to be removed from here when they are (the test fails on one that is gone).
PENDING_CYCLES: list[set[str]] = []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_graph() -> dict[str, set[str]]:
    """warpforge module -> the warpforge modules it imports (``from pkg import sub`` names pkg.sub)."""
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names)
        graph[name] = set()
        for t in targets:
            while t and t not in files:  # warpforge.x.y.Name -> the module that defines it
                t = t.rpartition(".")[0]
            if t.startswith("warpforge") and t != name:
                graph[name].add(t)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_among_warpforge_modules():
    graph = _module_graph()
    assert "warpforge.llm.models" in graph["warpforge.llm.loader"]  # the walk sees real imports
    cycles = _cycles(graph)
    new = [sorted(c) for c in cycles if c not in PENDING_CYCLES]
    gone = [sorted(c) for c in PENDING_CYCLES if c not in cycles]
    assert not new, f"import cycles (move the shared piece into a module both can import): {new}"
    assert not gone, f"no longer cycles: remove them from PENDING_CYCLES: {gone}"


def test_the_rules_form_a_dag():
    assert _cycles({part: {p for p in allowed if p != part} for part, allowed in MAY_IMPORT.items()}) == []
    assert all(p in MAY_IMPORT for allowed in MAY_IMPORT.values() for p in allowed)


def test_every_part_imports_only_what_its_rules_allow():
    graph = _module_graph()
    unknown = sorted({_part(m) for m in graph} - set(MAY_IMPORT))
    assert not unknown, f"new parts: give each its place in MAY_IMPORT: {unknown}"
    bad = []
    for module, targets in sorted(graph.items()):
        part = _part(module)
        for t in sorted(targets):
            if _part(t) != part and _part(t) not in MAY_IMPORT[part] and (module, t) not in ALLOWED_EDGES:
                bad.append(f"{module} ({part}) imports {t} ({_part(t)})")
    assert not bad, "imports against the layering (move the shared piece down a layer):\n" + "\n".join(bad)
    used = {(m, t) for m, targets in graph.items() for t in targets}
    assert set(ALLOWED_EDGES) <= used, f"no longer imported: remove from ALLOWED_EDGES: {set(ALLOWED_EDGES) - used}"


def test_the_rule_check_sees_an_upward_import():
    assert _part("warpforge.bench.suites.llm") == "bench.suites" and _part("warpforge.bench.runner") == "bench"
    assert _part("warpforge.bench.suites") == "bench" and _part("warpforge") == "warpforge"
    assert "optimize" not in MAY_IMPORT["llm"] and "llm" not in MAY_IMPORT["bench"]
    assert "bench" not in MAY_IMPORT["results"] and "bench" not in MAY_IMPORT["optimize"]
