"""Sequence: one request's tokens, pages and progress as the scheduler and block manager see it."""

from __future__ import annotations

import itertools
import time
from typing import Any
from enum import Enum, auto

from warpforge.llm.sampling import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()  # queued, holds no pages (new, or preempted: its tokens will be recomputed)
    RUNNING = auto()  # holds pages; prefilling (maybe over several chunks) or decoding
    FINISHED_STOPPED = auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = auto()  # max_tokens, max_model_len, or out of KV pages with nothing left to preempt
    FINISHED_ABORTED = auto()  # aborted by the caller


FINISH_REASONS = {SequenceStatus.FINISHED_STOPPED: "stop", SequenceStatus.FINISHED_LENGTH: "length",
                  SequenceStatus.FINISHED_ABORTED: "abort"}

_ids = itertools.count()


class Sequence:
    """A prompt and the tokens generated after it.

    token_ids            prompt + output ids
    num_prompt_tokens    length of the prompt part
    block_table          KV page ids in position order: token at position p lives in page
                         block_table[p // page_size] at row p % page_size
    block_hashes         chained hashes of the leading full, computed pages (owned by BlockManager)
    num_cached_tokens    tokens whose KV came from the prefix cache at the last allocation
    num_computed_tokens  tokens whose KV is in the cache: the next step computes tokens from here
                         (the chunked-prefill cursor; num_tokens - 1 while decoding)
    logprobs             per output token: {token id: logprob} for the chosen token and the top n
    output_text          the detokenized output, kept by the engine
    finish_reason        "stop" | "length" | "abort" once finished; stop_reason: the stop token id
                         or stop string that matched (None for EOS and length)
    grammar              the xgrammar GrammarMatcher of a structured-outputs request (else None): it
                         masks each step's logits and advances with every sampled token
    """

    def __init__(self, token_ids: list[int], params: SamplingParams | None = None, *,
                 seq_id=None, arrival_time: float | None = None):
        # the engine's request id (a str), else a counter's int (a sequence made directly: tests, benchmarks)
        self.seq_id: Any = next(_ids) if seq_id is None else seq_id
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params if params is not None else SamplingParams()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_table_version = 0  # bumped when a page id is replaced in place (copy-on-write)
        self.pending_token = False  # the last id is a placeholder for a token still being sampled
        self.block_hashes: list[int] = []
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0
        self.output_text = ""
        self.stop_reason: int | str | None = None
        self._stop_scanned = 0  # output_text chars already searched for stop strings
        self.grammar = None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        # Read several times per sequence per step: identity tests (Enum.__hash__ is Python code).
        s = self.status
        return s is not SequenceStatus.RUNNING and s is not SequenceStatus.WAITING

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        """Append a sampled token; it fills the placeholder instead when a lookahead step put one there."""
        if self.pending_token:
            self.token_ids[-1] = token_id
            self.pending_token = False
        else:
            self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.get(token_id, 0.0)

    def check_stop(self, text: str) -> bool:
        """Take the engine's detokenized output ``text``; True when it contains a stop string.

        On a match the output text is cut before the stop string, the status becomes
        FINISHED_STOPPED and ``stop_reason`` the string; the engine must then call
        ``Scheduler.finish(seq)`` to free the pages. Only the part of ``text`` that can hold a new
        match is searched (text is expected to grow between calls), so streaming stays linear.
        """
        self.output_text = text
        if not self.params.stop:
            return False
        longest = max(len(s) for s in self.params.stop)
        start = max(0, self._stop_scanned - longest + 1)
        self._stop_scanned = len(text)
        hits = [(i, s) for s in self.params.stop if (i := text.find(s, start)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.output_text = text[:index]
        self.status = SequenceStatus.FINISHED_STOPPED
        self.stop_reason = stop
        return True
