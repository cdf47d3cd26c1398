"""SamplingParams: how one request picks its tokens and when it stops (OpenAI / vLLM semantics)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from warpforge._validate import FieldError, check_int
from warpforge.llm.structured import StructuredOutputsParams

# Temperatures below this are greedy (as vLLM): dividing logits by ~0 would overflow to inf.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # the OpenAI API's cap on top-n logprobs


def _number(name: str, value, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
          and (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi))
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise FieldError(name, f"expected a number in {rng}, got {value!r}")


@dataclass
class SamplingParams:
    """Per-request sampling. Unknown keywords raise TypeError naming them (dataclass ``__init__``).

    temperature         >= 0; below 1e-5 (e.g. 0): greedy, the exact argmax of the penalized logits
    top_p               (0, 1]: keep the fewest most-likely tokens whose probability sums to >= top_p
    top_k               -1 or 0: off; k >= 1: keep the k most likely tokens (ties with the k-th kept)
    min_p               [0, 1]: drop tokens less likely than min_p x the most likely one
    repetition_penalty  > 0, HF style over prompt + output tokens: positive logits / p, negative x p
    presence_penalty    [-2, 2] OpenAI style: subtracted once from every token already generated
    frequency_penalty   [-2, 2] OpenAI style: subtracted per occurrence among generated tokens
    seed                None (the engine's random stream) or an int: this request's tokens depend
                        only on the seed, never on the batch it shares
    stop                strings that end the output (not included in it); checked by the engine on
                        the detokenized text, see ``Sequence.check_stop``
    stop_token_ids      token ids that end the output (the token is kept in the output ids)
    max_tokens          >= 1 new tokens at most
    logprobs            None: none; n in [0, 20]: the chosen token's logprob and the top n
    ignore_eos          keep going past the model's EOS tokens (stop_token_ids still stop)
    structured_outputs  None, or StructuredOutputsParams (or a dict of its keywords): constrain the output
                        to a JSON schema, regex, choice or grammar (llm/structured.py)
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    logprobs: int | None = None
    ignore_eos: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _number("temperature", self.temperature, 0.0, math.inf, hi_open=True)
        _number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_int("top_k", self.top_k, -1)
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf, lo_open=True, hi_open=True)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**63 - 1)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        self.stop = list(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise FieldError("stop", f"expected non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            check_int("stop_token_ids", t, 0)
        check_int("max_tokens", self.max_tokens, 1)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not isinstance(self.ignore_eos, bool):
            raise FieldError("ignore_eos", f"expected a bool, got {self.ignore_eos!r}")
        self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
