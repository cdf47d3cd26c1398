"""The engine's own process: `warpforge serve` steps its LLMEngine here, the HTTP server runs beside it.

Why a process: a step's Python (schedule, launch, postprocess, detokenize) and the server's event loop
(HTTP, JSON, SSE for every stream) need the same GIL when they share a process: even with the model step
stubbed to GIL-free device time, the engine thread waited for the GIL before each step and the loop to pick
up each step's outputs, and the server fell far behind the same engine offline (notes/serve.md). vLLM split
its API server and engine the same way (v0.6).

``run(spec, sock)`` is the process's body (``EngineClient`` in engine_client.py starts it and talks to it).
One socketpair carries frames of a 4-byte length and a pickle:

    API -> engine   a list of ops per frame: ("add", rid, prompt_ids, params) | ("abort", rid) | ("stop",)
    engine -> API   ("ready", info) once loaded, or ("failed", message)
                    ("outputs", [(rid, delta_text, delta_ids, delta_logprobs, finish_reason), ...], stats)
                    after each step; ("refused", rid, message) for a request the engine will not take;
                    ("fatal", message) when a step failed (the engine's state is unknown: it stops)

The loop takes whatever ops have arrived between steps (it blocks only when there is nothing to step),
so the engine never waits on the HTTP side; a request whose grammar is still compiling joins the batch
when the compile is done, on a thread of its own, and steps go on meanwhile. The process ends on
("stop",), or when the socket closes (the API process is gone: nothing is left to serve).
"""

from __future__ import annotations

import importlib
import pickle
import select
import signal
import socket
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

_LEN = struct.Struct("!I")
SOCKET_BUFFER = 4 << 20  # bytes each way: a step's outputs for hundreds of streams never wait on a full pipe
RECV_BYTES = 4 << 20  # most bytes one read takes, into a buffer allocated once (see EngineClient._readable)
GRAMMAR_THREADS = 2  # compiles at once (each one's matcher is cached by xgrammar afterwards)


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds. ``model``: a resolved checkpoint path; ``engine_kwargs``: EngineConfig
    fields. ``setup``: "module:function" called as ``function(engine, **setup_args)`` once the engine is
    loaded (the stubbed-step benchmark replaces the model step this way); it may return a callable that
    runs when the process stops."""

    model: str
    dtype: Any = None  # torch.dtype | str | None
    device: str | None = None
    engine_kwargs: dict = field(default_factory=dict)
    setup: str | None = None
    setup_args: dict = field(default_factory=dict)


# ---- frames -----------------------------------------------------------------------------------------

def pack(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


class Frames:
    """Bytes in, whole frames out (``feed`` -> the objects completed by these bytes)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> list[Any]:  # recv_into hands a memoryview slice
        self.buf += data
        out, at = [], 0
        while len(self.buf) - at >= _LEN.size:
            (n,) = _LEN.unpack_from(self.buf, at)
            if len(self.buf) - at - _LEN.size < n:
                break
            out.append(pickle.loads(self.buf[at + _LEN.size:at + _LEN.size + n]))
            at += _LEN.size + n
        del self.buf[:at]
        return out


