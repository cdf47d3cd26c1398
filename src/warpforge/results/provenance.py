"""Where a record came from, and whether the code it timed has changed since.

Each record names its commit in ``git`` (``"<sha>"``, or ``"<sha>-dirty"`` when tracked files differed from
that commit, so the timed code is not exactly any commit) and the software it ran on in ``device`` (``torch``,
``triton``, ``driver``, ``cuda``). :data:`SUITE_SOURCES` maps each suite to the source paths whose change can
move its figures: the suite's own modules, the code it times, and :data:`HARNESS` (timing, ratio rule,
roofline ceilings) for every suite. :func:`stale_groups` asks git which of those paths changed between a
record's commit and a revision (HEAD by default): ``warpforge results stale``.

A test keeps the map complete: every warpforge module a suite imports, directly or through the modules it
imports, lies under one of the suite's paths or in :data:`NOT_TIMED`.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Paths are relative to the repository root; a path ending in "/" is a whole directory.
_B = "src/warpforge/bench/"
_R = "src/warpforge/results/"
_K = "src/warpforge/kernels/"
HARNESS: tuple[str, ...] = (
    "src/warpforge/timing.py", _B + "compare.py", _B + "runner.py", _B + "suite.py", _B + "e2e.py", _R + "ratio.py",
    _R + "host.py", "src/warpforge/hw/roofline.py", "src/warpforge/hw/specs.py", "src/warpforge/settings.py",
)
SUITE_SOURCES: dict[str, tuple[str, ...]] = {
    "kernels": (_B + "suites/kernels.py", _B + "suites/_kernels_fused.py", _B + "suites/_kernels_matmul.py", _K),
    "attention": (_B + "suites/attention.py", _K),
    "memory": (_B + "suites/memory.py", _K),
    # the engine's quantized weights reuse the optimizer's quantizers (optimize/weight_only.py, fp8.py)
    "llm": (_B + "suites/llm.py", _B + "suites/_llm_spec.py", _B + "suites/_llm_static.py", _B + "suites/_inductor.py",
            _B + "suites/_llm_guided.py", _B + "suites/_llm_models.py", _B + "suites/_llm_work.py",
            "src/warpforge/llm/", "src/warpforge/optimize/", _K),
    "vision": (_B + "suites/vision.py", _B + "suites/_vision_peers.py", _B + "suites/_inductor.py",
               _B + "suites/_session.py", _B + "suites/_vision_run.py",
               _B + "suites/_vision_stages.py", _B + "suites/_vision_wall.py", "src/warpforge/zoo/",
               "src/warpforge/optimize/", "src/warpforge/_factory.py", _K),
    "splat": (_B + "suites/splat.py", _B + "suites/_splat_run.py", _B + "suites/_session.py", "src/warpforge/splat/",
              _K),
    "splat_train": (_B + "suites/splat_train.py", "src/warpforge/splat/", _K),
    "serve": (_B + "suites/serve.py", _B + "suites/_serve_stub.py", _B + "suites/llm.py", _B + "suites/_llm_spec.py",
              _B + "suites/_llm_static.py", _B + "suites/_inductor.py", _B + "suites/_llm_guided.py",
              _B + "suites/_llm_models.py", _B + "suites/_llm_work.py", _B + "suites/_serve_clients.py",
              _B + "loadgen/", _B + "serve_cli.py", "src/warpforge/serve/", "src/warpforge/llm/",
              "src/warpforge/optimize/", "src/warpforge/_cli_support.py", _K),
    # benchmarks/profile_h200.py: the profiler against the bench on kernel cases, and model reports
    "profile": ("benchmarks/profile_h200.py", "src/warpforge/profile/", _B + "suites/memory.py",
                _B + "suites/kernels.py", _B + "suites/_kernels_fused.py", _B + "suites/_kernels_matmul.py",
                _B + "suites/attention.py", "src/warpforge/zoo/", "src/warpforge/optimize/",
                "src/warpforge/llm/", "src/warpforge/_factory.py", _K),
}

# Reached by a suite's imports but never run while it times: package roots, terminal output, the record
# schema and store, the probe (its cached figures reach a record through hw/roofline.py, in HARNESS).
NOT_TIMED: tuple[str, ...] = (
    "src/warpforge/__init__.py", _B + "__init__.py", _B + "suites/__init__.py", "src/warpforge/_cli_support.py",
    _B + "cli.py", _R + "__init__.py", _R + "terminal.py", _R + "record.py", _R + "store.py",
    "src/warpforge/hw/probe.py", "src/warpforge/hw/probe_plan.py", "src/warpforge/hw/_probe_kernels.py",
    "src/warpforge/hw/_probe_measure.py",
    # lazy package names, argument checks and dtype spellings: read before anything is timed; the reports'
    # shared stylesheet: written after
    "src/warpforge/_lazy.py", "src/warpforge/_validate.py", "src/warpforge/dtypes.py", "src/warpforge/_html.py",
)


def timed_paths(suite: str) -> tuple[str, ...]:
    """The paths whose change can move ``suite``'s figures (the harness included)."""
    if suite not in SUITE_SOURCES:
        raise KeyError(f"no source map for suite {suite!r} (known: {', '.join(sorted(SUITE_SOURCES))}); "
                       "add it to warpforge.results.provenance.SUITE_SOURCES")
    return HARNESS + SUITE_SOURCES[suite]


