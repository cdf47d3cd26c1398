"""ModelRunner: owns the KV cache, turns a scheduled batch into tensors, runs the model, samples.

One step (``run``): copy-on-write page copies -> ``prepare`` (token ids, positions, StepContext;
one host-to-device copy per tensor, from pinned memory on CUDA) -> forward (a replayed CUDA graph
for decode-only batches, else eager) -> logits of the rows that sample -> Sampler. The only host
wait in a step is reading the sampled ids back.

KV memory: ``EngineConfig.num_pages`` when given; on CUDA otherwise what is left of
``gpu_memory_utilization`` x the GPU's memory after the weights and a profiling step at the
largest batch (``max_num_batched_tokens`` tokens, ``max_num_seqs`` sampled rows).
"""

from __future__ import annotations

import contextlib
import logging
import math

import numpy as np
import torch

from warpforge.kernels.attention import PagedKVCache
from warpforge.llm.context import StepContext, set_context
from warpforge.llm.cuda_graphs import DecodeGraphs
from warpforge.llm.engine_config import EngineConfig
from warpforge.llm.sampler import Sampler, SamplerOutput, SamplingTensors
from warpforge.llm.sampling import MAX_LOGPROBS, SamplingParams
from warpforge.llm.scheduler import ScheduledBatch

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
_CPU_KV_BYTES = 256 << 20  # CPU runs are tests and demos: a modest cache unless num_pages says otherwise


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config, engine_config: EngineConfig,
                 device: torch.device | str, *, extra_page_bytes: int = 0):
        if engine_config.max_model_len is None:
            raise ValueError("engine_config: max_model_len must be resolved first (EngineConfig.for_model)")
        self.model, self.config, self.engine_config = model, model_config, engine_config
        model.fuse_norms(engine_config.fused_norm)  # before the profiling step and the graph captures
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.page_size = engine_config.page_size
        self.extra_page_bytes = extra_page_bytes  # another cache on the same page ids (a draft model's)
        self.kv_dtype = FP8 if engine_config.kv_cache_dtype == "fp8" else model_config.dtype
        if self.kv_dtype == FP8 and model_config.dtype == torch.float32:
            raise ValueError("kv_cache_dtype: fp8 pages need a float16 or bfloat16 model, got float32")
        self.max_pages_per_seq = math.ceil(engine_config.max_model_len / self.page_size)
        self.sampler = Sampler(engine_config.seed)
        self.num_pages = engine_config.num_pages or self._default_num_pages()
        if self.num_pages < self.max_pages_per_seq:
            # Refused here, not found out mid-generation: a sequence that cannot get its next page
            # would otherwise end early with finish "length".
            raise ValueError(
                f"num_pages: {self.num_pages} pages of {self.page_size} tokens hold {self.num_pages * self.page_size} "
                f"tokens, fewer than one sequence of max_model_len {engine_config.max_model_len} needs "
                f"({self.max_pages_per_seq} pages); raise num_pages or lower max_model_len")
        self.kv_caches = [
            PagedKVCache.allocate(self.num_pages, self.page_size, model_config.num_kv_heads, model_config.head_dim,
                                  dtype=self.kv_dtype, device=self.device)
            for _ in range(model_config.num_layers)]
        model.bind_kv_caches(self.kv_caches)
        self.graphs: DecodeGraphs | None = None
        sizes = [s for s in engine_config.cuda_graph_batch_sizes if s <= engine_config.max_num_seqs]
        if self.on_cuda and torch.cuda.is_available() and not engine_config.enforce_eager and sizes:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(model, sizes, max_pages_per_seq=self.max_pages_per_seq,
                                           max_seq_len=engine_config.max_model_len, device=self.device,
                                           pdl=engine_config.pdl)

    # ---- KV memory -----------------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        """K and V of one page in every layer: 2 * layers * kv_heads * page_size * head_dim * elem
        (+ ``extra_page_bytes``)."""
        c = self.config
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * c.num_layers * c.num_kv_heads * self.page_size * c.head_dim * elem + self.extra_page_bytes

    def _default_num_pages(self) -> int:
        # Pages beyond every running sequence at full length serve only the prefix cache: cap at twice
        # that, so a small model on a large GPU does not get millions of page records.
        cap = 2 * self.engine_config.max_num_seqs * self.max_pages_per_seq
        if not self.on_cuda:
            return max(self.max_pages_per_seq, min(cap, _CPU_KV_BYTES // self.page_bytes))
        return min(cap, self._num_pages_from_gpu_memory())

    def _num_pages_from_gpu_memory(self) -> int:
        dev = self.device
        # Unbind caches an earlier engine left on this model: the profiling step must not attend
        # through them, and their memory must not count as taken.
        self.model.bind_kv_caches([None] * self.config.num_layers)
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        self._profile_step()
        torch.cuda.synchronize(dev)
        activations = torch.cuda.max_memory_allocated(dev) - before  # the largest step's temporaries
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        # total - free: weights, the CUDA context, torch's pool and any other process on the GPU.
        budget = total * self.engine_config.gpu_memory_utilization - (total - free) - activations
        num_pages = int(budget // self.page_bytes)
        gib = 1 << 30
        log.info("KV cache: %d pages of %d tokens (%.2f GiB); GPU %.1f GiB, in use %.2f GiB, step peak %.2f GiB",
                 num_pages, self.page_size, num_pages * self.page_bytes / gib, total / gib,
                 (total - free) / gib, activations / gib)
        if num_pages < self.max_pages_per_seq:
            raise ValueError(
                f"gpu_memory_utilization: {self.engine_config.gpu_memory_utilization} leaves room for "
                f"{max(num_pages, 0)} KV pages ({max(num_pages, 0) * self.page_size} tokens), fewer than one "
                f"sequence of max_model_len {self.engine_config.max_model_len} needs; raise it or lower "
                f"max_model_len / max_num_batched_tokens")
        return num_pages

    @torch.inference_mode()
    def _profile_step(self) -> None:
        """The largest step the scheduler can form, with no KV cache bound (attention sees each
        sequence's own new tokens), plus logits and a worst-case sampler pass for every row."""
        ec = self.engine_config
        tokens = min(ec.max_num_batched_tokens, ec.max_num_seqs * ec.max_model_len)
        num_seqs = min(ec.max_num_seqs, tokens)
        lens = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        ctx = StepContext(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((num_seqs, 1), dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            max_seqlen_q=max(lens), max_seq_len=max(lens), decode_only=False)
        set_context(ctx)
        try:
            hidden = self.model(ids, pos)
        finally:
            set_context(None)
        logits = self.model.compute_logits(hidden[torch.tensor(cu[1:], device=self.device) - 1])
        # Every filter and top-20 logprobs: the sampler's largest temporaries are [B, V] sorts.
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1,
                                frequency_penalty=0.1, logprobs=MAX_LOGPROBS)
        st = SamplingTensors.from_params([params] * num_seqs, [[0]] * num_seqs, [[0]] * num_seqs,
                                         logits.shape[-1], self.device)
        self.sampler(logits, st)
        del hidden, logits

    # ---- one step --------------------------------------------------------------------------------

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: K and V pages src -> dst in every layer, before the step writes into dst."""
        src = self._upload([s for s, _ in copies], torch.int64)
        dst = self._upload([d for _, d in copies], torch.int64)
        for cache in self.kv_caches:
            cache.k_cache.index_copy_(0, dst, cache.k_cache.index_select(0, src))
            cache.v_cache.index_copy_(0, dst, cache.v_cache.index_select(0, src))

    def _upload(self, values, dtype: torch.dtype) -> torch.Tensor:
        """A host list as a device tensor: one copy, from pinned memory on CUDA (no host wait)."""
        if not self.on_cuda:
            return torch.tensor(values, dtype=dtype, device=self.device)
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def host_inputs(self, batch: ScheduledBatch, pad_to: int | None = None) -> dict:
        """The step's inputs as host lists; ``pad_to`` adds rows of slot -1 and seq_len 0 (graph padding)."""
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        cu = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            # A lookahead batch is formed before the previous step's postprocess: its one token per
            # sequence is the last one (a placeholder until that step's id arrives).
            start = seq.num_tokens - n if batch.lookahead else seq.num_computed_tokens
            end = start + n
            bt = seq.block_table
            ids.extend(seq.token_ids[start:end])
            pos.extend(range(start, end))
            for page in range(start // ps, (end - 1) // ps + 1):  # slots run contiguously inside a page
                lo, hi = max(start, page * ps), min(end, (page + 1) * ps)
                base = bt[page] * ps - page * ps
                slots.extend(range(base + lo, base + hi))
            seq_lens.append(end)
            cu.append(cu[-1] + n)
            tables.append(bt[:(end + ps - 1) // ps])
            if end == seq.num_tokens:
                sample_rows.append(cu[-1] - 1)
        if pad_to is not None:
            extra = pad_to - len(batch.seqs)
            ids += [0] * extra
            pos += [0] * extra
            slots += [-1] * extra
            seq_lens += [0] * extra
            cu += [cu[-1] + i + 1 for i in range(extra)]
            tables += [[]] * extra
        width = max(1, max(len(t) for t in tables))
        tables = [t + [0] * (width - len(t)) for t in tables]  # pad with a valid page id
        return {"input_ids": ids, "positions": pos, "slot_mapping": slots, "seq_lens": seq_lens,
                "cu_seqlens_q": cu, "block_tables": tables, "sample_rows": sample_rows,
                "max_seqlen_q": max(batch.num_new_tokens), "max_seq_len": max(seq_lens)}

    def decode_arrays(self, batch: ScheduledBatch, pad_to: int) -> dict[str, np.ndarray]:
        """What :meth:`host_inputs` gives a decode-only batch (one token per sequence), as numpy arrays
        padded to ``pad_to`` rows, for the CUDA-graph path: input_ids, positions, slot_mapping (int64),
        seq_lens (int32) and block_tables (int32 [pad_to, pages]). Built from a numpy copy of each
        sequence's page list kept between steps (``table_array``), not from per-token Python lists:
        at batch 256 with 100-page contexts the list version cost ~1 ms of host time per step."""
        seqs, ps = batch.seqs, self.page_size
        n = len(seqs)
        if not batch.decode_only or n > pad_to:
            raise ValueError(f"decode_arrays: expected a decode-only batch of at most {pad_to} sequences")
        pos_list = [len(s.token_ids) - 1 for s in seqs]  # a decode computes the last token (see host_inputs)
        pos = np.array(pos_list, dtype=np.int64)
        pages = [p // ps + 1 for p in pos_list]
        width = max(pages)
        table = np.zeros((pad_to, width), np.int32)
        # Ragged rows in one vectorized store: the mask's True cells, row-major, take the pages in order.
        flat = np.concatenate([table_array(s)[:k] for s, k in zip(seqs, pages)])
        table[:n][np.arange(width)[None, :] < np.array(pages)[:, None]] = flat
        out = {"input_ids": np.zeros(pad_to, np.int64), "positions": np.zeros(pad_to, np.int64),
               "slot_mapping": np.full(pad_to, -1, np.int64), "seq_lens": np.zeros(pad_to, np.int32),
               "block_tables": table}
        out["input_ids"][:n] = [s.token_ids[p] for s, p in zip(seqs, pos_list)]
        out["positions"][:n] = pos
        out["slot_mapping"][:n] = table[np.arange(n), pos // ps].astype(np.int64) * ps + pos % ps
        out["seq_lens"][:n] = pos + 1
        return out

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, StepContext, torch.Tensor]:
        """-> input_ids int64 [T], positions int64 [T], StepContext, sample_indices int64 [S]
        (rows of the T tokens whose logits are sampled: each sequence's last token when its range
        reaches its end)."""
        h = self.host_inputs(batch)
        up = self._upload
        ctx = StepContext(slot_mapping=up(h["slot_mapping"], torch.int64),
                          block_tables=up(h["block_tables"], torch.int32),
                          seq_lens=up(h["seq_lens"], torch.int32), cu_seqlens_q=up(h["cu_seqlens_q"], torch.int32),
                          max_seqlen_q=h["max_seqlen_q"], max_seq_len=h["max_seq_len"],
                          decode_only=batch.decode_only)
        return (up(h["input_ids"], torch.int64), up(h["positions"], torch.int64), ctx,
                up(h["sample_rows"], torch.int64))

    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[dict[int, float] | None]]:
        """Compute the batch; -> (token id, logprobs or None) per ``batch.sampling_seqs`` row."""
        return self.launch(batch).result()

    def launch(self, batch: ScheduledBatch, ids_from: PendingStep | None = None) -> PendingStep:
        """Queue the batch's forward and sampling on the device; the host does not wait (read the ids
        with ``.result()``). ``ids_from``: a lookahead batch (``batch.lookahead``) whose input tokens
        are the ids that step samples, in row order: copied device to device, never through the host."""
        # The async engine steps from a worker thread, whose current CUDA device is not the model's.
        with torch.inference_mode(), (torch.cuda.device(self.device) if self.on_cuda else contextlib.nullcontext()):
            return self._launch(batch, ids_from)

    def _launch(self, batch: ScheduledBatch, ids_from: PendingStep | None) -> PendingStep:
        if batch.lookahead != (ids_from is not None):
            raise ValueError("launch: a lookahead batch needs ids_from (the step whose tokens it decodes), "
                             "and only a lookahead batch takes it")
        prev_ids = ids_from.token_ids if ids_from is not None else None
        if batch.copies:
            self.copy_pages(batch.copies)
        graph_bs = self.graphs.padded_size(len(batch.seqs)) if self.graphs and batch.decode_only else None
        if graph_bs is not None:
            # A decode computes each sequence's last token, so every row samples: no gather.
            hidden = self.graphs.replay_arrays(graph_bs, self.decode_arrays(batch, graph_bs),
                                               input_ids=prev_ids)[:len(batch.seqs)]
            sample_idx = None
        else:
            input_ids, positions, ctx, sample_idx = self.prepare(batch)
            if prev_ids is not None:  # decode-only: one input row per sequence, in order
                input_ids.copy_(prev_ids)
            set_context(ctx)
            try:
                hidden = self.model(input_ids, positions)  # [T, hidden]
            finally:
                set_context(None)
            if sample_idx.shape[0] == hidden.shape[0]:
                sample_idx = None  # every row samples (a decode step): skip the gather
        sampling = batch.sampling_seqs
        if not sampling:
            return PendingStep(None, [])
        # Built after the forward is queued: this host work overlaps the GPU's, its uploads queue behind it.
        st = SamplingTensors.from_sequences(sampling, self.config.vocab_size, self.device)
        logits = self.model.compute_logits(hidden if sample_idx is None else hidden[sample_idx])  # [S, V] f32
        return PendingStep(self.sampler(logits, st), st.num_logprobs)


class PendingStep:
    """A launched step's sampled tokens: ``token_ids`` on the device at once (a lookahead step reads
    them there), host lists from ``result()``. On CUDA the device-to-host copies are queued right
    behind the sampler, with an event, so ``result()`` waits for this step only, not for a step
    queued after it."""

    def __init__(self, out: SamplerOutput | None, num_logprobs: list[int | None]):
        self.out, self.num_logprobs = out, num_logprobs
        self._host, self._ready = out, None
        if out is not None and out.token_ids.is_cuda:
            self._host = SamplerOutput(*(None if t is None else t.to("cpu", non_blocking=True)
                                         for t in (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)))
            self._ready = torch.cuda.Event()
            self._ready.record()

    @property
    def token_ids(self) -> torch.Tensor | None:
        return None if self.out is None else self.out.token_ids

    def result(self) -> tuple[list[int], list[dict[int, float] | None]]:
        if self.out is None:
            return [], []
        if self._ready is not None:
            self._ready.synchronize()  # the step's one wait on the device
        return self._host.to_lists(self.num_logprobs)


def table_array(seq) -> np.ndarray:
    """``seq.block_table`` as int32 numpy, cached on the sequence between steps. The block manager
    appends pages (a longer list), replaces the list (allocate, free) or swaps one page in place
    (copy-on-write, which bumps ``seq.block_table_version``); each of these rebuilds the copy."""
    bt = seq.block_table
    key = (id(bt), len(bt), seq.block_table_version)
    cached = seq.__dict__.get("_table_np")
    if cached is None or cached[0] != key:
        cached = (key, np.asarray(bt, dtype=np.int32), bt)  # holding bt keeps its id from being reused
        seq._table_np = cached
    return cached[1]
