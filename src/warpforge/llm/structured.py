"""Structured outputs: a request's tokens constrained to a JSON schema, a regex, a choice or a grammar.

Built on xgrammar (vLLM's default backend). ``SamplingParams(structured_outputs=StructuredOutputsParams(...))``
names the constraint; the engine compiles it once per request (:class:`GrammarBackend`, cached by
xgrammar) and gives the sequence a ``GrammarMatcher``. Each step:

1. ``token_bitmask`` (host): the constrained rows' allowed next tokens, one bit per vocabulary id,
   filled by xgrammar's batch matcher while the forward pass runs; None when no row is constrained, so
   an unconstrained batch does no bitmask work at all;
2. the sampler sets the forbidden logits of those rows to -inf before anything else reads them;
3. ``Scheduler.postprocess`` advances the matcher with the sampled token. Once the grammar is complete
   only the stop tokens (EOS) are allowed; the request ends with finish_reason "stop" when the matcher
   accepts one (``ignore_eos`` does not keep a finished grammar going).

Not with async scheduling's lookahead (the next mask needs this step's token on the host) nor with
speculative drafting: constrained sequences decode one plain token per step next to drafted ones.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from warpforge._validate import FieldError, from_dict

# Whitespace xgrammar allows between JSON tokens unless disable_any_whitespace: unbounded, a model that
# likes newlines can spend max_tokens on them (the endless-whitespace reports vLLM users file). 20 chars
# still lets a model indent four levels of pretty-printed JSON.
MAX_JSON_WHITESPACE = 20

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Compiled grammars kept for reuse by a GrammarBackend, least recently used dropped first: a server that sees a
# new schema per request would otherwise grow without bound (vLLM bounds its xgrammar cache the same way).
GRAMMAR_CACHE_BYTES = 512 << 20


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's ``StructuredOutputsParams``):

    json                 a JSON schema (dict or JSON text): the output is one JSON value that validates;
                         objects take only the listed properties unless the schema says otherwise
    regex                the output matches this regular expression (whole output)
    choice               the output is exactly one of these strings
    grammar              an EBNF grammar (GBNF, llama.cpp's format) whose ``root`` rule the output matches
    json_object          True: any JSON object (OpenAI's ``response_format={"type": "json_object"}``)
    disable_any_whitespace  JSON without free whitespace: ``{"a": 1, "b": [2, 3]}`` spacing only
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise FieldError("structured_outputs", f"expected exactly one of {', '.join(_KINDS)}, got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise FieldError("structured_outputs.json", f"expected a JSON schema (an object or its JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise FieldError(f"structured_outputs.{name}", f"expected a non-empty string, got {v!r:.80}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise FieldError("structured_outputs.choice", f"expected a non-empty list of non-empty strings, "
                                 f"got {self.choice!r:.80}")
            object.__setattr__(self, "choice", tuple(self.choice))  # hashable: the compile cache's key
        if self.json_object not in (None, True, False):
            raise FieldError("structured_outputs.json_object", f"expected a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise FieldError("structured_outputs.disable_any_whitespace", f"expected a bool, "
                             f"got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def of(cls, value: StructuredOutputsParams | dict | None) -> StructuredOutputsParams | None:
        """``value`` as params: a dict of the same keywords is accepted (unknown keys raise)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return from_dict("structured_outputs", cls, value)
        raise FieldError("structured_outputs",
                         f"expected StructuredOutputsParams or a dict, got {type(value).__name__}")


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise FieldError("structured_outputs", "needs the xgrammar package (pip install 'warpforge[llm]')") from None
    return xgrammar


