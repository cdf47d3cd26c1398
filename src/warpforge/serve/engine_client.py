"""The API process's side of the engine: ``EngineClient`` starts the engine process and streams its outputs.

``EngineClient.start(spec)`` launches ``engine_core`` in a fresh interpreter, waits until the model is
loaded (the process says so, or why not) and returns a client with AsyncLLM's streaming surface:
``generate(ids, params, request_id)`` yields RequestOutputs (cumulative ``text``/``token_ids``, the step's
``delta_*``), ``abort(rid)``, ``error``, ``shutdown()``. The socket is read and written from the event
loop itself (``add_reader``/``add_writer`` on a non-blocking socket): no thread shares the GIL with the
loop, and the loop never blocks on the engine. The ops of one loop iteration (new requests, aborts)
leave as one frame.

A stream that has not taken its last output when the next step's arrives gets both as one output (the
deltas joined), as vLLM's output collector does: when the HTTP side falls behind, it sends fewer, larger
chunks instead of a growing backlog of one-token ones.

``LocalEngine`` gives an in-process :class:`warpforge.llm.AsyncLLM` the same surface, so ``create_app``
takes either (tests and embedders build their engine in process).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import socket
import subprocess
import sys
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from warpforge.llm.outputs import RequestOutput
from warpforge.serve.engine_core import BOOT, RECV_BYTES, EngineSpec, Frames, pack, stats, tune

if TYPE_CHECKING:
    from warpforge.llm.structured import GrammarBackend  # imported when first used (the grammars property)


class EngineStartError(RuntimeError):
    """The engine process could not load the model (the message says why, in one line)."""


@dataclass
class _Stream:
    """One request's outputs as they arrive; ``get`` -> everything since the last ``get`` as one output."""

    rid: str
    prompt_ids: list[int]
    logprobs: list | None = None  # None: not asked for
    text: str = ""  # what ``get`` handed out
    parts: list[str] = field(default_factory=list)  # text arrived since
    token_ids: list[int] = field(default_factory=list)
    sent_ids: int = 0
    finish_reason: str | None = None
    error: BaseException | None = None
    finish_sent: bool = False
    fresh: bool = False  # something arrived since the last ``get``
    waiter: asyncio.Future | None = None

    def put(self, delta_text: str, delta_ids: list[int], lps, finish_reason: str | None) -> None:
        self.parts.append(delta_text)
        self.token_ids.extend(delta_ids)
        if lps and self.logprobs is not None:
            self.logprobs.extend(lps)
        self.finish_reason = finish_reason
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        self.fresh = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while not self.fresh:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        self.fresh, self.waiter = False, None
        if self.error is not None and not self.parts and self.sent_ids == len(self.token_ids) and (
                self.finish_reason is None or self.finish_sent):
            raise self.error  # what arrived before the error has been handed out
        self.fresh = self.error is not None  # the error comes next
        self.finish_sent = self.finish_reason is not None
        delta = "".join(self.parts)
        self.text, self.parts = self.text + delta, []
        ids, start = self.token_ids, self.sent_ids
        self.sent_ids = len(ids)
        return RequestOutput(self.rid, None, self.prompt_ids, text=self.text, token_ids=ids[:], delta_text=delta,
                             delta_token_ids=ids[start:], finish_reason=self.finish_reason,
                             logprobs=None if self.logprobs is None else self.logprobs[:])


