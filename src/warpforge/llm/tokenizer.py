"""Tokenizer: a `tokenizers` backend plus the special tokens and the jinja chat template around it.

Sources: an HF directory (tokenizer.json, tokenizer_config.json, chat_template.jinja) or the metadata of
a GGUF file. For GGUF we rebuild the tokenizer that the metadata describes with `tokenizers` alone (no
transformers at run time): byte-level BPE for ``tokenizer.ggml.model = "gpt2"`` (Llama 3, Qwen) with
the pre-tokenizer split named by ``tokenizer.ggml.pre``, and sentencepiece-style BPE with byte fallback
for ``"llama"`` (Llama 2, Gemma), whose merges are derived from the vocabulary the way transformers'
GGUF converter derives them, so both give the same ids.

Chat prompts: ``apply_chat_template`` returns text that already holds the template's special tokens
(e.g. ``<bos>``); encode it with ``add_special_tokens=False`` (``encode_chat`` does both).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

CONTROL, USER_DEFINED = 3, 4  # GGUF token types (llama.cpp's llama_token_type)

# Pre-tokenizer splits by tokenizer.ggml.pre: the regex the merges were learned on.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# Llama 3's vocabulary (tiktoken) maps a pre-token that is itself a token straight to it, without merges
# (its tokenizer.json: "ignore_merges": true; llama.cpp sets the same for these pre-tokenizers).
IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe"}

# Gemma 3's chat template as Google publishes it with the instruction-tuned checkpoints (their
# tokenizer_config.json); Gemma GGUFs often carry none. Multimodal parts other than text are skipped
# here: the engine serves text.
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


class Tokenizer:
    """encode/decode/apply_chat_template over a `tokenizers.Tokenizer`; see the module docstring."""

    def __init__(self, backend: Backend, *, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, clean_up_spaces: bool = False,
                 extra_eos_token_ids: Sequence[int] = (), chat_template_note: str | None = None):
        self.backend = backend
        # Said to the user when a chat prompt is formed: set when the template is not the checkpoint's own.
        self.chat_template_note = chat_template_note
        self.bos_token, self.eos_token = bos_token, eos_token
        self.chat_template = chat_template
        self.clean_up_spaces = clean_up_spaces
        eos = [] if eos_token is None or backend.token_to_id(eos_token) is None else [backend.token_to_id(eos_token)]
        self.eos_token_ids = list(dict.fromkeys([*eos, *extra_eos_token_ids]))

    # ---- sources -----------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path}: no tokenizer.json (only fast-tokenizer checkpoints are supported)")
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception on a bad file
            raise ValueError(f"{path / 'tokenizer.json'}: not a readable tokenizer file ({e})") from None
        cfg = _read_json(path / "tokenizer_config.json")
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        if "add_bos_token" in cfg or "add_eos_token" in cfg:  # explicit flags override tokenizer.json
            _set_template(backend, bos if cfg.get("add_bos_token") else None, eos if cfg.get("add_eos_token") else None)
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        elif isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        gen = _read_json(path / "generation_config.json").get("eos_token_id")
        extra = [] if gen is None else ([gen] if isinstance(gen, int) else list(gen))
        return cls(backend, bos_token=bos, eos_token=eos, chat_template=template,
                   clean_up_spaces=bool(cfg.get("clean_up_tokenization_spaces", False)), extra_eos_token_ids=extra)

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """From GGUF key/values (``tokenizer.ggml.*``, ``tokenizer.chat_template``)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        if not tokens:
            raise ValueError("GGUF: no tokenizer.ggml.tokens in the metadata")
        arch = meta.get("general.architecture", "")
        if kind == "gpt2":
            backend = _byte_level(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre"))
            add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
        elif kind == "llama":
            backend = _sentencepiece(tokens, meta, gemma=arch.startswith("gemma"))
            add_bos = meta.get("tokenizer.ggml.add_bos_token", True)
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")
        _add_special(backend, tokens, meta.get("tokenizer.ggml.token_type") or [])

        def tok(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = tok("bos_token_id"), tok("eos_token_id")
        _set_template(backend, bos if add_bos else None, eos if meta.get("tokenizer.ggml.add_eos_token") else None)
        template = meta.get("tokenizer.chat_template")
        extra, note = [], None
        if arch.startswith("gemma"):
            if not template:
                template = GEMMA_CHAT_TEMPLATE
                name = meta.get("general.name") or "this GGUF"
                note = (f"{name} carries no chat template: using Gemma 3's published one. A pre-trained (not "
                        f"instruction-tuned) model answers chat turns poorly whatever the template.")
            if "<end_of_turn>" in tokens:
                extra.append(backend.token_to_id("<end_of_turn>"))  # ends a chat turn (llama.cpp: EOG)
        return cls(backend, bos_token=bos, eos_token=eos, chat_template=template, extra_eos_token_ids=extra,
                   chat_template_note=note)

    # ---- the API -----------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text: expected a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_spaces else text

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text for a conversation [{"role": ..., "content": ...}, ...] (jinja, as HF renders it)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (none in tokenizer_config.json or the GGUF)")
        if not messages or not all(isinstance(m, Mapping) and "role" in m for m in messages):
            raise ValueError("messages: expected a non-empty list of {'role': ..., 'content': ...} dicts")
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        """Token ids of the chat prompt (the template writes the special tokens; none are added)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template = template
        self.__dict__.pop("_template", None)  # the compiled template is cached on first use

    def with_chat_template(self, template: str) -> Tokenizer:
        """A copy that renders chat prompts with ``template``; this tokenizer (maybe the engine's) is unchanged."""
        other = copy.copy(self)
        other.chat_template = template
        return other

    @cached_property
    def _template(self):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
        return env.from_string(self.chat_template)


# ---- helpers -----------------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    """An optional JSON object file ({} when absent); a ValueError naming the file when it is not one."""
    from warpforge.llm.config import read_json

    if not path.is_file():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_str(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok  # AddedToken dicts or plain strings


def _set_template(backend: Backend, bos: str | None, eos: str | None) -> None:
    """Post-processor adding bos/eos around a single sequence (and a pair), as HF rebuilds it."""
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t is not None and backend.token_to_id(t) is not None]
    names = {t for t, _ in specials}
    b = f"{bos}:0 " if bos in names else ""
    e = f" {eos}:0" if eos in names else ""
    pair = f"{b}$A:0{e} {b.replace(':0', ':1')}$B:1{e.replace(':0', ':1')}"
    backend.post_processor = processors.TemplateProcessing(single=f"{b}$A:0{e}", pair=pair, special_tokens=specials)


def _clean_up(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values (the alphabet of byte-level vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Backend:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(BPE(vocab=vocab, merges=pairs, continuing_subword_prefix="", end_of_word_suffix="",
                          fuse_unk=False, ignore_merges=pre in IGNORE_MERGES))
    split = GGUF_SPLITS.get(pre or "")
    if split is None:  # GPT-2's own regex
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def spm_merges(tokens: list[str], rank: Mapping[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a sentencepiece vocabulary: every split of a token into two tokens, best
    merged-token ``rank`` first, then longer left and right parts, then lower ids (transformers' order)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in rank.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _sentencepiece(tokens: list[str], meta: Mapping[str, Any], *, gemma: bool) -> Backend:
    if gemma:
        # Gemma files store whitespace-only tokens with real spaces; the vocabulary spells them with "▁".
        # Its scores do not follow the merge order; the token order in the file does.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        rank = dict(zip(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if gemma and unk_id is not None else None
    backend = Backend(BPE(vocab=vocab, merges=spm_merges(tokens, rank), unk_token=unk, fuse_unk=True,
                          byte_fallback=True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        scheme = "first" if prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        if prefix:
            steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_special(backend: Backend, tokens: list[str], types: Sequence[int]) -> None:
    """Control tokens (``<start_of_turn>``) become special tokens, user-defined ones plain added tokens,
    so the text never cuts them apart; only tokens already in the vocabulary (no new ids)."""
    vocab = backend.get_vocab()
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types)
               if k == CONTROL and t in vocab]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types)
            if k == USER_DEFINED and t in vocab]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)
