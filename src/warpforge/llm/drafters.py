"""Drafters for speculative decoding: n-gram prompt lookup, a separate draft model, the target's own first layers.

A drafter proposes up to ``ks[i]`` tokens after each sequence's last token (``propose``) and hears what
the target kept (``advance``). The pages for the drafted positions are reserved before ``propose`` runs
(``SpecDecoder.step``), so the model drafters write their KV through the sequence's own block table:

* the draft model keeps a KV cache of its own with the target's page layout (same page ids, its own
  head sizes), so one block manager serves both; it feeds every token it has not seen yet (the prompt
  on the first step, the accepted drafts and the target's token after each verification);
* self-speculation runs the target's first L layers, whose KV for a token is exactly what the
  target's forward writes in those layers: it reads the target's cache and writes its drafts' KV there,
  where the verification forward overwrites it with the same values (or, for rejected drafts, later
  tokens overwrite it).

A draft sampled at temperature > 0 is drawn from q, the drafter's distribution after the request's
temperature, top-k, top-p and min-p, and q is handed to the verification; a greedy draft is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from warpforge.kernels.argmax import argmax_rows
from warpforge.llm.context import StepContext, set_context
from warpforge.llm.sampler import Sampler, SamplingTensors
from warpforge.llm.sequence import Sequence
from warpforge.llm.speculative import SpeculativeConfig

# Text whose tokens a draft model's tokenizer must reproduce to share the target's vocabulary.
_PROBE = "To be, or not to be: that is the question. 0123456789 <b>Ophelia</b> caf\u00e9 \u6771\u4eac\n\tend"


@dataclass
class Proposal:
    """Drafted tokens per sequence (at most its k) and, for sampled drafts, the distributions they came from."""

    drafts: list[list[int]]
    probs: torch.Tensor | None  # [B, K, V] f32 q rows (K = the most drafts of any sequence); None: point masses


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, n from ngram_max down to ngram_min; no draft when no suffix recurs. Host work only."""

    draft_cost = 0.0

    def __init__(self, config: SpeculativeConfig):
        self.n_max, self.n_min = config.ngram_max, config.ngram_min

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens continuing ``tokens`` by its longest recurring suffix (latest occurrence)."""
        arr = np.asarray(tokens, dtype=np.int64)
        n_tok = arr.shape[0]
        for n in range(min(self.n_max, n_tok - 1), self.n_min - 1, -1):
            # Windows starting at 0 .. n_tok - n - 1: every occurrence but the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []

    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        return Proposal([self.lookup(s.token_ids, k) for s, k in zip(seqs, ks)], None)

    def advance(self, seq: Sequence, num_fed: int, num_valid: int) -> None:
        pass

    def forget(self, live_ids: set) -> None:
        pass


def step_context(items: list[tuple[Sequence, int, list[int]]], page_size: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, StepContext]:
    """-> input_ids [T], positions [T], StepContext for feeding ``tokens`` at positions start.. of each
    ``(seq, start, tokens)`` through the sequence's block table (its pages already hold those positions)."""
    ids, pos, slots, lens, cu, tables = [], [], [], [], [0], []
    for seq, start, tokens in items:
        end = start + len(tokens)
        bt = seq.block_table
        ids += tokens
        pos += range(start, end)
        slots += [bt[p // page_size] * page_size + p % page_size for p in range(start, end)]
        lens.append(end)
        cu.append(cu[-1] + len(tokens))
        tables.append(bt[:(end + page_size - 1) // page_size])
    width = max(len(t) for t in tables)
    tables = [t + [0] * (width - len(t)) for t in tables]

    def up(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    q_lens = [b - a for a, b in zip(cu, cu[1:])]
    ctx = StepContext(slot_mapping=up(slots, torch.int64), block_tables=up(tables, torch.int32),
                      seq_lens=up(lens, torch.int32), cu_seqlens_q=up(cu, torch.int32), max_seqlen_q=max(q_lens),
                      max_seq_len=max(lens), decode_only=all(n == 1 for n in q_lens))
    return up(ids, torch.int64), up(pos, torch.int64), ctx


def matmul_params(model: torch.nn.Module, num_layers: int | None = None) -> int:
    """Weights a token multiplies through (the first ``num_layers`` layers' matrices and the LM head):
    what a decode step reads, so the drafters' cost in the adaptive-k rule."""
    inner = model.model
    layers = inner.layers if num_layers is None else inner.layers[:num_layers]
    head = inner.embed_tokens.weight.numel() if model.lm_head is None else _matrix_elements(model.lm_head)
    return sum(_matrix_elements(layer) for layer in layers) + head


def _matrix_elements(m: torch.nn.Module) -> int:
    """Elements of the matrices under ``m``, whatever holds them: a float weight, a quantized layer's packed
    buffers (its in x out features) or a GGUF-block layer."""
    k, n = getattr(m, "in_features", None), getattr(m, "out_features", None)
    if isinstance(k, int) and isinstance(n, int):
        return k * n
    w = getattr(m, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return w.numel()
    return sum(_matrix_elements(c) for c in m.children())


class _ModelDrafter:
    """Drafting by k forwards of a model over the batch: the first feeds each sequence's unseen tokens,
    the next ones the draft just made. Subclasses give ``_logits(ids, positions) -> f32 [T, V]``."""

    def __init__(self, page_size: int, vocab_size: int, device: torch.device, seed: int):
        self.page_size, self.vocab_size, self.device = page_size, vocab_size, device
        self.sampler = Sampler(seed + 1)  # its own random stream: the target's stays as without drafts

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """ids [T], positions [T] fed under the step context; -> f32 logits [len(last), V] of rows ``last``."""
        raise NotImplementedError

    def _start(self, seq: Sequence) -> int:
        """The first position this drafter has no KV for (at most the last token's)."""
        return seq.num_tokens - 1

    def _run(self, items: list[tuple[Sequence, int, list[int]]]) -> torch.Tensor:
        """Feed the items; -> logits [len(items), V] of each item's last token."""
        ids, pos, ctx = step_context(items, self.page_size, self.device)
        set_context(ctx)
        try:
            last = ctx.cu_seqlens_q[1:].long() - 1
            return self._logits(ids, pos, last)
        finally:
            set_context(None)

    def _draw(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> token per row [B], and q [B, V] (None when every row is greedy)."""
        greedy = argmax_rows(logits)
        if st.all_greedy:
            return greedy, None
        q = self.sampler.processed_logits(logits, st).softmax(dim=-1)
        drawn = argmax_rows(q / self.sampler.noise(q, st))
        return torch.where(st.greedy, greedy, drawn), q

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], ks: list[int]) -> Proposal:
        K = max(ks)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs = None
        active = list(range(len(seqs)))
        items = [(s, self._start(s), s.token_ids[self._start(s):]) for s in seqs]
        st_all = SamplingTensors.from_params([s.params for s in seqs], None, None, self.vocab_size, self.device,
                                             num_outputs=[0] * len(seqs))
        for j in range(K):
            logits = self._run(items)  # [len(active), V]
            rows = torch.tensor(active, device=self.device)
            st = st_all if len(active) == len(seqs) else _rows(st_all, rows, active)
            tokens, q = self._draw(logits, st)
            if q is not None:
                if probs is None:
                    probs = torch.zeros(len(seqs), K, self.vocab_size, device=self.device)
                probs[rows, j] = q
            for i, t in zip(active, tokens.tolist()):
                drafts[i].append(t)
            active = [i for i in active if ks[i] > j + 1]
            if not active:
                break
            items = [(seqs[i], seqs[i].num_tokens + j, [drafts[i][-1]]) for i in active]
        return Proposal(drafts, probs)


def _rows(st: SamplingTensors, rows: torch.Tensor, host_rows: list[int]) -> SamplingTensors:
    """The sampling tensors of some rows (no penalties, no seeds: speculation runs neither)."""
    pick = (lambda t: None if t is None else t[rows])
    return SamplingTensors(temperature=st.temperature[rows], greedy=st.greedy[rows], top_k=pick(st.top_k),
                           top_p=pick(st.top_p), min_p=pick(st.min_p), repetition_penalty=None, presence_penalty=None,
                           frequency_penalty=None, seen_ids=None, output_ids=None, row_seeds=[],
                           num_logprobs=[st.num_logprobs[i] for i in host_rows],
                           all_greedy=st.all_greedy)  # a subset of greedy rows is greedy; else the mask decides


class SelfDrafter(_ModelDrafter):
    """The target's first ``num_layers`` layers, then its final norm and LM head."""

    def __init__(self, model: torch.nn.Module, num_layers: int, page_size: int, seed: int):
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(model, "compute_logits"):
            raise ValueError("speculative.method: 'self' needs a decoder with model.layers, "
                             f"got {type(model).__name__}")
        total = len(inner.layers)
        if not 1 <= num_layers < total:
            raise ValueError(f"speculative.draft_layers: expected 1..{total - 1} (the target has {total} layers), "
                             f"got {num_layers}")
        device = next(model.parameters()).device
        super().__init__(page_size, model.config.vocab_size, device, seed)
        self.model, self.num_layers = model, num_layers
        self.draft_cost = matmul_params(model, num_layers) / matmul_params(model)

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        x, residual = inner.embed_tokens(ids), None
        for layer in inner.layers[:self.num_layers]:
            x, residual = layer(positions, x, residual)
        hidden = inner.norm(x[last], residual[last])[0]  # the last rows only: the norm is per row
        return self.model.compute_logits(hidden)

    def advance(self, seq: Sequence, num_fed: int, num_valid: int) -> None:
        pass  # its KV is the target's: always as far as the target's

    def forget(self, live_ids: set) -> None:
        pass


class DraftModelDrafter(_ModelDrafter):
    """A separate model with the target's vocabulary and a KV cache of its own in the target's page layout."""

    def __init__(self, loaded, target, num_pages: int, page_size: int, max_model_len: int, seed: int):
        from warpforge.kernels.attention import PagedKVCache

        model, tokenizer, config = loaded
        t_model, t_tok, t_config = target
        if config.vocab_size != t_config.vocab_size:
            raise ValueError(f"speculative.draft_model: vocabulary of {config.vocab_size} tokens, the target has "
                             f"{t_config.vocab_size}; a draft model must share the target's tokenizer")
        if tokenizer is not None and t_tok is not None and tokenizer.encode(_PROBE) != t_tok.encode(_PROBE):
            raise ValueError("speculative.draft_model: its tokenizer splits text differently from the target's; "
                             "a draft model must share the target's tokenizer")
        if config.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative.draft_model: context of {config.max_position_embeddings} tokens, shorter "
                             f"than max_model_len {max_model_len}; lower max_model_len")
        device = next(t_model.parameters()).device
        if next(model.parameters()).device != device:
            raise ValueError(f"speculative.draft_model: loaded on {next(model.parameters()).device}, "
                             f"the target is on {device}")
        super().__init__(page_size, config.vocab_size, device, seed)
        self.model, self.config = model, config
        # Same page ids as the target's cache: the target's block tables address both.
        self.caches = [PagedKVCache.allocate(num_pages, page_size, config.num_kv_heads, config.head_dim,
                                             dtype=config.dtype, device=device) for _ in range(config.num_layers)]
        model.bind_kv_caches(self.caches)
        self.draft_cost = matmul_params(model) / matmul_params(t_model)
        self._seen: dict[object, tuple[int, int]] = {}  # seq id -> (preemptions, positions with draft KV)

    def _start(self, seq: Sequence) -> int:
        n_pre, seen = self._seen.get(seq.seq_id, (seq.num_preemptions, 0))
        if n_pre != seq.num_preemptions:  # preempted since: its pages (and our KV in them) are gone
            seen = 0
        return min(seen, seq.num_tokens - 1)

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model(ids, positions)[last])

    def advance(self, seq: Sequence, num_fed: int, num_valid: int) -> None:
        """Positions below ``num_valid`` hold KV of the tokens the sequence now has (accepted drafts)."""
        self._seen[seq.seq_id] = (seq.num_preemptions, min(num_fed, num_valid))

    def forget(self, live_ids: set) -> None:
        for sid in [s for s in self._seen if s not in live_ids]:
            del self._seen[sid]


def build_drafter(config: SpeculativeConfig, engine, draft):
    """The drafter ``config`` names, for ``engine`` (an LLMEngine whose runner and block manager exist);
    ``draft``: the draft model (:func:`load_draft_model`), for method "draft"."""
    ec = engine.config
    if config.method == "ngram":
        return NgramDrafter(config)
    if config.method == "self":
        n = config.draft_layers if config.draft_layers is not None else max(1, engine.model_config.num_layers // 2)
        return SelfDrafter(engine.model, n, ec.page_size, ec.seed)
    return DraftModelDrafter(draft, (engine.model, engine.tokenizer, engine.model_config), engine.runner.num_pages,
                             ec.page_size, ec.max_model_len, ec.seed)


def load_draft_model(spec, engine, resolve):
    """``SpeculativeConfig.draft_model`` loaded like the target (its dtype, its device); ``resolve``
    turns a checkpoint name into a path (``warpforge.llm.loader.resolve_model``: "gemma3-270m")."""
    if isinstance(spec, tuple):
        if len(spec) != 3:
            raise ValueError("speculative.draft_model: expected (model, tokenizer, config), "
                             f"got a tuple of {len(spec)}")
        if spec[0] is engine.model:
            raise ValueError("speculative.draft_model: the draft model must be a separate model (each binds its "
                             "own KV cache); load it again, or use method 'self'")
        return spec
    from warpforge.llm.loader import load

    if str(spec) != "gemma3-270m" and not Path(spec).exists():
        raise ValueError(f"speculative.draft_model: no such file or directory: {str(spec)!r}")
    return load(resolve(str(spec)), dtype=engine.model_config.dtype, device=engine.device)
