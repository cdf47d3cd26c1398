"""The tiny GPT with a bottleneck put in on purpose, to see what ``warpforge profile --train`` says about
each (and to check that it says it): a loader that sleeps before every batch, and gradients all-reduced
one tensor at a time after backward instead of overlapped with it.

    warpforge profile --train warpforge.examples.bottlenecks:slow_loader
    torchrun --nproc-per-node 2 -m warpforge profile --train warpforge.examples.bottlenecks:exposed_allreduce
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from warpforge.examples import tiny_gpt
from warpforge.profile.train import TrainSetup

DELAY_S = 0.05  # the slow loader's sleep per batch


class SleepyLoader:
    """Batches of ``loader``, each after ``seconds`` of sleep (a slow disk or decoder)."""

    def __init__(self, loader: Any, seconds: float):
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds}")
        self.loader, self.seconds = loader, seconds

    def __iter__(self):
        for b in self.loader:
            time.sleep(self.seconds)
            yield b


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def slow_loader(size: str | None = None, device: torch.device | str | None = None) -> TrainSetup:
    """tiny_gpt whose loader sleeps ``DELAY_S`` per batch (wrapped in DDP when run by torchrun)."""
    s = tiny_gpt.factory(size=size, device=_device(device))
    model = s.model
    if _distributed():
        model = nn.parallel.DistributedDataParallel(model, device_ids=[s.device.index] if s.device.index is not None
                                                    else None)
    return TrainSetup(loader=SleepyLoader(s.loader, DELAY_S), model=model, optimizer=s.optimizer, loss_fn=s.loss_fn,
                      device=s.device, name=f"{s.name} + slow loader")


def exposed_allreduce(size: str | None = None, device: torch.device | str | None = None) -> TrainSetup:
    """tiny_gpt whose gradients are all-reduced after backward, one tensor at a time (nothing overlaps them)."""
    import torch.distributed as dist

    s = tiny_gpt.factory(size=size, device=_device(device))
    model, opt, loss_fn = s.model, s.optimizer, s.loss_fn

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        loss_fn(model(x), y).backward()
        if _distributed():
            world = dist.get_world_size()
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return TrainSetup(loader=s.loader, step=step, model=model, optimizer=opt, device=s.device,
                      name=f"{s.name} + all-reduce after backward")


FACTORIES = {"slow_loader": slow_loader, "exposed_allreduce": exposed_allreduce, "tiny_gpt": tiny_gpt.factory}


def profile_rank(name: str, size: str | None, steps: int, warmup: int) -> dict[str, Any] | None:
    """Profile the named setup on this rank; rank 0 gets the merged, judged profile, the others None.
    (For :func:`warpforge.hw.collectives.run_local_group`, which starts the ranks.)"""
    from warpforge.profile.train import TrainConfig
    from warpforge.profile.train_cli import finalize, gather_ranks
    from warpforge.profile.train_run import profile_train

    setup = FACTORIES[name](size=size, device=_device(None))
    d = profile_train(setup, TrainConfig(steps=steps, warmup=warmup))
    ranks = gather_ranks(d)
    return None if ranks is None else finalize(ranks[0], ranks)
