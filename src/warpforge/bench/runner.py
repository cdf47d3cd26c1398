"""Find suites, run their cases side by side, and emit one record per case.

The hot path is ``run_suite``: build the cases, then for each one ``compare_case`` (check, time)
and ``build_record``. Device facts, the git version and the roofline ceilings are gathered once; the
host's load (``results.host.check_host``) before each case, and kept in its record.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

import torch

from warpforge.bench import suites as _suites_pkg
from warpforge.bench.compare import CaseResult, Outcome, build_record, case_seed, compare_case
from warpforge.bench.suite import EndToEndCase, Suite
from warpforge.results.host import check_host
from warpforge.results.record import device_info, git_version

# (warmup, rep): quick trades spread for speed; the full run keeps enough repeats for a stable p20/p80.
REPEATS = {False: (10, 50), True: (3, 15)}

Progress = Callable[[int, int, str], None]  # (cases done, cases total, name of the case starting)


class UnknownSuiteError(LookupError):
    """No suite of that name; the message lists the available ones."""


def list_suites() -> list[str]:
    """Suite names: modules under warpforge.bench.suites (dotted for sub-packages), none starting with "_"."""
    names = []
    for info in pkgutil.walk_packages(_suites_pkg.__path__, prefix=""):
        if info.ispkg or any(part.startswith("_") for part in info.name.split(".")):
            continue
        names.append(info.name)
    return sorted(names)


def load_suite(name: str) -> Suite:
    """Import ``warpforge.bench.suites.<name>`` and return its SUITE."""
    available = list_suites()
    if name not in available:
        raise UnknownSuiteError(f"unknown suite {name!r}; available: {', '.join(available) or '(none)'}")
    module = importlib.import_module(f"{_suites_pkg.__name__}.{name}")
    suite = getattr(module, "SUITE", None)
    if not isinstance(suite, Suite):
        raise TypeError(f"{module.__name__} must define SUITE = Suite(...)")
    if suite.name != name:
        raise ValueError(f"{module.__name__}: SUITE.name is {suite.name!r}, expected {name!r} (its module name)")
    return suite


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _ceilings(device: torch.device) -> Any:
    """The roofline's ceilings for this device: measured (probe cache) or datasheet, else None.

    Nominal estimates (a CPU or an unknown GPU without a probe cache) are not used: a roofline
    fraction against a guessed ceiling would be an invented number, so the record says null.
    """
    if device.type == "cpu":
        # CPU runs use cache-resident sizes on the torch reference path: a fraction of the DRAM
        # roofline would read above 100% and mean nothing.
        return None
    try:
        from warpforge.hw.roofline import ceilings

        ceil = ceilings(device)
    except Exception:  # noqa: BLE001 - hw part absent or device unknown: the record says null
        return None
    source = str(getattr(ceil, "source", ""))
    return ceil if source.startswith(("probe", "datasheet")) else None


def run_suite(suite: Suite, *, quick: bool = False, case_filter: str | None = None,
              progress: Progress | None = None, device: torch.device | str | None = None,
              records: list[dict] | None = None, on_record: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every case (whose name contains ``case_filter``) and return one record per case.

    Records are appended to ``records`` (if given) and passed to ``on_record`` as each case
    finishes, so a caller interrupted mid-suite still holds every finished case.
    """
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    cases = suite.build(quick)
    if case_filter:  # a substring of the case name; "a|b" for any of several
        alts = [x.strip() for x in case_filter.split("|") if x.strip()] if "|" in case_filter else [case_filter]
        cases = [c for c in cases if any(a in c.name for a in alts)]
    warmup, rep = REPEATS[bool(quick)]
    env = {"suite": suite.name, "device": device_info(dev), "git": git_version(), "ceil": _ceilings(dev)}
    records = [] if records is None else records

    def add(record: dict) -> None:
        records.append(record)
        if on_record is not None:
            on_record(record)

    for i, case in enumerate(cases):
        if progress is not None:
            progress(i, len(cases), case.name)
        host = check_host(dev).as_dict()
        if isinstance(case, EndToEndCase):  # whole runs, timed by wall clock with their own figures
            from warpforge.bench.e2e import run_end_to_end

            add(run_end_to_end(case, suite=suite.name, device=dev, env_device=env["device"],
                               git=env["git"], ceil=env["ceil"], host=host))
            continue
        try:
            result = compare_case(case, suite=suite.name, device=dev, warmup=warmup, rep=rep)
        except Exception as e:  # noqa: BLE001 - a broken case (its inputs or reference) fails alone
            result = CaseResult(case=case, seed=case_seed(suite.name, case.name), device=dev,
                                ours=Outcome(error=f"case failed before timing: {type(e).__name__}: {str(e)[:400]}"),
                                warmup=warmup, rep=rep, interleaved=False)
        add(build_record(result, **env, host=host))
        if dev.type == "cuda":
            torch.cuda.empty_cache()  # the next case's 1 GiB inputs should not fight this one's cache
    if progress is not None:
        progress(len(cases), len(cases), "")
    return records
