"""Findings on a training profile, in plain words, each with its evidence and the fix to try first.

``severity`` is the share of the step the finding costs (what removing the bottleneck could win), so
findings sort by it and the first one is the largest. Time findings fire at ``THRESHOLD`` (10% of the
step) or above; memory findings carry a tenth of the peak share they could free, so they rank below
any time finding at the threshold. Distributed runs add the straggler finding from the merged ranks.
"""

from __future__ import annotations

from typing import Any

THRESHOLD = 0.10  # a time finding fires at this share of the step; a clean run has none at or above it
H2D_THRESHOLD = 0.05  # copies: pinning fixes them cheaply, so a smaller share is worth naming
OTHER_THRESHOLD = 0.15  # uncovered time includes Python between phases; only a large share is a finding
ACTIVATION_SHARE = 0.5  # activations above this share of the peak make checkpointing worth a look
LOW_MFU = 0.3  # a layer under this fraction of the matrix peak is named when it loses time
# Ranks of a balanced run differ by some percent from noise (shared hosts, clocks); a straggler stands out more.
STRAGGLER_THRESHOLD = 0.25


def _f(kind: str, severity: float, text: str, advice: str, **evidence: Any) -> dict[str, Any]:
    return {"kind": kind, "severity": round(max(0.0, min(1.0, severity)), 4), "text": text, "advice": advice,
            "evidence": evidence}


def _ms(v: float) -> str:
    return f"{v:.3g} ms"


def starved_loader(d: dict[str, Any]) -> dict[str, Any] | None:
    m, s = d["aggregate"]["mean"], d["aggregate"]["share"]
    if s["data"] < THRESHOLD:
        return None
    ld = d.get("loader") or {}
    tips = []
    if ld.get("num_workers") in (0, None):
        tips.append("load in worker processes (DataLoader num_workers=4..8, persistent_workers=True)")
    else:
        tips.append(f"more workers than {ld['num_workers']}, or a larger prefetch_factor "
                    f"(now {ld.get('prefetch_factor')})")
    if ld.get("pin_memory") is False and d["meta"]["device_type"] == "cuda":
        tips.append("pin_memory=True")
    tips.append("move decoding and augmentation off the critical path (pre-decoded shards, GPU augmentation)")
    return _f("starved_loader", s["data"],
              f"The loader starves the step: the host waits {_ms(m['data'])} per step for the next batch, "
              f"{100 * s['data']:.0f}% of the {_ms(d['aggregate']['mean']['step_ms'])} step.",
              "; ".join(tips) + ".", wait_ms=m["data"], share=s["data"], loader=ld)


def pageable_copies(d: dict[str, Any], probe: dict[str, Any] | None = None) -> dict[str, Any] | None:
    m, s = d["aggregate"]["mean"], d["aggregate"]["share"]
    h2d = d.get("h2d") or {}
    if s["h2d"] < H2D_THRESHOLD or h2d.get("pinned") is not False:
        return None
    rate = h2d.get("bytes", 0) / (m["h2d"] / 1e3) / 1e9 if m["h2d"] > 0 else None
    pc = (probe or {}).get("pcie") or {}
    pinned, pageable = pc.get("h2d_pinned_GBps"), pc.get("h2d_pageable_GBps")
    gain = s["h2d"] * (1 - rate / pinned) if rate and pinned else s["h2d"]
    return _f("pageable_copies", gain,
              f"Batches are copied from pageable memory: {_ms(m['h2d'])} per step ({100 * s['h2d']:.0f}%) at "
              + (f"{rate:.3g} GB/s" if rate else "an unknown rate")
              + (f", where pinned copies reach {pinned:.3g} GB/s on this machine" if pinned else "") + ".",
              "DataLoader(pin_memory=True) and .to(device, non_blocking=True), so the copy runs as DMA and "
              "overlaps compute.", bytes=h2d.get("bytes"), copy_ms=m["h2d"], achieved_GBps=rate,
              probe_pinned_GBps=pinned, probe_pageable_GBps=pageable)


def _nvlink_GBps(d: dict[str, Any]) -> float | None:
    """The datasheet's one-direction NVLink figure of the run's GPU; None on a CPU or without NVLink."""
    meta = d.get("meta", {})
    if meta.get("device_type") != "cuda":
        return None
    from warpforge.hw.specs import spec_for

    spec = spec_for(meta.get("device_name") or meta.get("device"))
    return spec.nvlink_GBps if spec is not None else None


