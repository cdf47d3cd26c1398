"""Data-parallel splat training over ``torch.distributed`` (NCCL on GPUs, gloo on CPU), launched by torchrun.

Every rank holds all the Gaussians and renders its own cameras of the step. After backward the gradients
are averaged (one flat all-reduce), the visibility masks OR-ed, and at each refinement the densification
statistics summed, so every rank applies the same update and the same clone/split/prune decisions: the
ranks never diverge and never exchange Gaussians. ``torchrun --nproc_per_node 8 -m warpforge splat train
street --out DIR`` runs it; ``init_world`` reads torchrun's environment.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class World:
    """This process's place in the job."""

    rank: int
    size: int
    local_rank: int
    device: torch.device

    def all_reduce_(self, t: Tensor, op: str = "sum") -> None:
        """In place over all ranks; ``op`` is "sum" or "max"."""
        ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        if op not in ops:
            raise ValueError(f"all_reduce_: op must be 'sum' or 'max', got {op!r}")
        dist.all_reduce(t, op=ops[op])

    @torch.no_grad()
    def average_grads(self, params: dict[str, Tensor]) -> None:
        """Replace each parameter's gradient by the mean over ranks, in one flat all-reduce."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params.values()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= self.size
        off = 0
        for p, g in zip(params.values(), grads):
            n = g.numel()
            p.grad = flat[off:off + n].view_as(p)
            off += n

    def any_(self, mask: Tensor) -> Tensor:
        """Element-wise OR of a bool tensor over ranks."""
        t = mask.to(torch.uint8)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.bool()

    def barrier(self) -> None:
        dist.barrier()


def init_world(device: str = "auto", timeout_s: float = 600.0) -> World | None:
    """Join the job torchrun started (``WORLD_SIZE`` > 1), or return None for a single process.

    ``device`` "auto": one GPU per rank (``LOCAL_RANK``) with NCCL when CUDA is there, else CPU with gloo.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return None
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs are visible")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": dev} if use_cuda else {}))
    return World(rank, size, local, dev)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
