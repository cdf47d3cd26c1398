"""Sampler: one batched pass over the logits of every sampling sequence in a step, on their device.

Per row, in HF's order: repetition penalty (HF: over prompt + output tokens, positive logits / p,
negative x p), presence and frequency penalties (OpenAI: over output tokens, counted with one
scatter_add), then temperature, top-k, top-p, min-p, and a draw by the exponential race
(argmax of probs / Exp(1) noise: a categorical sample without a host sync or a cumsum search).
Greedy rows (temperature < 1e-5) take the exact argmax of the penalized logits. Rows of a
structured-outputs request first have the tokens their grammar forbids set to -inf (the token bitmask
``SamplingTensors.from_sequences`` fills on the host; llm/structured.py).

Logprobs are log_softmax of the penalized logits, *before* temperature and filtering: the
model's distribution under the request's penalties, so the chosen token's logprob is always
finite and does not depend on the sampling knobs. A constrained row's are under its grammar's mask.

Seeds. Unseeded rows draw their noise in one call from the sampler's generator (seeded from
EngineConfig.seed). A seeded row draws its own noise row from a generator reseeded with
hash(seed, output position): its tokens depend only on its seed and its own history, not on the
batch it shares or on preemption. Only seeded rows cost a small per-row launch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from warpforge.kernels.argmax import argmax_rows
from warpforge.llm.sampling import SamplingParams
from warpforge.llm.sequence import Sequence
from warpforge.llm.structured import apply_token_bitmask, token_bitmask


def _row_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(seed.to_bytes(8, "little") + position.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # fits torch's signed range


def _padded(rows: list[list[int]], pad: int) -> torch.Tensor:
    """[B, max(len)] int64, short rows padded with ``pad`` (a scratch vocab column)."""
    width = max(1, max((len(r) for r in rows), default=0))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors on the logits' device, built once per step.

    Build it right after schedule(), before launching the forward pass, so the host work and the
    (pinned, non-blocking) uploads overlap the GPU. Optional tensors are None when no row uses them.
    """

    temperature: torch.Tensor  # [B] f32, 1.0 on greedy rows (their token is the argmax anyway)
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor | None  # [B] int64, V where off
    top_p: torch.Tensor | None  # [B] f32, 1.0 where off
    min_p: torch.Tensor | None  # [B] f32, 0.0 where off
    repetition_penalty: torch.Tensor | None  # [B] f32
    presence_penalty: torch.Tensor | None  # [B] f32
    frequency_penalty: torch.Tensor | None  # [B] f32
    seen_ids: torch.Tensor | None  # [B, L] int64 prompt + output ids, padded with V (repetition penalty)
    output_ids: torch.Tensor | None  # [B, L] int64 output ids, padded with V (presence/frequency)
    row_seeds: list[tuple[int, int]]  # (row, generator seed for this step) of seeded rows
    num_logprobs: list[int | None]  # per row: None or top-n count
    all_greedy: bool
    # Structured outputs: allowed next tokens, 1 bit per id (llm/structured.py); None when no row is constrained
    token_bitmask: torch.Tensor | None = None  # [B, ceil(V/32)] int32
    bitmask_rows: list[int] | None = None  # the constrained rows (None: every row)

    @classmethod
    def from_params(cls, params: list[SamplingParams], prompt_ids: list[list[int]] | None,
                    output_ids: list[list[int]] | None, vocab_size: int, device: torch.device | str, *,
                    num_outputs: list[int] | None = None) -> SamplingTensors:
        """``prompt_ids``/``output_ids`` may be None when no row uses a penalty; then ``num_outputs``
        (tokens generated so far per row) seeds the seeded rows."""
        device = torch.device(device)
        pin = device.type == "cuda"

        def up(t: torch.Tensor) -> torch.Tensor:
            return t.pin_memory().to(device, non_blocking=True) if pin else t.to(device)

        def col(values, dtype=torch.float32) -> torch.Tensor:
            return up(torch.tensor(values, dtype=dtype))

        V = vocab_size
        greedy = [p.greedy for p in params]
        use_k = any(p.top_k > 0 for p in params)
        use_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        use_rep = any(p.repetition_penalty != 1.0 for p in params)
        use_out = any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params)
        if (use_rep or use_out) and (prompt_ids is None or output_ids is None):
            raise ValueError("from_params: penalties need prompt_ids and output_ids")
        if num_outputs is None:
            if output_ids is None:
                raise ValueError("from_params: give output_ids or num_outputs")
            num_outputs = [len(o) for o in output_ids]
        return cls(
            temperature=col([1.0 if g else p.temperature for p, g in zip(params, greedy)]),
            greedy=col(greedy, torch.bool),
            top_k=col([p.top_k if p.top_k > 0 else V for p in params], torch.int64) if use_k else None,
            top_p=col([p.top_p for p in params]) if use_p else None,
            min_p=col([p.min_p for p in params]) if use_min_p else None,
            repetition_penalty=col([p.repetition_penalty for p in params]) if use_rep else None,
            presence_penalty=col([p.presence_penalty for p in params]) if use_out else None,
            frequency_penalty=col([p.frequency_penalty for p in params]) if use_out else None,
            seen_ids=up(_padded([a + b for a, b in zip(prompt_ids, output_ids)], V)) if use_rep else None,
            output_ids=up(_padded(output_ids, V)) if use_out else None,
            row_seeds=[(i, _row_seed(p.seed, n)) for i, (p, n) in enumerate(zip(params, num_outputs))
                       if p.seed is not None and not p.greedy],
            num_logprobs=[p.logprobs for p in params],
            all_greedy=all(greedy),
        )

    @classmethod
    def from_sequences(cls, seqs: list[Sequence], vocab_size: int, device: torch.device | str) -> SamplingTensors:
        st = cls._from_sequences(seqs, vocab_size, device)
        # Host work while the forward runs; nothing at all when no sequence is constrained.
        mask = token_bitmask([s.grammar for s in seqs], vocab_size, st.temperature.device)
        if mask is not None:
            st.token_bitmask, st.bitmask_rows = mask
        return st

    @classmethod
    def _from_sequences(cls, seqs: list[Sequence], vocab_size: int, device: torch.device | str) -> SamplingTensors:
        params = [s.params for s in seqs]
        if any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
               for p in params):
            return cls.from_params(params, [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs],
                                   vocab_size, device)
        # No penalty reads the ids: skip copying every sequence's tokens (O(context) per row per step);
        # a seeded row needs only its output count.
        return cls.from_params(params, None, None, vocab_size, device,
                               num_outputs=[s.num_output_tokens for s in seqs])


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] f32: the chosen token's logprob (None: no row asked)
    top_ids: torch.Tensor | None  # [B, n] int64, n = the largest top-n asked (None: n == 0)
    top_logprobs: torch.Tensor | None  # [B, n] f32

    def to_lists(self, num_logprobs: list[int | None]) -> tuple[list[int], list[dict[int, float] | None]]:
        """Host lists for Scheduler.postprocess: ids, and per row None or {chosen: lp, top-n...}."""
        ids = self.token_ids.tolist()  # the step's one wait on the device
        lps: list[dict[int, float] | None] = [None] * len(ids)
        if self.logprobs is None:
            return ids, lps
        chosen = self.logprobs.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in ids]
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else [[] for _ in ids]
        for i, n in enumerate(num_logprobs):
            if n is not None:
                d = {ids[i]: chosen[i]}
                for t, lp in zip(top_ids[i][:n], top_lps[i][:n]):
                    d.setdefault(t, lp)
                lps[i] = d
        return ids, lps


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [B, V] -> penalized logits [B, V] (out of place)."""
    B, V = logits.shape
    if t.seen_ids is not None:
        seen = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, t.seen_ids, True)  # column V collects the padding
        r = t.repetition_penalty[:, None]
        logits = torch.where(seen[:, :V], torch.where(logits > 0, logits / r, logits * r), logits)
    if t.output_ids is not None:
        counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(1, t.output_ids, torch.ones_like(t.output_ids, dtype=logits.dtype))
        counts = counts[:, :V]
        logits = logits - t.frequency_penalty[:, None] * counts - t.presence_penalty[:, None] * (counts > 0)
    return logits


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (-inf) what top-k then top-p drop, as HF: top-k keeps ties with the k-th value; top-p
    keeps the most likely tokens until their mass reaches top_p (always at least one)."""
    if top_k is None and top_p is None:
        return x
    V = x.shape[1]
    srt, idx = x.sort(dim=-1, descending=True)  # [B, V]
    if top_k is not None:
        kth = srt.gather(1, (top_k.clamp(1, V) - 1)[:, None])  # [B, 1]
        srt = srt.masked_fill(srt < kth, float("-inf"))
    if top_p is not None:
        probs = srt.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop = (before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # p = 1 never drops (rounding)
        srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).scatter_(1, idx, srt)


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Mask tokens whose probability is below min_p x the row's largest probability."""
    if min_p is None:
        return x
    probs = x.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return x.masked_fill(~keep, float("-inf"))