class EngineClient:
    """See the module docstring. Facts of the loaded engine: ``tokenizer``, ``max_model_len``, ``vocab_size``,
    ``eos_token_ids``, ``info`` (what the startup line prints); ``stats()`` for /metrics."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, info: dict):
        self.proc, self.sock, self.info = proc, sock, info
        self.tokenizer = info["tokenizer"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.eos_token_ids: list[int] = info["eos_token_ids"]
        self._stats = info["stats"]
        self.error: BaseException | None = None
        self._streams: dict[str, _Stream] = {}
        self._ops: list[tuple] = []
        self._out = bytearray()  # frames not yet taken by the socket
        self._frames = Frames()
        # recv into one buffer: recv(4 MiB) allocates (and the kernel zeroes) a 4 MiB bytes object per call
        self._inbuf = memoryview(bytearray(RECV_BYTES))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._grammars: GrammarBackend | None = None
        self._stopping = False  # shutdown sent "stop": the socket closing is expected

    # ---- start and stop ------------------------------------------------------------------------------

    @classmethod
    def start(cls, spec: EngineSpec, *, env: dict[str, str] | None = None) -> EngineClient:
        """Launch the engine process and wait for its model to load (EngineStartError says why it did not)."""
        mine, theirs = socket.socketpair()
        tune(mine)
        env = dict(os.environ if env is None else env)
        # OpenMP threads that spin at every barrier lose their core to the HTTP process and the clients on the
        # same machine: Gemma 3 270M on a busy 2-core CPU took 20-24 s for 32 tokens on the engine process's
        # main thread with spinning threads, 3.7-4.0 s with sleeping ones (unless the user chose a policy).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        proc = subprocess.Popen([sys.executable, "-c", BOOT, str(theirs.fileno()), str(os.getpid())],
                                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        try:
            mine.sendall(pack((list(sys.path), pickle.dumps(spec))))
            msg = cls._first(mine)
        except BaseException:
            mine.close()
            _stop_process(proc, 5.0)
            raise
        if msg is None or msg[0] != "ready":
            mine.close()
            _stop_process(proc, 5.0)
            why = msg[1] if msg is not None else f"the engine process exited with status {proc.returncode}"
            raise EngineStartError(why)
        mine.setblocking(False)
        return cls(proc, mine, msg[1])

    @staticmethod
    def _first(sock: socket.socket):
        """The first message (blocking: the load may take minutes); None when the process died first."""
        frames = Frames()
        got: list[Any] = []
        while not got:
            data = sock.recv(1 << 20)
            if not data:
                return None
            got = frames.feed(data)
        return got[0]

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Tell the engine to stop (its streams end with finish_reason "abort"), wait for the process
        (SIGKILL after ``timeout_s``), close the socket."""
        if self.proc.poll() is None and self.error is None:
            self._attach()
            self._stopping = True
            self._ops.append(("stop",))
            self._flush()
            deadline = asyncio.get_running_loop().time() + timeout_s
            while self.proc.poll() is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)  # the last outputs (aborts) are read meanwhile
        await asyncio.to_thread(_stop_process, self.proc, 1.0)
        self._close()

    def _close(self) -> None:
        if self._loop is not None and self.sock.fileno() != -1:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self.sock)
                self._loop.remove_writer(self.sock)
        self.sock.close()

    # ---- requests ------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request (token ids in); leaving the loop early aborts it."""
        if self.error is not None:
            raise RuntimeError(f"the engine failed earlier and stopped: {self.error}") from self.error
        rid = str(request_id)
        if rid in self._streams:
            raise ValueError(f"request {rid}: a request with this id is still streaming")
        self._attach()
        st = _Stream(rid, prompt_ids, logprobs=[] if params.logprobs is not None else None)
        self._streams[rid] = st
        self._send(("add", rid, prompt_ids, params))
        finished = False
        try:
            while not finished:
                try:
                    item = await st.get()
                except BaseException:
                    finished = st.error is not None  # nothing left to abort: refused, or the engine failed
                    raise
                finished = item.finished
                yield item
        finally:
            if not finished and self.error is None:
                self._send(("abort", rid))
            self._streams.pop(rid, None)

    def abort(self, request_id: str) -> None:
        if str(request_id) in self._streams and self.error is None:
            self._send(("abort", str(request_id)))

    def stats(self) -> tuple:
        """engine_core.stats' tuple as of the last step, with the requests not yet sent counted as waiting."""
        s = self._stats
        return (s[0], s[1] + sum(op[0] == "add" for op in self._ops), *s[2:])

    @property
    def grammars(self):
        """A grammar compiler over the engine's vocabulary, for checking a request's constraint before it
        is admitted (the engine process compiles its own for the matcher). It keeps no compiled grammar:
        the server remembers outcomes (app.GRAMMAR_CACHE), the engine its compiled grammars."""
        if self._grammars is None:
            from warpforge.llm.structured import GrammarBackend

            self._grammars = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids, cache_bytes=0)
        return self._grammars

    # ---- the socket ----------------------------------------------------------------------------------

    def _attach(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self.sock, self._readable)

    @property
    def _attached(self) -> asyncio.AbstractEventLoop:
        """The loop the socket is read and written from: _attach runs before anything is sent (generate
        and shutdown call it; abort sends only for a stream that generate started)."""
        assert self._loop is not None, "the socket is not attached to an event loop yet"
        return self._loop

    def _send(self, op: tuple) -> None:
        if not self._ops:
            self._attached.call_soon(self._flush)
        self._ops.append(op)

    def _flush(self) -> None:
        if self._ops:
            self._out += pack(self._ops)
            self._ops = []
        self._writable()

    def _writable(self) -> None:
        if not self._out:
            return
        try:
            n = self.sock.send(self._out)
        except BlockingIOError:
            n = 0
        except OSError as e:
            self._fail(f"the engine process is gone ({e})")
            return
        del self._out[:n]
        if self._out:
            self._attached.add_writer(self.sock, self._writable)
        else:
            self._attached.remove_writer(self.sock)

    def _readable(self) -> None:
        why: str | None
        try:
            n = self.sock.recv_into(self._inbuf)
        except BlockingIOError:
            return
        except OSError as e:
            n, why = 0, str(e)
        else:
            why = None
        if not n:
            code = self.proc.poll()
            self._fail(why or ("the engine process stopped" if self._stopping else "the engine process exited"
                               + (f" with status {code}" if code is not None else "")))
            return
        for msg in self._frames.feed(self._inbuf[:n]):
            kind = msg[0]
            if kind == "outputs":
                self._stats = msg[2]
                streams = self._streams
                for rid, *out in msg[1]:
                    st = streams.get(rid)
                    if st is not None:  # else the stream was left (its abort is on the way)
                        st.put(*out)
            elif kind == "refused":
                st = self._streams.get(msg[1])
                if st is not None:
                    st.fail(ValueError(msg[2]))
            elif kind == "fatal":
                self._fail(msg[1])

    def _fail(self, why: str) -> None:
        """The engine is unusable: every stream ends with the error, /health says so from now on."""
        if self.error is None:
            self.error = RuntimeError(why)
        for st in self._streams.values():
            st.fail(RuntimeError(f"engine failed: {why}"))
        self._close()


def _stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    if proc.poll() is None:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LocalEngine:
    """An in-process AsyncLLM behind EngineClient's surface."""

    def __init__(self, llm):
        self.llm = llm
        self.tokenizer = llm.tokenizer
        e = llm.engine
        self.max_model_len: int = e.config.max_model_len
        self.vocab_size: int = e.model_config.vocab_size
        self.eos_token_ids = sorted(e.scheduler.eos_token_ids)

    @property
    def error(self) -> BaseException | None:
        return self.llm.error

    @property
    def grammars(self):
        return self.llm.engine.grammars

    def generate(self, prompt_ids: list[int], params, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        return self.llm.generate(prompt_ids, params, request_id=request_id)

    def abort(self, request_id: str) -> None:
        self.llm.abort(request_id)

    def stats(self) -> tuple:
        s = stats(self.llm.engine)
        return (s[0], self.llm.num_waiting(), *s[2:])

    async def shutdown(self) -> None:
        await self.llm.shutdown()


def as_engine(llm) -> EngineClient | LocalEngine:
    """What the server talks to: an EngineClient as it is, an AsyncLLM behind LocalEngine."""
    return llm if isinstance(llm, (EngineClient, LocalEngine)) else LocalEngine(llm)
