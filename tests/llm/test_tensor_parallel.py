"""Tensor parallelism on 2 CPU processes (gloo; the sharding code NCCL runs): the same greedy tokens and
logprobs as one process, one all-reduce per attention and per MLP block, the refusals, and no worker
process outliving its engine (on shutdown, at exit, after an error)."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from .engine_helpers import checkpoint, one_thread  # noqa: F401  (autouse: one torch thread per process)
from warpforge.llm import LLM, SamplingParams
from warpforge.llm.config import ModelConfig
from warpforge.llm.parallel import check_tensor_parallel, kv_heads_of, shard_config

pytestmark = pytest.mark.timeout(120)

# Pages of 4 tokens: the 8-token prompt is two full pages; run twice at once after it is cached, both hit
# every page and one copies the last (copy-on-write), a step the workers repeat on their KV shards.
PROMPTS = [[5, 17, 99, 100, 3, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 300], [40, 41, 42], [7] * 9,
           list(range(60, 68))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=8)
ENGINE = dict(dtype="float32", page_size=4, max_num_seqs=8)


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


@pytest.fixture
def engines():
    """Engines made by a test; their workers are stopped (killed if need be) whatever the test did."""
    made: list[LLM] = []
    yield made
    for llm in made:
        pids = llm.engine.workers.pids if llm.engine.workers else []
        llm.engine.shutdown()
        for p in wait_gone(pids, 5.0):
            os.kill(p, signal.SIGKILL)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from warpforge.llm.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("tp")
    return {"llama": checkpoint("llama"),  # untied head, 4 heads / 2 KV heads (shared with the engine tests)
            "gemma3": checkpoint("gemma3"),  # sandwich norms, q/k norms, sliding layers
            # qkv bias and one KV head: replicated on both ranks
            "qwen2-1kv": tiny_checkpoint("qwen2", root / "qwen2", num_key_value_heads=1)}


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2-1kv"])
def test_two_ranks_match_one_process(ckpts, engines, arch):
    ref = LLM(str(ckpts[arch]), **ENGINE).generate(PROMPTS, GREEDY)
    llm = LLM(str(ckpts[arch]), tensor_parallel_size=2, **ENGINE)
    engines.append(llm)
    pids = llm.engine.workers.pids
    assert len(pids) == 1 and all(alive(p) for p in pids)
    copies = []
    runner = llm.engine.runner
    real_copy = runner.copy_pages
    runner.copy_pages = lambda pairs: (copies.extend(pairs), real_copy(pairs))[1]
    out = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS + PROMPTS[-1:], GREEDY)  # from the prefix cache, with a copied page
    assert llm.engine.lookahead_steps > 0  # decode steps whose input ids reached the worker by broadcast
    assert copies and sum(o.metrics.num_cached_tokens for o in again) > 0
    assert again[-1].token_ids == ref[-1].token_ids
    for a, b, c in zip(ref, out, again):
        assert b.token_ids == a.token_ids and c.token_ids == a.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert list(lb) == list(la)  # the same top tokens in the same order
            # fp32 partial sums added in another order than one GEMM's, through every layer: a few ulps
            # of logprobs around -10 (2.3e-5 seen, ~2e-6 relative)
            torch.testing.assert_close(torch.tensor(list(lb.values())), torch.tensor(list(la.values())),
                                       rtol=1e-5, atol=3e-5)
    # Exactly two all-reduces per layer per step: after the attention block and after the MLP block.
    tp, layers = llm.engine.runner.tp, llm.engine.model_config.num_layers
    before = tp.all_reduces
    llm.engine.add_request([9, 10, 11], SamplingParams(max_tokens=1))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert tp.all_reduces - before == 2 * layers
    # An engine dropped without shutdown() stops its workers (explicit shutdown: the CLI test).
    engines.clear()
    del llm, tp, runner
    real_copy = None  # the spy's cell let go of the runner's bound method (not del: the lambda reads it)
    gc.collect()
    assert wait_gone(pids) == []


def _config(**kw) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize("kw, n, msg", [
    ({}, 3, "tensor_parallel_size: 3 does not divide the model's 4 attention heads"),
    ({"num_heads": 6, "num_kv_heads": 3}, 2, "tensor_parallel_size: 2 neither divides the model's 3 KV heads"),
    ({"intermediate_size": 130}, 4, "tensor_parallel_size: 4 does not divide the model's MLP width 130"),
])
def test_refusals_name_the_numbers(kw, n, msg):
    with pytest.raises(ValueError, match=msg):
        check_tensor_parallel(_config(**kw), n, "cpu")


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 ranks need 4 GPUs, this machine has 2"):
        check_tensor_parallel(_config(num_heads=8, num_kv_heads=8), 4, "cuda")
    check_tensor_parallel(_config(num_heads=8, num_kv_heads=8), 2, "cuda")


def test_shard_sizes():
    assert [kv_heads_of(r, 2, 8) for r in range(2)] == [(0, 4), (4, 4)]
    assert [kv_heads_of(r, 8, 2) for r in range(8)] == [(0, 1)] * 4 + [(1, 1)] * 4  # replicated
    c = shard_config(_config(num_heads=32, num_kv_heads=8, intermediate_size=256), 4)
    assert (c.num_heads, c.num_kv_heads, c.intermediate_size) == (8, 2, 64)


def children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if fields[1] == me and fields[0] != "Z":
                out.add(int(d))
    return out


def test_refused_before_any_process_starts(ckpts):
    before = children()
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide the model's 4 attention heads"):
        LLM(str(ckpts["llama"]), tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(ckpts["llama"]), tensor_parallel_size=2, max_model_len=100_000, **{k: v for k, v in ENGINE.items()})
    assert children() == before


def test_loaded_model_is_refused(ckpts):
    from warpforge.llm.loader import load

    with pytest.raises(ValueError, match="tensor_parallel_size: .* checkpoint path, got a loaded model"):
        LLM(load(ckpts["llama"]), tensor_parallel_size=2)


def test_failed_step_stops_the_workers(ckpts, engines, monkeypatch):
    llm = LLM(str(ckpts["llama"]), tensor_parallel_size=2, **ENGINE)
    engines.append(llm)
    pids = llm.engine.workers.pids
    mlp = llm.engine.model.model.layers[0].mlp

    def boom(*a, **k):  # the driver fails between two all-reduces: the worker waits in the MLP's
        raise RuntimeError("injected failure")

    monkeypatch.setattr(mlp, "forward", boom)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(PROMPTS[0], GREEDY)
    assert wait_gone(pids) == []
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="tensor parallel: the workers are stopped .*injected failure"):
        llm.generate(PROMPTS[0], GREEDY)


def test_workers_end_with_the_driver_process(ckpts):
    """A script that never calls shutdown: its workers end at its exit (cleanly), and when it is killed."""
    script = textwrap.dedent(f"""
        import os, sys, torch
        torch.set_num_threads(1)
        from warpforge.llm import LLM, SamplingParams
        llm = LLM({str(ckpts['llama'])!r}, tensor_parallel_size=2, dtype="float32", page_size=4, max_num_seqs=4)
        print(*llm.engine.workers.pids, flush=True)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        print(len(out[0].token_ids), flush=True)
        if sys.argv[1] == "hang":
            sys.stdin.read()  # until killed
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # Both drivers at once (the machine's cores share the start-up): one exits, one is killed.
    procs = {mode: subprocess.Popen([sys.executable, "-c", script, mode], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True, env=env) for mode in ("exit", "hang")}
    pids: dict[str, list[int]] = {}
    try:
        for mode, p in procs.items():
            pids[mode] = [int(x) for x in p.stdout.readline().split()]
            assert len(pids[mode]) == 1
            assert p.stdout.readline().strip() == "3"
        assert alive(pids["hang"][0])
        procs["hang"].kill()  # no exit handlers run: the worker notices its parent is gone
        for mode, p in procs.items():
            p.wait(timeout=60)
            assert wait_gone(pids[mode], 15.0) == [], mode
    finally:
        for pid in [p.pid for p in procs.values()] + [q for v in pids.values() for q in v]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_dead_worker_fails_the_step(ckpts, engines):
    llm = LLM(str(ckpts["llama"]), tensor_parallel_size=2, **ENGINE)
    engines.append(llm)
    pid = llm.engine.workers.pids[0]
    with pytest.raises(ValueError, match="another tensor-parallel engine is running in this process"):
        LLM(str(ckpts["llama"]), tensor_parallel_size=2, **ENGINE)
    os.kill(pid, signal.SIGKILL)
    assert wait_gone([pid]) == []
    with pytest.raises(RuntimeError, match=rf"tensor parallel: worker rank 1 \(pid {pid}, status -9\) exited"):
        llm.generate(PROMPTS[0], GREEDY)


