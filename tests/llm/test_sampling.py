"""SamplingParams validation: every field checked, errors name the field and the allowed range."""

from __future__ import annotations

import math

import pytest

from warpforge.llm.sampling import SamplingParams


def test_defaults_and_greedy():
    p = SamplingParams()
    assert not p.greedy and not p.has_penalties and p.stop == [] and p.stop_token_ids == []
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy  # would overflow logits / T
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties


@pytest.mark.parametrize("field,value,expected", [
    ("temperature", -0.1, "[0.0, inf)"),
    ("temperature", math.inf, "[0.0, inf)"),
    ("temperature", math.nan, "[0.0, inf)"),
    ("temperature", "hot", "[0.0, inf)"),
    ("top_p", 0.0, "(0.0, 1.0]"),
    ("top_p", 1.5, "(0.0, 1.0]"),
    ("top_k", -2, ">= -1"),
    ("top_k", 2.5, ">= -1"),
    ("top_k", True, ">= -1"),
    ("min_p", -0.01, "[0.0, 1.0]"),
    ("min_p", 1.01, "[0.0, 1.0]"),
    ("repetition_penalty", 0.0, "(0.0, inf)"),
    ("presence_penalty", 2.5, "[-2.0, 2.0]"),
    ("frequency_penalty", -3, "[-2.0, 2.0]"),
    ("seed", -1, "[0, "),
    ("seed", 1.5, "[0, "),
    ("max_tokens", 0, ">= 1"),
    ("logprobs", -1, "[0, 20]"),
    ("logprobs", 21, "[0, 20]"),
    ("stop_token_ids", [3, -4], ">= 0"),
])
def test_invalid_values_name_field_and_range(field, value, expected):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(field + ":") and expected in str(e.value)
    assert e.value.field == field and expected in e.value.problem  # a server renames the field from these


def test_stop_strings_and_flags():
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    with pytest.raises(ValueError, match="stop:"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(ValueError, match="stop:"):
        SamplingParams(stop=[3])
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos="yes")


def test_unknown_keyword_is_named():
    with pytest.raises(TypeError, match="best_of"):
        SamplingParams(best_of=2)


def test_valid_edges_accepted():
    p = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, repetition_penalty=3.0,
                       presence_penalty=-2.0, frequency_penalty=2.0, seed=2**63 - 1, max_tokens=1,
                       logprobs=0, stop_token_ids=[0])
    assert p.logprobs == 0 and p.seed == 2**63 - 1
