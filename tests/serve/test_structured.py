"""Structured outputs and tool calls through the server: the official client's ``chat.completions.parse`` with
a pydantic model, response_format / guided_* / structured_outputs on both endpoints, tool_choice "required"
and a named function (streamed and not), "auto" replies parsed for calls, tools and tool results rendered
by the chat template, and bad constraints refused with a 400 naming the field.

The tiny model is random: schemas bound what can repeat, and ``structured_outputs.disable_any_whitespace``
keeps it from padding the JSON with whitespace."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pydantic = pytest.importorskip("pydantic")

COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
MESSAGES = [{"role": "user", "content": "What is the weather in Elsinore?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Elsinore", "Wittenberg", "Paris"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                                       "required": ["tz"]}}}


class Ghost(pydantic.BaseModel):
    name: Literal["Hamlet", "Horatio", "Marcellus"]
    act: Annotated[int, pydantic.Field(ge=1, le=5)]
    armed: bool
    lines: Annotated[list[Literal["Who's there?", "Stand!"]], pydantic.Field(max_length=2)]


def test_parse_with_a_pydantic_model(server):
    c = server.client()
    r = c.chat.completions.parse(model=server.model, messages=MESSAGES, response_format=Ghost, max_tokens=100,
                                 temperature=1.0, seed=3, extra_body=COMPACT)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Ghost)
    assert msg.parsed == Ghost.model_validate_json(msg.content)


def test_fields_on_both_endpoints(server):
    c = server.client()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["a", "b"]}}, "required": ["n", "tag"]}
    r = c.completions.create(model=server.model, prompt="The king", max_tokens=40, extra_body={"guided_json": schema,
                             **COMPACT})
    jsonschema.validate(json.loads(r.choices[0].text), schema)
    r = c.completions.create(model=server.model, prompt="The king", max_tokens=20, n=3, seed=1,
                             extra_body={"guided_regex": r"[A-Z][a-z]{2,4} \d{2}"})
    assert all(re.fullmatch(r"[A-Z][a-z]{2,4} \d{2}", ch.text) for ch in r.choices)
    r = c.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=20,
                                  extra_body={"guided_choice": ["to be", "not to be"]})
    assert r.choices[0].message.content in ("to be", "not to be") and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=20,
                                  extra_body={"guided_grammar": 'root ::= "act " [1-5] ", scene " [1-9]'})
    assert re.fullmatch(r"act [1-5], scene [1-9]", r.choices[0].message.content)
    r = c.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=60, temperature=1.0, seed=2,
                                  response_format={"type": "json_object"}, extra_body=COMPACT)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    stream = c.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=20, stream=True,
                                       extra_body={"structured_outputs": {"choice": ["Ophelia", "Gertrude"]}})
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) in ("Ophelia", "Gertrude")


@pytest.mark.parametrize("body, param, message", [
    ({"guided_regex": "[a-"}, "guided_regex", "guided_regex: not a usable regex"),
    ({"guided_json": {"type": "wibble"}}, "guided_json", "guided_json: not a usable JSON schema: Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wibble"}}}},
     "response_format", "response_format.json_schema.schema: not a usable JSON schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type: expected"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "guided_grammar: not a usable EBNF grammar"),
    ({"guided_choice": []}, "guided_choice", "guided_choice: expected a non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one output constraint"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "tool_choice: no tool named 'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice: needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wibble"}}}],
      "tool_choice": "required"}, "tools", "tools: not a usable JSON schema"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex", "not together with"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, message):
    r = httpx.post(server.base_url + "/chat/completions", timeout=30,
                   json={"model": server.model, "messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err


def _args(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    return json.loads(call.function.arguments)


def test_tool_choice_required_and_named(server):
    c = server.client()
    kw = dict(model=server.model, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=80, temperature=1.0, seed=5,
              extra_body=COMPACT)
    r = c.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None and len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    jsonschema.validate(_args(call), schema)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(tool_choice=named, **kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(_args(ch.message.tool_calls[0]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_calls_stream_as_deltas(server, choice):
    c = server.client()
    tool_choice = "required" if choice == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=server.model, messages=MESSAGES, tools=[WEATHER], max_tokens=80, temperature=1.0, seed=7,
              tool_choice=tool_choice, extra_body=COMPACT)
    whole = c.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    content, calls, finish = _streamed(c.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content == "" and len(calls) == 1
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)  # same seed, same call


def _streamed(chunks) -> tuple[str, list[dict], str | None]:
    """(content, calls, finish_reason) of an openai client stream; asserts the OpenAI delta order: each call's
    header (id, name, empty arguments) before any of its argument fragments."""
    content, calls, finish = "", [], None
    for chunk in chunks:
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index == len(calls):
                assert tc.id.startswith("call_") and tc.function.name and tc.function.arguments == ""
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": "", "fragments": 0})
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
                calls[tc.index]["fragments"] += 1
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_auto_streams_content_then_the_call(server):
    """tool_choice "auto": the reply (forced here by guided_choice, the tiny model being random) streams its
    text as content, then the call's header, then its arguments; the whole reply parses to the same."""
    reply = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
             '</tool_call>')
    c = server.client()
    kw = dict(model=server.model, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="auto", max_tokens=200,
              extra_body={"guided_choice": [reply]})
    whole = c.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check."
    assert _args(whole.message.tool_calls[0]) == {"city": "Paris", "days": 2}
    content, calls, finish = _streamed(c.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content == "Let me check."
    assert [c_["name"] for c_ in calls] == ["get_weather"] and calls[0]["fragments"] >= 1
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}


