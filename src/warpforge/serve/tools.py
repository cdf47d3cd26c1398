"""Tool calling for /v1/chat/completions: ``tools`` and ``tool_choice`` as the OpenAI API takes them.

The chat template renders the tools (``tools=`` as HF's ``apply_chat_template`` passes them). Then, by
``tool_choice``:

none        no tool call: the reply is text (the tools are still rendered, as vLLM does)
required    the output is constrained (structured outputs) to a JSON array of calls,
            ``[{"name": <a tool's name>, "parameters": <that tool's parameters schema>}, ...]``
            (one call when ``parallel_tool_calls`` is false), returned as ``message.tool_calls``
{"type": "function", "function": {"name": N}}
            the output is constrained to N's parameters schema: it *is* the call's arguments
auto        (the default with tools) unconstrained; the reply is parsed for calls in the format Hermes and
            Qwen templates teach, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (any number,
            text around them is the content), or a reply that is only such a JSON object (or a list of
            them; "parameters" is read as "arguments"). Anything else is text.

Calls come back as ``tool_calls: [{"id", "type": "function", "function": {"name", "arguments": JSON
text}}]`` with finish_reason "tool_calls". Streamed replies send each call's header and then its
arguments as they are generated (serve/tool_stream.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from warpforge.llm.structured import StructuredOutputsParams
from warpforge.serve.protocol import bad_request

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TAGGED = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.S)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class ToolPlan:
    """What a request's ``tools``/``tool_choice`` ask for: ``mode`` "none" | "auto" | "required" | "named"."""

    tools: list[dict]  # as the client sent them: [{"type": "function", "function": {...}}]
    mode: str
    name: str | None = None  # mode "named"
    parallel: bool = True

    @property
    def functions(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"] for t in self.tools}

    @property
    def named(self) -> str:
        """The tool mode "named" forces (tool_plan always gives that mode its name)."""
        assert self.name is not None, "mode 'named' without a name"
        return self.name

    def constraint(self, compact: bool = False) -> StructuredOutputsParams | None:
        """The structured output that forces the call ("required", "named"); None otherwise. ``compact``:
        no free whitespace (structured_outputs.disable_any_whitespace)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self.functions[self.named]), disable_any_whitespace=compact)
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]},
                                                   "parameters": _parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for n, f in self.functions.items()]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_any_whitespace=compact)

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished reply -> (content, calls); no calls: (text, [])."""
        if self.mode == "named":
            return None, [ToolCall(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                return None, [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in items]
            except (ValueError, TypeError, KeyError):  # cut short (finish "length"): the text as it is
                return text, []
        if self.mode == "auto":
            return parse_auto(text, set(self.functions))
        return text, []


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def tool_plan(tools, tool_choice, parallel_tool_calls) -> ToolPlan | None:
    """Check the request's tool fields (400 naming the field); None when it uses no tools."""
    if tools in (None, []):
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice: needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request(f"tools: expected a list of tools, got {type(tools).__name__}", param="tools")
    names = set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise bad_request(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ...}}}}",
                              param="tools")
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_request(f"tools[{i}].function.name: expected a non-empty string", param="tools")
        if f["name"] in names:
            raise bad_request(f"tools[{i}].function.name: {f['name']!r} is given twice", param="tools")
        names.add(f["name"])
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters: expected a JSON schema object", param="tools")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "auto", "required"):
        return ToolPlan(tools, choice, parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise bad_request(f"tool_choice: expected 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                          f"{{'name': ...}}}}, got {choice!r:.80}", param="tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice: no tool named {name!r} in tools ({', '.join(sorted(names))})",
                          param="tool_choice")
    return ToolPlan(tools, "named", name, parallel)


def parse_auto(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Calls in a free reply (see the module docstring); a call naming no known tool is left as text."""
    def call(obj) -> ToolCall | None:
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def loads(s: str):
        try:
            return json.loads(s)
        except ValueError:
            return None

    if TOOL_CALL_OPEN in text:
        tagged = [call(loads(m.group(1))) for m in _TAGGED.finditer(text)]
        calls = [c for c in tagged if c is not None]
        if tagged and len(calls) == len(tagged):  # every tag a known tool's call
            content = _TAGGED.sub("", text).strip()
            return content or None, calls
        return text, []
    obj = loads(text.strip())
    items = obj if isinstance(obj, list) else [obj]
    calls = [c for c in map(call, items) if c is not None]
    if items and len(calls) == len(items):
        return None, calls
    return text, []
