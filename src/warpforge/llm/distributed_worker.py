"""Tensor-parallel processes: the driver's runner, the workers' loop, their start and their end.

The engine process is rank 0, the driver: it schedules, samples and detokenizes as with one GPU. Before
each step's forward it sends the workers that step's host inputs (the arrays its own runner uploads) on a
gloo control group; every rank then runs the same forward on its shard, meeting at the all-reduces. A
lookahead step (async scheduling) decodes tokens the driver has not read back yet: the driver broadcasts
those ids on the device group, so no rank waits for the host. Workers run neither the LM head nor the
sampler (the head is replicated: the driver's logits are the whole logits).

Start: spawned by the engine (one fresh interpreter per extra rank, rendezvous on a free
localhost port), or under ``torchrun``, where every rank runs the user's script: rank 0's ``LLM(...)``
returns the engine, the other ranks serve it inside the constructor and exit the process when it ends.

End: ``TensorParallelWorkers.shutdown`` (the engine's ``shutdown()``, and at interpreter exit) tells the
workers to stop and joins them; a step that fails on the driver stops them at once (they may be waiting
in a collective that will never complete) and the engine refuses further steps. Spawned workers also exit
when the driver process disappears.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from warpforge.llm.context import StepContext, set_context
from warpforge.llm.engine_config import EngineConfig
from warpforge.llm.parallel import (TPGroup, apply_tp, check_tensor_parallel, init_group, launched_by_torchrun,
                                    read_config, shard_config)
from warpforge.llm.runner import ModelRunner

_STOP = "stop"


@dataclass
class StepMessage:
    """One step, from the driver to every worker, before the driver's own forward."""

    copies: list[tuple[int, int]]  # (src, dst) KV pages to copy first (copy-on-write)
    graph_bs: int | None  # the captured decode graph to replay (inputs: ModelRunner.decode_arrays), or None:
    inputs: dict  # eager (inputs: ModelRunner.host_inputs)
    decode_only: bool
    lookahead_rows: int  # > 0: the input ids are the previous step's samples, broadcast on the device group


_LIVE: TensorParallelWorkers | None = None  # this process's group (torch.distributed has one default group)


class TensorParallelWorkers:
    """The driver's handle on the other ranks: the control channel and, when spawned, their processes."""

    def __init__(self, tp: TPGroup, procs: list):
        self.tp, self.procs = tp, procs
        self.closed = False
        self.error: str | None = None
        self.exited_before = ""
        atexit.register(self.shutdown)
        global _LIVE
        _LIVE = self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, msg: StepMessage | str) -> None:
        if self.closed:
            raise RuntimeError(f"tensor parallel: the workers are stopped ({self.error or 'engine shut down'})")
        dist.broadcast_object_list([msg], src=0, group=self.tp.cpu_group)

    def shutdown(self, error: BaseException | None = None) -> None:
        """Stop the workers (a stop message, or at once after ``error``) and leave the process group."""
        if self.closed:
            return
        # Workers that had ended on their own before this shutdown: rank, pid and exit status.
        self.exited_before = ", ".join(f"rank {r} (pid {p.pid}, status {p.poll()})"
                                       for r, p in enumerate(self.procs, 1) if p.poll() is not None)
        if error is None:
            try:
                self.send(_STOP)
            except Exception as e:  # a worker died: nothing to tell the others, stop them below
                error = e
        self.closed = True
        if error is not None:
            self.error = f"{type(error).__name__}: {error}"
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30 if error is None else 0.5)
        if error is not None:  # a worker whose death caused the error may be reaped only now
            self.exited_before = ", ".join(f"rank {r} (pid {p.pid}, status {p.poll()})"
                                           for r, p in enumerate(self.procs, 1) if p.poll() is not None)
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
            if p.poll() is None:
                p.kill()
                p.wait()
        if error is None or self.procs:  # under torchrun after an error, peers may still hold the group
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        atexit.unregister(self.shutdown)


