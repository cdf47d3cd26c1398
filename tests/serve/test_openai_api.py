"""The API as the official `openai` client sees it, against a real server process: completions and chat,
streamed and not, usage equal to the tokenizer's counts, stop strings, seeds, n > 1, logprobs, echo,
and greedy text identical to offline ``LLM.generate`` (the server adds nothing to the tokens)."""

from __future__ import annotations

import functools

import httpx
import pytest

from tests.serve.conftest import MAX_MODEL_LEN

PROMPTS = ["Who's there? Nay, answer me", "To be, or not to be, that is the question", "The king"]
GREEDY = {"temperature": 0.0}
ECHO_FREE = {"extra_body": {"ignore_eos": True}}


@functools.cache
def _tokenizer(path):
    from warpforge.llm.tokenizer import Tokenizer

    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def tok(server):
    return _tokenizer(server.checkpoint)


def stream_text(chunks, chat: bool) -> tuple[dict[int, str], dict[int, str], list]:
    """(text per choice, finish_reason per choice, chunks) of a streamed response."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    chunks = list(chunks)
    for ch in chunks:
        for c in ch.choices:
            piece = (c.delta.content if chat else c.text) or ""
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                assert c.index not in finish, "a choice finished twice"
                finish[c.index] = c.finish_reason
    return texts, finish, chunks


def test_models_lists_the_served_name(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [server.model] and models[0].owned_by == "warpforge"
    # root is the served name: the checkpoint's path on the server's disk is nobody's business
    assert models[0].root == server.model and str(server.checkpoint) not in str(models[0].model_dump())


def test_models_retrieve_by_id(server):
    import openai

    c = server.client()
    m = c.models.retrieve(server.model)
    assert m.id == server.model and m.object == "model" and m.model_dump() == c.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-9")
    assert e.value.code == "model_not_found" and e.value.param == "model" and "gpt-9" in e.value.message
    r = httpx.get(server.base_url + "/models/org/some-model", timeout=10)  # an id with a slash
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenize_detokenize_and_version_as_vllm(server, tok):
    post = functools.partial(httpx.post, timeout=10)
    r = post(server.root + "/tokenize", json={"model": server.model, "prompt": PROMPTS[1]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(PROMPTS[1]) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN and body["token_strs"] is None
    plain = post(server.root + "/tokenize", json={"prompt": PROMPTS[1], "add_special_tokens": False,
                                                  "return_token_strs": True}).json()
    assert plain["tokens"] == tok.encode(PROMPTS[1], add_special_tokens=False)
    assert "".join(plain["token_strs"]) == tok.decode(plain["tokens"])
    # messages: the ids /v1/chat/completions runs, which its usage counts
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = post(server.root + "/tokenize", json={"messages": messages}).json()
    usage = server.client().chat.completions.create(model=server.model, messages=messages, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens
    text = post(server.root + "/detokenize", json={"model": server.model, "tokens": plain["tokens"]}).json()
    assert text == {"prompt": PROMPTS[1]}
    for path, bad, param in [("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                             ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                             ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
                             ("/detokenize", {"tokens": [1, True]}, "tokens")]:
        r = post(server.root + path, json=bad)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, bad, r.text)
    from warpforge import __version__

    assert httpx.get(server.root + "/version", timeout=10).json() == {"version": __version__}


def test_completion_usage_matches_the_tokenizer(server, tok):
    c = server.client()
    r = c.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=7, **GREEDY, **ECHO_FREE)
    assert r.object == "text_completion" and r.model == server.model and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert r.usage.prompt_tokens == len(tok.encode(PROMPTS[1]))
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7
    # token-id prompts are taken as they are
    ids = tok.encode(PROMPTS[0])
    r2 = c.completions.create(model=server.model, prompt=ids, max_tokens=3, **GREEDY)
    assert r2.usage.prompt_tokens == len(ids)


def test_chat_usage_matches_the_chat_template(server, tok):
    messages = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": PROMPTS[0]}]
    r = server.client().chat.completions.create(model=server.model, messages=messages, max_tokens=6, **GREEDY,
                                                **ECHO_FREE)
    (choice,) = r.choices
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and isinstance(choice.message.content, str)
    assert r.usage.prompt_tokens == len(tok.encode_chat(messages)) and r.usage.completion_tokens == 6
    # content as a list of text parts means the same conversation
    parts = [{"role": "user", "content": [{"type": "text", "text": "Who's there? "}, {"type": "text",
                                                                                        "text": "Nay, answer me"}]}]
    r2 = server.client().chat.completions.create(model=server.model, messages=parts, max_tokens=6, **GREEDY,
                                                 **ECHO_FREE)
    r3 = server.client().chat.completions.create(model=server.model, messages=messages[1:], max_tokens=6, **GREEDY,
                                                 **ECHO_FREE)
    assert r2.choices[0].message.content == r3.choices[0].message.content


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_equals_the_whole_response(server, chat):
    c = server.client()
    kw = dict(model=server.model, max_tokens=12, **GREEDY, **ECHO_FREE)
    if chat:
        msgs = [{"role": "user", "content": PROMPTS[2]}]
        whole = c.chat.completions.create(messages=msgs, **kw)
        stream = c.chat.completions.create(messages=msgs, stream=True, stream_options={"include_usage": True}, **kw)
    else:
        whole = c.completions.create(prompt=PROMPTS[2], **kw)
        stream = c.completions.create(prompt=PROMPTS[2], stream=True, stream_options={"include_usage": True}, **kw)
    texts, finish, chunks = stream_text(stream, chat)
    want = whole.choices[0].message.content if chat else whole.choices[0].text
    assert texts == {0: want} and finish == {0: "length"}
    assert len(chunks) > 3  # token by token, not one blob
    if chat:
        assert chunks[0].choices[0].delta.role == "assistant"
    # include_usage: one last chunk with no choices and the counts; none before it
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_stream_ends_with_done(server):
    import httpx

    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_stop_strings_cut_the_text(server):
    c = server.client()
    kw = dict(model=server.model, prompt=PROMPTS[1], max_tokens=30, **GREEDY, **ECHO_FREE)
    text = c.completions.create(**kw).choices[0].text
    start = next(i for i in range(3, len(text) - 3) if text[i:i + 3].strip() and text.find(text[i:i + 3]) == i)
    stop = text[start:start + 3]
    r = c.completions.create(stop=[stop, "never-appears"], **kw)
    assert r.choices[0].text == text[:start] and r.choices[0].finish_reason == "stop"
    texts, finish, _ = stream_text(c.completions.create(stop=stop, stream=True, **kw), chat=False)
    assert texts == {0: text[:start]} and finish == {0: "stop"}


def test_seed_repeats_and_n_choices_differ(server):
    c = server.client()
    kw = dict(model=server.model, prompt=PROMPTS[0], max_tokens=16, temperature=1.0, **ECHO_FREE)
    a = c.completions.create(seed=7, **kw).choices[0].text
    assert c.completions.create(seed=7, **kw).choices[0].text == a
    assert c.completions.create(seed=8, **kw).choices[0].text != a
    r = c.completions.create(seed=7, n=3, **kw)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    texts = [ch.text for ch in r.choices]
    assert texts[0] == a and len(set(texts)) == 3  # choice j samples with seed + j
    assert r.usage.completion_tokens == 3 * 16
    assert r.usage.prompt_tokens == c.completions.create(seed=7, **kw).usage.prompt_tokens  # the prompt counts once


def test_n_choices_stream_and_several_prompts(server):
    c = server.client()
    stream = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": PROMPTS[0]}], n=2,
                                       max_tokens=5, seed=1, stream=True, **ECHO_FREE)
    texts, finish, _ = stream_text(stream, chat=True)
    assert set(texts) == {0, 1} and finish == {0: "length", 1: "length"}
    r = c.completions.create(model=server.model, prompt=PROMPTS, n=2, max_tokens=4, **GREEDY, **ECHO_FREE)
    assert [ch.index for ch in r.choices] == list(range(6))
    assert r.choices[0].text == r.choices[1].text  # greedy: both choices of a prompt agree


def test_completion_logprobs(server):
    r = server.client().completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=6, logprobs=3,
                                           **GREEDY, **ECHO_FREE)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and all(v <= 0 for v in top.values())
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the chosen token is the top one


def test_chat_logprobs_streamed_and_whole(server):
    c = server.client()
    kw = dict(model=server.model, messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=5, logprobs=True,
              top_logprobs=2, **GREEDY, **ECHO_FREE)
    whole = c.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == 5
    for t in whole:
        assert len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)
        assert t.bytes == list(t.token.encode())
    streamed = [t for ch in c.chat.completions.create(stream=True, **kw) for choice in ch.choices
                if choice.logprobs is not None for t in choice.logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in whole]


def test_echo_puts_the_prompt_first(server):
    c = server.client()
    kw = dict(model=server.model, prompt=PROMPTS[0], max_tokens=4, **GREEDY, **ECHO_FREE)
    plain = c.completions.create(**kw).choices[0].text
    assert c.completions.create(echo=True, **kw).choices[0].text == PROMPTS[0] + plain
    texts, _, _ = stream_text(c.completions.create(echo=True, stream=True, **kw), chat=False)
    assert texts == {0: PROMPTS[0] + plain}


def test_vllm_sampling_extensions_are_honoured(server):
    c = server.client()
    kw = dict(model=server.model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, seed=3)
    # top_k = 1 is greedy whatever the temperature
    greedy = c.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=8, **GREEDY,
                                  **ECHO_FREE).choices[0].text
    r = c.completions.create(extra_body={"top_k": 1, "ignore_eos": True}, **kw)
    assert r.choices[0].text == greedy
    r = c.completions.create(extra_body={"min_p": 1.0, "ignore_eos": True}, **kw)
    assert r.choices[0].text == greedy  # min_p = 1 keeps only the most likely token
    r = c.completions.create(extra_body={"repetition_penalty": 1.3, "ignore_eos": True}, **kw)
    assert r.usage.completion_tokens == 8


def test_greedy_text_equals_offline_generate(server):
    """The server adds nothing to the tokens: the same prompts through LLM.generate give the same text."""
    import torch

    from warpforge.llm import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(str(server.checkpoint), max_model_len=256)
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    r = server.client().completions.create(model=server.model, prompt=PROMPTS, max_tokens=24, **GREEDY, **ECHO_FREE)
    assert [c.text for c in r.choices] == [o.text for o in offline]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in offline)
    chat = llm.chat([{"role": "user", "content": PROMPTS[0]}], SamplingParams(temperature=0.0, max_tokens=16,
                                                                              ignore_eos=True))[0]
    r = server.client().chat.completions.create(model=server.model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                max_tokens=16, **GREEDY, **ECHO_FREE)
    assert r.choices[0].message.content == chat.text


def test_continuous_usage_stats_count_up_in_every_chunk(server):
    """vLLM's stream_options.continuous_usage_stats (guidellm asks for it): the usage so far in each chunk."""
    chunks = list(server.client().completions.create(
        model=server.model, prompt=PROMPTS[0], max_tokens=6, stream=True, **GREEDY, **ECHO_FREE,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and len(set(counts)) > 2
    assert len({ch.usage.prompt_tokens for ch in chunks}) == 1
