"""Every bad-request class gets its documented status and OpenAI's error body; none disturbs a
request running next to it."""

from __future__ import annotations

import threading

import httpx
import pytest

from warpforge.llm.sampling import SamplingParams


def post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(server.base_url + path, timeout=30, **kw)


def check_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None,
                says: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert err["param"] == param and (code is None or err["code"] == code), err
    if says is not None:
        assert says in err["message"], err
    return err


def completion(server, **fields) -> dict:
    return {"model": server.model, "prompt": "To be", "max_tokens": 4, **fields}


def test_malformed_json_and_non_objects(server):
    check_error(post(server, "/completions", content=b'{"model": "x", "prompt": '), 400, code="invalid_json",
                says="malformed JSON")
    check_error(post(server, "/completions", content=b"[1, 2]"), 400, code="invalid_json", says="JSON object")
    check_error(post(server, "/chat/completions", content=b"\xff\xfe"), 400, code="invalid_json")


def test_body_over_the_limit_is_413(server):
    big = completion(server, prompt="x" * (5 << 20))
    check_error(post(server, "/completions", json=big), 413, code="request_too_large", says="bytes")

    def chunks():  # no Content-Length: counted while read
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"y" * (64 << 10)
        yield b'"}'

    check_error(post(server, "/completions", content=chunks()), 413, code="request_too_large")


def test_unknown_model_is_404(server):
    check_error(post(server, "/completions", json=completion(server, model="gpt-9")), 404, "model",
                "model_not_found", "gpt-9")
    body = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    check_error(post(server, "/chat/completions", json=body), 404, "model", "model_not_found")


def test_unknown_route_and_method(server):
    check_error(httpx.get(server.root + "/v1/nothing", timeout=10), 404, code="not_found")
    check_error(httpx.get(server.base_url + "/completions", timeout=10), 405)


def test_prompt_longer_than_the_context(server):
    long_ids = [5] * 300  # the server's max_model_len is 256
    check_error(post(server, "/completions", json=completion(server, prompt=long_ids)), 400, "prompt",
                "context_length_exceeded", "256")
    check_error(post(server, "/completions", json=completion(server, prompt=[5] * 256)), 400, "prompt",
                "context_length_exceeded")
    check_error(post(server, "/completions", json=completion(server, prompt=[5] * 200, max_tokens=100)), 400,
                "max_tokens", "context_length_exceeded")
    chat = {"model": server.model, "messages": [{"role": "user", "content": "word " * 400}]}
    check_error(post(server, "/chat/completions", json=chat), 400, "messages", "context_length_exceeded")
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}
    check_error(post(server, "/chat/completions", json=chat), 400, "max_completion_tokens", "context_length_exceeded")


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
                                         ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
                                         ("repetition_penalty", 0.0), ("max_tokens", 0), ("logprobs", 50),
                                         ("seed", -1), ("stop", [""])])
def test_invalid_values_reuse_sampling_params_messages(server, field, value):
    with pytest.raises(ValueError) as want:
        SamplingParams(**{field: value})
    err = check_error(post(server, "/completions", json=completion(server, **{field: value})), 400, field)
    assert err["message"] == str(want.value)