class DriverRunner(ModelRunner):
    """Rank 0's runner: the ModelRunner's step, with the step's host inputs sent to the workers first."""

    def __init__(self, model, config, engine_config: EngineConfig, device, workers: TensorParallelWorkers):
        self.workers, self.tp = workers, workers.tp
        self._memo = None  # (batch, inputs) of the step being launched: computed once, sent and uploaded
        super().__init__(model, config, engine_config, device)
        weakref.finalize(self, workers.shutdown)  # an engine dropped without shutdown() stops its workers

    def _default_num_pages(self) -> int:
        return agree_num_pages(super()._default_num_pages(), self.tp)

    def _launch(self, batch, ids_from):
        graph_bs = self.graphs.padded_size(len(batch.seqs)) if self.graphs and batch.decode_only else None
        inputs = self.decode_arrays(batch, graph_bs) if graph_bs is not None else self.host_inputs(batch)
        prev = ids_from.token_ids if ids_from is not None else None
        self._memo = (batch, inputs)
        try:
            self.workers.send(StepMessage(batch.copies, graph_bs, inputs, batch.decode_only,
                                          0 if prev is None else prev.shape[0]))
            if prev is not None:
                dist.broadcast(prev, src=0, group=self.tp.group)
            return super()._launch(batch, ids_from)
        except BaseException as e:
            if not self.workers.closed:
                self.workers.shutdown(error=e)  # they may wait in a collective this rank will never reach
            dead = self.workers.exited_before
            if dead and not str(e).startswith("tensor parallel:"):
                raise RuntimeError(f"tensor parallel: worker {dead} exited during the step; the engine is "
                                   f"stopped (its error is in the worker's stderr)") from e
            raise
        finally:
            self._memo = None

    def decode_arrays(self, batch, pad_to):
        if self._memo is not None and self._memo[0] is batch:
            return self._memo[1]
        return super().decode_arrays(batch, pad_to)

    def host_inputs(self, batch, pad_to=None):
        if pad_to is None and self._memo is not None and self._memo[0] is batch:
            return self._memo[1]
        return super().host_inputs(batch, pad_to)


class WorkerRunner(ModelRunner):
    """A rank > 0 runner: its KV cache share and graphs; steps come from the driver's messages."""

    def __init__(self, model, config, engine_config: EngineConfig, device, tp: TPGroup):
        self.tp = tp
        super().__init__(model, config, engine_config, device)

    def _default_num_pages(self) -> int:
        return agree_num_pages(super()._default_num_pages(), self.tp)

    def step(self, msg: StepMessage) -> None:
        """The driver's step on this rank's shard: page copies, the forward (a graph replay or eager)."""
        ids = None
        if msg.lookahead_rows:
            ids = torch.empty(msg.lookahead_rows, dtype=torch.int64, device=self.device)
            dist.broadcast(ids, src=0, group=self.tp.group)
        with torch.inference_mode():
            if msg.copies:
                self.copy_pages(msg.copies)
            if msg.graph_bs is not None:
                self.graphs.replay_arrays(msg.graph_bs, msg.inputs, input_ids=ids)
                return
            up, h = self._upload, msg.inputs
            ctx = StepContext(slot_mapping=up(h["slot_mapping"], torch.int64),
                              block_tables=up(h["block_tables"], torch.int32),
                              seq_lens=up(h["seq_lens"], torch.int32), cu_seqlens_q=up(h["cu_seqlens_q"], torch.int32),
                              max_seqlen_q=h["max_seqlen_q"], max_seq_len=h["max_seq_len"],
                              decode_only=msg.decode_only)
            input_ids = up(h["input_ids"], torch.int64)
            if ids is not None:
                input_ids.copy_(ids)
            set_context(ctx)
            try:
                self.model(input_ids, up(h["positions"], torch.int64))
            finally:
                set_context(None)