def tune(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:  # a capped kernel limit: the default buffers still work, with more waits
            pass


# ---- the engine's side --------------------------------------------------------------------------------

def stats(engine) -> tuple:
    """What /metrics reads: (running, waiting, kv_used, prefix hit tokens, prefix queried tokens,
    preemptions, speculative counters or None)."""
    sched, bm = engine.scheduler, engine.block_manager
    spec = getattr(engine, "spec", None)
    s = spec.stats if spec is not None else None
    return (len(sched.running), len(sched.waiting), 1.0 - bm.num_free_pages / bm.num_pages, bm.prefix_hit_tokens,
            bm.prefix_queried_tokens, sched.num_preemptions,
            None if s is None else (s.num_draft_tokens, s.num_accepted_tokens, s.num_emitted_tokens,
                                    s.acceptance_rate))


def info(engine) -> dict:
    """The facts the API process needs (and prints) once the engine is loaded."""
    mc, ec, bm = engine.model_config, engine.config, engine.block_manager
    tok = engine.tokenizer
    tok.__dict__.pop("_template", None)  # a compiled jinja template does not pickle; it is rebuilt on use
    return {"tokenizer": tok, "max_model_len": ec.max_model_len, "vocab_size": mc.vocab_size,
            "eos_token_ids": sorted(engine.scheduler.eos_token_ids), "architecture": mc.architecture,
            "num_layers": mc.num_layers, "hidden_size": mc.hidden_size, "dtype": str(mc.dtype).replace("torch.", ""),
            "device": str(engine.device), "num_pages": bm.num_pages, "page_size": bm.page_size,
            "max_num_seqs": ec.max_num_seqs, "stats": stats(engine)}


def _wire(out) -> tuple:
    """A step's RequestOutput as what it added: text, ids, logprobs of the new tokens, finish reason."""
    new = len(out.delta_token_ids)
    lps = out.logprobs[len(out.logprobs) - new:] if out.logprobs is not None and new else (
        [] if out.logprobs is not None else None)
    return out.request_id, out.delta_text, out.delta_token_ids, lps, out.finish_reason


class Core:
    """The engine process's loop over one LLMEngine and the socket to the API process."""

    def __init__(self, engine, sock: socket.socket):
        self.engine, self.sock = engine, sock
        self.frames = Frames()
        self._inbuf = memoryview(bytearray(RECV_BYTES))
        self.compiling: dict[str, Future] = {}  # rid -> the request being built on a grammar thread
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def send(self, msg: Any) -> None:
        self.sock.sendall(pack(msg))  # blocks only while the API process is behind: its pace is the limit

    def _read(self, block: bool) -> list | None:
        """Ops that have arrived (waiting for some when ``block``); None once the API process is gone."""
        timeout = None if block else 0.0
        if block and self.compiling:
            timeout = 0.005  # a grammar may finish: look again soon
        ops: list = []
        while select.select([self.sock], [], [], timeout)[0]:
            n = self.sock.recv_into(self._inbuf)
            if not n:
                return None
            for frame in self.frames.feed(self._inbuf[:n]):
                ops.extend(frame)
            timeout = 0.0
        return ops

    def _make(self, rid: str, ids: list[int], params):
        with self._lock:  # the first one builds the engine's grammar backend; the others wait for it
            self.engine.grammars  # noqa: B018
        return self.engine.make_request(ids, params, request_id=rid, stream=True)

    def _add(self, rid: str, ids: list[int], params) -> None:
        if params.structured_outputs is not None:  # compiling may take seconds: never in the step loop
            if self._pool is None:
                self._pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="warpforge-grammar")
            self.compiling[rid] = self._pool.submit(self._make, rid, ids, params)
            return
        try:
            self.engine.add(self.engine.make_request(ids, params, request_id=rid, stream=True))
        except ValueError as e:
            self.send(("refused", rid, str(e)))

    def _compiled(self) -> None:
        for rid, fut in list(self.compiling.items()):
            if fut.done():
                del self.compiling[rid]
                try:
                    self.engine.add(fut.result())
                except ValueError as e:
                    self.send(("refused", rid, str(e)))

    def _abort(self, rid: str) -> None:
        fut = self.compiling.pop(rid, None)
        if fut is not None:  # never reached the engine
            fut.cancel()
            self.send(("outputs", [(rid, "", [], None, "abort")], stats(self.engine)))
            return
        out = self.engine.abort(rid)
        if out is not None:
            self.send(("outputs", [_wire(out)], stats(self.engine)))

    def loop(self) -> None:
        engine = self.engine
        while True:
            ops = self._read(block=not engine.has_unfinished())
            if ops is None:
                return
            for op in ops:
                if op[0] == "add":
                    self._add(*op[1:])
                elif op[0] == "abort":
                    self._abort(op[1])
                elif op[0] == "stop":
                    for rid in [*self.compiling, *list(engine.requests)]:
                        self._abort(rid)
                    return
            if self.compiling:
                self._compiled()
            if engine.has_unfinished():
                try:
                    outs = engine.step()
                except Exception as e:  # noqa: BLE001 - the API process fails every stream and says why
                    self.send(("fatal", f"engine step failed: {e!r}"))
                    return
                self.send(("outputs", [_wire(o) for o in outs], stats(engine)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def build(spec: EngineSpec):
    """The LLMEngine ``spec`` describes, and the setup hook's closer (or None)."""
    from warpforge.llm.engine import LLMEngine
    from warpforge.llm.engine_config import EngineConfig

    engine = LLMEngine(spec.model, EngineConfig(**spec.engine_kwargs), dtype=spec.dtype, device=spec.device)
    closer = None
    if spec.setup is not None:
        module, _, name = spec.setup.partition(":")
        closer = getattr(importlib.import_module(module), name)(engine, **spec.setup_args)
    return engine, closer


def run(spec: EngineSpec, sock: socket.socket) -> None:
    """The engine process: load, say so, serve ops until told to stop or the API process is gone."""
    # Ctrl-C reaches the whole process group: the API process drains and then sends ("stop",).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tune(sock)
    try:
        engine, closer = build(spec)
    except ModuleNotFoundError as e:
        sock.sendall(pack(("failed", f"{e.name} is missing: install the llm extra (pip install 'warpforge[llm]')")))
        return
    except Exception as e:  # noqa: BLE001 - one line for the user, said by the API process
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sock.sendall(pack(("failed", msg if isinstance(e, (ValueError, FileNotFoundError)) else f"{e!r}"[:500])))
        return
    core = Core(engine, sock)
    try:
        core.send(("ready", info(engine)))
        core.loop()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the API process is gone
    finally:
        core.close()
        if closer is not None:
            closer()
        engine.shutdown()
        sock.close()


# A fresh interpreter (not multiprocessing's spawn, which re-imports the caller's main module): the first
# frame is (sys.path, the pickled spec), read before anything of warpforge is imported so that the
# API process's path finds it.
BOOT = ("import pickle, socket, struct, sys; s = socket.socket(fileno=int(sys.argv[1])); "
        "n = struct.unpack('!I', s.recv(4, socket.MSG_WAITALL))[0]; "
        "path, spec = pickle.loads(s.recv(n, socket.MSG_WAITALL)); sys.path[:0] = path; "
        "from warpforge.serve.engine_core import main; main(s, spec, int(sys.argv[2]))")


def main(sock: socket.socket, spec: bytes, parent_pid: int) -> None:
    """Entry of ``python -c BOOT FD PID``."""
    from warpforge.llm.distributed_worker import watch_parent

    # the API process may die while the model still loads; after that, the socket says so
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    run(pickle.loads(spec), sock)
