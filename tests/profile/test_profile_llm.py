"""``warpforge profile llm:CHECKPOINT`` / ``llm-prefill:CHECKPOINT`` on a tiny random Llama checkpoint.

The checkpoint comes from ``random_checkpoint`` (no network, no HF transformers), so these run on the
offline GPU machine too."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from warpforge.cli import main

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from warpforge.profile.llm_target import random_checkpoint

    return random_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama-tiny", dtype=torch.float32)


def test_random_checkpoint_has_the_preset_shapes(ckpt):
    from warpforge.llm.loader import load
    from warpforge.profile.llm_target import PRESETS

    model, _tok, cfg = load(ckpt)
    want = PRESETS["llama-tiny"]
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size) == (
        want["hidden_size"], want["num_hidden_layers"], want["num_key_value_heads"], want["vocab_size"])
    n = sum(p.numel() for p in model.parameters())
    d, f, v, L = 64, 128, 1024, 2
    assert n == v * d + d + L * (d * 64 + 2 * d * 32 + 64 * d + 3 * d * f + 2 * d)  # tied embeddings


@pytest.mark.parametrize("form,unit", [("llm", "decode"), ("llm-prefill", "prefill")])
def test_engine_step_profiles(ckpt, tmp_path, form, unit):
    out = tmp_path / unit
    r = CliRunner().invoke(main, ["profile", f"{form}:{ckpt}", "--batch", "2", "--prompt-len", "12", "--iters", "2",
                                  "--warmup", "1", "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    d = json.loads((out / "report.json").read_text())
    assert d["target"].startswith(f"llm {unit}: batch 2")
    assert d["counts"]["flops"] > 0 and not d["counts"]["error"]
    modules = {row["module"] for row in d["ops"]}
    assert any(m and m.startswith("model.layers.0") for m in modules), modules


def test_prompt_longer_than_the_context_is_refused(ckpt):
    r = CliRunner().invoke(main, ["profile", f"llm:{ckpt}", "--prompt-len", "500", "--iters", "1"])
    assert r.exit_code == 2 and "lower --prompt-len" in " ".join(r.output.split())


def test_missing_checkpoint():
    r = CliRunner().invoke(main, ["profile", "llm:/no/such/model", "--iters", "1"])
    assert r.exit_code == 2 and "no such checkpoint" in r.output


@pytest.mark.gpu
def test_decode_step_replays_a_cuda_graph_and_counts_eagerly(ckpt):
    from warpforge.profile import profile
    from warpforge.profile.targets import resolve

    t = resolve(f"llm:{ckpt}", device=torch.device("cuda"), batch=4, prompt_len=32)
    p = profile(t.fn, module=t.module, count_fn=t.count_fn, iters=10, name=t.name)
    assert p.counts.flops > 0  # counted on the eager step
    assert p.analysis.split.kernels > 0
    # The replayed kernels are the eager step's operators again: per layer and module, on the roofline.
    layer0 = [r for r in p.analysis.ops if r.graph and (r.module or "").startswith("model.layers.0")]
    assert layer0 and all(r.fraction is not None for r in layer0), [(r.name, r.fraction) for r in layer0]
    assert any(r.op == "triton::_linear_kernel" for r in layer0)
    placed = sum(r.share for r in p.analysis.ops if r.fraction is not None)
    assert placed > 0.8, [(r.name, r.share) for r in p.analysis.ops if r.fraction is None]
