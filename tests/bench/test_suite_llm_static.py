"""The plain-PyTorch decode peer of the llm suite's batch-1 rows (bench/suites/_llm_static.py): the same
function as HF on the same checkpoint, and judged in the record exactly as ours is."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


@pytest.mark.parametrize("preset", ["llama-tiny", "llama-tiny-untied"])
def test_static_llama_logits_match_hf_in_fp32(preset, tmp_path):
    from transformers import AutoModelForCausalLM

    from warpforge.bench.suites._llm_static import load_static
    from warpforge.llm.random_weights import random_checkpoint

    path = random_checkpoint(tmp_path / preset, preset, dtype=torch.float32, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ours = load_static(path, 64, torch.float32, torch.device("cpu"))
    ids = torch.randint(16, 1000, (1, 21), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = hf(input_ids=ids).logits[0].double()
        # the prompt's last position, then two decode steps over the static cache, against HF's full pass
        got = [ours(ids[:, :19], torch.arange(19))[0]]
        got += [ours(ids[:, i:i + 1], torch.tensor([i]))[0] for i in (19, 20)]
    for k, pos in enumerate((18, 19, 20)):
        err = (got[k].double() - want[pos]).norm() / want[pos].norm()
        assert err < 1e-5, (pos, float(err))


def test_llama3_rope_scaling_matches_hf():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from warpforge.bench.suites._llm_static import _rope_inv_freq
    from warpforge.llm.random_weights import preset

    cfg = preset("llama-8b")
    hf = LlamaConfig(**cfg)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert torch.allclose(_rope_inv_freq(cfg), want.float(), rtol=1e-6, atol=0)


def test_the_quick_decode_row_judges_the_peer_as_ours():
    from warpforge.results.record import validate_record
    from warpforge.bench.runner import load_suite, run_suite
    from warpforge.bench.suites._llm_static import NAME

    records = run_suite(load_suite("llm"), quick=True, device="cpu", case_filter="decode batch 1 llama-tiny ")
    (r,) = records
    validate_record(r, figures=True)
    peer = r["peers"][NAME]
    assert "error" not in peer, peer
    c, mine = peer["correct"], r["correct"]
    assert c["against"] == mine["against"] == "peer:hf" and c["tol"] == mine["tol"] and c["ok"], (c, mine)
    assert peer["tokens"] == r["ours"]["tokens"] and NAME in r["ratio"]
    assert peer["compile"].startswith("none") and peer["cudagraph_skips"] == 0
