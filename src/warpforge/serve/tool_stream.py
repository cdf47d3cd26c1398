"""Tool calls streamed as they are generated, in the OpenAI API's delta shape.

A call goes out as ``{"tool_calls": [{"index": i, "id", "type": "function", "function": {"name", "arguments":
""}}]}`` once its name is complete, then as ``{"tool_calls": [{"index": i, "function": {"arguments": fragment}}]}``
while its arguments are generated; the fragments join into the arguments' JSON text (the model's own
spacing: the non-streamed reply re-serializes it, the value is the same). By ``tool_choice``:

named      the whole output is the arguments; the header rides the role chunk
required   the output is a JSON array of ``{"name", "parameters"}`` (structured outputs force it)
auto       text goes out as content until a ``<tool_call>`` tag (or a reply that opens with ``{`` / ``[``)
           may start a call; a call naming a known tool streams as above, one that turns out not to be a
           call (an unknown name, not JSON) goes out as content once that is clear. Whitespace after
           content goes out only when more content follows (the non-streamed reply strips its ends).

A call whose header went out stays a call even if the reply is cut short (finish_reason "length").
"""

from __future__ import annotations

import json
from typing import Any

from warpforge.serve.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, ToolPlan

_WS = " \t\r\n"


class CallScanner:
    """Reads JSON text one piece at a time as a call object ``{"name": ..., <args key>: {...}}`` or an array of
    them; says when a call's name is complete and which characters are its arguments.

    ``feed(text)`` -> events: ("name", i, name) when call i's name string closes; ("args", i, text) argument
    text as it arrives (a string-valued arguments field once complete, decoded); ``bad`` turns True when the
    text is not calls, ``done`` when the top-level value closed."""

    def __init__(self, arg_keys: tuple[str, ...]):
        self.arg_keys = arg_keys
        self.stack: list[str] = []
        self.call_depth = 0  # 1: the top level is a call object; 2: an array of them
        self.calls = -1  # index of the call being read
        self.in_str = self.esc = False
        self.str_start = 0  # where the current string began, in ``buf``
        self.buf = ""  # text of the current call object so far (strings are cut from it)
        self.key: str | None = None  # the key whose value is being read (call depth)
        self.expect = "key"  # at call depth: "key", "colon", "value", "comma"
        self.args_from: int | None = None  # where the open arguments value began in ``buf``
        self.args_str = False  # the arguments value is a JSON string (sent decoded, once complete)
        self.args_sent = 0
        self.bad = self.done = False

    def feed(self, text: str) -> list[tuple]:
        events: list[tuple] = []
        for ch in text:
            if self.bad:
                break
            self._char(ch, events)
        if self.args_from is not None and not self.args_str:
            self._args(len(self.buf), events)
        return events

    def _args(self, end: int, events: list) -> None:
        assert self.args_from is not None  # called only while an arguments value is open
        start = self.args_from + self.args_sent
        if end > start:
            events.append(("args", self.calls, self.buf[start:end]))
            self.args_sent = end - self.args_from

    def _char(self, ch: str, events: list) -> None:
        depth = len(self.stack)
        if self.done:
            self.bad = ch not in _WS  # anything but whitespace after the value: not a reply of calls
            return
        self.buf += ch
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if depth == self.call_depth:
                    self._string_end(events)
            return
        if ch in _WS:
            return
        if depth == 0:  # the top-level value: a call or an array of calls
            if ch not in "[{":
                self.bad = True
                return
            self.call_depth = 1 if ch == "{" else 2
        if depth == self.call_depth:  # inside a call object, between its members
            self._member(ch, events)
            return
        if depth == self.call_depth - 1 and depth > 0:  # in the array of calls: calls, commas
            if ch == "{":
                self._new_call()
            elif ch == "]":
                self.stack.pop()
                self.done = True
                return
            elif ch != ",":
                self.bad = True
                return
        if ch in "[{":
            self.stack.append(ch)
            if depth == 0 and ch == "{":
                self._new_call()
        elif ch in "]}":
            self.stack.pop()
            if self.args_from is not None and len(self.stack) == self.call_depth:
                self._args_end(len(self.buf), events)
        elif ch == '"':
            self.in_str = True

    def _new_call(self) -> None:
        self.calls += 1
        self.buf, self.key, self.expect = "{", None, "key"
        self.args_from, self.args_str, self.args_sent = None, False, 0

    def _member(self, ch: str, events: list) -> None:
        """A character at call depth (outside strings): keys, colons, the start of values, commas, the end."""
        if self.expect == "key":
            if ch == '"':
                self.in_str, self.str_start = True, len(self.buf) - 1
            elif ch == "}":
                self._call_end()
            else:
                self.bad = True
        elif self.expect == "colon":
            self.bad = ch != ":"
            self.expect = "value"
        elif self.expect == "value":
            if self.key in self.arg_keys:
                self.args_from, self.args_sent = len(self.buf) - 1, 0
                self.args_str = ch == '"'
            if ch == '"':
                self.in_str, self.str_start = True, len(self.buf) - 1
            elif ch in "[{":
                self.stack.append(ch)
            else:  # a number, true, false or null: read until the next comma or brace
                self.expect = "scalar"
                return
            self.expect = "comma"
        elif self.expect in ("comma", "scalar"):
            if ch in ",}" and self.args_from is not None:  # a scalar arguments value ends before this
                self._args_end(len(self.buf) - 1, events)
            if ch == ",":
                self.expect = "key"
            elif ch == "}":
                self._call_end()
            elif self.expect == "comma":
                self.bad = True

    def _string_end(self, events: list) -> None:
        raw = self.buf[self.str_start:]
        if self.expect == "key":
            self.key, self.expect = json.loads(raw), "colon"
        elif self.key == "name":
            name = json.loads(raw)
            if isinstance(name, str):
                events.append(("name", self.calls, name))
        elif self.args_from is not None and self.args_str:
            self._args_end(len(self.buf), events)

    def _args_end(self, end: int, events: list) -> None:
        if self.args_str:
            value = json.loads(self.buf[self.args_from:end])
            if value:
                events.append(("args", self.calls, value))
        else:
            self._args(end, events)
        self.args_from = None

    def _call_end(self) -> None:
        self.stack.pop()
        self.key, self.expect = None, "key"
        if not self.stack:
            self.done = True


