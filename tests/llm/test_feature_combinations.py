"""Engine features that do not compose yet are refused at start with one line naming both, before any
weight loads or any rank starts."""

from __future__ import annotations

import pytest

from warpforge.llm.engine import LLMEngine
from warpforge.llm.engine_config import EngineConfig


@pytest.mark.parametrize("kw, message", [
    (dict(speculative="ngram"), r"speculative: not available with tensor_parallel_size > 1 \(got 2\)"),
    (dict(quantization="int8"), r"quantization: not available with tensor_parallel_size > 1 \(got 2\)"),
])
def test_tensor_parallelism_refuses_what_runs_on_one_rank(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(tensor_parallel_size=2, **kw)


def test_gguf_blocks_refuse_a_second_quantization_and_tensor_parallelism(tmp_path):
    path = tmp_path / "never-read.gguf"  # the checks come before the file is opened
    with pytest.raises(ValueError, match=r"quantization: 'int4' with gguf_blocks: .*drop one of them"):
        LLMEngine(path, EngineConfig(quantization="int4"), device="cpu", gguf_blocks=True)
    with pytest.raises(ValueError, match=r"gguf_blocks: not available with tensor_parallel_size > 1"):
        LLMEngine(path, EngineConfig(tensor_parallel_size=2), device="cpu", gguf_blocks=True)
