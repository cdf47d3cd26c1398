"""`warpforge results stale`: the suite -> timed source map is complete, and git says which records are stale."""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

import pytest

from warpforge.results.provenance import NOT_TIMED, SUITE_SOURCES, stale_groups, timed_paths
from warpforge.bench.runner import list_suites

from .conftest import fake_record

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"


def _module_file(name: str) -> Path | None:
    p = SRC.joinpath(*name.split("."))
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    return p / "__init__.py" if (p / "__init__.py").is_file() else None


def _imports(path: Path) -> set[str]:
    """warpforge modules ``path`` imports (function-local imports too): a ``from pkg import name`` names the
    submodule when there is one, else the package (whose __init__ then holds or re-exports the name)."""
    pkg = ".".join(path.relative_to(SRC).with_suffix("").parts) if path.is_relative_to(SRC) else "script"
    base = pkg.removesuffix(".__init__") if path.name == "__init__.py" else pkg.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("warpforge"))
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                parts = base.split(".")[: len(base.split(".")) - node.level + 1]
                mod = ".".join(parts + ([mod] if mod else []))
            if not mod.startswith("warpforge"):
                continue
            subs = [f"{mod}.{a.name}" for a in node.names if _module_file(f"{mod}.{a.name}")]
            out.update(subs)
            if len(subs) < len(node.names):
                out.add(mod)
    return out


def _closure(module: str, script: Path | None = None) -> set[Path]:
    seen, todo, files = set(), [module] if script is None else sorted(_imports(script)), set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        f = _module_file(m)
        if f is not None:
            files.add(f)
            todo.extend(_imports(f))
    return files


def _covered(path: Path, paths: tuple[str, ...]) -> bool:
    rel = str(path.relative_to(REPO))
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in paths)


@pytest.mark.parametrize("suite", list_suites())
def test_the_map_covers_every_module_a_suite_reaches(suite):
    paths = timed_paths(suite) + NOT_TIMED
    missing = sorted(str(f.relative_to(REPO)) for f in _closure(f"warpforge.bench.suites.{suite}")
                     if not _covered(f, paths))
    assert not missing, f"add to SUITE_SOURCES[{suite!r}] in warpforge/results/provenance.py: {missing}"


def test_the_map_covers_the_profile_script():
    script = REPO / "benchmarks" / "profile_h200.py"
    paths = timed_paths("profile") + NOT_TIMED
    missing = sorted(str(f.relative_to(REPO)) for f in _closure("", script) if not _covered(f, paths))
    assert not missing, f"add to SUITE_SOURCES['profile'] in warpforge/results/provenance.py: {missing}"


def test_every_map_path_exists_and_unknown_suites_are_named():
    for suite in SUITE_SOURCES:
        for p in timed_paths(suite) + NOT_TIMED:
            assert (REPO / p).exists(), f"{suite}: {p} does not exist"
    with pytest.raises(KeyError, match="no source map for suite 'nope'"):
        timed_paths("nope")


# ---- staleness in a scratch repository -------------------------------------------------------------

def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    r = tmp_path / "repo"
    (r / "src/warpforge/kernels").mkdir(parents=True)
    (r / "src/warpforge/bench/suites").mkdir(parents=True)
    (r / "results").mkdir()
    _git(r, "init", "-q")
    _git(r, "config", "user.email", "t@example.com")
    _git(r, "config", "user.name", "t")
    (r / "src/warpforge/kernels/memory.py").write_text("x = 1\n")
    (r / "src/warpforge/bench/suites/memory.py").write_text("y = 1\n")
    (r / "README.md").write_text("hi\n")
    _git(r, "add", "-A")
    _git(r, "commit", "-q", "-m", "first")
    return r


def _write(repo: Path, name: str, records: list[dict]) -> None:
    (repo / "results" / name).write_text("".join(json.dumps(x) + "\n" for x in records))


def test_stale_current_dirty_and_unknown(repo):
    first = _git(repo, "rev-parse", "HEAD")
    recs = [dict(fake_record("copy", suite="memory"), git=first[:7]),
            dict(fake_record("fill", suite="memory"), git=first + "-dirty"),
            dict(fake_record("x", suite="memory"), git="0123456789abcdef")]
    _write(repo, "memory.jsonl", recs)
    got = {g.git: g for g in stale_groups([repo / "results"])}
    assert got[first[:7]].status == "current" and got[first[:7]].cases == ["copy"] and got[first[:7]].commits == 0
    assert got[first + "-dirty"].status == "dirty"
    assert got["0123456789abcdef"].status == "unknown commit"

    (repo / "README.md").write_text("not timed code\n")
    _git(repo, "commit", "-q", "-am", "docs")
    assert {g.git: g.status for g in stale_groups([repo / "results"])}[first[:7]] == "current"

    (repo / "src/warpforge/kernels/memory.py").write_text("x = 2\n")
    _git(repo, "commit", "-q", "-am", "kernel change")
    g = {g.git: g for g in stale_groups([repo / "results" / "memory.jsonl"])}[first[:7]]
    assert g.status == "stale" and g.changed == ["src/warpforge/kernels/memory.py"] and g.commits == 1
    # against the first commit itself it is current again
    assert {g.git: g.status for g in stale_groups([repo / "results"], rev=first)}[first[:7]] == "current"


def test_stale_cli(repo, monkeypatch):
    from click.testing import CliRunner

    from warpforge.cli import main

    first = _git(repo, "rev-parse", "HEAD")
    _write(repo, "memory.jsonl", [dict(fake_record("copy", suite="memory"), git=first)])
    run = CliRunner().invoke(main, ["results", "stale", str(repo / "results"), "--json"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)[0]["status"] == "current"
    (repo / "src/warpforge/bench/suites/memory.py").write_text("y = 2\n")
    _git(repo, "commit", "-q", "-am", "suite change")
    run = CliRunner().invoke(main, ["results", "stale", str(repo / "results"), "--strict"])
    assert run.exit_code == 1 and "stale" in run.output and "bench/suites/memory.py" in run.output
    run = CliRunner().invoke(main, ["results", "stale", str(repo / "nowhere")])
    assert run.exit_code == 2 and "no records at" in run.output
    run = CliRunner().invoke(main, ["results", "stale", str(repo / "results"), "--rev", "nope"])
    assert run.exit_code == 2 and "--rev 'nope'" in run.output


def test_a_generated_table_marks_rows_whose_timed_code_changed(repo):
    """`results table --update` with the repository at hand: a row measured before a change to its suite's
    timed code says "**stale** (N commits since)"; the committed-table check ignores that moving note."""
    from warpforge.results.tables import STALE_NOTE, check_markdown, stale_loader, update_markdown

    first = _git(repo, "rev-parse", "HEAD")
    rec = dict(fake_record("copy", suite="memory"), git=first)
    _write(repo, "memory.jsonl", [rec])
    load = lambda suite: [rec] if suite == "memory" else []  # noqa: E731
    doc = "<!-- results:table suite=memory -->\n<!-- /results:table -->\n"
    fresh, _ = update_markdown(doc, stale_loader(load, repo))
    assert "stale" not in fresh and f"@ {first[:7]}" in fresh
    for i in (2, 3):
        (repo / "src/warpforge/kernels/memory.py").write_text(f"x = {i}\n")
        _git(repo, "commit", "-q", "-am", f"kernel change {i}")
    marked, _ = update_markdown(doc, stale_loader(load, repo))
    assert "**stale** (2 commits since)" in marked and STALE_NOTE.sub("", marked) == fresh
    assert check_markdown(marked, load) == [] and check_markdown(fresh, load) == []