class ToolStream:
    """One streamed choice's deltas under a plan: ``feed(text, delta, finished)`` -> the deltas to send now
    (a list, maybe empty); ``finish_reason`` for the last chunk."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.names = set(plan.functions)
        self.named = ToolCall(plan.named, "") if plan.mode == "named" else None
        self.calls: list[ToolCall] = []  # headers sent, in index order
        self.read = 0  # chars of the reply handled
        self.held_ws = ""  # whitespace after content: sent only if more content follows
        self.block: CallScanner | None = None  # auto: the JSON being read as calls (a tag's, or the reply's)
        self.block_start = 0  # where that JSON began in the reply
        self.block_calls: dict[int, int] = {}  # the block's call i -> index in ``calls``
        self.bare: bool | None = None  # auto: None until the reply's first character says; True: the reply is JSON
        self.plain = False  # auto: the reply is known to be text only

    def first(self) -> dict:
        """The role chunk's delta (a named call's header rides it)."""
        delta: dict[str, Any] = {"role": "assistant", "content": None if self.named else ""}
        if self.named:
            delta["tool_calls"] = [self.named.body(0)]
        return delta

    def finish_reason(self, text: str, reason: str | None) -> str | None:
        if reason == "stop" and (self.calls or self.named is not None):
            return "tool_calls"
        return reason

    def feed(self, text: str, delta: str, finished: bool) -> list[dict]:
        mode = self.plan.mode
        if mode == "none":
            return [{"content": delta}] if delta or finished else []
        if mode == "named":
            return [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}] if delta else []
        out: list[dict] = []
        if mode == "required":
            if self.block is None:
                self.block = CallScanner(("parameters",))
            self._scan(text[self.read:], out)
            self.read = len(text)
            return out
        self._auto(text, finished, out)
        return out

    # ---- auto ------------------------------------------------------------------------------------------

    def _auto(self, text: str, finished: bool, out: list[dict]) -> None:
        if self.bare is None:
            head = text.lstrip(_WS)
            if not head:
                if finished:
                    self._content(text, out)
                    self.read = len(text)
                return
            self.bare = head[0] in "{["
            if self.bare:
                self.block, self.block_start = CallScanner(("arguments", "parameters")), len(text) - len(head)
                self.read = self.block_start
        if self.bare and not self.plain:
            block = self.block
            assert block is not None  # opened with bare, dropped only once the reply turns out plain
            self._scan(text[self.read:], out)
            self.read = len(text)
            if block.bad and not self.calls:  # JSON, but no call: it was text all along
                self.plain, self.block = True, None
                self._content(text[:self.read], out)
            elif finished and not self.calls and not self.plain:
                self._content(text, out)
            return
        while self.read < len(text):
            if self.block is None:
                i = text.find(TOOL_CALL_OPEN, self.read)
                if i < 0:  # no tag yet: all but a tag that may be forming at the end is content
                    safe = len(text) if finished else _safe_end(text, self.read)
                    self._content(text[self.read:safe], out)
                    self.read = safe
                    break
                self._content(text[self.read:i], out)
                self.read = i + len(TOOL_CALL_OPEN)
                self.block, self.block_start, self.block_calls = CallScanner(("arguments", "parameters")), i, {}
                continue
            j = text.find(TOOL_CALL_CLOSE, self.read)
            end = j if j >= 0 else (len(text) if finished else _safe_end(text, self.read, TOOL_CALL_CLOSE))
            self._scan(text[self.read:end], out)
            self.read = end
            if j < 0 and not finished:
                break
            block_end = j + len(TOOL_CALL_CLOSE) if j >= 0 else len(text)
            if not self.block_calls:  # not a call after all: the block is content
                self._content(text[self.block_start:block_end], out)
            self.block, self.read = None, block_end
        if finished:
            if self.held_ws and not self.calls:  # a reply without calls keeps its trailing whitespace
                out.append({"content": self.held_ws})
            self.held_ws = ""

    def _content(self, s: str, out: list[dict]) -> None:
        """Send ``s`` as content, holding its trailing whitespace back until more content follows (the end of
        a reply with calls drops it)."""
        s = self.held_ws + s
        body = s.rstrip(_WS)
        self.held_ws = s[len(body):]
        if body:
            out.append({"content": body})

    # ---- calls ------------------------------------------------------------------------------------------

    def _scan(self, text: str, out: list[dict]) -> None:
        block = self.block
        assert block is not None  # feed and _auto open the block before scanning into it
        for ev in block.feed(text):
            kind, i = ev[0], ev[1]
            if kind == "name":
                if ev[2] not in self.names:
                    block.bad = True
                    return
                call = ToolCall(ev[2], "")
                self.block_calls[i] = len(self.calls)
                self.calls.append(call)
                out.append({"tool_calls": [call.body(len(self.calls) - 1)]})
            elif i in self.block_calls:  # arguments of a call whose header went out
                out.append({"tool_calls": [{"index": self.block_calls[i], "function": {"arguments": ev[2]}}]})


def _safe_end(text: str, start: int, tag: str = TOOL_CALL_OPEN) -> int:
    """How far from ``start`` the text surely holds no start of ``tag`` (a partial one may end it)."""
    for k in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[-k:]):
            return len(text) - k
    return len(text)
