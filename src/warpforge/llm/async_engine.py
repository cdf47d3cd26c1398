"""AsyncLLM: per-request token streams over one LLMEngine, for servers.

One asyncio task steps the engine while any request is unfinished; each step runs in a single
worker thread so the event loop keeps accepting and streaming while the GPU works. New requests
and aborts are applied by that task *between* steps, so the engine is only ever touched by one
step at a time. A request with bad input raises in its own stream (before anything is queued);
an aborted or disconnected stream frees its pages at the next step boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor

import torch

from warpforge.llm.engine import LLMEngine, Prompt, Request
from warpforge.llm.engine_config import EngineConfig
from warpforge.llm.outputs import RequestOutput
from warpforge.llm.sampling import SamplingParams


class AsyncLLM:
    """``AsyncLLM(path | LLMEngine, dtype=..., max_model_len=..., **EngineConfig fields)``.

    >>> async for out in llm.generate("Hello", SamplingParams(max_tokens=8), request_id="r1"):
    ...     print(out.delta_text, end="")
    """

    def __init__(self, model, *, dtype: torch.dtype | str | None = None, max_model_len: int | None = None,
                 device: torch.device | str | None = None, **engine_kwargs):
        if isinstance(model, LLMEngine):
            if max_model_len is not None or engine_kwargs:
                raise ValueError("max_model_len, engine settings: give them to the LLMEngine, not with one")
            self.engine = model
        else:
            config = EngineConfig(max_model_len=max_model_len, **engine_kwargs)
            self.engine = LLMEngine(model, config, dtype=dtype, device=device)
        self.tokenizer = self.engine.tokenizer
        self._streams: dict[str, asyncio.Queue] = {}
        self._pending: list[Request] = []  # made, not yet handed to the engine
        self._aborts: list[str] = []
        self._task: asyncio.Task | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warpforge-engine")
        self.error: BaseException | None = None  # set when a step failed: the engine is unusable

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       *, add_special_tokens: bool = True) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request: an output per step that sampled a token for it (``delta_text``,
        ``delta_token_ids``), the last one with ``finish_reason`` set. Leaving the loop early (a
        client disconnect, a cancelled task) aborts the request."""
        if self.error is not None:
            raise RuntimeError(f"the engine failed earlier and stopped: {self.error}") from self.error
        req = self.engine.make_request(prompt, params, request_id=request_id, stream=True,
                                       add_special_tokens=add_special_tokens)
        rid = req.request_id
        if rid in self._streams:
            raise ValueError(f"request {rid}: a request with this id is still streaming")
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        self._pending.append(req)
        self._kick()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # nothing left to abort: it never ran, or the engine failed
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(rid)
            self._streams.pop(rid, None)

    def abort(self, request_id: str) -> None:
        """Stop a request: its stream ends with a ``finish_reason="abort"`` output and its pages are
        freed before the next step."""
        rid = str(request_id)
        for req in self._pending:
            if req.request_id == rid:  # never reached the engine
                self._pending.remove(req)
                self._deliver(RequestOutput(rid, req.prompt, req.prompt_token_ids, finish_reason="abort",
                                            metrics=req.metrics))
                return
        self._aborts.append(rid)
        self._kick()

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        queue = self._streams.get(item.request_id) if isinstance(item, RequestOutput) else None
        if queue is not None:
            queue.put_nowait(item)

    async def chat(self, messages: list[dict], params: SamplingParams | None = None,
                   request_id: str | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream a reply to one conversation through the tokenizer's chat template."""
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        async for out in self.generate(prompt, params, request_id, add_special_tokens=False):
            yield out

    def has_unfinished(self) -> bool:
        return bool(self._pending or self._aborts or self.engine.has_unfinished())

    def num_waiting(self) -> int:
        """Requests accepted but not running yet: not yet handed to the engine, or in its waiting queue."""
        return len(self._pending) + len(self.engine.scheduler.waiting)

    def _kick(self) -> None:
        if self.error is None and (self._task is None or self._task.done()):
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # a stream finalized after its loop closed: applied at the next kick
                return
            self._task = loop.create_task(self._run())

    def _apply_pending(self) -> None:
        aborts, self._aborts = self._aborts, []
        for rid in aborts:
            out = self.engine.abort(rid)
            if out is not None:
                self._deliver(out)
        pending, self._pending = self._pending, []
        for req in pending:
            try:
                self.engine.add(req)
            except ValueError as e:  # the scheduler's own checks: this stream fails, the rest run
                queue = self._streams.get(req.request_id)
                if queue is not None:
                    queue.put_nowait(e)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._apply_pending()
                if not self.engine.has_unfinished():
                    return  # no await between this check and the task ending: _kick restarts cleanly
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
                for out in outputs:
                    self._deliver(out)
        except Exception as e:  # a failed step leaves the engine's state unknown: fail every stream
            self.error = e
            for queue in self._streams.values():
                queue.put_nowait(RuntimeError(f"engine step failed: {e!r}"))

    async def shutdown(self) -> None:
        """Abort everything, stop the loop and the worker thread."""
        for rid in list(self._streams):
            self.abort(rid)
        if self._task is not None and not self._task.done():
            await self._task
        self._executor.shutdown(wait=True)
