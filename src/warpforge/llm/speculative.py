"""Speculative decoding settings, counters, and the rule that picks k each step.

``LLM(model, speculative=SpeculativeConfig(method="ngram", k=4))`` (or ``speculative="ngram"``):
each decode step a cheap drafter proposes up to k tokens per sequence, the target model scores the last
token and the k drafts in one forward (the chunked-prefill attention path, k + 1 query positions), and
the longest acceptable run of drafts plus one token from the target is kept. Greedy output is the plain
engine's; at temperature > 0, drafts are accepted with probability min(1, p/q) and a rejection resamples
from norm(max(0, p - q)), so every token is distributed as the target's (Leviathan et al., 2023; Chen et
al., 2023). The step itself is in :mod:`warpforge.llm.spec_step`, the drafters in
:mod:`warpforge.llm.drafters`.

When speculation pays (:class:`AdaptiveK`). With a per-draft acceptance rate a, k drafts yield
E(k) = (1 - a^(k+1)) / (1 - a) tokens per step, at a cost of 1 + k (c_draft + c_verify) decode steps:
c_draft is what one drafted token costs (0 for n-grams; the drafter's share of the weights read for the
model drafters) and c_verify = 0.05 what one more query token costs the target's forward at the small
batches speculation runs at, where a step reads the weights once however many tokens it computes. Each
step takes the k in 1..k_max with the best E(k) / cost(k); when even that is below 1.1, the step runs
plainly, and every 16th such step probes with k = 1 so a rising acceptance rate is noticed. Above
``max_batch_size`` sequences in a step the forward is no longer bound by reading the weights, extra
query tokens cost about as much as the ones they replace, and speculation is off for that step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warpforge._validate import check_int, from_dict

METHODS = ("ngram", "draft", "self")
MAX_K = 32
VERIFY_TOKEN_COST = 0.05  # one more query token in the target's forward, in decode steps (see the docstring)
MIN_GAIN = 1.1  # expected tokens per unit of cost below which a step runs without drafts
PROBE_EVERY = 16  # plain steps (speculation off by the rule above) between probes with k = 1
_PRIOR_WEIGHT = 4.0  # pseudo-observations behind the starting acceptance estimate
_DECAY = 0.95  # per update: the estimate follows the last ~20 steps


@dataclass
class SpeculativeConfig:
    """How the engine drafts and verifies. Every field is checked in ``__post_init__``.

    method          "ngram": prompt lookup, the tokens that followed the latest earlier occurrence of
                    the sequence's last n tokens (n from ngram_max down to ngram_min; nothing to load);
                    "draft": a separate small model (``draft_model``) with the target's vocabulary and
                    its own KV cache; "self": the target's first ``draft_layers`` layers, its final norm
                    and its LM head (no extra weights, and the drafted KV is the target's own)
    k               most tokens drafted per sequence and step (1..32); with ``adaptive`` the engine
                    picks 1..k from the measured acceptance rate, or none when drafting does not pay
    draft_model     method "draft": an HF checkpoint directory, a .gguf, "gemma3-270m", or an already
                    loaded (model, tokenizer, config)
    draft_layers    method "self": layers the draft runs (1 .. num_layers - 1; None: half of them)
    ngram_max       method "ngram": longest suffix matched (1..16)
    ngram_min       method "ngram": shortest suffix matched (1..ngram_max)
    adaptive        pick k per step from the acceptance rate (False: always k, for tests and ablations)
    max_batch_size  no drafting in a step that runs more sequences than this (see the module docstring)
    """

    method: str = "ngram"
    k: int = 4
    draft_model: Any = None
    draft_layers: int | None = None
    ngram_max: int = 4
    ngram_min: int = 2
    adaptive: bool = True
    max_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method: expected one of {METHODS}, got {self.method!r}")
        check_int("speculative.k", self.k, 1, MAX_K)
        if self.method == "draft":
            if self.draft_model is None:
                raise ValueError("speculative.draft_model: method 'draft' needs a draft model (a checkpoint path, "
                                 "'gemma3-270m' or a loaded (model, tokenizer, config)), got None")
            if not isinstance(self.draft_model, (str, Path, tuple)):
                raise ValueError(f"speculative.draft_model: expected a path or a loaded (model, tokenizer, config), "
                                 f"got {type(self.draft_model).__name__}")
        elif self.draft_model is not None:
            raise ValueError(f"speculative.draft_model: only method 'draft' takes a draft model, "
                             f"got one with method {self.method!r}")
        if self.draft_layers is not None:
            if self.method != "self":
                raise ValueError(f"speculative.draft_layers: only method 'self' takes draft_layers, "
                                 f"got {self.draft_layers!r} with method {self.method!r}")
            check_int("speculative.draft_layers", self.draft_layers, 1)
        check_int("speculative.ngram_max", self.ngram_max, 1, 16)
        check_int("speculative.ngram_min", self.ngram_min, 1, self.ngram_max)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative.adaptive: expected a bool, got {self.adaptive!r}")
        check_int("speculative.max_batch_size", self.max_batch_size, 1)


def speculative_config(value) -> SpeculativeConfig | None:
    """What ``EngineConfig.speculative`` takes: None, a SpeculativeConfig, a method name ("ngram",
    "self") or a dict of SpeculativeConfig fields."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        return SpeculativeConfig(method=value)
    if isinstance(value, dict):
        return from_dict("speculative", SpeculativeConfig, value)
    raise ValueError(f"speculative: expected a SpeculativeConfig, a method name {METHODS} or a dict, "
                     f"got {type(value).__name__}")


@dataclass
class SpecStats:
    """Counters since the engine started (the server's /metrics reads them)."""

    num_spec_steps: int = 0  # steps whose forward verified drafts
    num_draft_tokens: int = 0  # tokens proposed and verified
    num_accepted_tokens: int = 0  # of which the target accepted
    num_emitted_tokens: int = 0  # tokens the speculative steps added to sequences (accepted + one each)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**self.__dict__, "acceptance_rate": self.acceptance_rate}


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step yields with k drafts, each accepted with probability alpha until the first rejection."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class AdaptiveK:
    """Picks each step's k from a running estimate of the per-draft acceptance rate.

    The estimate counts accepted drafts and rejections (a run of drafts ends in at most one), both
    decayed by 0.95 per update: accepted / (accepted + rejections) is the maximum-likelihood per-token
    rate of a run that stops at its first rejection, unbiased by runs cut short at k."""

    def __init__(self, k_max: int, draft_cost: float, *, adaptive: bool = True, prior: float = 0.6):
        self.k_max, self.draft_cost, self.adaptive = k_max, draft_cost, adaptive
        self.accepted, self.rejected = prior * _PRIOR_WEIGHT, (1.0 - prior) * _PRIOR_WEIGHT
        self.off_steps = 0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def gain(self, k: int) -> float:
        """Expected tokens per unit of cost with k drafts (1.0: a plain step)."""
        return expected_tokens(self.alpha, k) / (1.0 + k * (self.draft_cost + VERIFY_TOKEN_COST))

    def best_k(self) -> int:
        """The k in 1..k_max with the best gain, 0 when it is below MIN_GAIN."""
        k = max(range(1, self.k_max + 1), key=self.gain)
        return k if self.gain(k) >= MIN_GAIN else 0

    def next_k(self) -> int:
        """This step's k (0: no drafting this step)."""
        if not self.adaptive:
            return self.k_max
        k = self.best_k()
        if k == 0:
            self.off_steps += 1
            if self.off_steps >= PROBE_EVERY:
                self.off_steps = 0
                return 1
        return k

    def plain_next(self) -> bool:
        """Whether the next step will draft nothing by this rule, counted as one of the plain steps
        between probes (the engine then queues it ahead, async scheduling; see LLMEngine.step)."""
        if not self.adaptive or self.best_k() > 0 or self.off_steps + 1 >= PROBE_EVERY:
            return False
        self.off_steps += 1
        return True

    def update(self, accepted: int, rejected: int) -> None:
        self.accepted = _DECAY * self.accepted + accepted
        self.rejected = _DECAY * self.rejected + rejected
