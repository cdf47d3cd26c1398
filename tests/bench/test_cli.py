"""`warpforge bench` and `warpforge results` through the real CLI entry point, on CPU."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from warpforge.results.record import read_jsonl
from warpforge.cli import main


@pytest.fixture
def cli(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps narrow tables; tests read whole cells
    # These tests check the CPU path (what CI runs), also on a GPU machine; test_bench_memory_gpu covers the GPU.
    # Import the kernels first: their dispatch decides once, at import, whether to use Triton's
    # interpreter, and it must see the real answer.
    import warpforge.kernels  # noqa: F401

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner = CliRunner()
    return lambda *args: runner.invoke(main, list(args), catch_exceptions=False)


def test_bench_list(cli):
    out = cli("bench", "--list")
    assert out.exit_code == 0
    assert "memory" in out.output and "copy fp32" in out.output and "sum bf16" in out.output


def test_bench_unknown_suite_exits_2_with_list(cli):
    out = cli("bench", "nosuchsuite")
    assert out.exit_code == 2 and "unknown suite 'nosuchsuite'" in out.output and "memory" in out.output
    out = cli("bench")
    assert out.exit_code == 2 and "memory" in out.output


def test_bench_memory_quick_then_results(cli, tmp_path):
    store, jsonl = tmp_path / "r.sqlite", tmp_path / "m.jsonl"
    out = cli("bench", "memory", "--quick", "--store", str(store), "--out", str(jsonl))
    assert out.exit_code == 0, out.output
    recs = read_jsonl(jsonl)  # validates every record
    assert len(recs) == 6 and all(r["device"]["name"] == "cpu" and r["correct"]["ok"] for r in recs)
    assert {r["params"]["op"] for r in recs} == {"copy", "fill", "sum"}
    assert all(set(r["peers"]) == {"torch"} for r in recs)  # no compile peers on CPU
    assert "reference-path figures" in out.output and "stored as run 1" in out.output
    assert "copy fp32 4MiB" in out.output and "vs torch" in out.output
    # What the probe caches on a CPU is not what is missing here: no "run warpforge probe" hint.
    assert "roofline: not computed for CPU runs" in out.output and "warpforge probe" not in out.output

    out = cli("bench", "memory", "--quick", "-k", "sum", "--store", str(store))
    assert out.exit_code == 0 and "stored as run 2" in out.output

    out = cli("results", "list", "--store", str(store))
    assert out.exit_code == 0 and "memory" in out.output
    out = cli("results", "show", "latest", "--store", str(store))
    assert out.exit_code == 0 and "run 2" in out.output and "sum fp32 4MiB" in out.output
    assert "copy fp32" not in out.output
    out = cli("results", "compare", "1", "2", "--store", str(store))
    assert out.exit_code == 0 and "only in A" in out.output and "sum bf16 4MiB" in out.output
    out = cli("results", "show", "9", "--store", str(store))
    assert out.exit_code == 2 and "no run 9" in out.stderr and out.stdout == ""

    import json

    runs = json.loads(cli("results", "list", "--store", str(store), "--json").stdout)
    assert [r["id"] for r in runs] == [2, 1] and runs[0]["suite"] == "memory"
    shown = json.loads(cli("results", "show", "1", "--store", str(store), "--json").stdout)
    assert shown["run"]["id"] == 1 and len(shown["records"]) == 6
    compared = json.loads(cli("results", "compare", "1", "2", "--store", str(store), "--json").stdout)
    assert {c["case"] for c in compared["cases"]} >= {"sum fp32 4MiB"}


def test_bench_json_and_out_directory(cli, tmp_path):
    """--json: the records alone on stdout; --out DIR writes DIR/<suite>.jsonl (a .jsonl path stays a file)."""
    import json

    out = cli("bench", "memory", "--quick", "-k", "fill fp32", "--no-store", "--json", "--out", str(tmp_path / "d"))
    assert out.exit_code == 0, out.output
    recs = json.loads(out.stdout)
    assert [r["case"] for r in recs] == [r["case"] for r in read_jsonl(tmp_path / "d" / "memory.jsonl")]
    assert recs and "fill fp32" in out.stderr  # the table, on stderr
    bad = cli("bench", "memory", "-k", "nothing like this", "--no-store")
    assert bad.exit_code == 2 and "no case of memory matches" in bad.stderr and bad.stderr.count("\n") == 1


def test_failing_ours_exits_1_after_storing(cli, tmp_path, monkeypatch):
    from warpforge.bench.suites import memory

    monkeypatch.setattr(memory, "_ours_copy", lambda src, out: out.copy_(src * 2))
    store = tmp_path / "r.sqlite"
    out = cli("bench", "memory", "--quick", "-k", "copy", "--store", str(store))
    assert out.exit_code == 1
    assert "FAIL" in out.output and "correctness FAILED" in out.output and "stored as run 1" in out.output
    out = cli("results", "list", "--store", str(store))
    assert out.exit_code == 0


def test_interrupted_run_keeps_finished_cases(cli, tmp_path, monkeypatch):
    """Ctrl-C (or SIGTERM) mid-suite: the cases that finished are in --out and the store; exit 130."""
    from warpforge.bench.suites import memory

    real = memory._ours_copy

    def ours_then_interrupt(src, out):
        if src.dtype == torch.bfloat16:  # "copy fp32" finishes; "copy bf16" is cut short
            raise KeyboardInterrupt
        return real(src, out)

    monkeypatch.setattr(memory, "_ours_copy", ours_then_interrupt)
    store, jsonl = tmp_path / "r.sqlite", tmp_path / "m.jsonl"
    out = cli("bench", "memory", "--quick", "-k", "copy", "--store", str(store), "--out", str(jsonl))
    assert out.exit_code == 130, out.output
    assert "interrupted: keeping the 1 finished case(s)" in out.output
    kept = read_jsonl(jsonl)
    assert len(kept) == 1 and kept[0]["correct"]["ok"]
    assert "stored as run 1" in out.output


def test_store_error_exits_2_but_writes_out(cli, tmp_path):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"not a database at all\n" * 100)
    jsonl = tmp_path / "m.jsonl"
    out = cli("bench", "memory", "--quick", "-k", "fill fp32", "--store", str(bad), "--out", str(jsonl))
    assert out.exit_code == 2
    assert "results store error" in out.output and "not an SQLite database" in out.output
    assert "Traceback" not in out.output
    assert len(read_jsonl(jsonl)) == 1
    for args in (["list"], ["show", "latest"], ["compare", "1", "2"]):
        out = cli("results", *args, "--store", str(bad))
        assert out.exit_code == 2 and "not an SQLite database" in out.output


def test_results_on_a_fresh_machine(cli, tmp_path):
    out = cli("results", "list")  # default store under the test's WARPFORGE_DATA_DIR: not created yet
    assert out.exit_code == 0 and "no results store" in out.output
    out = cli("bench", "memory", "--quick", "-k", "sum fp32", "--no-store")
    assert out.exit_code == 0 and "stored as" not in out.output


@pytest.mark.gpu
def test_bench_memory_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "200")
    jsonl = tmp_path / "m.jsonl"
    out = CliRunner().invoke(main, ["bench", "memory", "--quick", "-k", "fp32", "--store", str(tmp_path / "r.sqlite"),
                                    "--out", str(jsonl)], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    recs = read_jsonl(jsonl)
    assert len(recs) == 3 and "reference-path" not in out.output
    for r in recs:
        assert r["device"]["name"] != "cpu" and r["device"]["sms"] > 0
        assert r["correct"]["ok"] and r["timing"]["method"] == "cuda_event+l2flush-read+hostpad"
        assert "torch.compile" in r["peers"]  # run, or recorded with its error
        assert r["roofline"] is not None and 0 < r["roofline"]["fraction"] <= 1.05, r["roofline"]
