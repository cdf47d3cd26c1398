"""``warpforge probe``: measure the machine's real ceilings and set them beside the datasheet.

On a GPU (full run < 60 s, ``--quick`` < 20 s on an H200):
  HBM read / write / copy with warpforge's own memory kernels (and torch's copy beside them);
  a working-set sweep 1..512 MiB showing the L2 plateau and the cliff into HBM;
  L1 / L2 / HBM load-to-use latency by pointer chasing, in SM cycles and ns;
  cuBLAS matmul TFLOP/s in fp32, tf32, fp16, bf16, fp8 (e4m3) and int8 at 8192^3;
  kernel launch cost, eager and inside a CUDA graph; host <-> device copies, pinned and pageable.
Without a GPU: host memory copy and fp32 matmul through torch, and a line that says so.

The result is one JSON-able dict; ``warpforge probe`` caches it per device under
``cache_dir()/probe/<device slug>.json``, where :func:`warpforge.hw.roofline.ceilings` reads it.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import os
import platform
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from warpforge.hw.probe_plan import FULL, QUICK, GiB, MiB, ProbePlan
from warpforge.hw.specs import DeviceSpec, spec_for

SCHEMA = 1
Progress = Callable[[str, int, int], None]  # (step description, steps done, steps in all)


# ---- device identity and the cache ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    """"CPU <model name>" from /proc/cpuinfo (or the platform): the CPU's device name for the cache."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name") and ":" in line:
                    return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU " + (platform.processor() or platform.machine() or "unknown")


def current_device_name() -> str:
    return torch.cuda.get_device_name(torch.cuda.current_device()) if torch.cuda.is_available() else cpu_name()


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def cache_path(device_name: str) -> Path:
    """``cache_dir()/probe/<slug>.json``, e.g. ``.../probe/nvidia-h200.json``."""
    from warpforge.settings import cache_dir

    return cache_dir() / "probe" / f"{_slug(device_name)}.json"


def load_cached(device_name: str | None = None) -> dict | None:
    """The cached probe result of a device (default: the current one), or None if absent or unreadable."""
    path = cache_path(device_name or current_device_name())
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(result, dict) or result.get("schema") != SCHEMA or "device" not in result:
        return None
    return result


def save_cache(result: dict) -> Path:
    """Write ``result`` to its device's cache file atomically (temp file + os.replace); returns the path."""
    path = cache_path(result["device"]["name"])
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# ---- running the probe ------------------------------------------------------------------------------

def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
        return out.strip().splitlines()[0] if out.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _versions() -> dict[str, Any]:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def _gpu_device_info(dev: torch.device, spec: DeviceSpec | None) -> dict[str, Any]:
    p = torch.cuda.get_device_properties(dev)
    l2 = getattr(p, "L2_cache_size", 0) or int((spec.l2_MiB if spec else 50) * MiB)
    return {"name": p.name, "kind": "cuda", "index": dev.index, "cc": f"{p.major}.{p.minor}",
            "sms": p.multi_processor_count, "l2_bytes": l2, "l2_MiB": l2 / MiB,
            "mem_GiB": p.total_memory / GiB, "driver": _driver_version(), **_versions()}


def _gpu_steps(plan: ProbePlan, info: dict[str, Any]) -> list[tuple[str, str, Callable[[], Any]]]:
    from warpforge.hw import _probe_measure as m

    dev = torch.device("cuda", info["index"])
    gen = torch.Generator(device=dev).manual_seed(0)
    total_mem = int(info["mem_GiB"] * GiB)
    return [
        ("HBM read, write, copy", "hbm", lambda: m.measure_hbm(dev, plan, gen, total_mem)),
        (f"cache sweep {min(plan.sweep_MiB)}-{max(plan.sweep_MiB)} MiB", "sweep",
         lambda: m.measure_sweep(dev, plan, gen, info["sms"], info["l2_MiB"])),
        ("pointer-chase latency L1 / L2 / HBM", "latency",
         lambda: m.measure_latency(dev, plan, gen, info["sms"], info["l2_bytes"])),
        (f"cuBLAS matmul {plan.matmul_n}^3 fp32..int8", "matmul", lambda: m.measure_matmul(dev, plan, gen)),
        ("kernel launch cost, eager and graph", "launch", lambda: m.measure_launch(dev, plan, gen)),
        ("host <-> device copies", "pcie", lambda: m.measure_pcie(dev, plan, gen)),
    ]


