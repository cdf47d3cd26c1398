"""The probe's Triton kernels: the sweep covers its working set, the chase follows the chain exactly.

On CPU they run through the Triton interpreter (timers compiled out); on a GPU with the timers on.
"""

from __future__ import annotations

import pytest
import torch

from warpforge.hw import _probe_kernels as pk


@pytest.mark.parametrize("ws_tiles, programs, bytes_per_launch", [(7, 3, 64 * 4 * 3 * 5), (2, 5, 1), (16, 4, 10**5)])
def test_sweep_reads_each_programs_tiles(device, ws_tiles, programs, bytes_per_launch):
    tile = 64
    gen = torch.Generator(device=device).manual_seed(ws_tiles)
    buf = torch.rand(tile * 20, generator=gen, device=device)
    ws = ws_tiles * tile * 4 + 100  # a ragged set rounds down to whole tiles
    run, nbytes = pk.sweep_launcher(buf, ws, bytes_per_launch, programs, tile=tile, num_warps=1)
    iters = nbytes // (programs * tile * 4)
    assert nbytes == programs * iters * tile * 4 and nbytes >= min(bytes_per_launch, programs * tile * 4)
    got = run().to(torch.float64)
    exp = pk.sweep_expected(buf, ws, programs, iters, tile).to(device)
    torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-4)
    # the walk touches every tile of the set once the programs have made enough steps together
    seen = {(p + i * programs) % ws_tiles for p in range(programs) for i in range(iters)}
    assert programs * iters < ws_tiles or seen == set(range(ws_tiles))


def test_sweep_launcher_validates():
    buf = torch.rand(1024)
    with pytest.raises(ValueError, match="ws_bytes"):
        pk.sweep_launcher(buf, 8 * 1024, 1, 2, tile=64)  # larger than the buffer
    with pytest.raises(ValueError, match="ws_bytes"):
        pk.sweep_launcher(buf, 100, 1, 2, tile=64)  # smaller than a tile
    with pytest.raises(ValueError, match="buf"):
        pk.sweep_launcher(buf.half(), 256, 1, 2, tile=64)


def test_chain_is_one_cycle_through_every_slot():
    gen = torch.Generator().manual_seed(1)
    chain = pk.make_chain(4096, 64, torch.device("cpu"), gen)  # 64 slots, 16 int32 apart
    nxt = chain.next.tolist()
    idx, seen = 0, set()
    for _ in range(64):
        seen.add(idx)
        assert idx % chain.stride == 0
        idx = nxt[idx]
    assert idx == 0 and len(seen) == 64
    assert chain.order.tolist() != list(range(64))  # shuffled, not sequential


@pytest.mark.parametrize("warm, steps, start", [(1, 1, 0), (3, 100, 5), (130, 257, 63), (1, 1000, 17)])
def test_chase_final_index_matches_python_walk(device, warm, steps, start):
    gen = torch.Generator(device=device).manual_seed(steps)
    chain = pk.make_chain(4096, 64, device, gen)
    timed = device.type == "cuda"
    res = pk.chase(chain, start, warm, steps, cache=".cg", timed=timed)
    assert res["final"] == pk.walk(chain, start, warm + steps)
    if timed:
        assert res["cycles"] > 1 and res["ns"] > 0


def test_chase_validates():
    chain = pk.make_chain(1024, 64, torch.device("cpu"), torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="warm"):
        pk.chase(chain, 0, 0, 10, cache=".cg", timed=False)
    with pytest.raises(ValueError, match="cache"):
        pk.chase(chain, 0, 1, 10, cache=".xx", timed=False)
    with pytest.raises(ValueError, match="stride"):
        pk.make_chain(1024, 6, torch.device("cpu"), torch.Generator())
    with pytest.raises(ValueError, match="slots"):
        pk.make_chain(64, 64, torch.device("cpu"), torch.Generator())


@pytest.mark.gpu
def test_chase_latency_levels_on_gpu():
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    l1 = pk.make_chain(16 << 10, 128, dev, gen)
    big = pk.make_chain(512 << 20, 512, dev, gen)
    torch.empty(256 << 20, dtype=torch.uint8, device=dev).fill_(1)  # push the chain's lines out of L2
    fast = pk.chase(l1, int(l1.order[0]), 256, 20000, cache=".ca", timed=True)
    slow = pk.chase(big, int(big.order[0]), 1, 2000, cache=".cg", timed=True)
    assert fast["final"] == pk.walk(l1, int(l1.order[0]), 20256)
    assert slow["final"] == int(big.order[2001 % big.order.numel()]) * big.stride
    assert 10 < fast["cycles"] < 100 and 300 < slow["cycles"] < 3000, (fast, slow)
