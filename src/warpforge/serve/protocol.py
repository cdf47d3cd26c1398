"""The OpenAI API's request bodies (pydantic), its error shape, and what a body means for the engine.

Bodies follow the OpenAI reference for ``/v1/completions`` and ``/v1/chat/completions`` plus vLLM's
documented sampling extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``stop_token_ids``) and structured outputs (``response_format``; vLLM's ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar``, ``structured_outputs``). Unknown fields are ignored, as OpenAI
does; fields that ask for something this server does not do (logit_bias, legacy functions, ...) are
refused with a 400 naming the field, never silently dropped.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Strict, ValidationError

from warpforge.llm.structured import StructuredOutputsParams

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
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs (one of them)
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    echo: Bool = False
    logprobs: Int | None = None


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: str
    content: str | list[TextPart] | None = None  # null: an assistant message that carries tool_calls
    name: str | None = None
    tool_calls: list[dict] | None = None  # assistant: [{"id", "type": "function", "function": {"name", "arguments"}}]
    tool_call_id: str | None = None  # role "tool": the call this message answers


class ChatRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    logprobs: Bool = False
    top_logprobs: Int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: Bool | None = None


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
    "functions": ("legacy function calling: use tools", (None, [])),
    "function_call": ("legacy function calling: use tool_choice", (None, "none")),
    "logit_bias": ("logit_bias", (None, {})),
    "suffix": ("suffix (insertion)", (None, "")),
    "audio": ("audio output", (None,)),
    "modalities": ("output modalities other than text", (None, ["text"])),
    "prediction": ("predicted outputs", (None,)),
    "min_tokens": ("min_tokens", (None, 0)),
    "use_beam_search": ("beam search", (None, False)),
    "prompt_logprobs": ("prompt logprobs", (None,)),
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
        if isinstance(m, dict) and m.get("function_call") not in (None, []):
            raise bad_request(f"messages[{i}].function_call: not supported by this server (legacy function "
                              f"calling: use tool_calls)", param="messages", code="unsupported_field")
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
    """Messages as the chat template reads them: text content only (parts joined); an assistant's
    tool_calls with their arguments as objects (HF templates write them with ``tojson``, as vLLM
    passes them), a tool message's tool_call_id."""
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
        if content is None and not m.tool_calls:
            raise bad_request(f"messages[{i}].content: expected a string or a list of text parts, got null "
                              f"(null content goes with tool_calls)", param="messages")
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _template_call(i: int, j: int, call: dict) -> dict:
    where = f"messages[{i}].tool_calls[{j}]"
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise bad_request(f"{where}: expected {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                          param="messages")
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args or "{}")
        except ValueError:
            raise bad_request(f"{where}.function.arguments: expected JSON text, got {_short(args)}",
                              param="messages") from None
    return {**call, "type": call.get("type", "function"), "function": {**f, "arguments": args}}


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(req: _Sampling) -> tuple[StructuredOutputsParams | None, str | None]:
    """The body's output constraint -> (params, the field that asked for it), or (None, None). At most one
    of response_format (json_object / json_schema), guided_* and structured_outputs gives it;
    structured_outputs may also carry only options (disable_any_whitespace) for the others."""
    asked: list[tuple[str, dict]] = []
    options: dict = {}
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema: expected a JSON schema object",
                                  param="response_format")
            asked.append(("response_format.json_schema.schema", {"json": schema}))
        elif kind != "text":
            raise bad_request(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}",
                              param="response_format")
    for name, key in _GUIDED.items():
        if getattr(req, name) is not None:
            asked.append((name, {key: getattr(req, name)}))
    if req.structured_outputs is not None:
        so = dict(req.structured_outputs)
        if "disable_any_whitespace" in so:
            options["disable_any_whitespace"] = so.pop("disable_any_whitespace")
        if so:
            asked.append(("structured_outputs", so))
    if len(asked) > 1:
        raise bad_request(f"{asked[1][0]}: only one output constraint per request, got {asked[0][0]} too",
                          param=asked[1][0].split(".")[0])
    if not asked:
        return None, None
    field, kw = asked[0]
    try:
        return StructuredOutputsParams.of({**kw, **options}), field
    except ValueError as e:
        msg = str(e)
        msg = msg if field == "structured_outputs" else re.sub(r"^structured_outputs(\.\w+)?", field, msg)
        raise bad_request(msg, param=field.split(".")[0]) from None


def check_n(n: int) -> None:
    if isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise bad_request(f"n: expected an integer in [1, {MAX_N}], got {n!r}", param="n")


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

