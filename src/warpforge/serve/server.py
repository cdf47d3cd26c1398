"""Run the API: load the model (with progress), listen, serve until SIGTERM / Ctrl-C, stop gracefully.

The port is bound and listening before the model loads, so a port in use fails in a second instead of
after the load, and of two servers started on one port exactly one runs. On the first SIGTERM or SIGINT
the server drains: the listener stays open and /health and new requests answer 503 (a load balancer
sees the server leave instead of a refused connection), in-flight requests run for ``shutdown_grace_s``,
what is left is aborted (streams end with finish_reason "abort" and ``[DONE]``); then the listener
closes, the engine shuts down and the process exits 0. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import signal
import socket
import sys
import time
from collections.abc import Callable

from warpforge.serve.config import TORCH_DTYPES, ServeConfig


def say(msg: str) -> None:
    print(f"warpforge serve: {msg}", file=sys.stderr, flush=True)


BACKLOG = 2048  # uvicorn's default: connections the kernel holds until they are accepted


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (uvicorn serves it later); OSError says so in one line when the port is taken.

    It listens at once, not at uvicorn's start: a socket that is only bound does not hold the port, so two
    servers loading at the same time could both bind it and find out a minute later. Connections that
    arrive while the model loads wait in the backlog and are answered once it is up."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"--host: cannot resolve {host!r}: {e.strerror or e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    if sys.platform.startswith("linux"):
        # A restarted server may take its port while the last run's connections sit in TIME_WAIT. Linux never
        # lets SO_REUSEADDR share a port with a listening socket; BSD/macOS and Windows would (not set there).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(f"port {port} is in use on {host} (another server listens there; pick another --port)"
                          ) from None
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def build_llm(config: ServeConfig, **spec):
    """The engine process ``config`` describes (serve/engine_client.py), started and loaded with a progress
    line (a spinner on a terminal). ``spec``: more EngineSpec fields (device, setup, setup_args).
    EngineStartError says why the model did not load."""
    from warpforge._cli_support import make_console
    from warpforge.llm.loader import resolve_model
    from warpforge.serve.engine_client import EngineClient
    from warpforge.serve.engine_core import EngineSpec

    path = resolve_model(config.model)
    say(f"loading {config.model} (dtype {config.dtype}, kv cache {config.kv_cache_dtype}) ...")
    t0 = time.perf_counter()
    engine_kwargs = {"max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs,
                     "kv_cache_dtype": config.kv_cache_dtype, "speculative": config.speculative}
    with make_console(stderr=True).status(f"loading {config.model}", spinner="dots"):
        llm = EngineClient.start(EngineSpec(str(path), TORCH_DTYPES[config.dtype], engine_kwargs=engine_kwargs,
                                            **spec))
    i = llm.info
    say(f"loaded {i['architecture']} ({i['num_layers']} layers, hidden {i['hidden_size']}, vocab {i['vocab_size']}, "
        f"{i['dtype']}) on {i['device']} in {time.perf_counter() - t0:.1f} s, in its own process; "
        f"max_model_len {i['max_model_len']}, {i['num_pages']} KV pages ({i['num_pages'] * i['page_size']} tokens), "
        f"max_num_seqs {i['max_num_seqs']}, max_queue {config.max_queue}")
    return llm


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with our signal policy: the first SIGTERM/SIGINT starts the drain
        (``on_signal``) and leaves the listener open; the drain sets ``should_exit`` when it is done,
        and only then does uvicorn close the listener. A second SIGINT forces. The signal is not
        re-raised after shutdown (uvicorn does that, which would make the exit status 128 + signal
        instead of 0)."""

        def __init__(self, config, on_signal: Callable[[], None], on_ready: Callable[[], None]):
            super().__init__(config)
            self.on_signal, self.on_ready = on_signal, on_ready
            self.draining = False

        def handle_exit(self, sig, frame) -> None:
            if self.draining:
                if sig == signal.SIGINT:
                    self.should_exit = self.force_exit = True
            else:
                self.draining = True
                self.on_signal()

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                self.on_ready()

    return Server


def serve(config: ServeConfig, llm=None, sock: socket.socket | None = None) -> int:
    """Serve until stopped; -> exit status. ``llm``/``sock`` are built from ``config`` when not given."""
    import uvicorn

    from warpforge.serve.app import create_app

    sock = sock or bind(config.host, config.port)
    llm = llm or build_llm(config)
    app = create_app(llm, config)
    state = app.state.server
    # What is loaded by now (torch, the tokenizer, pydantic's schemas, the app) lives as long as the process:
    # frozen out of the cyclic collector, whose full passes walked all of it again every few hundred requests
    # and stalled every stream meanwhile (notes/serve.md).
    gc.collect()
    gc.freeze()
    host, port = sock.getsockname()[:2]
    # By the time uvicorn shuts down, the drain has finished or aborted every request: what is left is
    # the last chunks of aborted streams.
    uv_config = uvicorn.Config(app, log_level="info" if config.access_log else "warning",
                               access_log=config.access_log, lifespan="off", backlog=BACKLOG,
                               # X-Forwarded-For only changes the client address the access log shows; parsing
                               # it cost ~4% of the server's time per request in the stubbed-step profile
                               proxy_headers=config.access_log,
                               timeout_graceful_shutdown=5, timeout_keep_alive=5)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task] = set()

        async def drain_then_exit() -> None:
            try:
                await state.drain(config.shutdown_grace_s)
            finally:
                server.should_exit = True

        def on_signal() -> None:
            say(f"stopping: /health and new requests get 503; in-flight requests have {config.shutdown_grace_s:g} s "
                f"to finish")
            loop.call_soon_threadsafe(lambda: tasks.add(loop.create_task(drain_then_exit())))

        def on_ready() -> None:
            key = "API key required" if config.api_key else "no API key"
            url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
            say(f"listening on {url} (model {config.model_name!r}, OpenAI API at {url}/v1, {key}); "
                f"Ctrl-C to stop")

        server = _server_class()(uv_config, on_signal, on_ready)
        try:
            await server.serve(sockets=[sock])
        finally:
            state.close()
            await llm.shutdown()

    loop_factory = uv_config.get_loop_factory() if hasattr(uv_config, "get_loop_factory") else None
    if loop_factory is not None and sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(main())
    else:
        asyncio.run(main())
    say("stopped")
    return 0
