"""Collective bus bandwidth: the nccl-tests formulas, and the probe's table from 2 gloo processes on CPU."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from warpforge.cli import main
from warpforge.hw.collectives import bus_bandwidth, bus_factor, run_local_group
from warpforge.hw.specs import spec_for


def test_bus_factors_match_nccl_tests():
    assert bus_factor("all_reduce", 2) == 1.0 and bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather", 8) == pytest.approx(0.875) and bus_factor("reduce_scatter", 2) == 0.5
    alg, bus = bus_bandwidth("all_reduce", 256 * 2**20, 1e-3, 8)
    assert alg == pytest.approx(268.435456) and bus == pytest.approx(268.435456 * 1.75)
    with pytest.raises(ValueError, match="op must be one of all_reduce, all_gather, reduce_scatter, got 'bcast'"):
        bus_factor("bcast", 2)


def test_nvlink_datasheet_figures():
    assert spec_for("NVIDIA H200").nvlink_GBps == 450  # 900 GB/s bidirectional
    assert spec_for("NVIDIA H100 80GB HBM3").nvlink_GBps == 450
    assert spec_for("NVIDIA L40S").nvlink_GBps is None


def _fail_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("deliberate")
    return dist.get_rank()


def test_a_failing_rank_is_reported():
    with pytest.raises(RuntimeError, match="rank 1: ValueError: deliberate"):
        run_local_group(_fail_on_rank_one, world=2, timeout_s=60)


def test_probe_collectives_on_two_gloo_processes(tmp_path):
    out = tmp_path / "coll.json"
    r = CliRunner().invoke(main, ["probe", "--collectives", "--quick", "--json", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["backend"] == "gloo" and d["world"] == 2 and d["nvlink_GBps"] is None
    assert "CPU figures" in d["note"] and "CPU figures" in r.output
    assert {(x["op"], x["bytes"]) for x in d["rows"]} == {(op, s) for op in ("all_reduce", "all_gather",
                                                                             "reduce_scatter")
                                                          for s in (4096, 16384, 65536)}
    for x in d["rows"]:
        assert x["us"] > 0 and x["busbw_GBps"] == pytest.approx(x["algbw_GBps"] * (1.0 if x["op"] == "all_reduce"
                                                                                    else 0.5))
    assert "busbw GB/s" in r.output and "reduce_scatter" in r.output