def _clean(e: Exception) -> str:
    """xgrammar's C++ errors start with a timestamp and a source location; the user wants the reason."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?", "", msg)


def _plain_bounded_strings(schema):
    """The schema with each length-bounded string (minLength/maxLength, no pattern, format or enum) as
    the same bounds on a pattern of plain characters. xgrammar 0.2.9 builds such strings from
    ``[^"\\\r\n]``, which lets raw control characters through: not JSON (json.loads refuses them).
    The pattern keeps the bounds and leaves out control characters (and escapes: plain text only)."""
    if isinstance(schema, list):
        return [_plain_bounded_strings(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _plain_bounded_strings(v) for k, v in schema.items()}
    lo, hi = out.get("minLength"), out.get("maxLength")
    if (out.get("type") == "string" and (lo is not None or hi is not None)
            and not {"pattern", "format", "enum", "const"} & out.keys()
            and all(v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0) for v in (lo, hi))):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = '^[^\\x00-\\x1f"\\\\]{%d,%s}$' % (lo or 0, "" if hi is None else hi)
    return out


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for "exactly one of these strings" (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarBackend:
    """One engine's xgrammar state: the vocabulary as xgrammar sees it, and the compiler (with its cache).

    ``tokenizer``: warpforge's Tokenizer (a `tokenizers` backend); ``vocab_size``: the model's logits width
    (may exceed the tokenizer's: the extra ids are never allowed); ``stop_token_ids``: what ends a
    complete grammar (the engine's EOS ids); ``cache_bytes``: compiled grammars kept (0: none).
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], cache_bytes: int = GRAMMAR_CACHE_BYTES):
        xgr = _xgrammar()
        backend = tokenizer.backend
        encoded = [""] * vocab_size
        for token, i in backend.get_vocab(with_added_tokens=True).items():
            if i < vocab_size:
                encoded[i] = token
        # Added special tokens (<|im_end|>, <bos>) never appear inside constrained text: xgrammar treats
        # an empty entry as special (never allowed) except where it is a stop token.
        for i, tok in backend.get_added_tokens_decoder().items():
            if tok.special and i < vocab_size:
                encoded[i] = ""
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())  # what from_huggingface reads
        self.info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab_size,
                                      stop_token_ids=list(stop_token_ids) or None,
                                      add_prefix_space=meta["add_prefix_space"])
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=cache_bytes > 0,
                                            cache_limit_bytes=cache_bytes if cache_bytes > 0 else -1)
        self.vocab_size = vocab_size

    def compile(self, so: StructuredOutputsParams):
        """-> xgrammar's CompiledGrammar; a bad schema, regex or grammar -> ValueError naming the field."""
        kind = so.kind
        ws: dict[str, Any] = {"any_whitespace": not so.disable_any_whitespace}
        if not so.disable_any_whitespace:
            ws["max_whitespace_cnt"] = MAX_JSON_WHITESPACE
        try:
            if kind == "json":
                schema = json.loads(so.json) if isinstance(so.json, str) else so.json
                return self.compiler.compile_json_schema(json.dumps(_plain_bounded_strings(schema)), **ws)
            if kind == "json_object":
                return self.compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)
            if kind == "regex":
                return self.compiler.compile_regex(so.regex)
            if kind == "choice":
                assert so.choice is not None  # kind names the field that is set
                return self.compiler.compile_grammar(choice_grammar(so.choice))
            return self.compiler.compile_grammar(so.grammar)
        except (RuntimeError, ValueError, TypeError, RecursionError) as e:
            what = {"json": "JSON schema", "json_object": "JSON", "regex": "regex", "choice": "choice",
                    "grammar": "EBNF grammar"}[kind]
            raise FieldError(f"structured_outputs.{kind}", f"not a usable {what}: {_clean(e)}") from None

    def matcher(self, so: StructuredOutputsParams) -> Any:
        """A fresh GrammarMatcher for one sequence."""
        return _xgrammar().GrammarMatcher(self.compile(so))


@functools.cache
def _batch_matcher():
    return _xgrammar().BatchGrammarMatcher()


def token_bitmask(matchers: list, vocab_size: int,
                  device: torch.device) -> tuple[torch.Tensor, list[int] | None] | None:
    """The step's bitmask for the rows whose matcher is not None -> (int32 [B, ceil(V/32)] on ``device``,
    the rows it applies to or None for all), or None when no row is constrained. The rows of
    unconstrained sequences are left unfilled and never read."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    shape = (len(matchers), (vocab_size + 31) // 32)
    pin = device.type == "cuda"
    host = torch.empty(shape, dtype=torch.int32, pin_memory=pin)
    # One call over every constrained row: xgrammar spreads them over its threads.
    _batch_matcher().batch_fill_next_token_bitmask([matchers[i] for i in rows], host, rows)
    return host.to(device, non_blocking=pin), (None if len(rows) == len(matchers) else rows)


def apply_token_bitmask(logits: torch.Tensor,  # [B, V] f32, changed in place
                        bitmask: torch.Tensor,  # [B, ceil(V/32)] int32, bit j of word w: token 32 w + j allowed
                        rows: list[int] | None) -> None:
    """Forbidden tokens of the given rows (None: all) -> -inf. xgrammar's kernels: Triton on CUDA, C++ on
    the CPU."""
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
