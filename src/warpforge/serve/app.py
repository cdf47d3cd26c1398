"""The OpenAI-compatible HTTP API over one AsyncLLM: ``create_app(llm, config) -> FastAPI``.

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, GET /health,
GET /metrics, and vLLM's POST /tokenize, POST /detokenize, GET /version.
Every error is OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``). A request is
checked whole (body size, JSON, fields, model, prompt length, sampling values) before it is
admitted; admission bounds the sequences in the server (``ServeConfig.max_in_flight``: beyond, 429
with Retry-After), so a burst costs memory for at most that many. A client that disconnects has its
sequences aborted (streams: Starlette cancels the response; non-streamed: a watcher on the ASGI
receive channel).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hmac
import json
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from warpforge.serve.config import ServeConfig
from warpforge.serve.engine_client import as_engine
from warpforge.serve.metrics import CONTENT_TYPE, ServerMetrics
from warpforge.serve.protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                      bad_request, chat_messages, check_n, parse, sampling_kwargs, structured_outputs)
from warpforge.serve.serving import DONE, Job, Prompt
from warpforge.serve.tools import ToolPlan, tool_plan

RETRY_AFTER_S = 1  # what a 429 tells the client to wait: about one batch's worth of decode steps
GRAMMAR_CACHE = 1024  # output constraints whose compile outcome is remembered (least recently used go first)
WORKER_THREADS = 4  # grammar compiles and long tokenizations at once, off the event loop
# Texts at least this long are tokenized on a worker thread: `tokenizers`' encode holds the GIL (a long text
# stalls every stream), its batch call does not; a few words are cheaper inline than handed off
# (notes/serve.md has the figures).
INLINE_TEXT = 256
_OUTCOMES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "not_found", 413: "too_large",
             429: "rejected", 500: "error", 503: "error"}


class ServerState:
    """What the handlers share: the engine, the settings, the metrics, the admitted requests."""

    def __init__(self, llm, config: ServeConfig):
        self.llm, self.config = as_engine(llm), config
        llm = self.llm
        self.tokenizer = llm.tokenizer
        if config.chat_template is not None:  # the server's own copy: the engine's tokenizer stays as loaded
            self.tokenizer = self.tokenizer.with_chat_template(config.chat_template)
        self.metrics = ServerMetrics(llm, config.model_name)
        self.max_model_len: int = llm.max_model_len
        self.vocab_size: int = llm.vocab_size
        self.jobs: dict[str, Job] = {}
        self.num_seqs = 0  # sequences of the admitted jobs
        self.draining = False
        self.started = int(time.time())
        self._token_text: dict[int, str] = {}
        # constraint key -> None (compiles) or its error; compiles in flight, shared by requests that ask alike
        self._grammar_seen: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._grammar_running: dict[str, asyncio.Future] = {}
        self._workers: ThreadPoolExecutor | None = None

    def token_text(self, token_id: int) -> str:
        s = self._token_text.get(token_id)
        if s is None:
            s = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    # ---- admission -------------------------------------------------------------------------------

    def check_available(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.llm.error is not None:
            raise APIError(503, f"the engine failed and stopped: {self.llm.error}", code="engine_failed")

    def admit(self, job: Job) -> None:
        self.check_available()
        k, cap = len(job.choices), self.config.max_in_flight
        if k > cap:
            raise bad_request(f"n x prompts: {k} sequences exceed what this server admits at once ({cap}: "
                              f"--max-num-seqs + --max-queue)", param="n")
        if self.num_seqs + k > cap:
            raise APIError(429, f"the server is at capacity ({self.num_seqs} sequences running or waiting, limit "
                           f"{cap}); retry after {RETRY_AFTER_S} s", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.num_seqs += k
        self.jobs[job.id] = job

    def release(self, job: Job) -> None:
        if self.jobs.pop(job.id, None) is not None:
            self.num_seqs -= len(job.choices)

    def abort_all(self) -> None:
        for job in list(self.jobs.values()):
            for c in job.choices:
                self.llm.abort(c.rid)

    async def drain(self, grace_s: float, flush_s: float = 5.0) -> None:
        """Refuse new work (503, /health too); let admitted requests run up to ``grace_s``, then abort the
        rest (their streams end with finish_reason "abort" and ``[DONE]``) and give their last chunks up
        to ``flush_s`` to go out."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.abort_all()
        deadline = time.monotonic() + flush_s
        while self.jobs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # ---- request checks --------------------------------------------------------------------------

    async def check_constraint(self, so, field: str) -> None:
        """Compile ``so`` on a worker thread (a large schema takes seconds; the event loop, and with it every
        other stream, goes on meanwhile): a bad schema, regex or grammar is a 400 naming ``field``. The
        outcome is remembered for the last GRAMMAR_CACHE constraints."""
        key = json.dumps(dataclasses.asdict(so), sort_keys=True, default=str)
        if key in self._grammar_seen:
            self._grammar_seen.move_to_end(key)
            err = self._grammar_seen[key]
        else:
            fut = self._grammar_running.get(key)
            if fut is None:
                fut = asyncio.get_running_loop().run_in_executor(self.workers, _compile_error, self.llm.grammars, so)
                self._grammar_running[key] = fut
                fut.add_done_callback(lambda f: self._grammar_done(key, f))
            err = await asyncio.shield(fut)
        if err is not None:
            msg = err if field == "structured_outputs" else re.sub(r"^structured_outputs(\.\w+)?", field, err)
            raise bad_request(msg, param=field.split(".")[0].split("[")[0])

    def _grammar_done(self, key: str, fut: asyncio.Future) -> None:
        self._grammar_running.pop(key, None)
        if not fut.cancelled() and fut.exception() is None:
            self._grammar_seen[key] = fut.result()
            while len(self._grammar_seen) > GRAMMAR_CACHE:
                self._grammar_seen.popitem(last=False)

    @property
    def workers(self) -> ThreadPoolExecutor:
        if self._workers is None:
            self._workers = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="warpforge-serve")
        return self._workers

    def close(self) -> None:
        if self._workers is not None:
            self._workers.shutdown(wait=False, cancel_futures=True)

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, on a worker thread unless it is short (see INLINE_TEXT)."""
        if len(text) < INLINE_TEXT:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        backend = self.tokenizer.backend
        (enc,) = await asyncio.get_running_loop().run_in_executor(
            self.workers, functools.partial(backend.encode_batch, [text], add_special_tokens=add_special_tokens))
        return enc.ids

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.model_name:
            raise APIError(404, f"model: {model!r} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")

    def check_length(self, ids: list[int], param: str) -> None:
        if len(ids) + 1 > self.max_model_len:
            raise bad_request(f"{param}: {len(ids)} tokens leave no room for a new token within the model's "
                              f"context of {self.max_model_len} tokens", param=param, code="context_length_exceeded")

    def max_tokens(self, prompts: list[Prompt], asked, param: str, default: int | None) -> int:
        """``asked`` checked against the room each prompt leaves; None: ``default`` (None: all the room)."""
        room = self.max_model_len - max(len(p.ids) for p in prompts)
        if asked is None:
            return room if default is None else min(default, room)
        if isinstance(asked, int) and asked >= 1 and asked > room:
            raise bad_request(f"{param}: {asked} new tokens after a prompt of {self.max_model_len - room} tokens "
                              f"exceed the model's context of {self.max_model_len} tokens", param=param,
                              code="context_length_exceeded")
        return asked

    async def completion_prompts(self, prompt) -> list[Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt: expected a text, a list of texts, or token ids; got an empty list",
                              param="prompt")
        if all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise bad_request("prompt: expected a non-empty text, got ''", param="prompt")
                out.append(Prompt(await self.encode(p), p))
            else:
                bad = [t for t in p if not 0 <= t < self.vocab_size]
                if bad or not p:
                    raise bad_request(f"prompt: token ids must be in [0, {self.vocab_size}), got "
                                      f"{bad[:4] if bad else 'an empty list'}", param="prompt")
                out.append(Prompt(list(p), None))
            self.check_length(out[-1].ids, "prompt")
        return out


def _sampling(kw: dict, names: dict[str, str]) -> dict:
    """Check ``kw`` as SamplingParams does; its message names the field (renamed to the API's name)."""
    from warpforge._validate import FieldError
    from warpforge.llm.sampling import SamplingParams

    try:
        SamplingParams(**kw)
    except FieldError as e:
        param = names.get(e.field, e.field)
        raise bad_request(f"{param}: {e.problem}", param=param) from None
    except ValueError as e:
        raise bad_request(str(e)) from None
    return kw


def _compile_error(grammars, so) -> str | None:
    """None when ``so`` compiles, else why not (a worker thread runs this)."""
    try:
        grammars.compile(so)
    except ValueError as e:
        return str(e)
    return None


def _structured(state: ServerState, req, params: dict,
                tools: ToolPlan | None = None) -> tuple[dict, tuple | None]:
    """``params`` with the body's output constraint (or the one tool_choice forces), and (constraint, the
    field that asked for it) for ``ServerState.check_constraint`` to compile before the request is admitted,
    so that a bad schema, regex or grammar is a 400 naming its field."""
    so, field = structured_outputs(req)
    compact = bool((req.structured_outputs or {}).get("disable_any_whitespace", False))
    forced = tools.constraint(compact) if tools is not None else None
    if tools is not None and forced is not None:
        if so is not None:
            assert field is not None  # structured_outputs names the field of every constraint it returns
            raise bad_request(f"{field}: not together with tool_choice {req.tool_choice!r:.60} (it constrains the "
                              f"output to the tool call)", param=field.split(".")[0])
        names = [t["function"]["name"] for t in tools.tools]
        so, field = forced, (f"tools[{names.index(tools.name)}].function.parameters" if tools.mode == "named"
                             else "tools")
    if so is None:
        return params, None
    return {**params, "structured_outputs": so}, (so, field)


def _stream_flags(req) -> dict:
    """Job keywords from ``stream_options`` (only with ``stream``)."""
    opts = req.stream_options
    if opts is not None and not req.stream:
        raise bad_request("stream_options: only allowed when stream is true", param="stream_options")
    if opts is None:
        return {}
    return {"include_usage": opts.include_usage or opts.continuous_usage_stats,
            "continuous_usage": opts.continuous_usage_stats}


async def completion_job(state: ServerState, body: dict) -> tuple[Job, bool]:
    for name in ("tools", "tool_choice"):
        if body.get(name) not in (None, [], "none"):
            raise bad_request(f"{name}: tool calling is a /v1/chat/completions feature", param=name,
                              code="unsupported_field")
    req = parse(CompletionRequest, body)
    state.check_model(req.model)
    check_n(req.n)
    if req.echo and req.logprobs is not None:
        raise bad_request("echo: not supported together with logprobs (prompt logprobs are not computed)",
                          param="echo", code="unsupported_field")
    stream_flags = _stream_flags(req)
    prompts = await state.completion_prompts(req.prompt)
    max_tokens = state.max_tokens(prompts, req.max_tokens, "max_tokens", default=16)
    params, constraint = _structured(state, req, _sampling(sampling_kwargs(req, max_tokens, req.logprobs), {}))
    job = Job.build(state, "/v1/completions", state.config.model_name, prompts, req.n, params, chat=False,
                    logprobs=req.logprobs, echo=req.echo, constraint=constraint, **stream_flags)
    return job, req.stream


def chat_text(state: ServerState, req, add_generation_prompt: bool = True) -> str:
    """``req.messages`` through the chat template (the template writes the special tokens it wants)."""
    import jinja2

    messages = chat_messages(req)
    if state.tokenizer.chat_template is None:
        raise bad_request("messages: this model has no chat template; start the server with --chat-template FILE "
                          "or use /v1/completions", param="messages", code="no_chat_template")
    tools = getattr(req, "tools", None) or None  # rendered by the template, as HF passes them
    try:
        return state.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad_request(f"messages: the chat template refused them: {e}", param="messages") from None


async def chat_job(state: ServerState, body: dict) -> tuple[Job, bool]:
    req = parse(ChatRequest, body)
    state.check_model(req.model)
    check_n(req.n)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs: needs logprobs: true", param="top_logprobs")
    stream_flags = _stream_flags(req)
    tools = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
    prompt = Prompt(await state.encode(chat_text(state, req), add_special_tokens=False), None)
    state.check_length(prompt.ids, "messages")
    asked, name = ((req.max_completion_tokens, "max_completion_tokens") if req.max_completion_tokens is not None
                   else (req.max_tokens, "max_tokens"))
    max_tokens = state.max_tokens([prompt], asked, name, default=None)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = _sampling(sampling_kwargs(req, max_tokens, logprobs), {"max_tokens": name, "logprobs": "top_logprobs"})
    params, constraint = _structured(state, req, params, tools)
    job = Job.build(state, "/v1/chat/completions", state.config.model_name, [prompt], req.n, params, chat=True,
                    logprobs=logprobs, tools=tools, constraint=constraint, **stream_flags)
    return job, req.stream


async def tokenize(state: ServerState, body: dict) -> dict:
    """vLLM's /tokenize: the ids the completions or chat endpoint would run for this prompt or these messages."""
    req = parse(TokenizeRequest, body)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("prompt, messages: expected exactly one of them", param="prompt")
    if req.messages is not None:
        text, special = chat_text(state, req, req.add_generation_prompt), False
    else:
        text, special = req.prompt, True
    special = special if req.add_special_tokens is None else req.add_special_tokens
    ids = await state.encode(text, add_special_tokens=special)
    strs = [state.token_text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(state: ServerState, body: dict) -> dict:
    req = parse(DetokenizeRequest, body)
    state.check_model(req.model)
    bad = [t for t in req.tokens if not 0 <= t < state.vocab_size]
    if bad:
        raise bad_request(f"tokens: token ids must be in [0, {state.vocab_size}), got {bad[:4]}", param="tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}


# ---- HTTP plumbing -------------------------------------------------------------------------------

def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_json(receive, content_length: str, limit: int) -> dict:
    """The body (read from the ASGI ``receive``) as a JSON object: over ``limit`` bytes -> 413 (the body is
    drained, not kept, so the client reads the answer instead of a broken pipe), not JSON or not an object
    -> 400; the client gone meanwhile -> ClientDisconnect."""
    too_large = APIError(413, f"request body: larger than the server's limit of {limit} bytes",
                         code="request_too_large")
    if content_length.isdigit() and int(content_length) > 16 * limit:
        raise too_large  # not worth draining: the connection closes after the answer
    body, size = bytearray(), 0
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= limit:
                body += chunk
            if not message.get("more_body", False):
                break
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect
    if size > limit:
        raise too_large
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body: malformed JSON ({e})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body: expected a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


class ClientGone(Exception):
    pass


async def until_disconnected(receive, coro):
    """Run ``coro``; if the client disconnects first (the ASGI ``receive`` says so), cancel it (aborting its
    sequences) and raise ClientGone."""
    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, APIError):
                await work
    if work.cancelled():
        raise ClientGone
    return work.result()


class SSEResponse(StreamingResponse):
    """A job's event stream. However the response ends (done, client gone, cancelled), the job's
    streams are closed and the job leaves the admission count.

    A disconnect is watched by one plain task that aborts the job's sequences (the stream then ends by
    itself at the engine's next step; uvicorn drops what is sent after a disconnect), instead of
    Starlette's anyio task group per response, which cost about a tenth of the server's time in the
    stubbed-step profile. The last event ([DONE], with the final chunk and the usage) ends the body in
    the same message."""

    def __init__(self, job: Job):
        super().__init__(job.sse(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        finished = False

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                self.job.disconnect()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        finally:
            finished = True
            watcher.cancel()
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            self.job.abandon()

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            last = chunk.endswith(DONE)
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            if last:
                return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _APIKey:
    """ASGI middleware: every path but ``open_paths`` needs ``Authorization: Bearer <key>`` (compared in
    constant time; the key is never logged or echoed). Deny by default: a route added later is guarded."""

    def __init__(self, app, key: str, metrics: ServerMetrics, open_paths: frozenset[str]):
        self.app, self.key, self.metrics, self.open_paths = app, key.encode(), metrics, open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = got.partition(b" ")
            # compare_digest's time depends on the lengths only, never on where the bytes differ
            if not (hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"):
                self.metrics.requests.labels(_endpoint(scope["path"]), "unauthorized").inc()
                e = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(e)(scope, receive, send)
                return
        await self.app(scope, receive, send)


_ASGI = Callable[[Any, Any, Any], Awaitable[None]]  # an ASGI app: (scope, receive, send)
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/tokenize",
              "/detokenize", "/version")


def _endpoint(path: str) -> str:
    """The metrics label of a path: one per route (a model id in the path would make a label per id)."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return path if path in _ENDPOINTS else "other"


class _App(FastAPI):
    """FastAPI with the generation endpoints (``hot``: path -> ASGI app, POST only) answered before its
    middleware stack, router and dependency machinery: those layers were a large share of the HTTP
    process's time per request (notes/serve.md) for nothing these routes use (they read the raw body and
    validate it themselves). Every other path and method goes through FastAPI as before (405s, 404s, the
    error handlers). An exception these routes let out reaches uvicorn, which answers 500 when nothing was
    sent yet, as Starlette's error middleware does."""

    hot: dict[str, _ASGI]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.hot.get(scope["path"])
            if route is not None:
                scope["app"] = self
                await route(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _content_length(scope) -> str:
    return next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-length"), "")


def create_app(llm, config: ServeConfig) -> FastAPI:
    """The API over ``llm`` (a :class:`warpforge.llm.AsyncLLM`). The caller owns the engine (and shuts
    it down); ``app.state.server`` is the :class:`ServerState` (``drain`` for a graceful stop)."""
    state = ServerState(llm, config)
    app = _App(title="warpforge", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    m = state.metrics

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        m.requests.labels(_endpoint(request.url.path), _OUTCOMES.get(e.status_code, "bad_request")).inc()
        code = "not_found" if e.status_code == 404 else None
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=code))

    async def handled(receive, content_length: str, endpoint: str, handle):
        """``handle(state, body)`` (awaited when it is a coroutine) of the request's JSON body, or the Response
        that refuses it (counted)."""
        try:
            state.check_available()
            got = handle(state, await read_json(receive, content_length, config.max_body_bytes))
            return (await got) if asyncio.iscoroutine(got) else got
        except APIError as e:
            m.requests.labels(endpoint, _OUTCOMES.get(e.status, "bad_request")).inc()
            return error_response(e)
        except ClientDisconnect:  # gone while sending the body
            m.requests.labels(endpoint, "disconnected").inc()
            return Response(status_code=499)

    def generation(endpoint: str, make):
        """The response to a completions / chat request: the refusal, the event stream, or the whole body."""
        async def handle(state: ServerState, body: dict) -> tuple[Job, bool]:
            job, stream = await make(state, body)
            if job.constraint is not None:
                await state.check_constraint(*job.constraint)
            state.admit(job)
            return job, stream

        async def respond(receive, content_length: str) -> Response:
            got = await handled(receive, content_length, endpoint, handle)
            if isinstance(got, Response):
                return got
            job, stream = got
            if stream:
                return SSEResponse(job)
            try:
                return JSONResponse(await until_disconnected(receive, job.collect()))
            except APIError as e:  # counted by the job
                return error_response(e)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it; uvicorn drops it
            finally:
                job.abandon()
        return respond

    def answer(endpoint: str, handle):
        """A JSON body in, the JSON ``handle(state, body)`` returns out."""
        async def respond(receive, content_length: str) -> Response:
            got = await handled(receive, content_length, endpoint, handle)
            if isinstance(got, Response):
                return got
            m.requests.labels(endpoint, "ok").inc()
            return JSONResponse(got)
        return respond

    def asgi(respond):
        async def route(scope, receive, send) -> None:
            response = await respond(receive, _content_length(scope))
            await response(scope, receive, send)
        return route

    def fastapi_route(respond):
        async def route(request: Request) -> Response:
            return await respond(request.receive, request.headers.get("content-length", ""))
        return route

    posts = {"/v1/completions": generation("/v1/completions", completion_job),
             "/v1/chat/completions": generation("/v1/chat/completions", chat_job),
             "/tokenize": answer("/tokenize", tokenize), "/detokenize": answer("/detokenize", detokenize)}
    hot: dict[str, _ASGI] = {}
    for path, respond in posts.items():
        # registered with FastAPI too: the router knows the path (a GET is a 405, not a 404)
        app.add_api_route(path, fastapi_route(respond), methods=["POST"])
        if path.startswith("/v1/"):
            hot[path] = asgi(respond)

    @app.get("/version")
    async def version() -> Response:
        from warpforge import __version__

        m.requests.labels("/version", "ok").inc()
        return JSONResponse({"version": __version__})

    def model_card() -> dict:
        # root names the served model, not where its files are: a path would show the server's filesystem
        return {"id": config.model_name, "object": "model", "created": state.started, "owned_by": "warpforge",
                "root": config.model_name, "parent": None, "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models() -> Response:
        m.requests.labels("/v1/models", "ok").inc()
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        try:
            state.check_model(model_id)
        except APIError as e:
            m.requests.labels("/v1/models/{id}", "not_found").inc()
            return error_response(e)
        m.requests.labels("/v1/models/{id}", "ok").inc()
        return JSONResponse(model_card())

    @app.get("/health")
    async def health() -> Response:
        try:
            state.check_available()
        except APIError as e:
            m.requests.labels("/health", "error").inc()
            return error_response(e)
        m.requests.labels("/health", "ok").inc()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        m.requests.labels("/metrics", "ok").inc()
        return Response(m.render(), media_type=CONTENT_TYPE)

    if config.api_key is not None:
        open_paths = frozenset({"/health", "/metrics"} if config.metrics_without_auth else {"/health"})
        app.add_middleware(_APIKey, key=config.api_key, metrics=m, open_paths=open_paths)
        # the hot routes skip FastAPI's middleware: the same check wraps each of them
        hot = {path: _APIKey(route, config.api_key, m, open_paths) for path, route in hot.items()}
    app.hot = hot
    return app