def test_the_clients_stream_helper_reads_the_calls(server):
    """openai's ``chat.completions.stream`` accumulates the deltas into the final message (strict tools: it
    parses their arguments)."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    c = server.client()
    with c.chat.completions.stream(model=server.model, messages=MESSAGES, tools=[strict], tool_choice="required",
                                   max_tokens=80, temperature=1.0, seed=7, extra_body=COMPACT) as s:
        kinds = [e.type for e in s]
        final = s.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds and "tool_calls.function.arguments.done" in kinds
    ch = final.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(ch.message.tool_calls[0].function.parsed_arguments, WEATHER["function"]["parameters"])


def test_auto_parses_calls_and_passes_text():
    from warpforge.serve.tools import parse_auto

    names = {"get_weather"}
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    content, calls = parse_auto(text, names)
    assert content == "Let me look." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 2}
    content, calls = parse_auto('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', names)
    assert content is None and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert parse_auto('{"name": "launch", "arguments": {}}', names)[1] == []  # not a known tool: text
    assert parse_auto("To be, or not to be", names) == ("To be, or not to be", [])


HERMES = ("{{ bos_token }}{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t['function'] | tojson }}"
          "{% endfor %}</tools><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>{{ {'name': c['function']['name'], "
          "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}{% else %}{{ m['content'] }}"
          "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_template_renders_tools_calls_and_results(server):
    """Tools reach the template as ``tools``; an assistant's calls (null content) and the tool's answer are
    rendered, arguments as objects: the prompt the server ran is the template's text (usage counts it)."""
    import torch

    from tests.serve.test_app import run_app
    from warpforge.llm import AsyncLLM, EngineConfig, LLMEngine
    from warpforge.llm.loader import load
    from warpforge.serve.config import ServeConfig

    tool = {"type": "function", "function": {"name": "ask", "parameters": {"type": "object"}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "ask", "arguments": '{"q": 2}'}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    r = httpx.post(server.root + "/v1/chat/completions", timeout=30, json={
        "model": server.model, "messages": history, "tools": [tool], "max_tokens": 1})
    assert r.status_code == 200, r.text  # null content with tool_calls is taken (the default template ignores tools)

    torch.set_num_threads(1)
    parts = load(server.checkpoint, dtype=torch.float32, device="cpu")
    llm = AsyncLLM(LLMEngine(parts, EngineConfig(max_model_len=256, num_pages=128, page_size=4)))
    llm.tokenizer.chat_template = HERMES
    rendered = llm.tokenizer.apply_chat_template([history[0], {**history[1], "content": "", "tool_calls": [
        {**call, "function": {"name": "ask", "arguments": {"q": 2}}}]}, history[2]], tools=[tool])
    assert '<tool_call>{"name": "ask", "arguments": {"q": 2}}</tool_call>' in rendered
    assert '<tools>{"name": "ask", "parameters": {"type": "object"}}</tools>' in rendered and "rain" in rendered
    (r,) = run_app(llm, ServeConfig(served_model_name="tiny"), [("POST", "/v1/chat/completions", {
        "messages": history, "tools": [tool], "max_tokens": 1})])
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(rendered, add_special_tokens=False))