def test_generate_cli_on_two_ranks(ckpts):
    from click.testing import CliRunner

    from warpforge.cli import main

    args = ["generate", str(ckpts["llama"]), "To be", "--max-tokens", "6", "--dtype", "fp32", "--max-model-len", "64"]
    before = children()
    one = CliRunner().invoke(main, args)
    two = CliRunner().invoke(main, [*args, "--tensor-parallel-size", "2"])
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    assert two.stdout.split("\n")[0] == one.stdout.split("\n")[0]  # the same greedy text
    assert "on 2 ranks" in two.stderr
    assert wait_gone(list(children() - before)) == []  # the command stopped its worker
    bad = CliRunner().invoke(main, [*args, "--tensor-parallel-size", "3"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    # the loading line, then the one-line error
    assert bad.stderr.strip().splitlines()[-1] == ("warpforge generate: tensor_parallel_size: 3 does not divide "
                                                   "the model's 4 attention heads")


def test_torchrun_rank0_drives_and_rank1_follows(ckpts, tmp_path):
    """Every rank runs the script: rank 0 gets the engine, rank 1 serves it inside LLM() and exits with it."""
    script = tmp_path / "tp_script.py"
    script.write_text(textwrap.dedent(f"""
        import os, torch
        torch.set_num_threads(1)
        from warpforge.llm import LLM, SamplingParams
        llm = LLM({str(ckpts['llama'])!r}, tensor_parallel_size=2, dtype="float32", page_size=4, max_num_seqs=4)
        out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        print("rank", os.environ["RANK"], *out[0].token_ids, flush=True)
    """))
    want = LLM(str(ckpts["llama"]), **ENGINE).generate(
        [[5, 6, 7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0].token_ids
    from warpforge.hw.collectives import free_port

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    # A free port of our own: torchrun's default (29500) is shared with every other torchrun on the machine.
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)],
                       capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith("rank")]
    assert lines == ["rank 0 " + " ".join(map(str, want))]  # rank 1 never returned from LLM()
