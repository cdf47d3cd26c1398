"""One rank of the data-parallel test (launched by torchrun from test_distributed.py): train the tiny street
with one camera per rank a step; record the state before some steps, the averaged gradients and visibility
those steps update with, every reduction of the densification statistics, and the final Gaussians."""

from __future__ import annotations

import sys

import torch

from tests.splat.test_distributed import CHECK, STEPS, config, scene
from warpforge.splat.distributed import init_world, shutdown
from warpforge.splat.train import Trainer


def main(out: str) -> None:
    world = init_world("cpu", timeout_s=120)
    assert world is not None and world.size == 2
    torch.set_num_threads(1)  # two ranks share this machine's cores
    t = Trainer(scene(), config(batch=1), world=world)
    rec: dict = {"steps": {}, "reduce": []}
    update, reduce = t.update, t.densifier.all_reduce

    def spy_update(visible: torch.Tensor) -> None:
        if t.step in CHECK:
            rec["steps"][t.step].update(grads={k: p.grad.clone() for k, p in t.params.items()}, visible=visible.clone())
        update(visible)

    def spy_reduce(x: torch.Tensor, op: str) -> None:
        before = x.clone()
        reduce(x, op)
        rec["reduce"].append({"step": t.step, "op": op, "before": before, "after": x.clone()})

    t.update, t.densifier.all_reduce = spy_update, spy_reduce
    while t.step < STEPS:
        if t.step in CHECK:
            rec["steps"][t.step] = {"state": t.state_dict()}
        t.train_step()
    rec.update(params={k: v.detach() for k, v in t.params.items()}, history=t.history)
    torch.save(rec, f"{out}/rank{world.rank}.pt")
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
