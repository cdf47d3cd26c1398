"""``warpforge profile --train FACTORY``: load the training setup, profile it on every rank, merge on rank
0, judge, write report.json and report.html.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the process group is started here before the factory runs (NCCL
on GPUs, gloo on CPU), so the factory can wrap its model in DistributedDataParallel; each rank records
its own steps and rank 0 gathers them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


class TrainTargetError(ValueError):
    """A factory spec that does not resolve to a training setup."""


def load_setup(spec: str, device: torch.device, size: str | None = None):
    """The :class:`TrainSetup` that ``spec`` (``file.py:factory`` or ``package.module:factory``) returns."""
    from warpforge._factory import accepts, load_factory
    from warpforge.profile.train import TrainSetup

    where, sep, attr = spec.rpartition(":")
    if not sep or not where:
        raise TrainTargetError(f"--train {spec!r}: expected path/to/train.py:factory or package.module:factory")
    fn = load_factory(where, attr, TrainTargetError, "warpforge_train_")
    kwargs: dict[str, Any] = {}
    if accepts(fn, "device"):
        kwargs["device"] = device
    if size is not None:
        if not accepts(fn, "size"):
            raise TrainTargetError(f"--size {size}: {spec} takes no size argument")
        kwargs["size"] = size
    try:
        obj = fn(**kwargs)
    except (ValueError, TypeError) as e:
        raise TrainTargetError(f"{spec}: the factory failed: {e}") from e
    try:
        return TrainSetup.from_factory_result(obj, name=spec)
    except ValueError as e:
        raise TrainTargetError(f"{spec}: {e}") from e


def init_distributed(device: torch.device) -> torch.device:
    """Start the process group when launched by torchrun; -> this rank's device."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not dist.is_available() or dist.is_initialized():
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def _peak_tflops(d: dict[str, Any], dtype: torch.dtype | None
                 ) -> tuple[float | None, dict[str, Any] | None, float | None]:
    """(matrix peak TFLOP/s at the run's dtype, the cached probe, HBM GB/s) on a GPU; Nones on a CPU."""
    if d["meta"]["device_type"] != "cuda":
        return None, None, None
    from warpforge.hw.probe import load_cached
    from warpforge.hw.roofline import ceilings, dtype_key

    try:
        c = ceilings(torch.device("cuda"))
        return c.tflops[dtype_key(dtype or torch.float32)], load_cached(d["meta"]["device"]), c.hbm_GBps
    except (KeyError, ValueError):
        return None, None, None


def step_roofline(d: dict[str, Any], peak_tflops: float | None, hbm_GBps: float | None) -> dict[str, Any] | None:
    """The whole step against both roofs: the time its FLOPs need at the matrix peak, the time its bytes need
    at HBM bandwidth, which one binds, and how close the measured step comes to that floor."""
    step_ms = d["aggregate"]["mean"]["step_ms"]
    flops, nbytes = d.get("flops_per_step") or 0, d.get("bytes_per_step") or 0
    if not peak_tflops or not hbm_GBps or step_ms <= 0 or not (flops or nbytes):
        return None
    compute_ms, memory_ms = flops / (peak_tflops * 1e9), nbytes / (hbm_GBps * 1e6)
    floor = max(compute_ms, memory_ms)
    return {"flops": flops, "bytes": nbytes, "compute_floor_ms": compute_ms, "memory_floor_ms": memory_ms,
            "bound": "compute" if compute_ms >= memory_ms else "memory", "fraction": floor / step_ms,
            "mbu": nbytes / (step_ms / 1e3) / (hbm_GBps * 1e9), "peak_tflops": peak_tflops, "hbm_GBps": hbm_GBps}


def finalize(d: dict[str, Any], ranks: list[dict[str, Any]] | None = None, dtype: torch.dtype | None = None
             ) -> dict[str, Any]:
    """Add MFU, the per-rank comparison (on rank 0 of a distributed run), findings and the verdict."""
    from warpforge.profile.train_findings import THRESHOLD, train_findings
    from warpforge.profile.train_report import verdict

    peak, probe, hbm = _peak_tflops(d, dtype)
    step_s = d["aggregate"]["mean"]["step_ms"] / 1e3
    d["roofline"] = step_roofline(d, peak, hbm)
    d["mfu"] = d["flops_per_step"] / step_s / (peak * 1e12) if peak and step_s > 0 else None
    for r in d.get("layers") or []:
        r["mfu"] = (r["flops"] / (r["forward_ms"] / 1e3) / (peak * 1e12)) if peak and r["forward_ms"] else None
    if ranks and len(ranks) > 1:
        d["ranks"] = [{"meta": r["meta"], "aggregate": r["aggregate"]} for r in ranks]
    d["findings"] = train_findings(d, probe, peak)
    d["finding_threshold"] = THRESHOLD
    d["verdict"] = verdict(d)
    if peak is None:
        d["notes"].append("CPU run: host timers; MFU, the step's roofline and the low-MFU-layer finding need a "
                          "GPU's matrix peak and HBM bandwidth, so they are omitted (the layer table shows GFLOP/s; "
                          "the step's FLOPs and bytes are in the JSON).")
    return d


