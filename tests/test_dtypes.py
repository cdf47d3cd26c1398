"""One table of dtype spellings (warpforge.dtypes): the Python API, the configs and the CLIs take the same ones."""

from __future__ import annotations

import pytest
import torch

from warpforge import dtypes
from warpforge.llm.config import to_dtype
from warpforge.serve.config import TORCH_DTYPES, ServeConfig

SPELLINGS = {"fp32": ["fp32", "float32", "FP32", "torch.float32", "float"],
             "fp16": ["fp16", "float16", "half", "torch.float16"],
             "bf16": ["bf16", "bfloat16", "torch.bfloat16"]}
TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("short", list(SPELLINGS))
def test_every_spelling_means_the_same_dtype_everywhere(short):
    for name in SPELLINGS[short]:
        assert dtypes.short_name(name) == short
        assert to_dtype(name) is TORCH[short]  # LLM(dtype=...), LLMEngine, the loaders
        cfg = ServeConfig(model="m", dtype=name)  # warpforge serve's config
        assert cfg.dtype == short and getattr(torch, TORCH_DTYPES[cfg.dtype]) is TORCH[short]


def test_auto_and_bad_spellings():
    assert dtypes.torch_name("auto") is None and dtypes.torch_name("half") == "float16"
    assert to_dtype("auto", torch.bfloat16) is torch.bfloat16 and to_dtype(None) is torch.float32
    assert ServeConfig(model="m").dtype == "auto"
    for bad in ("fp4", "int8", 16):
        with pytest.raises(ValueError, match=r"^dtype: expected one of \['fp32', 'float32', 'float', 'fp16'"):
            to_dtype(bad)
        with pytest.raises(ValueError, match=r"^dtype: expected one of \['auto', 'fp32'"):
            ServeConfig(model="m", dtype=bad)
    with pytest.raises(ValueError, match="dtype: expected one of"):
        to_dtype(torch.float64)


def test_the_cli_takes_the_same_spellings():
    from warpforge.cli import DTYPE_ALIASES

    assert DTYPE_ALIASES is dtypes.ALIASES
