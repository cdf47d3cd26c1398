"""The architecture names the config parsers check (llm/architectures.py) are the registry's (llm/models)."""

from __future__ import annotations

import pytest

from warpforge.llm.architectures import ARCHITECTURES, GGUF_ARCHITECTURES, check_architecture
from warpforge.llm.models import MODEL_REGISTRY, resolve


def test_every_named_architecture_has_a_model_class():
    assert set(MODEL_REGISTRY) == set(ARCHITECTURES)
    assert set(GGUF_ARCHITECTURES.values()) <= set(ARCHITECTURES)


def test_an_unsupported_architecture_is_named_with_the_supported_ones():
    msg = "^unsupported architecture 'BertModel'; supported: Gemma3ForCausalLM, LlamaForCausalLM, "
    with pytest.raises(ValueError, match=msg):
        check_architecture("BertModel")
    with pytest.raises(ValueError, match=msg):
        resolve("BertModel")
