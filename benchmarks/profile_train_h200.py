"""``warpforge profile --train`` and ``probe --collectives`` on the H200s, one JSON line per case.

Cases (each line's ``case`` starts with ``train/`` or ``collectives/``; its ``target`` says the bar):

1. ``train/tiny_gpt small 1gpu``: the breakdown's parts against the step time (within 5%) and the
   profiler's overhead on the step (under 5%).
2. ``train/slow loader 2gpu`` and ``train/exposed all-reduce 2gpu``: DDP on 2 GPUs with the bottleneck put
   in (``warpforge.examples.bottlenecks``); the injected one must be the top finding, with its share.
3. ``collectives/all_reduce 2gpu 256MiB``: bus bandwidth against the NVLink datasheet (at least 0.8).
4. ``train/resnet50 small 1gpu``: the step's MFU and the layers that lose the most.

On a machine with 2 H200s, from the repository root (a few minutes):

    .venv/bin/python benchmarks/profile_train_h200.py

replaces the ``train/`` and ``collectives/`` lines of ``benchmarks/results/h200/profile.jsonl`` (other
lines stay) and writes ``benchmarks/reports/train-<case>/report.{json,html}``. With one GPU the 2-GPU
cases are recorded as skipped. ``--quick`` runs every case at tiny sizes on the CPU (gloo for 2 ranks):
the CPU test drives it end to end. Exit status 1 when a case failed to run; a missed bar is data in its line.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PARTS_BAR, OVERHEAD_BAR, LINK_BAR = 0.05, 0.05, 0.8


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _device() -> dict[str, Any]:
    if torch.cuda.is_available():
        return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(), "torch": torch.__version__}
    return {"name": "CPU", "count": 0, "torch": torch.__version__}


def _summary(d: dict[str, Any]) -> dict[str, Any]:
    a, t = d["aggregate"], d["timing"]
    top = d["findings"][0] if d["findings"] else None
    return {"step_ms": a["median_step_ms"], "plain_ms": t["plain_ms"], "overhead": t["overhead"],
            "parts_error": a["parts_error"], "share": a["share"], "mfu": d.get("mfu"),
            "top_finding": None if top is None else {"kind": top["kind"], "severity": top["severity"],
                                                     "text": top["text"]},
            "memory_peak_bytes": d["memory"]["peak_bytes"], "memory_peak_phase": d["memory"]["peak_phase"]}


def case_one_gpu(name: str, size: str, steps: int, warmup: int, reports: Path) -> dict[str, Any]:
    from warpforge.examples import resnet50, tiny_gpt
    from warpforge.profile.train import TrainConfig
    from warpforge.profile.train_cli import finalize, write
    from warpforge.profile.train_run import profile_train

    factory = {"tiny_gpt": tiny_gpt.factory, "resnet50": resnet50.factory}[name]
    setup = factory(size=size)
    p = next(setup.model.parameters())
    d = finalize(profile_train(setup, TrainConfig(steps=steps, warmup=warmup)),
                 dtype=torch.bfloat16 if name == "resnet50" and p.is_cuda else p.dtype)
    write(d, reports / f"train-{name}-{size}")
    s = _summary(d)
    line = {"case": f"train/{name} {size} 1gpu", "summary": s}
    if name == "tiny_gpt":
        line["target"] = {"parts_error_max": PARTS_BAR, "overhead_max": OVERHEAD_BAR}
        line["ok"] = s["parts_error"] <= PARTS_BAR and (s["overhead"] or 0.0) < OVERHEAD_BAR
    else:
        worst = sorted((r for r in d["layers"] if r.get("mfu") is not None), key=lambda r: r["mfu"])
        line["layers_lowest_mfu"] = [{k: r[k] for k in ("layer", "type", "forward_ms", "flops", "mfu")}
                                     for r in worst[:8]]
        line["target"] = {"mfu": "reported against the roofline, with the layers that lose most"}
        line["ok"] = d.get("mfu") is not None or not torch.cuda.is_available()
    return line


def case_two_ranks(name: str, size: str, steps: int, warmup: int, expect: str, reports: Path) -> dict[str, Any]:
    from warpforge.examples.bottlenecks import profile_rank
    from warpforge.hw.collectives import run_local_group
    from warpforge.profile.train_cli import write

    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    d = run_local_group(profile_rank, world=2, backend=backend, args=(name, size, steps, warmup), timeout_s=300)[0]
    write(d, reports / f"train-{name}-2ranks")
    s = _summary(d)
    top = s["top_finding"]
    return {"case": f"train/{name.replace('_', ' ')} 2gpu", "backend": backend, "summary": s,
            "target": {"top_finding": expect}, "ok": top is not None and top["kind"] == expect}


def case_collectives(quick: bool) -> dict[str, Any]:
    from warpforge.hw.collectives import probe_collectives

    size = 2 ** 16 if quick else 256 * 2 ** 20
    r = probe_collectives(world=2, sizes=[size], iters=5 if quick else 50)
    row = next(x for x in r["rows"] if x["op"] == "all_reduce")
    link = r["nvlink_GBps"]
    return {"case": f"collectives/all_reduce 2gpu {size // 2**20}MiB" if not quick else "collectives/all_reduce 2 gloo",
            "backend": r["backend"], "rows": r["rows"], "nvlink_GBps": link, "link_source": r["link_source"],
            "fraction": row["busbw_GBps"] / link if link else None, "target": {"fraction_min": LINK_BAR},
            "ok": (row["busbw_GBps"] / link >= LINK_BAR) if link else None, "note": r["note"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (the plumbing, not figures)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "h200" / "profile.jsonl"))
    ap.add_argument("--reports", default=str(ROOT / "benchmarks" / "reports"))
    args = ap.parse_args(argv)
    size = "tiny" if args.quick else "small"
    steps, warmup = (3, 1) if args.quick else (20, 5)
    reports = Path(args.reports)
    two = args.quick or torch.cuda.device_count() >= 2
    plan = [("tiny_gpt", lambda: case_one_gpu("tiny_gpt", size, steps, warmup, reports))]
    if two:
        plan += [("slow loader", lambda: case_two_ranks("slow_loader", size, steps, warmup, "starved_loader", reports)),
                 ("exposed all-reduce", lambda: case_two_ranks("exposed_allreduce", size, steps, warmup,
                                                                "exposed_comm", reports)),
                 ("collectives", lambda: case_collectives(args.quick))]
    plan.append(("resnet50", lambda: case_one_gpu("resnet50", size, max(2, steps // 2), warmup, reports)))
    base = {"suite": "profile", "tags": ["train"], "device": _device(), "git": _git(),
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    lines, failed = [], 0
    for label, run in plan:
        print(f"[profile --train] {label} ...", file=sys.stderr, flush=True)
        try:
            lines.append({**base, **run()})
        except Exception as e:  # one failed case is a line saying so; the rest still run
            failed += 1
            traceback.print_exc()
            lines.append({**base, "case": f"train/{label}", "error": f"{type(e).__name__}: {e}", "ok": False})
    if not two:
        lines.append({**base, "case": "train/2gpu cases", "skipped": "fewer than 2 GPUs", "ok": None})
    out = Path(args.out)
    kept = [x for x in (out.read_text().splitlines() if out.is_file() else [])
            if x.strip() and not json.loads(x)["case"].startswith(("train/", "collectives/"))]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(line + "\n" for line in kept + [json.dumps(x, default=str) for x in lines]))
    for x in lines:
        print(f"{x['case']}: ok={x.get('ok')}" + (f" error={x['error']}" if "error" in x else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