def exposed_comm(d: dict[str, Any], probe: dict[str, Any] | None = None,
                 straggler: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Collective time with no compute beside it, less what was spent waiting for a straggler: that wait is the
    late rank's cost, not the network's."""
    a = d["aggregate"]
    m = a["mean"]
    wait = min(m["comm_exposed"], straggler["evidence"]["excess_ms"]) if straggler is not None else 0.0
    own = m["comm_exposed"] - wait
    share = own / m["step_ms"] if m["step_ms"] > 0 else 0.0
    if share < THRESHOLD:
        return None
    total = m["comm_exposed"] + m["comm_overlapped"]
    # Bytes over the collectives' time (overlapped or not): the rate to set beside `probe --collectives`.
    algbw = a["comm_bytes"] / (total / 1e3) / 1e9 if total > 0 and a["comm_bytes"] else None
    # Bus bandwidth as nccl-tests define it for an all-reduce (2 (n-1) / n of the algorithm bandwidth): the
    # figure a link's datasheet bounds.
    world = int(d.get("meta", {}).get("world") or 1)
    busbw = algbw * 2 * (world - 1) / world if algbw and world > 1 else None
    link = _nvlink_GBps(d)
    of_link = busbw / link if busbw and link else None
    ddp = d.get("ddp")
    if d.get("fsdp"):
        advice = ("let FSDP overlap its all-gathers and reduce-scatters with compute: prefetch the next unit "
                  "(set_modules_to_forward_prefetch / backward prefetch), keep parameters gathered between forward "
                  "and backward where memory allows (reshard_after_forward=False), shard fewer, larger units; "
                  "a model that fits on one GPU is often faster under DistributedDataParallel")
    elif ddp is None:
        advice = ("wrap the model in DistributedDataParallel so gradient all-reduces overlap backward instead of "
                  "running after it; accumulate gradients over several micro-batches (no_sync) to all-reduce less "
                  "often")
    else:
        advice = (f"overlap more: smaller buckets start the first all-reduce earlier (bucket_cap_mb, now "
                  f"{ddp['bucket_cap_mb']:.0f}); gradient accumulation with no_sync() all-reduces once per several "
                  "micro-batches; bf16 gradient compression halves the bytes")
    waiting = (f" (besides {_ms(wait)} waiting for the straggler, rank {straggler['evidence']['worst_rank']})"
               if straggler is not None and wait > 0 else "")
    return _f("exposed_comm", share,
              f"Gradient communication is exposed: {_ms(own)} per step ({100 * share:.0f}%) with no compute beside "
              f"it{waiting}; "
              f"{100 * m['comm_overlapped'] / total if total else 0:.0f}% of the collectives' time overlaps compute"
              + (f"; they move {a['comm_bytes'] / 2**20:.3g} MiB per step at {algbw:.3g} GB/s algorithm bandwidth"
                 + (f", {busbw:.3g} GB/s bus bandwidth" if busbw else "")
                 + (f" ({100 * of_link:.0f}% of the {link:g} GB/s NVLink datasheet figure)" if of_link else "")
                 + "; `warpforge probe --collectives` measures what this machine's links reach." if algbw else "."),
              advice + ".", exposed_ms=own, straggler_wait_ms=wait, overlapped_ms=m["comm_overlapped"],
              algbw_GBps=algbw,
              busbw_GBps=busbw, nvlink_GBps=link, of_link=of_link,
              collectives_per_step=a["collectives"], bytes_per_step=a["comm_bytes"])


def launch_bound_optimizer(d: dict[str, Any]) -> dict[str, Any] | None:
    m, s = d["aggregate"]["mean"], d["aggregate"]["share"]
    o = d.get("optimizer")
    if o is None or s["optimizer"] < THRESHOLD or o.get("fused") or o.get("foreach"):
        return None
    n = o["param_tensors"]
    return _f("launch_bound_optimizer", s["optimizer"],
              f"The optimizer ({o['type']}) takes {_ms(m['optimizer'])} per step ({100 * s['optimizer']:.0f}%) "
              f"updating {n} parameter tensors one at a time ({1e3 * m['optimizer'] / max(n, 1):.3g} µs each).",
              f"{o['type']}(..., fused=True) on CUDA, or foreach=True: a handful of multi-tensor kernels instead of "
              "several per tensor.", optimizer=o, optimizer_ms=m["optimizer"])


def activation_peak(d: dict[str, Any]) -> dict[str, Any] | None:
    mem = d.get("memory") or {}
    peak, split = mem.get("peak_bytes") or 0, mem.get("split") or {}
    act = (mem.get("phases") or {}).get("forward", {}).get("activations", 0)
    if not peak or act / peak < ACTIVATION_SHARE or mem.get("peak_phase") == "optimizer":
        return None
    share = act / peak
    return _f("activation_peak", 0.1 * share,
              f"Activations dominate memory: {act / 2**20:.3g} MiB saved for backward, {100 * share:.0f}% of the "
              f"{peak / 2**20:.3g} MiB peak in {mem['peak_phase']}.",
              "activation checkpointing (torch.utils.checkpoint on the repeated blocks) trades a second forward "
              "for that memory, which buys a larger batch; mixed precision halves it.",
              activations_bytes=act, peak_bytes=peak, split=split, source=mem.get("source"))


def low_mfu_layers(d: dict[str, Any], peak_tflops: float | None) -> dict[str, Any] | None:
    if not peak_tflops:
        return None
    step = d["aggregate"]["mean"]["step_ms"]
    rows = []
    for r in d.get("layers") or []:
        if not r["flops"] or not r["forward_ms"]:
            continue
        ideal_ms = r["flops"] / (peak_tflops * 1e12) * 1e3
        mfu = ideal_ms / r["forward_ms"]
        if mfu < LOW_MFU:
            rows.append({"layer": r["layer"], "type": r["type"], "mfu": mfu, "lost_ms": r["forward_ms"] - ideal_ms})
    rows.sort(key=lambda r: -r["lost_ms"])
    lost = sum(r["lost_ms"] for r in rows) * 3  # forward, and backward at about twice the forward's work
    if not rows or lost / step < THRESHOLD:
        return None
    names = ", ".join(f"{r['layer']} ({r['type']}, {100 * r['mfu']:.0f}% MFU)" for r in rows[:4])
    return _f("low_mfu_layers", lost / step,
              f"Layers far below the matrix peak lose about {_ms(lost)} per step (forward and backward): {names}.",
              "larger or padded matmul dimensions (multiples of 64), bf16 autocast, channels_last for convolutions, "
              "torch.compile to fuse the small ops around them.", layers=rows[:8], peak_tflops=peak_tflops)


def launch_gaps(d: dict[str, Any]) -> dict[str, Any] | None:
    m, s = d["aggregate"]["mean"], d["aggregate"]["share"]
    if s["other"] < OTHER_THRESHOLD:
        return None
    return _f("gaps", s["other"],
              f"{_ms(m['other'])} per step ({100 * s['other']:.0f}%) is outside every phase: Python between phases, "
              "launch gaps, synchronisation.",
              "CUDA graphs or torch.compile(mode='reduce-overhead') for launch-bound steps; remove .item() and "
              "prints from the loop.", other_ms=m["other"])


def stragglers(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A rank whose own work (step less exposed communication) is well above the median of the ranks."""
    if len(ranks) < 2:
        return None
    busy = [r["aggregate"]["mean"]["step_ms"] - r["aggregate"]["mean"]["comm_exposed"] for r in ranks]
    order = sorted(busy)
    med = order[len(order) // 2] if len(order) % 2 else (order[len(order) // 2 - 1] + order[len(order) // 2]) / 2
    worst = max(range(len(ranks)), key=lambda i: busy[i])
    step = max(r["aggregate"]["mean"]["step_ms"] for r in ranks)
    excess = busy[worst] - min(busy)
    if excess / step < STRAGGLER_THRESHOLD:
        return None
    slow = ranks[worst]["aggregate"]["mean"]
    part = max(("data", "h2d", "forward", "backward", "optimizer"), key=lambda k: slow[k] - min(
        r["aggregate"]["mean"][k] for r in ranks))
    return _f("straggler", excess / step,
              f"Rank {ranks[worst]['meta']['rank']} is a straggler: its own work takes {_ms(busy[worst])} per step "
              f"against a median of {_ms(med)}; the other ranks wait for it in their collectives. Most of the "
              f"difference is in {part}.",
              "find what differs on that rank (its data shard, a slower loader, a throttled or shared GPU, a "
              "noisy neighbour); balance the work per rank.", busy_ms=busy, worst_rank=worst, part=part,
              excess_ms=excess)


def train_findings(d: dict[str, Any], probe: dict[str, Any] | None = None,
                   peak_tflops: float | None = None) -> list[dict[str, Any]]:
    """Every finding for one rank's profile (and the stragglers of a merged one), largest first."""
    lag = stragglers(d["ranks"]) if d.get("ranks") else None
    found = [starved_loader(d), pageable_copies(d, probe), exposed_comm(d, probe, lag), launch_bound_optimizer(d),
             activation_peak(d), low_mfu_layers(d, peak_tflops), launch_gaps(d), lag]
    return sorted((f for f in found if f is not None), key=lambda f: -f["severity"])
