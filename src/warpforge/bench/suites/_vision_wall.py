"""Suite ``vision``'s wall-time case: ``warpforge.optimize`` end to end against torch.compile max-autotune.

Each side runs in a fresh Python process with fresh, empty Inductor, Triton and warpforge caches, and
without the autotune winners warpforge ships for known GPUs (``WARPFORGE_AUTOTUNE=cold``: a cold start,
what a first ``warpforge optimize`` of a model nobody tuned before pays), under a time limit: a side
that does not finish is killed with its process group and recorded as an error saying how far it got.
The time is taken inside the child around the call alone (model already built, imports done), and the
child's whole process time is recorded beside it.

* ours: ``optimize(model, inputs, val=the zoo's validation inputs, kind="classifier")`` with the default
  backends and precisions for the device, as ``warpforge optimize mobilenet_v2`` runs it;
* peer: ``torch.compile(model.half(), mode="max-autotune")`` + its first call, device synchronized.

Settings (the bench CLI has no per-suite options; docs/settings.md): ``WARPFORGE_BENCH_MAX_AUTOTUNE=0``
skips the peer; ``WARPFORGE_BENCH_WALL_LIMIT_S`` sets each side's limit (default 270 s on CUDA, so that both
sides together stay within a 10-minute job; 120 s on CPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from warpforge import settings
from warpforge.bench.suite import Run

RESULT = "WARPFORGE_WALL_RESULT "  # the child's last stdout line: this prefix + JSON
PEER = "torch.compile-max-autotune-fp16"


def limit_s(device_is_cuda: bool) -> float:
    return settings.current().bench_wall_limit_s or (270.0 if device_is_cuda else 120.0)


def max_autotune_enabled() -> bool:
    return settings.current().bench_max_autotune


def _src_root() -> str:
    import warpforge

    return str(Path(warpforge.__file__).resolve().parents[1])


def _run_child(task: dict[str, Any], limit: float) -> dict[str, Any]:
    """Run ``child(task)`` in a fresh process with cold caches; its result dict plus ``process_s``."""
    with tempfile.TemporaryDirectory(prefix="wf-wall-") as tmp:
        env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor",
                   TRITON_CACHE_DIR=f"{tmp}/triton", WARPFORGE_CACHE_DIR=f"{tmp}/warpforge",
                   # cold: no winners shipped in warpforge/kernels/tuned/ either (unless tuning is off)
                   WARPFORGE_AUTOTUNE="off" if settings.current().autotune == "off" else "cold")
        env["PYTHONPATH"] = os.pathsep.join([_src_root(), *filter(None, [os.environ.get("PYTHONPATH")])])
        code = "import sys; from warpforge.bench.suites._vision_wall import child; child(sys.argv[1])"
        t0 = time.perf_counter()
        # A new session: on timeout the whole group goes (inductor's compile workers too).
        proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(task)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            last = [ln for ln in err.splitlines() if ln.startswith("[wall]")][-1:] or ["(no progress reported)"]
            raise RuntimeError(f"did not finish within the {limit:.0f} s limit (so > {limit:.0f} s); "
                               f"last progress: {last[0]}") from None
        process_s = time.perf_counter() - t0
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(err.strip().splitlines()[-3:])
        raise RuntimeError(f"child exited {proc.returncode}: {tail[-400:]}")
    return {**json.loads(lines[-1][len(RESULT):]), "process_s": process_s}


def ours_fn(workload: dict[str, Any], protocol: dict[str, Any]):
    def fn(device: torch.device, rep: int) -> list[Run]:
        runs = []
        for _ in range(rep):
            r = _run_child({"side": "ours", "workload": workload, "protocol": protocol, "device": str(device)},
                           limit_s(device.type == "cuda"))
            runs.append(Run(ms=r["s"] * 1e3, tokens=0, output=r,
                            extra={"s": r["s"], "process_s": r["process_s"], "status": r["status"],
                                   "winner": r["winner"], "candidates": r["candidates"], "caches": "cold"}))
        return runs
    return fn


def peer_fn(workload: dict[str, Any]):
    def fn(device: torch.device, rep: int) -> list[Run]:
        if device.type != "cuda":
            raise RuntimeError("the max-autotune peer runs on CUDA only")
        runs = []
        for _ in range(rep):
            r = _run_child({"side": "peer", "workload": workload, "device": str(device)}, limit_s(True))
            runs.append(Run(ms=r["s"] * 1e3, tokens=0, extra={"s": r["s"], "process_s": r["process_s"],
                                                               "caches": "cold", "precision": "fp16"}))
        return runs
    return fn


def check(ours: dict[str, Any], _peer: None) -> dict[str, Any]:
    """The optimizer returned a model whose accuracy (its own gate, against fp32 on the validation inputs)
    is within its precision's budget."""
    acc, budget = ours.get("accuracy") or {}, ours.get("budget") or {}
    ok = ours.get("status") == "ok" and ours.get("winner") is not None
    return {"ok": ok, "rel_err": acc.get("max_rel"), "tol": budget.get("max_rel"), "against": "reference:eager-fp32",
            "winner": ours.get("winner"),
            "top1": acc.get("top1"), "note": "the winner's gate result against fp32, inside optimize()"}


# ---- the child process --------------------------------------------------------------------------------

def _progress(t0: float):
    def report(what: str, done: int, total: int) -> None:
        print(f"[wall] t={time.perf_counter() - t0:.1f}s {what} ({done}/{total})", file=sys.stderr, flush=True)
    return report


def _child_ours(task: dict[str, Any], device: torch.device) -> dict[str, Any]:
    from warpforge.bench.suites._vision_run import Workload, load
    from warpforge.optimize.api import NoCandidateError, optimize

    w = Workload(**task["workload"])
    loaded = load(w, device)
    t0 = time.perf_counter()
    try:
        report = optimize(loaded.model, loaded.inputs, val=loaded.val, kind="classifier", device=device,
                          name=w.model, progress=_progress(t0), **task["protocol"]).report
    except NoCandidateError as e:
        report = e.report or {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    s = time.perf_counter() - t0
    cands = report.get("candidates", [])
    win = next((c for c in cands if c["name"] == report.get("winner")), {})
    return {"s": s, "status": report.get("status"), "winner": report.get("winner"),
            "accuracy": win.get("accuracy"), "budget": win.get("budget"),
            "candidates": [{"name": c["name"], "status": c["status"], "build_s": c.get("build_s"),
                            "p50_ms": (c.get("latency") or {}).get("p50_ms")} for c in cands]}


def _child_peer(task: dict[str, Any], device: torch.device) -> dict[str, Any]:
    import copy

    from warpforge.bench.suites._vision_run import Workload, load

    loaded = load(Workload(**task["workload"]), device)
    model = copy.deepcopy(loaded.model).half().eval()
    x = tuple(t.half() for t in loaded.inputs)
    t0 = time.perf_counter()
    compiled = torch.compile(model, mode="max-autotune")
    with torch.no_grad():
        compiled(*x)
    torch.cuda.synchronize(device)
    return {"s": time.perf_counter() - t0}


def child(task_json: str) -> None:
    task = json.loads(task_json)
    device = torch.device(task["device"])
    out = _child_ours(task, device) if task["side"] == "ours" else _child_peer(task, device)
    print(RESULT + json.dumps(out, allow_nan=False, default=float), flush=True)
