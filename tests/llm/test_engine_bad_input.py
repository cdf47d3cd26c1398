"""The Python API's bad input: one ValueError naming the argument, at construction or at the call,
never a bare TypeError, torch's AssertionError, or outputs silently cut short."""

from __future__ import annotations

import pytest
import torch

from warpforge.kernels.attention import PagedKVCache
from warpforge.llm import LLM, SamplingParams

from .engine_helpers import checkpoint, loaded, one_thread  # noqa: F401

pytest.importorskip("transformers")


def test_num_pages_too_small_for_max_model_len_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"^num_pages: 5 pages of 4 tokens hold 20 tokens, fewer than one sequence "
                                         r"of max_model_len 32 needs \(8 pages\)"):
        LLM(loaded("llama"), max_model_len=32, page_size=4, num_pages=5)
    llm = LLM(loaded("llama"), max_model_len=32, page_size=4, num_pages=8)  # exactly one sequence: accepted
    out = llm.generate(list(range(5, 15)), SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 22  # runs to max_model_len, not short of it


@pytest.mark.parametrize("dtype", ["fp32", "float32", "torch.float32"])
def test_llm_takes_the_cli_dtype_spellings(dtype):
    """``warpforge serve --dtype fp32`` and ``LLM(dtype="fp32")`` take the same spellings (warpforge.dtypes)."""
    llm = LLM(str(checkpoint("llama")), dtype=dtype, device="cpu", max_model_len=32, page_size=4, num_pages=8)
    assert llm.engine.model_config.dtype is torch.float32
    with pytest.raises(ValueError, match=r"^dtype: expected one of \['fp32', 'float32'"):
        LLM(str(checkpoint("llama")), dtype="fp4", device="cpu")


@pytest.mark.parametrize("prompts", [None, 3, {"a": 1}])
def test_prompts_of_the_wrong_type(prompts):
    llm = LLM(loaded("llama"), max_model_len=64, page_size=4, num_pages=32)
    with pytest.raises(ValueError, match="^prompts: expected a string, a list of token ids"):
        llm.generate(prompts)
    with pytest.raises(ValueError, match="^messages: expected a list"):
        llm.chat(None)


def test_device_that_this_machine_lacks():
    bad = "cuda:99" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=rf"^device: '{bad}' requested but"):
        LLM(str(checkpoint("llama")), device=bad, max_model_len=64)
    with pytest.raises(ValueError, match="^device: expected 'cpu', 'cuda' or 'cuda:N', got 'gpu0'"):
        LLM(str(checkpoint("llama")), device="gpu0", max_model_len=64)


def test_the_cli_model_name_works_in_the_python_api(monkeypatch, tmp_path):
    """LLM("gemma3-270m") takes the name `warpforge generate` takes (here resolved to a tiny GGUF)."""
    pytest.importorskip("gguf")
    import warpforge.llm.loader as loader
    from warpforge.llm.testing import write_gguf

    gguf_path = write_gguf(checkpoint("qwen3"), tmp_path / "tiny.gguf")
    monkeypatch.setattr(loader, "bundled_gemma3_270m", lambda: gguf_path)
    llm = LLM("gemma3-270m", max_model_len=64, page_size=4, num_pages=32)
    assert llm.engine.model_config.architecture == "Qwen3ForCausalLM"
    assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_kv_cache_allocates_where_it_can_run():
    cache = PagedKVCache.allocate(4, 16, 2, 64, dtype=torch.float32)
    assert cache.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="^device: 'cuda' requested but CUDA is not available"):
            PagedKVCache.allocate(4, 16, 2, 64, device="cuda")
    with pytest.raises(ValueError, match=r"^num_pages: expected an int >= 1, got 0"):
        PagedKVCache.allocate(0, 16, 2, 64)
