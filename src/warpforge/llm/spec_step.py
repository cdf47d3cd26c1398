"""One speculative step: reserve pages, draft, verify k + 1 positions in one target forward, keep the
accepted run, roll the rest back.

``SpecDecoder.step(batch)`` takes the batch ``Scheduler.schedule()`` formed and returns the sequences
that got tokens (as ``Scheduler.postprocess`` does), or None when nothing is drafted this step; the
engine then runs the batch as usual. Inside:

1. k for this step (:class:`~warpforge.llm.speculative.AdaptiveK`); each eligible decode gets
   min(k, tokens left before max_tokens and max_model_len, the step's token budget) and the pages for
   those positions (``BlockManager.reserve``);
2. the drafter proposes; drafts go after each sequence's last token, and the batch runs through the
   target once (chunked-prefill attention: a sequence with d drafts has d + 1 query rows);
3. :func:`verify` accepts the longest run and picks the one token after it, on the device; one read;
4. the drafts leave ``token_ids``, the accepted ones come back with the target's token (stopping at an
   EOS, a stop id, max_tokens or max_model_len inside the run), ``num_computed_tokens`` ends before the
   new last token, and ``BlockManager.trim`` frees the pages past the tokens kept. The KV rejected
   drafts wrote stays in the kept page's tail, unread, until later tokens overwrite it.

Eligible: greedy rows, and sampled rows without penalties or a seed (a seeded request's tokens depend
only on its seed, which a batch-dependent k would break); none asking for logprobs or structured outputs
(their next mask needs the previous token). The others, and
prefill chunks, run in the same forward as in a plain step, sampled by the engine's Sampler.
"""

from __future__ import annotations

import contextlib

import torch

from warpforge.kernels.argmax import argmax_rows
from warpforge.llm.context import set_context
from warpforge.llm.drafters import build_drafter, load_draft_model
from warpforge.llm.sampler import Sampler, SamplingTensors
from warpforge.llm.scheduler import ScheduledBatch, check_end
from warpforge.llm.sequence import Sequence
from warpforge.llm.speculative import AdaptiveK, SpecStats, SpeculativeConfig