def agree_num_pages(num_pages: int, tp: TPGroup) -> int:
    """The fewest KV pages any rank can hold: the driver's block manager hands out page ids for all."""
    t = torch.tensor([num_pages], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    return int(t.item())


def _rank_device(device_type: str, local_rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device("cpu")
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    return dev


def _load_shard(path: str, dtype: torch.dtype, device: torch.device, tp: TPGroup):
    """Load the whole checkpoint on this rank's device and keep its share (the rest is freed)."""
    from warpforge.llm.loader import load

    model, tokenizer, config = load(path, dtype=dtype, device=device)
    apply_tp(model, tp)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return model, tokenizer, config


def serve(tp: TPGroup, path: str, dtype: torch.dtype, device: torch.device, engine_config: EngineConfig) -> None:
    """A worker's life: load its shard, build its runner with the driver, follow the driver's steps."""
    model, _, config = _load_shard(path, dtype, device, tp)
    ec = engine_config.for_model(config.max_position_embeddings)
    runner = WorkerRunner(model, shard_config(config, tp.world_size), ec, device, tp)
    cuda = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with cuda:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
            msg = box[0]
            if msg == _STOP:
                break
            runner.step(msg)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.destroy_process_group()


def watch_parent(parent_pid: int) -> None:
    """Exit when the parent process is gone (killed without running its exit handlers): a worker or engine
    process must not outlive the process that started it. Run it on a daemon thread."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(1)


_BOOT = ("import pickle, sys; args = pickle.load(sys.stdin.buffer); sys.path[:0] = args.pop('sys_path'); "
         "from warpforge.llm.distributed_worker import worker_main; worker_main(**args)")


def spawn_worker(args: dict) -> subprocess.Popen:
    """One rank > 0 as a fresh interpreter (not multiprocessing's spawn, which re-imports the user's
    script and so needs an ``if __name__ == "__main__"`` guard in it); its arguments arrive on stdin."""
    p = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE)
    p.stdin.write(pickle.dumps({**args, "sys_path": list(sys.path)}))
    p.stdin.close()
    return p


def worker_main(rank: int, n: int, init_method: str, path: str, dtype: torch.dtype, device_type: str,
                engine_config: EngineConfig, threads: int, parent_pid: int) -> None:
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(threads)
    device = _rank_device(device_type, rank)
    try:
        tp = init_group(rank, n, device_type, init_method)
        serve(tp, path, dtype, device, engine_config)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # close this rank's sockets now: the driver's next collective fails instead of waiting
    os._exit(0)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_driver(path: str | Path, engine_config: EngineConfig, dtype: torch.dtype, device: torch.device):
    """Check the split, start or join the other ranks, load rank 0's shard and build its runner.

    -> ((model, tokenizer, config), DriverRunner, TensorParallelWorkers). Under torchrun a rank > 0
    serves rank 0 here and exits the process when rank 0's engine shuts down."""
    n = engine_config.tensor_parallel_size
    path = str(path)
    if _LIVE is not None and not _LIVE.closed:
        gc.collect()  # an engine dropped but still in a reference cycle: its finalizer stops its workers
        if not _LIVE.closed:
            raise ValueError("tensor_parallel_size: another tensor-parallel engine is running in this process "
                             "(one process group per process); call its engine.shutdown() first")
    config = read_config(path)
    check_tensor_parallel(config, n, device.type)
    engine_config.for_model(config.max_position_embeddings)  # its refusal before any process starts
    if device.type == "cuda" and device.index not in (None, 0):
        raise ValueError(f"device: tensor parallel runs ranks on cuda:0..cuda:{n - 1}, got {device}")
    procs = []
    if launched_by_torchrun():
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        device = _rank_device(device.type, local)
        tp = init_group(rank, n, device.type, None)
        if rank != 0:
            serve(tp, path, dtype, device, engine_config)
            sys.exit(0)
    else:
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [spawn_worker(dict(rank=r, n=n, init_method=init, path=path, dtype=dtype, device_type=device.type,
                                   engine_config=engine_config, threads=torch.get_num_threads(),
                                   parent_pid=os.getpid()))
                 for r in range(1, n)]
        device = _rank_device(device.type, 0)
        try:
            tp = init_group(0, n, device.type, init)
        except BaseException:
            for p in procs:
                p.kill()
                p.wait()
            raise
    workers = TensorParallelWorkers(tp, procs)
    try:
        loaded = _load_shard(path, dtype, device, tp)
        ec = engine_config.for_model(loaded[2].max_position_embeddings)
        runner = DriverRunner(loaded[0], shard_config(loaded[2], n), ec, device, workers)
    except BaseException as e:
        workers.shutdown(error=e)
        raise
    return loaded, runner, workers
