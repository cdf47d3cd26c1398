"""CUDA graphs of decode steps: one per batch size, replayed over persistent input buffers.

A decode step is ~2 launches per layer-op at tiny sizes, so launch overhead dominates; a graph
replays the whole forward with one launch. Each graph reads its inputs from fixed buffers (the
model's StepContext points into them at capture) and writes its hidden states to a fixed output.
A batch of B pads to the next captured size with rows of slot -1 (no KV write) and seq_len 0
(attention gives zeros); their hidden rows are ignored. The decode grid is sized for
``max_seq_len`` = max_model_len so one graph serves every context length.

Graphs share one memory pool; capturing the largest size first lets the smaller ones reuse its
blocks. Each size runs once eagerly before capture so Triton compiles (and autotunes) outside it.
With ``pdl`` the kernels that support it are captured with programmatic dependent launch (each one's
programs start while the previous kernel drains; see kernels/_dispatch.py).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from warpforge.kernels import programmatic_launch
from warpforge.llm.context import StepContext, set_context


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, sizes: list[int], *, max_pages_per_seq: int, max_seq_len: int,
                 device: torch.device, pdl: bool = False):
        self.model = model
        self.pdl = pdl  # capture the kernels that support it with programmatic dependent launch
        self.sizes = sorted(set(sizes))
        self.max_seq_len = max_seq_len
        n = self.sizes[-1]
        kw = {"device": device}
        self.input_ids = torch.zeros(n, dtype=torch.int64, **kw)  # [N]
        self.positions = torch.zeros(n, dtype=torch.int64, **kw)  # [N]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, **kw)  # [N]
        self.seq_lens = torch.zeros(n, dtype=torch.int32, **kw)  # [N]
        self.block_tables = torch.zeros((n, max_pages_per_seq), dtype=torch.int32, **kw)  # [N, max pages]
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, **kw)  # [N + 1], one token per row
        # Pinned host staging of every input: a step writes into numpy views of these and queues one
        # async copy per buffer (no per-step pinned allocation or list->tensor conversion).
        self._stage = {name: torch.empty_like(buf, device="cpu").pin_memory() for name, buf in self._buffers().items()}
        self._stage_np = {name: t.numpy() for name, t in self._stage.items()}
        self._copied: torch.cuda.Event | None = None  # the last step's copies out of the staging buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [bs, hidden] written by each replay
        self.pool = None
        self.replays = 0  # steps served by a graph (tests and stats)
        self._capture()

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                "seq_lens": self.seq_lens, "block_tables": self.block_tables}

    def _context(self, bs: int) -> StepContext:
        return StepContext(slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
                           seq_lens=self.seq_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
                           max_seqlen_q=1, max_seq_len=self.max_seq_len, decode_only=True)

    def _capture(self) -> None:
        for bs in reversed(self.sizes):
            set_context(self._context(bs))
            try:
                with programmatic_launch(self.pdl):
                    self.model(self.input_ids[:bs], self.positions[:bs])  # warm-up: compile/tune outside capture
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        self.outputs[bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            finally:
                set_context(None)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def padded_size(self, batch_size: int) -> int | None:
        """The smallest captured size >= batch_size (None: too large, run eagerly)."""
        i = bisect.bisect_left(self.sizes, batch_size)
        return self.sizes[i] if i < len(self.sizes) else None

    def replay(self, bs: int, inputs: dict) -> torch.Tensor:
        """Fill the buffers from host lists padded to ``bs`` rows (see ModelRunner.host_inputs) and
        replay; -> hidden [bs, hidden] (valid until the next replay)."""
        arrays = {name: np.asarray(inputs[name]) for name in self._stage}
        return self.replay_arrays(bs, arrays)

    def replay_arrays(self, bs: int, arrays: dict[str, np.ndarray],
                      input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Fill the buffers from numpy arrays of ``bs`` rows (ModelRunner.decode_arrays): each goes
        into its pinned staging buffer, then one non-blocking copy per buffer; replay. Only the used
        block-table columns are copied: entries past a row's length are never read. ``input_ids``
        (a device tensor of the first rows' tokens, e.g. the previous step's samples) overrides the
        host's, copied on the device."""
        if self._copied is not None:
            self._copied.synchronize()  # the staging buffers are free again (normally long since)
        width = arrays["block_tables"].shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block_tables: {width} pages per sequence, the graphs hold {self.block_tables.shape[1]}")
        for name, buf in self._buffers().items():
            src = arrays[name]
            if name == "block_tables":
                self._stage_np[name][:bs, :width] = src[:bs]
                buf[:bs, :width].copy_(self._stage[name][:bs, :width], non_blocking=True)
            else:
                self._stage_np[name][:bs] = src[:bs]
                buf[:bs].copy_(self._stage[name][:bs], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        if input_ids is not None:
            self.input_ids[:input_ids.shape[0]].copy_(input_ids)
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs]
