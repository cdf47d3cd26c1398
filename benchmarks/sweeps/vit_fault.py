"""Which module faults in ViT-B/16's optimized fp16 forward at batch 32 on the H200?

    python benchmarks/sweeps/vit_fault.py --batch 32 --out vit_fault.json        (~1-2 min per combination)

Why: on the H200 (2026-12-02, git a3d2721 and 37e8e05) the vision suite's ViT-B/16 batch-32 build hit
"unspecified launch failure" with the patch-embedding GEMM (WARPFORGE_PATCH_GEMM=1) and the fuse_norm
pass (WARPFORGE_FUSE_NORM=1) on, while batch 1 ran (0.524 ms) and batch 32 had run without them. The two
kernels matched their references at those shapes on the CPU interpreter. A sticky CUDA error ends the
process's context, so each knob combination runs in its own child process, which:

1. builds the fp16 float pipeline (optimize_graph with float_passes, the fuse_linear tactic choice included),
2. runs it eagerly with a forward hook on every leaf module that synchronizes after it: the first module
   whose synchronize raises is where the fault is (or right before it),
3. captures and replays the CUDA graph, as the optimizer's candidate does, and checks against eager fp16.

Prints one line per combination (ok, or the faulting module and error) and writes them all to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

COMBOS = {"none": {}, "patch": {"WARPFORGE_PATCH_GEMM": "1"}, "norm": {"WARPFORGE_FUSE_NORM": "1"},
          "both": {"WARPFORGE_PATCH_GEMM": "1", "WARPFORGE_FUSE_NORM": "1"}}


def child(batch: int) -> dict:
    import torch

    from warpforge.models import get
    from warpforge.optimize.pipeline import float_passes, optimize_graph
    from warpforge.optimize.runtime import CastIO

    out: dict = {"stage": "build"}
    dev = torch.device("cuda")
    spec = get("vit_b16", batch=batch, device=dev, pretrained=False)
    model = spec.model.eval()
    x = spec.example_inputs[0]
    half = torch.nn.Module.to(__import__("copy").deepcopy(model), torch.float16)
    t0 = time.perf_counter()
    gm, report = optimize_graph(half, (x.half(),), float_passes(), device=dev, dtype=torch.float16)
    torch.cuda.synchronize()
    out["build_s"] = time.perf_counter() - t0
    out["passes"] = {p["name"]: p["counts"] for p in report["passes"]}
    out["stage"] = "eager"
    last = {"name": None}

    def hook(name):
        def fn(_m, _i, _o):
            torch.cuda.synchronize()  # raises here if this module (or an earlier launch) faulted
            last["name"] = name
        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in gm.named_modules() if not list(m.children())]
    try:
        with torch.no_grad():
            got = gm(x.half())
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the point: where it fails
        out.update(ok=False, after=last["name"], error=f"{type(e).__name__}: {str(e)[:300]}")
        return out
    for h in handles:
        h.remove()
    out["stage"] = "graph"
    with torch.no_grad():
        want = half(x.half()).float()
        mod = CastIO(gm, torch.float16).eval()
        static = x.clone()
        for _ in range(2):
            mod(static)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = mod(static)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    err = float((y.float() - want).abs().max() / want.abs().max())
    out.update(ok=True, eager_rel_err=float((got.float() - want).abs().max() / want.abs().max()), graph_rel_err=err)
    return out


def step(name: str) -> None:
    print(f"STEP {name}", flush=True)


def child_session(batch: int, pre_batch: int | None, with_peers: bool) -> dict:
    """The vision suite's own sequence for ViT-B/16 (vr.load, build_ours, collect over the validation
    batches, then timed calls with the L2 flush), a synchronize after every step and a STEP line before it:
    the bench's build ran where the sweep's plain graph replay did not fault."""
    import torch

    from warpforge.bench.suites import _vision_run as vr
    from warpforge.bench.timing import _flush_l2, time_interleaved

    dev = torch.device("cuda")
    out: dict = {}
    for b in ([pre_batch] if pre_batch else []) + [batch]:
        step(f"b{b} load")
        loaded = vr.load(vr.Workload(model="vit_b16", batch=b), dev)
        shared = vr.Shared(loaded, "fp16", None)
        step(f"b{b} build ours")
        fn, info = vr.build_ours(shared, dev)
        torch.cuda.synchronize()
        out[f"b{b}_ops"] = info.get("warpforge_ops")
        with torch.no_grad():
            for i, v in enumerate(loaded.val):
                step(f"b{b} val {i} {tuple(v[0].shape)}")
                fn(*v)
                torch.cuda.synchronize()
            for i in range(120):
                step(f"b{b} timed call {i} (L2 flushed)") if i % 20 == 0 else None
                _flush_l2(dev)
                fn(*loaded.inputs)
                torch.cuda.synchronize()
            if with_peers:
                fns = {"ours": fn}
                for name in (vr.EAGER16, vr.COMPILE, vr.GRAPH):
                    step(f"b{b} build {name}")
                    fns[name], _ = vr.BUILDERS[name](shared, dev)
                    for v in loaded.val:
                        fns[name](*v)
                    torch.cuda.synchronize()
                calls = {n: (lambda f=f: f(*loaded.inputs)) for n, f in fns.items()}
                for blk in range(5):
                    step(f"b{b} time_interleaved block {blk}")
                    got = time_interleaved(calls, warmup=10, rep=50, flush_l2=True, cuda_graph=False, device=dev,
                                           hide_host=False)
                    out[f"b{b}_ms_block{blk}"] = {n: t.median_ms for n, t in got.items()}
        step(f"b{b} teardown")
        del fn, shared, loaded
        __import__("gc").collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    out["ok"] = True
    return out


def child_suite(batch: int, pre_batch: int | None, names: list[str], sync_calls: bool) -> dict:
    """The vision suite's Session itself (reference, ours, peers as named), each share read as the e2e
    harness reads it. ``sync_calls``: the harness's timing calls each followed by a synchronize, and the
    first one that raises named."""
    import torch

    from warpforge.bench.suites import _vision_run as vr
    from warpforge.bench.suites.vision import FULL

    dev = torch.device("cuda")
    out: dict = {}
    if sync_calls:
        orig = vr.time_interleaved
        count = {"n": 0}

        def synced(fns, **kw):
            def wrap(n, f):
                def call():
                    count["n"] += 1
                    f()
                    try:
                        torch.cuda.synchronize()
                    except Exception:
                        print(f"STEP fault in timed call {count['n']} of {n!r}", flush=True)
                        raise
                return call
            return orig({n: wrap(n, f) for n, f in fns.items()}, **kw)
        vr.time_interleaved = synced
    for b in ([pre_batch] if pre_batch else []) + [batch]:
        step(f"b{b} session {names}")
        session = vr.Session(vr.Workload(model="vit_b16", batch=b), names, FULL)
        for name in names:
            try:
                runs = session.fn(name)(dev, 0)
                out[f"b{b} {name}"] = round(runs[len(runs) // 2].ms, 4)
            except Exception as e:  # noqa: BLE001
                out[f"b{b} {name}"] = f"{type(e).__name__}: {str(e)[:400]}"
        step(f"b{b} empty_cache")
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    out["ok"] = not any(isinstance(v, str) for v in out.values())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--combos", default="none,patch,norm,both", help=f"comma-separated of {list(COMBOS)}")
    ap.add_argument("--out", type=Path, default=Path("vit_fault.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per combination")
    ap.add_argument("--mode", choices=("graph", "session", "suite"), default="graph",
                    help="graph: optimize_graph + a plain CUDA graph; session: the vision suite's build and calls")
    ap.add_argument("--pre-batch", type=int, default=None, help="session: run this batch first (the suite ran b1)")
    ap.add_argument("--peers", action="store_true", help="session: also build the peers and time interleaved")
    ap.add_argument("--blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1 in the children")
    ap.add_argument("--names", default="eager-fp32,ours,eager-fp16,torch.compile-reduce-overhead-fp16,"
                    "cuda-graph-eager-fp16", help="suite: the Session's candidates (the reference first)")
    ap.add_argument("--sync-calls", action="store_true", help="suite: synchronize after every timed call")
    a = ap.parse_args(argv)
    if a.child:
        if a.mode in ("session", "suite"):
            try:
                res = (child_session(a.batch, a.pre_batch, a.peers) if a.mode == "session" else
                       child_suite(a.batch, a.pre_batch, a.names.split(","), a.sync_calls))
            except Exception as e:  # noqa: BLE001 - the point: where it fails
                import traceback
                traceback.print_exc()
                res = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        else:
            res = child(a.batch)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    results = {}
    for name in a.combos.split(","):
        if name not in COMBOS:
            ap.error(f"--combos: unknown {name!r}; choose from {list(COMBOS)}")
        env = {**os.environ, **COMBOS[name], **({"CUDA_LAUNCH_BLOCKING": "1"} if a.blocking else {})}
        for k in ("WARPFORGE_PATCH_GEMM", "WARPFORGE_FUSE_NORM"):
            if k not in COMBOS[name]:
                env.pop(k, None)
        t0 = time.perf_counter()
        try:
            cmd = [sys.executable, __file__, "--child", "--batch", str(a.batch), "--mode", a.mode]
            cmd += (["--pre-batch", str(a.pre_batch)] if a.pre_batch else []) + (["--peers"] if a.peers else [])
            cmd += ["--names", a.names] + (["--sync-calls"] if a.sync_calls else [])
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout_s)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            res = json.loads(line[7:]) if line else {"ok": False, "error": f"rc={p.returncode}: "
                                                     f"{(p.stderr or p.stdout)[-600:]}"}
            steps = [ln[5:] for ln in p.stdout.splitlines() if ln.startswith("STEP ")]
            if steps:
                res["last_step"] = steps[-1]
            if not res.get("ok"):
                res["stderr_tail"] = p.stderr[-3000:]
                print(p.stderr[-3000:], file=sys.stderr)
        except subprocess.TimeoutExpired:
            res = {"ok": False, "error": f"timed out after {a.timeout_s:.0f} s"}
        res["wall_s"] = time.perf_counter() - t0
        results[name] = res
        where = "" if res.get("ok") else f" after {res.get('after')!r} in {res.get('stage')} (step {res.get('last_step')})"
        print(f"{name:6s} {'ok' if res.get('ok') else 'FAULT'}{where}  {res.get('error', '')[:200]}  "
              f"graph rel_err {res.get('graph_rel_err')}  ({res['wall_s']:.0f} s)", flush=True)
    a.out.write_text(json.dumps({"batch": a.batch, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
