"""One API request as engine work: its prompts and choices, their streams, and the OpenAI bodies they become.

A request of P prompts and n choices runs P x n engine sequences (choice index ``p * n + j``, as
OpenAI numbers them); prompt pages they share come from the prefix cache. :class:`Job` streams them
merged as server-sent events (``sse``) or waits for all of them (``collect``); leaving either early (a
client disconnect cancels the task) closes every engine stream, which aborts its request and frees
its KV pages at the next step boundary.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from warpforge.llm.outputs import RequestOutput
from warpforge.llm.sampling import SamplingParams
from warpforge.serve.protocol import APIError, usage
from warpforge.serve.tool_stream import ToolStream
from warpforge.serve.tools import ToolPlan

if TYPE_CHECKING:
    from warpforge.serve.metrics import ServerMetrics


class JobHost(Protocol):
    """What a job needs of the server that admitted it (app.ServerState, which imports this module)."""

    llm: Any  # the engine or its process's client
    tokenizer: Any
    metrics: ServerMetrics

    def token_text(self, token_id: int) -> str: ...

    def release(self, job: Job) -> None: ...

_LOGPROB_FLOOR = -9999.0  # JSON has no -inf (vLLM clamps the same way)
DONE = b"data: [DONE]\n\n"
_MARK = f"\x00{uuid.uuid4().hex}"  # stands for a chunk's text in a pre-rendered frame (never in a real body)
# What json.dumps(..., ensure_ascii=False) does, without building a JSONEncoder per call (json.dumps does for any
# non-default argument), on the SSE path of every chunk.
_json_str = json.encoder.encode_basestring  # a str -> its JSON string literal (the C version where there is one)
_json = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _random_hex() -> str:
    """128 random bits as hex, for ids that only need to be unique (uuid4 reads the OS's entropy per call:
    3% of the server's time per request in the stubbed-step profile)."""
    return f"{random.getrandbits(128):032x}"


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # as the client gave it (echo); None for token ids


@dataclass
class Choice:
    """One engine sequence of a request and what has been sent of it."""

    index: int
    prompt: Prompt
    params: SamplingParams
    rid: str
    final: RequestOutput | None = None
    sent_tokens: int = 0
    first_token_t: float | None = None
    last_t: float | None = None

    @property
    def out(self) -> RequestOutput:
        """The last output, once its stream has ended: a stream that ends without raising ends with its finished
        output (an abort's too), so every choice has one."""
        assert self.final is not None, f"{self.rid}: its stream ended without an output"
        return self.final


@dataclass
class Job:
    """A validated request ready to run. ``chat`` picks the body shapes; ``logprobs`` is the top-n count
    (None: none); ``echo`` puts the prompt in front of the text (completions)."""

    state: JobHost  # engine, tokenizer, metrics, bookkeeping
    endpoint: str
    model: str
    prompts: list[Prompt]
    choices: list[Choice]
    chat: bool
    logprobs: int | None = None
    echo: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # every chunk carries the usage so far (vLLM's continuous_usage_stats)
    tools: ToolPlan | None = None  # chat with tools: replies may be tool calls (serve/tools.py)
    constraint: tuple | None = None  # (StructuredOutputsParams, the field that asked): compiled before admission
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.perf_counter)
    recorded: bool = field(default=False, init=False)  # outcome counted, sequences released
    gone: bool = field(default=False, init=False)  # the client disconnected: the sequences were aborted

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{_random_hex()}"

    @classmethod
    def build(cls, state, endpoint: str, model: str, prompts: list[Prompt], n: int, params: dict, *, chat: bool,
              **kw) -> Job:
        """P prompts x n choices; with a seed, choice j samples with seed + j (else all n would be equal)."""
        job = cls(state, endpoint, model, prompts, [], chat, **kw)
        seed = params.get("seed")
        for p_i, prompt in enumerate(prompts):
            for j in range(n):
                p = SamplingParams(**{**params, "seed": None if seed is None else seed + j})
                job.choices.append(Choice(p_i * n + j, prompt, p, f"{job.id}-{p_i}-{j}"))
        return job

    # ---- running ---------------------------------------------------------------------------------

    def _streams(self) -> list[AsyncGenerator[RequestOutput, None]]:
        llm = self.state.llm
        return [llm.generate(c.prompt.ids, c.params, request_id=c.rid) for c in self.choices]

    def _observe(self, c: Choice, out: RequestOutput) -> None:
        t = time.perf_counter()
        if out.delta_token_ids:
            m = self.state.metrics
            gap = None
            if c.first_token_t is None:
                c.first_token_t = t
                m.prompt_tokens.inc(len(c.prompt.ids))
            elif c.last_t is not None:
                gap = t - c.last_t
            m.chunk(len(out.delta_token_ids), gap)
            c.last_t = t
        c.final = out

    def disconnect(self) -> None:
        """The client left mid-stream: abort every sequence (each stream then ends at the engine's next step
        boundary, and ``sse`` with it); the outcome is counted as a disconnect."""
        self.gone = True
        for c in self.choices:
            self.state.llm.abort(c.rid)

    def abandon(self) -> None:
        """The response ended without the job running to its end (or never starting): count it as a
        disconnect. A no-op after ``sse``/``collect`` recorded their outcome."""
        self._record("disconnected")

    def _record(self, outcome: str) -> None:
        """Metrics of the finished request (once); its sequences leave the admission count."""
        if self.recorded:
            return
        self.recorded = True
        m = self.state.metrics
        m.requests.labels(self.endpoint, outcome).inc()
        if outcome == "ok":
            t = time.perf_counter()
            firsts = [c.first_token_t for c in self.choices if c.first_token_t is not None]
            if firsts:
                m.ttft.observe(min(firsts) - self.arrival)
            m.e2e.observe(t - self.arrival)
            for p in self.prompts:
                m.prompt_len.observe(len(p.ids))
            for c in self.choices:
                n_out = len(c.final.token_ids) if c.final is not None else 0
                m.output_len.observe(n_out)
                if n_out > 1 and c.first_token_t is not None and c.last_t is not None:
                    m.tpot.observe((c.last_t - c.first_token_t) / (n_out - 1))
        self.state.release(self)

    def _usage(self) -> dict:
        completion = sum(len(c.final.token_ids) for c in self.choices if c.final is not None)
        return usage(sum(len(p.ids) for p in self.prompts), completion)

    async def sse(self) -> AsyncIterator[bytes]:
        """The response as server-sent events, ending in ``data: [DONE]``."""
        outcome = "disconnected"
        tool_streams = {c.index: ToolStream(self.tools) for c in self.choices} if self.tools is not None else {}
        # Plain text chunks (the bulk of a stream) are a frame rendered once per choice with the text's JSON
        # in the middle; chunks that carry more (logprobs, tool calls, a finish reason) are built whole.
        frames = ({c.index: self._frame(c) for c in self.choices}
                  if not tool_streams and self.logprobs is None and not self.continuous_usage else None)
        live, tail = len(self.choices), b""
        try:
            for c in self.choices:  # the role (chat) or the echoed prompt first: headers go out now
                if self.chat:
                    first = tool_streams[c.index].first() if tool_streams else {"role": "assistant", "content": ""}
                    yield self._event(self._chunk(c, first, None, None))
                elif self.echo:
                    yield self._event(self._chunk(c, self._prompt_text(c), None, None))
            async for i, out in _merge(self._streams()):
                c = self.choices[i]
                self._observe(c, out)
                if not out.delta_text and not out.finished:
                    continue  # no text yet (a stop string forming, a partial UTF-8 char): tokens ride the next chunk
                if frames is not None and not out.finished:
                    head, tail = frames[i]
                    yield head + _json_str(out.delta_text).encode() + tail
                    continue
                text, reason = out.delta_text, out.finish_reason
                deltas: Sequence[dict | str] = [{"content": text} if self.chat else text]
                if tool_streams:
                    ts = tool_streams[c.index]
                    deltas = ts.feed(out.text, text, out.finished)
                    if out.finished:
                        reason = ts.finish_reason(out.text, reason)
                        deltas = deltas or [{}]
                    if not deltas:
                        continue  # held back (a tag may be forming): its tokens' logprobs ride the next chunk
                lps = self._logprobs(c, out, c.sent_tokens)
                c.sent_tokens = len(out.token_ids)
                last = len(deltas) - 1
                event = b"".join(self._event(self._chunk(c, d, reason if k == last else None, lps if k == 0 else None))
                                 for k, d in enumerate(deltas))
                if out.finished:
                    live -= 1
                    if not live:  # the last chunk goes out with the usage and [DONE], in one write
                        tail = event
                        continue
                yield event
            if self.include_usage:
                tail += self._event({"id": self.id, "object": self._object(True), "created": self.created,
                                     "model": self.model, "choices": [], "usage": self._usage()})
            outcome = ("disconnected" if self.gone else
                       "aborted" if any(c.out.finish_reason == "abort" for c in self.choices) else "ok")
        except ValueError as e:  # the scheduler refused a sequence (checked before anything ran)
            outcome = "bad_request"
            tail += self._event(APIError(400, str(e)).body())
        except RuntimeError as e:  # the engine failed: /health says so from now on
            outcome = "error"
            tail += self._event(APIError(500, str(e), code="engine_failed").body())
        finally:
            self._record(outcome)
        yield tail + DONE

    async def collect(self) -> dict:
        """The whole response body once every choice finished."""
        outcome = "disconnected"
        try:
            async for i, out in _merge(self._streams()):
                self._observe(self.choices[i], out)
            if any(c.out.finish_reason == "abort" for c in self.choices):
                outcome = "aborted"
                raise APIError(503, "the server is shutting down: request aborted", code="shutting_down")
            outcome = "ok"
            return {"id": self.id, "object": self._object(False), "created": self.created, "model": self.model,
                    "choices": [self._full_choice(c) for c in self.choices], "usage": self._usage()}
        except ValueError as e:
            outcome = "bad_request"
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            outcome = "error"
            raise APIError(500, str(e), code="engine_failed") from None
        finally:
            self._record(outcome)

    # ---- bodies ----------------------------------------------------------------------------------

    def _object(self, chunk: bool) -> str:
        if self.chat:
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def _prompt_text(self, c: Choice) -> str:
        p = c.prompt
        return p.text if p.text is not None else self.state.tokenizer.decode(p.ids)

    def _chunk(self, c: Choice, delta, finish_reason: str | None, logprobs) -> dict:
        choice = {"index": c.index, ("delta" if self.chat else "text"): delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        body = {"id": self.id, "object": self._object(True), "created": self.created, "model": self.model,
                "choices": [choice]}
        if self.continuous_usage:
            body["usage"] = self._usage()
        elif self.include_usage:
            body["usage"] = None  # as OpenAI: only the last chunk carries usage
        return body

    def _full_choice(self, c: Choice) -> dict:
        out = c.out
        lps = self._logprobs(c, out, 0)
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": out.text}
            reason = out.finish_reason
            if self.tools is not None and out.finish_reason == "stop":
                content, calls = self.tools.calls(out.text)
                if calls:
                    message = {"role": "assistant", "content": content, "tool_calls": [t.body() for t in calls]}
                    reason = "tool_calls"
            return {"index": c.index, "message": message, "logprobs": lps, "finish_reason": reason}
        text = (self._prompt_text(c) + out.text) if self.echo else out.text
        return {"index": c.index, "text": text, "logprobs": lps, "finish_reason": out.finish_reason}

    def _frame(self, c: Choice) -> tuple[bytes, bytes]:
        """The SSE bytes of a plain text chunk of ``c``, before and after the text's JSON string."""
        body = self._event(self._chunk(c, {"content": _MARK} if self.chat else _MARK, None, None))
        head, tail = body.split(_json_str(_MARK).encode())
        return head, tail

    @staticmethod
    def _event(body: dict) -> bytes:
        return b"data: " + _json(body).encode() + b"\n\n"

    def _logprobs(self, c: Choice, out: RequestOutput, start: int) -> dict | None:
        """Logprobs of output tokens [start:] in the endpoint's shape (None when not asked)."""
        if self.logprobs is None or out.logprobs is None:
            return None
        ids, lps = out.token_ids[start:], out.logprobs[start:len(out.token_ids)]
        tok = self.state.token_text
        n = self.logprobs
        if self.chat:
            content = []
            for t, d in zip(ids, lps):
                s = tok(t)
                top = sorted(d.items(), key=lambda kv: -kv[1])[:n]
                content.append({"token": s, "logprob": max(d.get(t, _LOGPROB_FLOOR), _LOGPROB_FLOOR),
                                "bytes": list(s.encode()),
                                "top_logprobs": [{"token": tok(i), "logprob": max(v, _LOGPROB_FLOOR),
                                                  "bytes": list(tok(i).encode())} for i, v in top]})
            return {"content": content}
        offset = sum(len(tok(t)) for t in out.token_ids[:start])
        if self.echo:
            offset += len(self._prompt_text(c))
        tokens, token_lps, tops, offsets = [], [], [], []
        for t, d in zip(ids, lps):
            s = tok(t)
            tokens.append(s)
            token_lps.append(max(d.get(t, _LOGPROB_FLOOR), _LOGPROB_FLOOR))
            tops.append({tok(i): max(v, _LOGPROB_FLOOR) for i, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def _merge(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every stream as they come. Every stream is closed on the way out,
    however it is left (a closed stream aborts its unfinished request)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as s:
            async for out in s:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async with aclosing(stream) as s:
                async for out in s:
                    queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader, who raises it
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
