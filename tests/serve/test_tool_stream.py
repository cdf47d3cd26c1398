"""Tool calls streamed as deltas (serve/tool_stream.py), fed a reply a few characters at a time: each call's
header (id, name, empty arguments) goes out before its arguments, the arguments arrive in pieces that join
into its JSON, text around calls is content, and what turns out not to be a call is content after all."""

from __future__ import annotations

import json

import pytest

from warpforge.serve.tool_stream import ToolStream
from warpforge.serve.tools import ToolPlan

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def stream(mode: str, text: str, step: int = 1, reason: str = "stop") -> tuple[list[dict], str | None]:
    """Every delta of ``text`` fed ``step`` characters at a time, and the finish reason."""
    ts = ToolStream(ToolPlan([WEATHER, TIME], mode))
    deltas, sent = [], 0
    for end in [*range(step, len(text), step), len(text)]:
        deltas += ts.feed(text[:end], text[sent:end], end == len(text))
        sent = end
    return deltas, ts.finish_reason(text, reason)


def joined(deltas: list[dict]) -> tuple[str, list[dict]]:
    """(content, calls) as a client accumulates them; asserts each call's header comes before its arguments."""
    content, calls = "", []
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(calls):  # a new call: its header, with no arguments yet
                assert tc["id"].startswith("call_") and tc["type"] == "function"
                assert tc["function"]["arguments"] == ""
                calls.append({"name": tc["function"]["name"], "arguments": "", "pieces": 0})
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
                calls[tc["index"]]["pieces"] += 1
    return content, calls


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, {"x": "}]"}]}}, '
            '{"name":"get_time","parameters":{}}]')


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_required_calls_stream_header_then_arguments(step):
    deltas, reason = stream("required", REQUIRED, step)
    content, calls = joined(deltas)
    assert content == "" and reason == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": [1, {"x": "}]"}]}
    assert json.loads(calls[1]["arguments"]) == {}
    if step == 1:  # one character at a time: the arguments went out as they came, not at the end
        assert calls[0]["pieces"] == len(calls[0]["arguments"])


def test_required_cut_short_keeps_the_call():
    deltas, reason = stream("required", '[{"name": "get_weather", "parameters": {"city": "Pa', 2, reason="length")
    content, calls = joined(deltas)
    assert reason == "length" and calls[0]["name"] == "get_weather" and calls[0]["arguments"] == '{"city": "Pa'


TAGGED = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
          '\n<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call> done')


@pytest.mark.parametrize("step", [1, 4, 10_000])
def test_auto_streams_text_and_tagged_calls(step):
    deltas, reason = stream("auto", TAGGED, step)
    content, calls = joined(deltas)
    assert reason == "tool_calls" and content == "Let me look.\n\n done"  # as the non-streamed reply's content
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}
    assert json.loads(calls[1]["arguments"]) == {"tz": "UTC"}  # arguments given as a JSON string: decoded
    if step == 1:
        assert deltas[0] == {"content": "L"}  # text flows before any call is seen
        assert calls[0]["pieces"] > 1


@pytest.mark.parametrize("text", ['  {"name": "get_weather", "arguments": {"city": "Paris"}}',
                                  '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'])
def test_auto_reply_that_is_a_call(text):
    content, calls = joined(stream("auto", text)[0])
    assert content == "" and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("text", ['{"answer": 42, "name": "nope"}',  # JSON, not a call
                                  'See <tool_call>{"name": "launch", "arguments": {}}</tool_call> ok',  # unknown tool
                                  "To be, or not to be <tool_ca",  # a tag that never formed
                                  "Plain text with < and <tool but no call.\n"])
@pytest.mark.parametrize("step", [1, 5])
def test_auto_text_that_is_no_call_is_content(text, step):
    deltas, reason = stream("auto", text, step)
    assert joined(deltas) == (text, []) and reason == "stop"


def test_named_streams_arguments_and_none_streams_text():
    ts = ToolStream(ToolPlan([WEATHER], "named", "get_weather"))
    first = ts.first()
    assert first["content"] is None and first["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                              "arguments": ""}
    assert ts.feed('{"ci', '{"ci', False) == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}]
    assert ts.finish_reason('{"city": 1}', "stop") == "tool_calls"
    none = ToolStream(ToolPlan([WEATHER], "none"))
    assert none.feed("<tool_call>", "<tool_call>", False) == [{"content": "<tool_call>"}]
    assert none.finish_reason("x", "stop") == "stop"