def split_git(git: Any) -> tuple[str | None, bool | None]:
    """``"<sha>"`` -> (sha, False); ``"<sha>-dirty"`` -> (sha, True); none or "unknown" -> (None, None)."""
    if not isinstance(git, str) or not git.strip() or git.strip() == "unknown":
        return None, None
    g = git.strip()
    return (g.removesuffix("-dirty"), True) if g.endswith("-dirty") else (g, False)


def provenance(rec: dict[str, Any]) -> dict[str, Any]:
    """A record's commit, dirtiness and software versions (None where it does not say)."""
    sha, dirty = split_git(rec.get("git"))
    dev = raw if isinstance(raw := rec.get("device"), dict) else {}
    return {"commit": sha, "dirty": dirty, "time": rec.get("time"), "device": dev.get("name"),
            **{k: dev.get(k) for k in ("torch", "triton", "driver", "cuda")}}


def missing_provenance(rec: dict[str, Any]) -> list[str]:
    """What a record lacks to say where it came from: a commit, and the torch/Triton (and, on a GPU, driver)
    versions. Empty when it says all of it."""
    p = provenance(rec)
    withdrawn = raw if isinstance(raw := rec.get("withdrawn"), dict) else {}
    out = [] if p["commit"] or "git" in withdrawn else ["git: no commit"]
    want = ("torch", "triton") + (("driver",) if p["device"] not in (None, "cpu") else ())
    out += [f"device.{k}: missing" for k in want if not p[k]]
    return out


# ---- git -----------------------------------------------------------------------------------------

class GitError(RuntimeError):
    """git is missing, or the directory is not in a git checkout."""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise GitError(f"git {' '.join(args[:2])} failed: {e}") from None


def repo_root(path: str | Path) -> Path:
    """The top of the git checkout holding ``path``."""
    p = Path(path).resolve()
    r = _git(p if p.is_dir() else p.parent, "rev-parse", "--show-toplevel")
    if r.returncode != 0:
        raise GitError(f"{path} is not inside a git checkout ({r.stderr.strip() or 'git rev-parse failed'})")
    return Path(r.stdout.strip())


def resolve_commit(repo: Path, rev: str) -> str | None:
    """The full sha of ``rev`` (a short sha works), or None when the checkout does not have it."""
    r = _git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    return r.stdout.strip() or None if r.returncode == 0 else None


# ---- staleness -----------------------------------------------------------------------------------

@dataclass
class Group:
    """The records of one file measured at one commit, and what changed in their timed code since."""

    file: str
    suite: str
    git: str | None
    cases: list[str] = field(default_factory=list)
    status: str = ""  # "current", "stale", "dirty", "unknown commit", "no source map"
    changed: list[str] = field(default_factory=list)  # timed paths changed between the commit and the revision
    commits: int = 0  # commits since the record's that touched those paths
    time: str | None = None  # the newest record's time

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "suite": self.suite, "git": self.git, "cases": self.cases, "status": self.status,
                "changed": self.changed, "commits": self.commits, "time": self.time}


def _read(path: Path) -> list[dict[str, Any]]:
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e})") from None
    return out


def group_records(files: Iterable[Path], root: Path) -> list[Group]:
    """Records grouped by (file, suite, commit) in file order."""
    groups: dict[tuple[str, str, str | None], Group] = {}
    for f in files:
        rel = str(f.resolve().relative_to(root)) if f.resolve().is_relative_to(root) else str(f)
        for rec in _read(f):
            key = (rel, str(rec.get("suite")), rec.get("git"))
            g = groups.setdefault(key, Group(file=rel, suite=key[1], git=key[2]))
            g.cases.append(str(rec.get("case")))
            t = rec.get("time")
            if isinstance(t, str) and (g.time is None or t > g.time):
                g.time = t
    return list(groups.values())


def check_group(g: Group, repo: Path, head: str) -> Group:
    """Fill in ``status``, ``changed`` and ``commits`` of one group against the full sha ``head``."""
    sha, dirty = split_git(g.git)
    try:
        paths = timed_paths(g.suite)
    except KeyError:
        g.status = "no source map"
        return g
    full = resolve_commit(repo, sha) if sha else None
    if full is None:
        g.status = "unknown commit"
        return g
    spec = ["--", *paths]
    diff = _git(repo, "diff", "--name-only", full, head, *spec)
    g.changed = sorted(x for x in diff.stdout.splitlines() if x.strip())
    count = _git(repo, "rev-list", "--count", f"{full}..{head}", *spec)
    g.commits = int(count.stdout.strip() or 0) if count.returncode == 0 else 0
    g.status = "dirty" if dirty else "stale" if g.changed else "current"
    return g


def stale_groups(paths: Sequence[str | Path], rev: str = "HEAD") -> list[Group]:
    """Every (file, suite, commit) group of the JSONL records under ``paths`` (files or directories), checked
    against ``rev``. Raises GitError outside a checkout or for an unknown ``rev``; FileNotFoundError for a
    path that does not exist."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.jsonl"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no records at {p} (expected a .jsonl file or a directory of them)")
    if not files:
        return []
    repo = repo_root(files[0])
    head = resolve_commit(repo, rev)
    if head is None:
        raise GitError(f"--rev {rev!r}: no such commit in {repo}")
    return [check_group(g, repo, head) for g in group_records(files, repo)]


__all__ = ["HARNESS", "NOT_TIMED", "SUITE_SOURCES", "GitError", "Group", "check_group", "group_records",
           "missing_provenance", "provenance", "repo_root", "resolve_commit", "split_git", "stale_groups",
           "timed_paths"]
