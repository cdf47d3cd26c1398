"""The OpenAI API's request bodies (pydantic), its error shape, and what a body means for the engine.

Bodies follow the OpenAI reference for ``/v1/completions`` and ``/v1/chat/completions`` plus vLLM's
documented sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``). Unknown fields are ignored, as OpenAI does; fields that ask for something this
server does not do (tools, structured output, ...) are refused with a 400 naming the field, never
silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Strict, ValidationError

MAX_N = 128  # choices per prompt

# JSON types as the API documents them. pydantic's lax mode would take true for 1, 2.0 for 2 and "yes" for
# true; a client that sends those has a bug worth a 400 naming the field. Numbers still take integers (1 -> 1.0).
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]
Float = Annotated[float, Strict()]


class APIError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- request bodies ------------------------------------------------------------------------------

class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored (kept only for the refusal check)


class StreamOptions(_Body):
    include_usage: Bool = False  # a last chunk with the usage, after every choice finished
    continuous_usage_stats: Bool = False  # vLLM: the usage so far in every chunk too


class _Sampling(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    n: Int = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: Int | None = None
    min_p: Float | None = None
    repetition_penalty: Float | None = None
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    echo: Bool = False
    logprobs: Int | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    # OpenAI allows null only on an assistant message that carries tool_calls, which ``parse`` refuses first
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a ``prompt`` text, or chat ``messages`` rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool | None = None  # None: vLLM's defaults, true for a prompt, false for messages
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Int]


# Fields that ask for behaviour this server lacks -> (what they ask for, values that ask for nothing).
_UNSUPPORTED: dict[str, tuple[str, tuple]] = {
    "tools": ("tool calling", (None, [])),
    "functions": ("function calling", (None, [])),
    "tool_choice": ("tool calling", (None, "none")),
    "function_call": ("function calling", (None, "none")),
    "response_format": ("structured output", (None, {"type": "text"})),
    "logit_bias": ("logit_bias", (None, {})),
    "suffix": ("suffix (insertion)", (None, "")),
    "audio": ("audio output", (None,)),
    "modalities": ("output modalities other than text", (None, ["text"])),
    "prediction": ("predicted outputs", (None,)),
    "min_tokens": ("min_tokens", (None, 0)),
    "use_beam_search": ("beam search", (None, False)),
    "prompt_logprobs": ("prompt logprobs", (None,)),
    "guided_json": ("structured output", (None,)),
    "guided_regex": ("structured output", (None,)),
    "guided_choice": ("structured output", (None,)),
    "guided_grammar": ("structured output", (None,)),
    "structured_outputs": ("structured output", (None,)),
}


def parse(model: type[_Body], body: dict) -> Any:
    """Validate ``body``; a field this server cannot honour or a wrong type -> 400 naming the field."""
    for name, (what, harmless) in _UNSUPPORTED.items():
        if name in body and not any(body[name] == h for h in harmless):
            raise bad_request(f"{name}: not supported by this server ({what})", param=name, code="unsupported_field")
    if "best_of" in body and body["best_of"] not in (None, 1, body.get("n", 1)):
        raise bad_request("best_of: not supported by this server (only best_of = n)", param="best_of",
                          code="unsupported_field")
    messages = body.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        for name in ("tool_calls", "function_call"):
            if isinstance(m, dict) and m.get(name) not in (None, []):
                raise bad_request(f"messages[{i}].{name}: not supported by this server (tool calling)",
                                  param="messages", code="unsupported_field")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # pydantic names the member of a union that failed ("prompt.list[int]"): report the field instead
        union = any(isinstance(p, str) and p in _UNION_MEMBERS for p in err["loc"])
        parts = [p for p in err["loc"] if not (isinstance(p, str) and p in _UNION_MEMBERS)]
        loc = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in parts).replace(".[", "[")
        field = str(parts[-1]) if parts else ""
        got = "" if err["type"] == "missing" else f", got {_short(err.get('input'))}"
        msg = f"expected {_EXPECTED[field]}" if union and field in _EXPECTED else err["msg"].lower()
        raise bad_request(f"{loc}: {msg}{got}", param=str(parts[0]) if parts else None) from None


_UNION_MEMBERS = {"str", "int", "list[str]", "list[int]", "list[list[int]]", "list[TextPart]"}
_EXPECTED = {"prompt": "a text, a list of texts, a list of token ids, or a list of token-id lists",
             "stop": "a string or a list of strings", "content": "a string or a list of text parts"}


def _short(value) -> str:
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


# ---- what a body asks the engine for -------------------------------------------------------------

def sampling_kwargs(req: _Sampling, max_tokens: int, logprobs: int | None) -> dict:
    """SamplingParams keywords from a body (None fields keep the engine's defaults)."""
    kw: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": logprobs, "ignore_eos": req.ignore_eos}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed"):
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    if req.stop is not None:
        kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_token_ids:
        kw["stop_token_ids"] = list(req.stop_token_ids)
    return kw


def chat_messages(req: ChatRequest) -> list[dict]:
    """Messages as the chat template reads them: text content only (parts joined)."""
    if not req.messages:
        raise bad_request("messages: expected at least one message", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content[{j}]: only text parts are supported, got type "
                                      f"{part.type!r}", param="messages")
                texts.append(part.text)
            content = "".join(texts)
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def check_n(n: int) -> None:
    if isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise bad_request(f"n: expected an integer in [1, {MAX_N}], got {n!r}", param="n")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

