"""What the engine hands back per request: text, token ids, logprobs, timings; and how text grows.

:class:`Detokenizer` turns a growing list of token ids into text without re-decoding the whole
output each step (stop strings are then matched by ``Sequence.check_stop``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

# How many prompt tokens the first decode window starts with: tokenizers that drop the leading
# space of the first decoded token (SentencePiece "▁", byte-level BPE after a BOS) then still
# render the first generated token's space, because it is not first in the window.
_PROMPT_CONTEXT = 5


@dataclass
class RequestMetrics:
    """Timings of one request (seconds, ``time.perf_counter`` clock) and its token counts."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the step that sampled it."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        """Arrival to finish."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Output tokens after the first, over the time after the first (the decode rate)."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        dt = self.finish_time - self.first_token_time
        return (self.num_output_tokens - 1) / dt if dt > 0 else None

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Prompt tokens over the time to first token (includes queueing behind other requests)."""
        ttft = self.ttft
        return self.num_prompt_tokens / ttft if ttft else None


@dataclass
class RequestOutput:
    """One request's state after a step. ``text``/``token_ids`` are cumulative; ``delta_*`` is what
    this step added (what a stream sends). ``finish_reason``: "stop" (EOS, stop token or stop
    string), "length" (max_tokens or the context), "abort", "error" (then ``error`` says why)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[Any] | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Detokenizer:
    """Incremental text of one request's output ids.

    Decodes a sliding window ``ids[prefix:]`` and keeps the part beyond ``ids[prefix:read]``; a
    window that ends in an incomplete UTF-8 sequence ("\\ufffd") waits for the next token. Two
    decodes of a few tokens per step instead of one of the whole output.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT:])  # context tokens + every output token
        self.prefix = 0
        self.read = len(self.ids)
        self.skip_special = skip_special_tokens
        self.text = ""

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Append output tokens; -> the whole text so far. ``final``: the request ends here, so an
        incomplete UTF-8 tail is kept as is (as a full decode would)."""
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=self.skip_special)
        window = decode(self.ids[self.prefix:], skip_special_tokens=self.skip_special)
        if len(window) > len(before) and (final or not window.endswith("\ufffd")):
            self.text += window[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self.text


def now() -> float:
    return time.perf_counter()
