"""DESIGN.md: arrows point inward only. kernels, hw and bench import no product part."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "warpforge"
PRODUCTS = {"llm", "serve", "optimize", "splat", "profile", "models", "cli", "demo"}
LOWER = ["kernels", "hw", "bench"]
# bench/suites/ measure the products (a suite runs warpforge.llm end to end against its peers), so they
# may import them, inside their case functions; the core of bench (timing, records, store, runner) stays
# product-free and is still checked.
EXEMPT = {"bench": ("suites",)}


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


@pytest.mark.parametrize("part", LOWER)
def test_lower_layers_import_no_product(part):
    bad = []
    for path in sorted((SRC / part).rglob("*.py")):
        if path.relative_to(SRC / part).parts[0] in EXEMPT.get(part, ()):
            continue
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "warpforge" and len(parts) > 1 and parts[1] in PRODUCTS:
                bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert not bad, "\n".join(bad)


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
