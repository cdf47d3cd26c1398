"""Two gloo processes on localhost (bounded, cleaned up by run_local_group): a deliberately non-overlapped
gradient all-reduce is named first, DDP's bucket all-reduces are recorded, and rank 0's merge names a rank
whose loader sleeps as the straggler."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from warpforge.hw.collectives import run_local_group
from warpforge.profile.train import TrainConfig, TrainSetup
from warpforge.profile.train_breakdown import PARTS
from warpforge.profile.train_cli import finalize, gather_ranks
from warpforge.profile.train_findings import THRESHOLD
from warpforge.profile.train_run import profile_train

WIDTH = 512  # a 1 MiB weight: its all-reduce over loopback outweighs a batch-4 forward by far


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, 10))


def _data(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(dist.get_rank())
    return [(torch.randn(4, WIDTH, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(n)]


class SleepyOnRank:
    def __init__(self, batches, rank: int, seconds: float):
        self.batches, self.rank, self.seconds = batches, rank, seconds

    def __iter__(self):
        for b in self.batches:
            if dist.get_rank() == self.rank:
                time.sleep(self.seconds)
            yield b


def _profile(setup: TrainSetup) -> dict | None:
    d = profile_train(setup, TrainConfig(steps=4, warmup=1, plain=2))
    ranks = gather_ranks(d)
    return None if ranks is None else finalize(ranks[0], ranks)


def _scenarios() -> dict:
    world = dist.get_world_size()
    out = {}
    # 1. All-reduce of every gradient after backward, one tensor at a time: nothing overlaps it.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)

    def step(batch):
        x, y = batch
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()

    out["manual"] = _profile(TrainSetup(loader=_data(), step=step, model=model, optimizer=opt))
    # 2. DDP with small buckets: its bucket all-reduces go through the comm hook.
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.5)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, foreach=True)
    out["ddp"] = _profile(TrainSetup(loader=_data(), model=ddp, optimizer=opt, loss_fn=nn.functional.cross_entropy))
    # 3. DDP where rank 1's loader sleeps 40 ms a batch.
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, foreach=True)
    out["straggler"] = _profile(TrainSetup(loader=SleepyOnRank(_data(), 1, 0.04), model=ddp, optimizer=opt,
                                           loss_fn=nn.functional.cross_entropy))
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_local_group(_scenarios, world=2, backend="gloo", timeout_s=150)[0]


def test_non_overlapped_all_reduce_is_the_top_finding(runs):
    d = runs["manual"]
    top = d["findings"][0]
    assert top["kind"] == "exposed_comm" and top["severity"] >= THRESHOLD, d["findings"]
    assert "DistributedDataParallel" in top["advice"] and top["evidence"]["algbw_GBps"] > 0
    a = d["aggregate"]
    assert a["collectives"] == 6 and a["comm_bytes"] == sum(p.numel() * 4 for p in _model().parameters())
    assert a["mean"]["comm_overlapped"] == 0.0  # synchronous: the host waited for every one
    assert a["parts_error"] < 0.05


def test_ddp_bucket_all_reduces_recorded(runs):
    d = runs["ddp"]
    a = d["aggregate"]
    n_params = sum(p.numel() * 4 for p in _model().parameters())
    assert a["collectives"] >= 2 and a["comm_bytes"] == n_params  # every gradient reduced, in buckets
    assert a["mean"]["comm_exposed"] + a["mean"]["comm_overlapped"] > 0
    for s in d["steps"]:
        assert sum(s[k] for k in PARTS) == pytest.approx(s["step_ms"], rel=0.05)
    assert d["ddp"]["bucket_cap_mb"] == pytest.approx(0.5)
    assert [r["meta"]["rank"] for r in d["ranks"]] == [0, 1]


def test_straggler_named_by_rank_zero(runs):
    d = runs["straggler"]
    f = d["findings"][0]
    assert f["kind"] == "straggler", d["findings"]
    assert "Rank 1" in f["text"] and f["evidence"]["part"] == "data"
    r0, r1 = (r["aggregate"]["mean"] for r in d["ranks"])
    assert r1["data"] > 30 and r0["comm_exposed"] > 20  # rank 0 waits in the all-reduce for rank 1
    # That wait is the straggler's cost: no exposed-communication finding blames the network for it (on a
    # busy machine gloo's own time can still earn one, without the wait).
    comm = [g for g in d["findings"] if g["kind"] == "exposed_comm"]
    assert all(g["evidence"]["exposed_ms"] < 0.5 * r1["data"] for g in comm), (comm, r1)


TRAIN_PY = '''
import time
import torch
import torch.distributed as dist
from torch import nn


class Sleepy:
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        for b in self.batches:
            if dist.get_rank() == 1:
                time.sleep(0.03)
            yield b


def factory():
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, foreach=True)
    data = [(torch.randn(8, 64), torch.randint(0, 10, (8,))) for _ in range(4)]
    return model, opt, Sleepy(data), nn.functional.cross_entropy
'''


def test_torchrun_each_rank_records_rank_zero_merges(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from warpforge.hw.collectives import free_port

    (tmp_path / "train.py").write_text(TRAIN_PY)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "warpforge", "profile", "--train", f"{tmp_path / 'train.py'}:factory", "--steps", "3", "--warmup",
           "1", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads((out / "report.json").read_text())
    assert d["meta"]["world"] == 2 and [x["meta"]["rank"] for x in d["ranks"]] == [0, 1]
    assert d["findings"][0]["kind"] == "straggler" and "Rank 1" in d["findings"][0]["text"]
    assert r.stdout.count("report:") == 1  # rank 0 alone writes and prints


FSDP_PY = '''
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard


def factory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(torch.randn(16, 64), torch.randint(0, 10, (16,))) for _ in range(8)]
    return model, opt, data, nn.functional.cross_entropy
'''


def test_torchrun_fsdp_run_is_profiled_with_sharded_memory(tmp_path):
    """FSDP2 (fully_shard): DTensor parameters count their local shard, and an exposed-communication finding
    gives FSDP's remedies, not DDP's."""
    import json
    import os
    import subprocess
    import sys

    from warpforge.hw.collectives import free_port

    (tmp_path / "train.py").write_text(FSDP_PY)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "warpforge", "profile", "--train",
           f"{tmp_path / 'train.py'}:factory", "--steps", "3", "--warmup", "1", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads((out / "report.json").read_text())
    assert d["meta"]["world"] == 2 and d["fsdp"] is True
    full = (64 * 128 + 128 + 128 * 10 + 10) * 4  # fp32 parameters of the whole model
    params = d["memory"]["split"]["parameters"]
    assert 0.4 * full <= params <= 0.6 * full, params  # rank 0 holds its shard, about half
    comm = [f for f in d["findings"] if f["kind"] == "exposed_comm"]
    assert comm, d["findings"]  # gloo's all-gathers dwarf this model's compute
    assert all("FSDP" in f["advice"] and "DistributedDataParallel so" not in f["advice"] for f in comm), comm
