"""Scheduler: continuous batching with chunked prefill, FCFS admission and preemption by recompute.

One step = ``schedule()`` -> the runner computes ``batch.num_new_tokens[i]`` tokens of each
``batch.seqs[i]`` starting at ``seq.num_computed_tokens`` and samples one token for each sequence
in ``batch.sampling_seqs`` -> ``postprocess(batch, token_ids)``.

Order inside a step: running sequences with one token left (decodes) first, so streams keep
flowing; then running sequences still prefilling, chunk by chunk (oldest first); then waiting
sequences FCFS while the token budget, max_num_seqs and free pages allow. The whole prompt's pages
are allocated on admission, so only decodes need new pages; when one cannot get a page, the newest
running sequence is preempted (pages freed, back to the front of the waiting queue, its tokens
recomputed when readmitted) and no new sequence is admitted in that step.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence as Seq
from dataclasses import dataclass, field
from functools import cached_property

from warpforge.llm.block_manager import BlockManager
from warpforge.llm.engine_config import EngineConfig
from warpforge.llm.sequence import Sequence, SequenceStatus

log = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """One step's work. ``seqs[i]`` computes tokens [start, start + num_new_tokens[i]) where
    start = ``seqs[i].num_computed_tokens`` (unchanged until postprocess); it samples a token
    when that range ends at its last token (the last chunk of a prefill, or a decode)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) pages, copy before the forward
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting during this schedule()
    finished: list[Sequence] = field(default_factory=list)  # ended in schedule(): out of KV pages, alone
    # Formed by Scheduler.lookahead before the previous step's tokens are known: one token per
    # sequence, the last one (a placeholder), every sequence samples.
    lookahead: bool = False

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        for name in ("decode_only", "sample_mask", "sampling_seqs"):  # a grown batch recomputes them
            self.__dict__.pop(name, None)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    # The three below are read several times a step (runner, sampler, postprocess) and computed once:
    # the batch is final when schedule() returns, and sample_mask is first read before postprocess
    # moves num_computed_tokens.
    @cached_property
    def decode_only(self) -> bool:
        """Every sequence computes exactly one token (paged decode, CUDA-graph eligible)."""
        return bool(self.seqs) and all(n == 1 for n in self.num_new_tokens)

    @cached_property
    def sample_mask(self) -> list[bool]:
        if self.lookahead:
            return [True] * len(self.seqs)
        return [s.num_computed_tokens + n == s.num_tokens for s, n in zip(self.seqs, self.num_new_tokens)]

    @cached_property
    def sampling_seqs(self) -> list[Sequence]:
        """Sequences that sample this step, in batch order (the rows postprocess's token ids follow)."""
        return [s for s, m in zip(self.seqs, self.sample_mask) if m]


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_token_ids: Iterable[int] = ()):
        if config.max_model_len is None:
            raise ValueError("max_model_len: the scheduler needs it resolved (EngineConfig.for_model)")
        self.config = config
        self.max_model_len: int = config.max_model_len  # resolved (checked above), so typed int
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the newest is last
        self._by_id: dict[object, Sequence] = {}
        self.num_preemptions = 0  # since start (the server's preemption counter)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, seq_id) -> Sequence | None:
        return self._by_id.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``; ValueError (naming the request) when it could never run."""
        name = f"request {seq.seq_id!r}"
        if seq.num_prompt_tokens == 0:
            raise ValueError(f"{name}: empty prompt")
        if seq.num_prompt_tokens + 1 > self.max_model_len:
            raise ValueError(f"{name}: prompt of {seq.num_prompt_tokens} tokens leaves no room for a new token "
                             f"within max_model_len {self.max_model_len}")
        bm = self.block_manager
        if bm.pages_for(seq.num_prompt_tokens) > bm.num_pages:
            raise ValueError(f"{name}: prompt of {seq.num_prompt_tokens} tokens needs "
                             f"{bm.pages_for(seq.num_prompt_tokens)} KV pages, the cache has {bm.num_pages}")
        if seq.seq_id in self._by_id:
            raise ValueError(f"{name}: already queued")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.seq_id] = seq

    def finish(self, seq: Sequence, status: SequenceStatus = SequenceStatus.FINISHED_STOPPED) -> None:
        """End ``seq`` now from any queue and free its pages (keeps a finished status already set)."""
        if not seq.is_finished:
            seq.status = status
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._by_id.pop(seq.seq_id, None)

    def abort(self, seq_id) -> Sequence | None:
        """Abort a waiting or running sequence, freeing its pages at once; None if unknown/finished.

        Call between steps, or after the runner has run a batch and before postprocess() (which then
        skips the sequence); never between schedule() and the runner reading the block tables."""
        seq = self._by_id.get(seq_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        # 1. Decodes (one token left), oldest first; a decode short of a page preempts the newest.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_uncomputed_tokens != 1:
                i += 1
                continue
            ok = bm.can_append(seq)
            while not ok and seq is not self.running[-1]:
                self._preempt(self.running[-1], batch)
                ok = bm.can_append(seq)
            if ok:
                bm.append_slot(seq)
                batch.add(seq, 1)
                budget -= 1
                i += 1
            elif len(self.running) == 1:  # alone and the cache is full: it can never grow
                self.finish(seq, SequenceStatus.FINISHED_LENGTH)
                batch.finished.append(seq)
            else:
                self._preempt(seq, batch)
        # 2. Prefill chunks of running sequences (pages allocated on admission).
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed_tokens > 1:
                n = min(seq.num_uncomputed_tokens, budget)
                batch.add(seq, n)
                budget -= n
        # 3. Admit waiting sequences FCFS (not after a preemption: the pages just freed are spoken for).
        while (self.waiting and budget > 0 and not batch.preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            self.waiting.popleft()
            bm.allocate(seq)
            seq.num_computed_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, n)
            budget -= n
        batch.copies = bm.take_copies()
        return batch

    def lookahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The next step's batch, formed while ``batch`` (already launched) still runs, so the host's
        scheduling and input preparation overlap the device (async scheduling). Each sequence gets a
        placeholder for the token ``batch`` is sampling (filled in by postprocess) and the slot after it;
        the runner takes the real ids from the device.

        Only where the result is the batch schedule() would form once ``batch`` is postprocessed:
        ``batch`` is decode-only and holds every running sequence, nothing is waiting, no sequence can
        end by length at this step, none needs its output ids to sample (penalties) or its token to
        mask the next step's logits (structured outputs), and every next
        slot is free without preemption. None otherwise (the engine then schedules as usual). A
        sequence that stops at this step (EOS, stop id or string, abort) has its lookahead row
        computed and dropped: postprocess skips finished sequences."""
        if (not batch.decode_only or self.waiting or batch.preempted or batch.finished
                or len(batch.seqs) != len(self.running)
                or len(batch.seqs) > self.config.max_num_batched_tokens):
            return None
        max_len = self.max_model_len
        for seq, run in zip(batch.seqs, self.running):
            p = seq.params
            if (seq is not run or seq.is_finished or seq.pending_token
                    or seq.num_output_tokens + 1 >= p.max_tokens or seq.num_tokens + 1 >= max_len
                    or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                    or seq.grammar is not None):
                return None
        bm = self.block_manager
        for seq in batch.seqs:
            seq.token_ids.append(-1)  # the placeholder
            seq.pending_token = True
        # Pages the next slots need (a page boundary, or a shared page to copy) against the free pool.
        need = sum(not bm.can_append_free(seq) for seq in batch.seqs)
        if need > bm.num_free_pages:
            for seq in batch.seqs:
                seq.token_ids.pop()
                seq.pending_token = False
            return None
        nxt = ScheduledBatch(lookahead=True)
        for seq in batch.seqs:
            bm.append_slot(seq)
            nxt.add(seq, 1)
        nxt.copies = bm.take_copies()
        return nxt

    def cancel_lookahead(self, batch: ScheduledBatch) -> None:
        """Undo :meth:`lookahead`'s placeholders (its launch failed); the slots it made ready stay
        allocated, as schedule() would have allocated them for the same tokens."""
        for seq in batch.seqs:
            if seq.pending_token:
                seq.token_ids.pop()
                seq.pending_token = False

    def postprocess(self, batch: ScheduledBatch, token_ids: Seq[int],
                    logprobs: Seq[dict[int, float] | None] | None = None) -> list[Sequence]:
        """Advance the batch by one step. ``token_ids[j]`` (and ``logprobs[j]``) belong to
        ``batch.sampling_seqs[j]``. Returns the sequences that got a new token (finished ones
        included: their status says why; their pages are already free)."""
        sampling = batch.sample_mask  # before num_computed_tokens moves
        if len(token_ids) != sum(sampling):
            raise ValueError(f"token_ids: expected {sum(sampling)} ids (one per sampling sequence), "
                             f"got {len(token_ids)}")
        bm, max_len = self.block_manager, self.max_model_len
        out: list[Sequence] = []
        j = 0
        for seq, n, samples in zip(batch.seqs, batch.num_new_tokens, sampling):
            if seq.is_finished:  # aborted since schedule()
                j += samples
                continue
            seq.num_computed_tokens += n
            bm.cache_computed_pages(seq)
            if not samples:
                continue
            token = int(token_ids[j])
            seq.append_token(token, None if logprobs is None else logprobs[j])
            j += 1
            out.append(seq)
            check_end(seq, token, self.eos_token_ids, max_len)
        for seq in out:
            if seq.is_finished:
                self.finish(seq)
        return out


def check_end(seq: Sequence, token: int, eos: frozenset[int], max_len: int) -> bool:
    """After ``token`` was appended: advance the sequence's grammar, set its finished status when it
    ended (EOS, a stop id, a finished grammar, max_tokens, max_model_len); -> True when it ended."""
    p = seq.params
    if seq.grammar is not None and not seq.grammar.accept_token(token):
        # Only reachable when the mask did not hold (a bug): end it rather than emit text off the grammar.
        log.warning("request %s: token %d is outside its grammar; stopping it", seq.seq_id, token)
        seq.status = SequenceStatus.FINISHED_STOPPED
    elif token in p.stop_token_ids or (not p.ignore_eos and token in eos):
        seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, (token if token in p.stop_token_ids else None)
    elif seq.grammar is not None and seq.grammar.is_terminated():  # its stop token, even with ignore_eos
        seq.status = SequenceStatus.FINISHED_STOPPED
    elif seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_len:
        seq.status = SequenceStatus.FINISHED_LENGTH
    return seq.is_finished