def test_wrong_types_and_missing_fields_name_the_field(server):
    check_error(post(server, "/completions", json=completion(server, temperature="hot")), 400, "temperature",
                says="temperature")
    check_error(post(server, "/completions", json={"model": server.model}), 400, "prompt", says="prompt")
    check_error(post(server, "/completions", json=completion(server, n=0)), 400, "n")
    check_error(post(server, "/completions", json=completion(server, prompt=[])), 400, "prompt")
    check_error(post(server, "/completions", json=completion(server, prompt="")), 400, "prompt")
    check_error(post(server, "/completions", json=completion(server, prompt=[1, 99999])), 400, "prompt",
                says="token ids")
    check_error(post(server, "/completions", json=completion(server, stream_options={"include_usage": True})), 400,
                "stream_options")
    check_error(post(server, "/completions", json=completion(server, echo=True, logprobs=1)), 400, "echo")
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}]}
    check_error(post(server, "/chat/completions", json={**chat, "top_logprobs": 2}), 400, "top_logprobs")
    check_error(post(server, "/chat/completions", json={**chat, "messages": []}), 400, "messages")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    check_error(post(server, "/chat/completions", json={**chat, "messages": image}), 400, "messages",
                says="only text parts")
    check_error(post(server, "/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 21}), 400,
                "top_logprobs")


@pytest.mark.parametrize("field,value", [("max_tokens", True), ("max_tokens", 2.0), ("n", True), ("seed", 1.5),
                                         ("temperature", True), ("stream", "yes"), ("ignore_eos", 1),
                                         ("stop_token_ids", [2, True]), ("logprobs", False)])
def test_json_types_are_not_coerced(server, field, value):
    """true is not 1, 2.0 is not 2, "yes" is not true: a 400 naming the field, as the docs say."""
    err = check_error(post(server, "/completions", json=completion(server, **{field: value})), 400, field)
    shown = value if not isinstance(value, list) else value[1]
    assert err["message"].startswith(field) and repr(shown) in err["message"]


def test_null_message_content_is_refused(server):
    chat = {"model": server.model, "max_tokens": 2}
    for messages in ([{"role": "user", "content": None}], [{"role": "user"}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]):
        check_error(post(server, "/chat/completions", json={**chat, "messages": messages}), 400, "messages",
                    says="content")
    # OpenAI allows null content beside tool_calls (tests/serve/test_structured.py); the legacy function_call is
    # refused by name
    calls = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    assert post(server, "/chat/completions", json={**chat, "messages": calls}).status_code == 200
    legacy = [calls[0], {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]
    check_error(post(server, "/chat/completions", json={**chat, "messages": legacy}), 400, "messages",
                "unsupported_field", "function_call")
    check_error(post(server, "/chat/completions", json={**chat, "max_tokens": True,
                                                        "messages": [{"role": "user", "content": "hi"}]}),
                400, "max_tokens")


@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("logit_bias", {"50": 10}),
    ("best_of", 3),
])
def test_unsupported_fields_are_refused_by_name(server, field, value):
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    check_error(post(server, "/chat/completions", json=chat), 400, field, "unsupported_field", field)


def test_unknown_and_harmless_fields_are_ignored(server):
    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "text"}, "tool_choice": "none", "user": "u1", "metadata": {"a": "b"},
            "some_future_field": 1}
    r = post(server, "/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_the_openai_client_raises_its_typed_errors(server):
    import openai

    c = server.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="other", prompt="x", max_tokens=2)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}],
                                  tools=[{"type": "function", "function": {"description": "no name"}}])
    assert e.value.param == "tools"


def test_bad_requests_do_not_disturb_a_running_stream(server):
    """A long stream runs while every class of bad request hits the server; it finishes whole."""
    c = server.client()
    result = {}

    def long_stream():
        chunks = list(c.completions.create(model=server.model, prompt="To be, or not", max_tokens=150, stream=True,
                                           temperature=0.0, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True}))
        result["finish"] = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
        result["usage"] = chunks[-1].usage

    t = threading.Thread(target=long_stream)
    t.start()
    bad = [dict(content=b"{oops"), dict(json=completion(server, temperature=-3)),
           dict(json=completion(server, model="x")), dict(json=completion(server, prompt=[5] * 300)),
           dict(json=completion(server, tools=[{"type": "function"}])), dict(json=completion(server, n="many"))]
    for _ in range(3):
        for kw in bad:
            assert post(server, "/completions", **kw).status_code in (400, 404)
    t.join(60)
    assert not t.is_alive()
    assert result["finish"][-1] == "length" and result["usage"].completion_tokens == 150
    assert httpx.get(server.root + "/health", timeout=10).status_code == 200
