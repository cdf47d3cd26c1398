"""CUDA graphs of decode steps: one per batch size, replayed over persistent input buffers.

A decode step is ~2 launches per layer-op at tiny sizes, so launch overhead dominates; a graph
replays the whole forward with one launch. Each graph reads its inputs from fixed buffers (the
model's StepContext points into them at capture) and writes its hidden states to a fixed output.
A batch of B pads to the next captured size with rows of slot -1 (no KV write) and seq_len 0
(attention gives zeros); their hidden rows are ignored. The decode grid is sized for
``max_seq_len`` = max_model_len so one graph serves every context length.

Graphs share one memory pool; capturing the largest size first lets the smaller ones reuse its
blocks. Each size runs once eagerly before capture so Triton compiles (and autotunes) outside it.
"""

from __future__ import annotations

import bisect

import torch

from warpforge.llm.context import StepContext, set_context


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, sizes: list[int], *, max_pages_per_seq: int, max_seq_len: int,
                 device: torch.device):
        self.model = model
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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [bs, hidden] written by each replay
        self.pool = None
        self.replays = 0  # steps served by a graph (tests and stats)
        self._capture()

    def _context(self, bs: int) -> StepContext:
        return StepContext(slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
                           seq_lens=self.seq_lens[:bs], cu_seqlens_q=self.cu_seqlens_q[:bs + 1],
                           max_seqlen_q=1, max_seq_len=self.max_seq_len, decode_only=True)

    def _capture(self) -> None:
        for bs in reversed(self.sizes):
            set_context(self._context(bs))
            try:
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
        """Fill the buffers from host lists padded to ``bs`` rows (see ModelRunner.host_inputs),
        one pinned non-blocking copy each, and replay; -> hidden [bs, hidden] (valid until the next replay)."""
        def fill(buf: torch.Tensor, values, dtype) -> None:
            buf.copy_(torch.tensor(values, dtype=dtype, pin_memory=True), non_blocking=True)

        fill(self.input_ids[:bs], inputs["input_ids"], torch.int64)
        fill(self.positions[:bs], inputs["positions"], torch.int64)
        fill(self.slot_mapping[:bs], inputs["slot_mapping"], torch.int64)
        fill(self.seq_lens[:bs], inputs["seq_lens"], torch.int32)
        # Only the used columns: entries past a row's length are never read, stale ones are harmless.
        width = len(inputs["block_tables"][0])
        fill(self.block_tables[:bs, :width], inputs["block_tables"], torch.int32)
        self.graphs[bs].replay()
        self.replays += 1
        return self.outputs[bs]