def verify(logits: torch.Tensor,  # [B, K + 1, V] f32 target logits at the last token and each draft
           drafts: torch.Tensor,  # [B, K] int64 (past a row's drafts: any id)
           num_drafts: torch.Tensor,  # [B] int64
           probs: torch.Tensor | None,  # [B, K, V] f32 draft distributions q; None: point masses at the drafts
           st: SamplingTensors,  # B rows: the requests' temperature, top-k/top-p/min-p, greedy flags
           sampler: Sampler, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative verification -> (accepted drafts [B] int64, the token after them [B] int64).

    Greedy rows accept a draft while it is the target's argmax and end with the argmax. Sampled rows
    accept draft j with probability min(1, p_j(d_j) / q_j(d_j)) (p: the target's distribution after the
    request's temperature and filters, exactly what a plain step samples from) and, at the first
    rejection, draw from norm(max(0, p_j - q_j)); when every draft is accepted, from p_K. Each output
    token is then distributed as p (Leviathan et al., 2023, Theorem 1)."""
    B, K1, V = logits.shape
    K = K1 - 1
    dev = logits.device
    flat = logits.reshape(B * K1, V)
    greedy_tok = argmax_rows(flat).view(B, K1)
    valid = torch.arange(K, device=dev)[None, :] < num_drafts[:, None]  # [B, K]
    accept = (drafts == greedy_tok[:, :K]) & valid
    if st.all_greedy:
        n_acc = accept.long().cumprod(dim=1).sum(dim=1)
        return n_acc, greedy_tok.gather(1, n_acc[:, None])[:, 0]
    p = sampler.processed_logits(flat, _repeat_rows(st, K1)).softmax(dim=-1).view(B, K1, V)
    q = torch.zeros_like(p)
    if probs is None:
        q[:, :K].scatter_(2, drafts[..., None], 1.0)
    else:
        q[:, :K] = probs
    q[:, :K] *= valid[..., None]  # no draft there: the residual is p itself
    p_d = p[:, :K].gather(2, drafts[..., None])[..., 0]
    q_d = q[:, :K].gather(2, drafts[..., None])[..., 0]
    u = torch.rand(B, K, device=dev, generator=generator)
    accept = torch.where(st.greedy[:, None], accept, (u * q_d <= p_d) & valid)
    n_acc = accept.long().cumprod(dim=1).sum(dim=1)
    resid = (p - q).clamp_min_(0.0)
    resid = torch.where(resid.sum(dim=-1, keepdim=True) > 0, resid, p)  # p == q: only reached if accepted
    noise = torch.empty_like(resid).exponential_(generator=generator).clamp_min_(1e-30)
    drawn = argmax_rows((resid / noise).view(B * K1, V)).view(B, K1)  # exponential race: a draw from norm(resid)
    tokens = torch.where(st.greedy[:, None], greedy_tok, drawn)
    return n_acc, tokens.gather(1, n_acc[:, None])[:, 0]


def _repeat_rows(st: SamplingTensors, n: int) -> SamplingTensors:
    """Each row's sampling tensors n times in a row (one per verified position)."""
    rep = (lambda t: None if t is None else t.repeat_interleave(n, dim=0))
    return SamplingTensors(temperature=rep(st.temperature), greedy=rep(st.greedy), top_k=rep(st.top_k),
                           top_p=rep(st.top_p), min_p=rep(st.min_p), repetition_penalty=None, presence_penalty=None,
                           frequency_penalty=None, seen_ids=None, output_ids=None, row_seeds=[],
                           num_logprobs=[x for x in st.num_logprobs for _ in range(n)], all_greedy=st.all_greedy)


def eligible(seq: Sequence) -> bool:
    p = seq.params
    return (not p.has_penalties and p.logprobs is None and (p.greedy or p.seed is None) and not seq.pending_token
            and seq.grammar is None)


def draft_page_bytes(loaded, page_size: int) -> int:
    """KV bytes of one page of the draft model's cache (0 without one): the runner sizes its pages for both."""
    if loaded is None:
        return 0
    c = loaded[2]
    elem = torch.empty((), dtype=c.dtype).element_size()
    return 2 * c.num_layers * c.num_kv_heads * page_size * c.head_dim * elem


class SpecDecoder:
    """Speculative steps for an LLMEngine (``engine.spec``); ``stats`` counts drafts and acceptances."""

    @staticmethod
    def load_draft(config: SpeculativeConfig | None, engine, resolve):
        """The draft model (method "draft"), loaded before the runner sizes the KV cache; else None.
        ``resolve``: checkpoint name -> path (see :func:`~warpforge.llm.drafters.load_draft_model`)."""
        return load_draft_model(config.draft_model, engine, resolve) if config and config.method == "draft" else None

    def __init__(self, engine, config: SpeculativeConfig, draft=None):
        self.engine, self.config = engine, config
        self.drafter = build_drafter(config, engine, draft)
        self.k_rule = AdaptiveK(config.k, self.drafter.draft_cost, adaptive=config.adaptive)
        self.stats = SpecStats()
        self._generator: torch.Generator | None = None

    def _rng(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self.engine.config.seed + 2)  # apart from the sampler's and the drafter's
        return self._generator

    def plain_next(self, batch: ScheduledBatch) -> bool:
        """Whether the step after ``batch`` (a plain one) will draft nothing, so the engine may queue
        it before this one's tokens are read (async scheduling), bypassing :meth:`step`."""
        return len(batch.seqs) > self.config.max_batch_size or self.k_rule.plain_next()

    def step(self, batch: ScheduledBatch) -> list[Sequence] | None:
        """Run ``batch`` with drafts; -> the sequences that got tokens, or None (run it plainly)."""
        if len(batch.seqs) > self.config.max_batch_size:
            return None
        k = self.k_rule.next_k()
        if k == 0:
            return None
        eng = self.engine
        ec, bm = eng.config, eng.block_manager
        budget = ec.max_num_batched_tokens - batch.num_tokens
        cands: list[Sequence] = []
        ks: list[int] = []
        for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, batch.sample_mask):
            if budget <= 0:
                break
            if n != 1 or not samples or not eligible(seq):
                continue
            kk = min(k, seq.params.max_tokens - seq.num_output_tokens - 1, ec.max_model_len - seq.num_tokens - 1,
                     budget)
            if kk > 0:
                kk = min(kk, bm.reserve(seq, seq.num_tokens + kk) - seq.num_tokens)
            if kk > 0:
                cands.append(seq)
                ks.append(kk)
                budget -= kk
        if not cands:
            return None
        runner = eng.runner
        with torch.inference_mode(), (torch.cuda.device(eng.device) if runner.on_cuda else contextlib.nullcontext()):
            try:
                if batch.copies:  # before drafting: self-speculation reads the copied page
                    runner.copy_pages(batch.copies)
                    batch.copies = []
                drafts = self.drafter.propose(cands, ks)
                if not any(drafts.drafts):
                    return None
                return self._verify_step(batch, cands, drafts)
            finally:
                for seq in cands:
                    bm.trim(seq)

    def _verify_step(self, batch: ScheduledBatch, cands: list[Sequence], proposal) -> list[Sequence]:
        eng = self.engine
        runner, model = eng.runner, eng.runner.model
        drafts = {id(s): d for s, d in zip(cands, proposal.drafts) if d}
        row_of = {id(s): i for i, s in enumerate(cands)}
        starts = {id(s): s.num_computed_tokens for s in cands}
        vb = ScheduledBatch()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            d = drafts.get(id(seq), [])
            seq.token_ids.extend(d)
            vb.add(seq, n + len(d))
        try:
            input_ids, positions, ctx, _ = runner.prepare(vb)
            set_context(ctx)
            try:
                hidden = model(input_ids, positions)  # [T, hidden]
            finally:
                set_context(None)
        finally:
            for seq in batch.seqs:
                d = drafts.get(id(seq))
                if d:
                    del seq.token_ids[-len(d):]
        # Rows to score: the last row of each plain sampling sequence, all d + 1 rows of a drafted one.
        plain: list[Sequence] = []
        plain_rows: list[int] = []
        spec: list[Sequence] = []
        spec_rows: list[list[int]] = []
        end = 0
        for seq, n, samples in zip(vb.seqs, vb.num_new_tokens, batch.sample_mask):
            end += n
            d = drafts.get(id(seq))
            if d:
                spec.append(seq)
                spec_rows.append(list(range(end - 1 - len(d), end)))
            elif samples:
                plain.append(seq)
                plain_rows.append(end - 1)
        K = max(len(r) for r in spec_rows) - 1
        index = plain_rows + [r[min(j, len(r) - 1)] for r in spec_rows for j in range(K + 1)]
        logits = model.compute_logits(hidden[torch.tensor(index, device=hidden.device)])  # [P + S (K + 1), V]
        V, dev = logits.shape[-1], logits.device
        plain_ids, plain_lps = [], []
        if plain:
            st = SamplingTensors.from_sequences(plain, eng.model_config.vocab_size, dev)
            plain_ids, plain_lps = runner.sampler(logits[:len(plain)], st).to_lists(st.num_logprobs)
        d_list = [drafts[id(s)] for s in spec]
        d_t = torch.tensor([d + [0] * (K - len(d)) for d in d_list], dtype=torch.int64).to(dev)
        n_t = torch.tensor([len(d) for d in d_list], dtype=torch.int64).to(dev)
        probs = None
        if proposal.probs is not None:
            probs = proposal.probs[torch.tensor([row_of[id(s)] for s in spec], device=dev), :K]
        st = SamplingTensors.from_params([s.params for s in spec], None, None, eng.model_config.vocab_size, dev,
                                         num_outputs=[s.num_output_tokens for s in spec])
        n_acc, nxt = verify(logits[len(plain):].view(len(spec), K + 1, V), d_t, n_t, probs, st, runner.sampler,
                            self._rng(dev))
        n_acc, nxt = torch.stack([n_acc, nxt]).tolist()  # the step's one wait on the device
        return self._postprocess(batch, plain, plain_ids, plain_lps,
                                 {id(s): (d, a, t, starts[id(s)]) for s, d, a, t in zip(spec, d_list, n_acc, nxt)},
                                 {id(s): k for s, k in zip(cands, [len(d) for d in proposal.drafts])})

    def _postprocess(self, batch, plain, plain_ids, plain_lps, verdicts: dict, fed: dict) -> list[Sequence]:
        """Scheduler.postprocess for a step whose drafted sequences may get several tokens."""
        eng = self.engine
        sched, bm = eng.scheduler, eng.block_manager
        eos, max_len = sched.eos_token_ids, eng.config.max_model_len
        plain_tok = {id(s): (t, lp) for s, t, lp in zip(plain, plain_ids, plain_lps)}
        out: list[Sequence] = []
        drafted = accepted = rejected = emitted = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            v = verdicts.get(id(seq))
            if v is None:
                seq.num_computed_tokens += n
                bm.cache_computed_pages(seq)
                if id(seq) in plain_tok:
                    t, lp = plain_tok[id(seq)]
                    seq.append_token(t, lp)
                    check_end(seq, t, eos, max_len)
                    out.append(seq)
                continue
            d, a, t, start = v
            drafted, accepted, rejected = drafted + len(d), accepted + a, rejected + (a < len(d))
            for tok in d[:a] + [t]:
                seq.append_token(tok)
                emitted += 1
                if check_end(seq, tok, eos, max_len):
                    break
            # KV is valid for the last token and the accepted drafts; the new last token is not computed.
            seq.num_computed_tokens = seq.num_tokens - 1
            bm.trim(seq)
            bm.cache_computed_pages(seq)
            self.drafter.advance(seq, start + fed[id(seq)], start + a + 1)
            out.append(seq)
        for seq in out:
            if seq.is_finished:
                sched.finish(seq)
        s = self.stats
        s.num_spec_steps += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        s.num_emitted_tokens += emitted
        self.k_rule.update(accepted, rejected)
        self.drafter.forget({q.seq_id for q in sched.running})
        return out

