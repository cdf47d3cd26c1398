"""Collective bandwidth: all-reduce, all-gather and reduce-scatter over message sizes, as NCCL's tests
report it, beside the NVLink datasheet figure.

For a message of S bytes on n ranks taking t seconds, algorithm bandwidth is ``S / t`` and bus bandwidth
(what each link carried, comparable across n and to the hardware's link rate) is

* all-reduce: ``algbw * 2 (n - 1) / n``
* all-gather, reduce-scatter: ``algbw * (n - 1) / n``, with S the whole gathered (or scattered) tensor

(nccl-tests, doc/PERFORMANCE.md). :func:`measure_collectives` runs inside an initialised process group;
:func:`run_local_group` starts one on this host (NCCL over the GPUs present, or gloo processes on CPU)
and :func:`probe_collectives` ties the two together for ``warpforge probe --collectives``.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

OPS = ("all_reduce", "all_gather", "reduce_scatter")
DEFAULT_SIZES = tuple(2 ** k for k in range(20, 29, 2))  # 1 MiB .. 256 MiB
CPU_SIZES = tuple(2 ** k for k in range(12, 23, 2))  # 4 KiB .. 4 MiB: gloo on a shared host is slow


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw for ``op`` on ``world`` ranks (nccl-tests' PERFORMANCE.md)."""
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")