def write(d: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    from warpforge.profile.train_report import render_train_html

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "report.json", "html": out_dir / "report.html"}
    paths["json"].write_text(json.dumps(d, indent=1, default=str, allow_nan=False))
    paths["html"].write_text(render_train_html(d), encoding="utf-8")
    return paths


def gather_ranks(d: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's profile on rank 0 (None elsewhere); ``[d]`` outside a distributed run."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [d]
    got: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(d, got if dist.get_rank() == 0 else None, dst=0)
    return got if dist.get_rank() == 0 else None


def cli_profile_train(spec: str, *, steps: int, warmup: int, out: str | None, device: str, size: str | None,
                      json_out: bool, console) -> int:
    from warpforge.profile.cli import _device, _err, _slug
    from warpforge.profile.train import TrainConfig
    from warpforge.profile.train_run import profile_train

    import torch.distributed as dist

    dev = _device(device)
    if dev is None:
        return _err("--device cuda: CUDA is not available on this machine")
    try:
        cfg = TrainConfig(steps=steps, warmup=warmup)
        dev = init_distributed(dev)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        setup = load_setup(spec, dev, size)
        if rank == 0:
            console.print(f"profiling training [bold]{spec}[/] on {setup.device}: {warmup} warm-up, "
                          f"{steps} measured steps", highlight=False)
        d = profile_train(setup, cfg, progress=(lambda m: console.print(f"  {m}", highlight=False)) if rank == 0
                          else None)
        ranks = gather_ranks(d)
    except ValueError as e:
        return _err(str(e))
    if ranks is None:  # not rank 0: rank 0 writes the merged report
        return 0
    p = next(iter(setup.model.parameters()), None) if setup.model is not None else None
    d = finalize(ranks[0], ranks, dtype=p.dtype if p is not None else None)
    out_dir = Path(out) if out else Path("out") / "profile" / ("train-" + _slug(spec))
    paths = write(d, out_dir)
    if json_out:
        import click

        click.echo(paths["json"].read_text())
    print_train_summary(d, console)
    console.print(f"\nreport: {paths['html']}\njson:   {paths['json']}", highlight=False)
    return 0


def print_train_summary(d: dict[str, Any], console) -> None:
    from rich.table import Table

    from warpforge.profile.train_report import PART_LABELS

    a, t = d["aggregate"], d["timing"]
    console.print(f"\n[bold]{d['verdict']}[/]", highlight=False, soft_wrap=True)
    ov = t["overhead"]
    ov_text = "below noise" if ov is None or ov < 0 else f"{100 * ov:.1f}%"
    console.print(f"step {a['median_step_ms']:.3f} ms (median of {a['steps']}; {t['plain_ms'] or 0:.3f} ms without "
                  f"the profiler, overhead {ov_text}); parts sum within "
                  f"{100 * a['parts_error']:.2f}%" + (f"; MFU {100 * d['mfu']:.1f}%" if d.get("mfu") is not None
                                                      else ""), highlight=False)
    rl = d.get("roofline")
    if rl:
        console.print(f"roofline: {rl['bound']}-bound; the step's {rl['flops'] / 1e9:.3g} GFLOP need "
                      f"{rl['compute_floor_ms']:.3f} ms at {rl['peak_tflops']:g} TFLOP/s and its "
                      f"{rl['bytes'] / 2**20:.4g} MiB {rl['memory_floor_ms']:.3f} ms at {rl['hbm_GBps']:g} GB/s: "
                      f"the step runs at {100 * rl['fraction']:.0f}% of that floor (MBU {100 * rl['mbu']:.1f}%)",
                      highlight=False)
    for f in d["findings"][:6]:
        console.print(f"  • [{100 * f['severity']:.0f}%] {f['text']}\n    → {f['advice']}", highlight=False,
                      soft_wrap=True, markup=False)
    tab = Table(title="mean per step", title_justify="left")
    for col in ("part", "ms", "share"):
        tab.add_column(col, justify="left" if col == "part" else "right")
    for k, label in PART_LABELS.items():
        tab.add_row(label, f"{a['mean'][k]:.3f}", f"{100 * a['share'][k]:.1f}%")
    tab.add_row("communication, overlapped (not in the sum)", f"{a['mean']['comm_overlapped']:.3f}",
                f"{100 * a['share']['comm_overlapped']:.1f}%")
    console.print(tab)
    mem = d["memory"]
    split = ", ".join(f"{k.replace('_', ' ')} {v / 2**20:.3g}" for k, v in mem["split"].items())
    console.print(f"memory peak {mem['peak_bytes'] / 2**20:.3g} MiB in {mem['peak_phase']} ({split} MiB)",
                  highlight=False)
    for r in d.get("ranks") or []:
        m = r["aggregate"]["mean"]
        console.print(f"rank {r['meta']['rank']}: step {m['step_ms']:.3f} ms, data {m['data']:.3f}, exposed comm "
                      f"{m['comm_exposed']:.3f}", highlight=False)