def run_probe(quick: bool = False, progress: Progress | None = None) -> dict[str, Any]:
    """Measure everything this machine offers; see the module docstring. A failing step is recorded
    as ``{"error": ...}`` under its key and the others still run."""
    plan = QUICK if quick else FULL
    t_start = time.perf_counter()
    result: dict[str, Any] = {"schema": SCHEMA, "time": _dt.datetime.now(_dt.timezone.utc).isoformat(
        timespec="seconds"), "quick": quick}
    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        spec = spec_for(torch.cuda.get_device_name(dev))
        info = _gpu_device_info(dev, spec)
        steps = _gpu_steps(plan, info)
    else:
        from warpforge.hw import _probe_measure as m

        spec = None
        info = {"name": cpu_name(), "kind": "cpu", "threads": torch.get_num_threads(), **_versions()}
        steps = [("CPU memory copy and fp32 matmul", "cpu", lambda: m.measure_cpu(plan))]
    result["device"] = info
    result["datasheet"] = spec.as_dict() if spec else None
    result["step_s"] = {}
    for i, (label, key, fn) in enumerate(steps):
        if progress:
            progress(label, i, len(steps))
        t0 = time.perf_counter()
        try:
            result[key] = fn()
        except Exception as e:  # noqa: BLE001 - one broken measurement must not hide the others
            result[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
        finally:
            if torch.cuda.is_available():
                try:  # a step's CUDA error can resurface here; it is already recorded
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                except RuntimeError:
                    pass
        result["step_s"][key] = time.perf_counter() - t0
    if progress:
        progress("done", len(steps), len(steps))
    result["figures"] = figures(result)
    result["elapsed_s"] = time.perf_counter() - t_start
    return _finite(result)


def _finite(x: Any) -> Any:
    """JSON-safe copy: non-finite floats (a failed timing) become None, tuples become lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


# ---- the figures: measured beside datasheet ---------------------------------------------------------

def _row(figure: str, unit: str, measured: float | None, datasheet: float | None = None, text: str | None = None,
         error: str | None = None) -> dict[str, Any]:
    frac = measured / datasheet if (measured is not None and datasheet) else None
    return {"figure": figure, "unit": unit, "measured": measured, "datasheet": datasheet, "fraction": frac,
            "text": text, "error": error}


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def figures(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of the probe table: {figure, unit, measured, datasheet, fraction, text, error}."""
    sheet = result.get("datasheet") or {}
    rows: list[dict[str, Any]] = []
    if result["device"].get("kind") == "cpu":
        cpu = result.get("cpu", {})
        err = cpu.get("error")
        rows.append(_row("host memory copy (read + write)", "GB/s", cpu.get("memcpy_GBps"), error=err))
        rows.append(_row(f"CPU fp32 matmul {cpu.get('matmul_n', '')}^3", "GFLOP/s", cpu.get("fp32_matmul_GFLOPs"),
                         error=err))
        return rows

    hbm, bw = result.get("hbm", {}), sheet.get("hbm_GBps")
    for key, label in (("read_GBps", "HBM read (warpforge sum)"), ("write_GBps", "HBM write (warpforge fill)"),
                       ("copy_GBps", "HBM copy (warpforge copy, read + write)"),
                       ("torch_copy_GBps", "HBM copy (torch copy_, read + write)")):
        rows.append(_row(label, "GB/s", hbm.get(key), bw, error=hbm.get("error")))
    sw = result.get("sweep", {})
    rows.append(_row("L2 bandwidth plateau (sets <= L2/2)", "GB/s", sw.get("plateau_GBps"), error=sw.get("error")))
    rows.append(_row("HBM stream (sweep, sets >= 4x L2)", "GB/s", sw.get("stream_GBps"), bw, error=sw.get("error")))
    if "error" not in sw:
        cliff = sw.get("cliff_MiB")
        rows.append(_row("L2 cliff (working set)", "MiB", cliff, sheet.get("l2_MiB"),
                         text=None if cliff is not None else "no cliff found"))
    lat = result.get("latency", {})
    for level, label in (("l1", "L1"), ("l2", "L2"), ("hbm", "HBM")):
        cyc, ns = _get(lat, level, "cycles"), _get(lat, level, "ns")
        text = f"{cyc:,.0f} cycles, {ns:,.1f} ns" if cyc is not None and ns is not None else None
        if text and _get(lat, level, "chain_ok") is False:
            text += " (chain WRONG)"
        rows.append(_row(f"{label} load-to-use latency", "cycles", cyc, text=text, error=lat.get("error")))
    rows.append(_row("SM clock during the chase", "MHz", lat.get("clock_MHz"), sheet.get("sm_clock_MHz"),
                     error=lat.get("error")))
    mm = result.get("matmul", {})
    for prec in ("fp32", "tf32", "fp16", "bf16", "fp8", "int8"):
        e = mm.get(prec, {}) if "error" not in mm else mm
        unit = "TOPS" if prec == "int8" else "TFLOP/s"
        rows.append(_row(f"matmul {prec} (cuBLAS)", unit, e.get("tflops"), sheet.get(prec), error=e.get("error")))
    la = result.get("launch", {})
    rows.append(_row("launch, eager (per kernel)", "us", la.get("eager_us"),
                     text=f"{la['eager_us']:.2f} us ({la['eager_per_s']:,.0f}/s)" if "eager_us" in la else None,
                     error=la.get("error")))
    rows.append(_row("launch, inside a CUDA graph (per kernel)", "us", la.get("graph_us"), error=la.get("error")))
    pc, link = result.get("pcie", {}), sheet.get("pcie_GBps")
    for key, label in (("h2d_pinned_GBps", "host->device, pinned"), ("d2h_pinned_GBps", "device->host, pinned"),
                       ("h2d_pageable_GBps", "host->device, pageable"),
                       ("d2h_pageable_GBps", "device->host, pageable")):
        rows.append(_row(label, "GB/s", pc.get(key), link, error=pc.get("error")))
    return rows


# ---- the command ------------------------------------------------------------------------------------

def format_value(v: float | None, unit: str) -> str:
    """A probe figure with its unit as the table prints it (the demo's headline too); "-" for none."""
    if v is None:
        return "-"
    if unit in ("GB/s", "MHz", "cycles", "GFLOP/s"):
        return f"{v:,.0f} {unit}"
    if unit == "us":
        return f"{v:.2f} us"
    if unit == "MiB":
        return f"{v:g} MiB"
    return f"{v:,.1f} {unit}"


def render(result: dict[str, Any], console) -> None:
    """The probe table (figure | measured | datasheet | fraction) and, on a GPU, the sweep."""
    from rich.table import Table

    dev, sheet = result["device"], result.get("datasheet")
    title = f"warpforge probe: {dev['name']}"
    if sheet:
        title += f"\ndatasheet: {sheet['name']}, from the {sheet['source']}"
    table = Table(title=title, title_justify="left")
    for col, just in (("figure", "left"), ("measured", "right"), ("datasheet", "right"), ("fraction", "right")):
        table.add_column(col, justify=just)
    for r in result["figures"]:
        if r["error"]:
            measured = f"[red]error: {r['error'][:60]}[/red]"
        else:
            measured = r["text"] or format_value(r["measured"], r["unit"])
        frac = f"{100 * r['fraction']:.0f}%" if r["fraction"] is not None else "-"
        table.add_row(r["figure"], measured, format_value(r["datasheet"], r["unit"]), frac)
    console.print(table)
    points = _get(result, "sweep", "points")
    if points:
        top = max(p["GBps"] for p in points)
        sweep = Table(title="working-set sweep (.cg loads, one persistent launch per sample)", title_justify="left")
        sweep.add_column("set", justify="right")
        sweep.add_column("GB/s", justify="right")
        sweep.add_column("")
        cliff = result["sweep"].get("cliff_MiB")
        for p in points:
            bar = "#" * max(1, round(40 * p["GBps"] / top))
            mark = "  <- cliff" if p["MiB"] == cliff else ""
            sweep.add_row(f"{p['MiB']} MiB", f"{p['GBps']:,.0f}", bar + mark)
        console.print(sweep)
    console.print(f"probe took {result['elapsed_s']:.1f} s" + (" (--quick)" if result.get("quick") else ""))


def cli_probe(quick: bool, json_out: str | None, use_cache: bool, console) -> int:
    """What ``warpforge probe`` runs: measure with a progress bar, print the table, cache, exit 0.

    ``json_out``: a file to write the result to as well, or "-" for the JSON alone on stdout (the rest
    then goes to stderr)."""
    from rich.progress import BarColumn, Progress as RichProgress, SpinnerColumn, TextColumn, TimeElapsedColumn

    if json_out == "-":
        from warpforge._cli_support import make_console

        console = make_console(stderr=True)
    gpu = torch.cuda.is_available()
    if not gpu:
        console.print("no CUDA GPU: measuring CPU-side figures only")
    with RichProgress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def progress(step: str, done: int, total: int) -> None:
            bar.update(task, description=step, completed=done, total=total)

        result = run_probe(quick=quick, progress=progress)
    render(result, console)
    if use_cache:
        path = save_cache(result)
        if gpu:
            console.print(f"cached for the roofline of bench and profile on this GPU: {path}")
        else:  # bench and profile compute no roofline on CPU runs: do not suggest they will use it
            console.print(f"cached: {path} (this CPU's figures; bench and profile compute a roofline for GPU "
                          "runs only)")
    write_json(result, json_out, console)
    return 0


def write_json(result: dict, json_out: str | None, console) -> None:
    """--json: the result as JSON on stdout ("-") or in the named file."""
    text = json.dumps(result, indent=1, allow_nan=False)
    if json_out == "-":
        print(text)
    elif json_out:
        Path(json_out).write_text(text)
        console.print(f"wrote {json_out}")