def bus_bandwidth(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s for one ``op`` of ``nbytes`` (the whole tensor) taking ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    alg = nbytes / seconds / 1e9
    return alg, alg * bus_factor(op, world)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _one(op: str, nbytes: int, world: int, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    import torch.distributed as dist

    n = max(world, nbytes // torch.tensor([], dtype=dtype).element_size() // world * world)
    if op == "all_reduce":
        buf = torch.ones(n, dtype=dtype, device=device)
        return lambda: dist.all_reduce(buf)
    shard = torch.ones(n // world, dtype=dtype, device=device)
    full = torch.empty(n, dtype=dtype, device=device)
    # The *_single names replace *_into_tensor / *_tensor in newer torch (same arguments, same collective).
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, shard)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return lambda: scatter(shard, full)


def measure_collectives(sizes: Sequence[int] = DEFAULT_SIZES, ops: Sequence[str] = OPS, iters: int = 20,
                        warmup: int = 5, dtype: torch.dtype = torch.float32,
                        device: torch.device | None = None) -> list[dict[str, Any]]:
    """Time each op at each size (bytes of the whole tensor) in the current process group; one row each
    (the slowest rank's mean time, as every rank waits for it). Every rank must call it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError("measure_collectives needs an initialised process group (torchrun, or run_local_group)")
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise ValueError(f"ops must be among {', '.join(OPS)}, got {bad}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    world = dist.get_world_size()
    device = device or (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl"
                        else torch.device("cpu"))
    rows = []
    for op in ops:
        for size in sizes:
            fn = _one(op, int(size), world, device, dtype)
            for _ in range(warmup):
                fn()
            _sync(device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            _sync(device)
            t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            if device.type == "cuda":
                t = t.to(device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            secs = float(t.item())
            alg, bus = bus_bandwidth(op, int(size), secs, world)
            rows.append({"op": op, "bytes": int(size), "us": secs * 1e6, "algbw_GBps": alg, "busbw_GBps": bus})
    return rows


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)  # several ranks share this host's cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=120))
        queue.put((rank, "ok", fn(*args)))
    except BaseException as e:  # reported to the parent, which raises with the rank's message
        queue.put((rank, "error", f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local_group(fn: Callable[..., Any], world: int = 2, backend: str = "gloo", args: tuple = (),
                    timeout_s: float = 120.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world`` fresh processes of this host in one process group (localhost, a free
    port); -> each rank's return value, by rank. ``fn`` must be importable (a module-level function).
    Processes still running at ``timeout_s`` are terminated and the call raises. The ranks are not daemons,
    so a rank may start DataLoader workers."""
    import queue as _queue

    import torch.multiprocessing as mp

    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ValueError(f"nccl with {world} ranks needs {world} GPUs, found {torch.cuda.device_count()}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, fn, args, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                rank, status, value = q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except _queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"process group of {world} did not finish in {timeout_s:.0f} s "
                                       f"(ranks done: {sorted(results)})") from None
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank died with exit code {dead[0].exitcode}") from None
                continue
            if status == "error":
                raise RuntimeError(f"rank {rank}: {value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        q.close()
    return [results[r] for r in range(world)]


def _probe_rank(sizes: Sequence[int], iters: int, warmup: int) -> list[dict[str, Any]]:
    return measure_collectives(sizes=sizes, iters=iters, warmup=warmup)


def probe_collectives(world: int | None = None, sizes: Sequence[int] | None = None, iters: int | None = None,
                      quick: bool = False) -> dict[str, Any]:
    """Bus bandwidth of each collective over message sizes on this host: NCCL over every GPU present (at
    least 2), else ``world`` (default 2) gloo processes on CPU, whose figures are CPU figures."""
    from warpforge.hw.specs import spec_for

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = gpus >= 2
    world = world or (gpus if gpu else 2)
    sizes = tuple(sizes or (DEFAULT_SIZES if gpu else CPU_SIZES)[: 3 if quick else None])
    iters = iters or (5 if quick else 20 if gpu else 10)
    rows = run_local_group(_probe_rank, world=world, backend="nccl" if gpu else "gloo",
                           args=(sizes, iters, max(1, iters // 4)))[0]
    name = torch.cuda.get_device_name(0) if gpu else "CPU"
    spec = spec_for(name) if gpu else None
    link = spec.nvlink_GBps if spec is not None else None
    for r in rows:
        r["of_link"] = r["busbw_GBps"] / link if link else None
    return {"backend": "nccl" if gpu else "gloo", "world": world, "device": name, "rows": rows,
            "nvlink_GBps": link, "link_source": (f"{spec.name} datasheet, NVLink one direction" if link else None),
            "note": None if gpu else (f"CPU figures: {world} gloo processes on this host over loopback; they say "
                                      "nothing about a GPU interconnect")}


def render(result: dict[str, Any], console) -> None:
    """The table ``warpforge probe --collectives`` prints: one row per op and size."""
    from rich.table import Table

    link = result.get("nvlink_GBps")
    title = (f"collectives, {result['world']} ranks, {result['backend']} on {result['device']}"
             + (f" (NVLink datasheet {link:g} GB/s one direction)" if link else ""))
    tab = Table(title=title, title_justify="left")
    for col in ("op", "size", "time", "algbw GB/s", "busbw GB/s") + (("of NVLink",) if link else ()):
        tab.add_column(col, justify="left" if col == "op" else "right")
    for r in result["rows"]:
        size = f"{r['bytes'] / 2**20:g} MiB" if r["bytes"] >= 2**20 else f"{r['bytes'] / 2**10:g} KiB"
        row = [r["op"], size, f"{r['us']:,.1f} µs", f"{r['algbw_GBps']:.3g}", f"{r['busbw_GBps']:.3g}"]
        if link:
            row.append(f"{100 * r['of_link']:.0f}%")
        tab.add_row(*row)
    console.print(tab)
    if result.get("note"):
        console.print(f"[yellow]note:[/] {result['note']}", highlight=False)


def cli_probe_collectives(quick: bool, json_out: str | None, console) -> int:
    from warpforge.hw.probe import write_json

    if json_out == "-":
        from warpforge._cli_support import make_console

        console = make_console(stderr=True)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    console.print(f"measuring collectives on {gpus} GPUs (NCCL)" if gpus >= 2 else
                  "fewer than 2 GPUs: measuring 2 gloo processes on CPU instead", highlight=False)
    try:
        result = probe_collectives(quick=quick)
    except (RuntimeError, TimeoutError, ValueError) as e:
        console.print(f"[bold red]warpforge probe --collectives:[/] {e}", highlight=False)
        return 1
    render(result, console)
    write_json(result, json_out, console)
    return 0