class Sampler:
    """``Sampler(seed)(logits [B, V] f32, SamplingTensors) -> SamplerOutput``."""

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._row_generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device, table: dict, seed: int) -> torch.Generator:
        if device not in table:
            table[device] = torch.Generator(device=device)
            table[device].manual_seed(seed)
        return table[device]

    def processed_logits(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Penalized logits [B, V] -> what the draw samples from: / temperature, filtered (-inf)."""
        x = logits / t.temperature[:, None]
        x = apply_top_k_top_p(x, t.top_k, t.top_p)
        return apply_min_p(x, t.min_p)

    def noise(self, like: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Exp(1) noise [B, V]; seeded rows from their own (seed, position) stream."""
        q = torch.empty_like(like).exponential_(generator=self._generator(like.device, self._generators, self.seed))
        if t.row_seeds:
            g = self._generator(like.device, self._row_generators, 0)
            for row, seed in t.row_seeds:
                g.manual_seed(seed)
                q[row].exponential_(generator=g)
        return q.clamp_min_(1e-30)  # an exact 0 would turn a zero-probability token into 0/0

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != t.temperature.shape[0]:
            raise ValueError(f"logits: expected [B={t.temperature.shape[0]}, V], got {tuple(logits.shape)}")
        logits = apply_penalties(logits.float(), t)  # [B, V]
        if t.token_bitmask is not None:  # before every read: logprobs too are under the grammar
            apply_token_bitmask(logits, t.token_bitmask, t.bitmask_rows)
        greedy_ids = argmax_rows(logits)  # [B]; a chunked Triton argmax on CUDA (torch's is one block per row)
        if t.all_greedy:
            ids = greedy_ids
        else:
            probs = self.processed_logits(logits, t).softmax(dim=-1)
            sampled = argmax_rows(probs / self.noise(probs, t))
            ids = torch.where(t.greedy, greedy_ids, sampled)
        wanted = [n for n in t.num_logprobs if n is not None]
        if not wanted:
            return SamplerOutput(ids, None, None, None)
        lp = logits.log_softmax(dim=-1)
        chosen = lp.gather(1, ids[:, None])[:, 0]
        n = max(wanted)
        if n == 0:
            return SamplerOutput(ids, chosen, None, None)
        top_lps, top_ids = lp.topk(n, dim=-1)
        return SamplerOutput(ids, chosen, top_ids, top_lps)
