"""Fixtures for the server tests: a tiny checkpoint, real `warpforge serve` processes on 127.0.0.1.

``start_server(*flags)`` launches ``python -m warpforge serve CHECKPOINT --port 0 ...`` in its own
process (one torch thread), waits for its "listening on http://..." line and for /health, and returns
a :class:`ServerHandle`:

    root       "http://127.0.0.1:PORT"
    base_url   root + "/v1": what ``openai.OpenAI(base_url=...)`` takes
    api_key    the server's key, or "none" (the openai client wants a string)
    model      the served model name (``TINY_MODEL`` unless --served-model-name is given)
    proc       the subprocess.Popen; ``log`` the file its stdout and stderr go to

Every server is stopped at the end of the session (SIGTERM, then SIGKILL after 10 s); tests that
start their own stop them earlier with ``handle.stop()`` or ``with start_server(...) as s:``.
``server`` is the shared default one (session scope).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

TINY_MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
_LISTENING = re.compile(r"listening on (http://[^\s]+?:\d+)")


@dataclass
class ServerHandle:
    proc: subprocess.Popen
    root: str
    api_key: str
    model: str
    log: Path
    checkpoint: Path
    flags: tuple[str, ...] = field(default_factory=tuple)

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def client(self, **kw):
        """An ``openai.OpenAI`` client for this server (no retries: tests see every status)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, **kw)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """/metrics samples: {'name{label="v",...}': value} (label order as the server writes it)."""
        text = httpx.get(self.root + "/metrics", headers=self.headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        """Signal the server and wait for it (SIGKILL after ``timeout`` s); -> its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random tiny Llama HF checkpoint with a tokenizer and a ChatML chat template."""
    pytest.importorskip("transformers")
    from warpforge.llm.testing import tiny_checkpoint

    return tiny_checkpoint("llama", tmp_path_factory.mktemp("serve-model") / "llama")


@pytest.fixture(scope="session")
def start_server(tiny_model, tmp_path_factory):
    """Factory: ``start_server(*flags, model=None, timeout=60) -> ServerHandle``; ``model`` replaces
    the tiny checkpoint. Flags are `warpforge serve` options (--max-queue 2, --api-key k, ...)."""
    started: list[ServerHandle] = []
    logs = tmp_path_factory.mktemp("serve-logs")

    def start(*flags: str, model: str | Path | None = None, timeout: float = 60.0) -> ServerHandle:
        flags = tuple(str(f) for f in flags)
        ckpt = Path(model) if model is not None else tiny_model
        if "--served-model-name" not in flags:
            flags = ("--served-model-name", TINY_MODEL, *flags)
        if "--max-model-len" not in flags:
            flags = ("--max-model-len", str(MAX_MODEL_LEN), *flags)
        log = logs / f"server-{len(started)}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env.pop("WARPFORGE_API_KEY", None)
        cmd = [sys.executable, "-m", "warpforge", "serve", str(ckpt), "--host", "127.0.0.1", "--port", "0", *flags]
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else "none"
        name = flags[flags.index("--served-model-name") + 1]
        deadline = time.monotonic() + timeout
        root = None
        while root is None:
            m = _LISTENING.search(log.read_text(errors="replace"))
            if m:
                root = m.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait(10)
                raise RuntimeError(f"`{' '.join(cmd)}` did not start (exit {proc.returncode}):\n"
                                   f"{log.read_text(errors='replace')[-4000:]}")
            else:
                time.sleep(0.05)
        handle = ServerHandle(proc, root, key, name, log, ckpt, flags)
        started.append(handle)
        while httpx.get(root + "/health", timeout=5).status_code != 200:  # listening means ready; be sure
            if time.monotonic() > deadline:
                handle.stop()
                raise RuntimeError(f"{root}/health never answered 200:\n{handle.output()[-4000:]}")
            time.sleep(0.05)
        return handle

    yield start
    for h in started:
        h.stop()


@pytest.fixture(scope="session")
def server(start_server) -> ServerHandle:
    """The shared default server: the tiny checkpoint, no API key, default queue."""
    return start_server()
