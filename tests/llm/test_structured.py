"""Structured outputs in the engine (llm/structured.py) on the tiny random Llama: a few hundred seeded JSON
schemas (nested objects, arrays, enums, bounded numbers, required fields, $ref) whose every output parses
and validates, regexes and choices matched whole, constrained and free requests sharing a batch, bad
constraints refused by name, and speculative decoding next to constrained rows.

A random model is the hard case for a grammar: it never "wants" to close a string or an array, so the
schemas bound what can repeat (maxLength, maxItems) and the requests sample at temperature 1, where the
grammar's exits are as likely as any other allowed token."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from tests.llm.engine_helpers import checkpoint, loaded, one_thread  # noqa: F401
from warpforge.llm import LLM, SamplingParams, StructuredOutputsParams
from warpforge.llm.engine import LLMEngine
from warpforge.llm.engine_config import EngineConfig

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

NUM_SCHEMAS = 200
PROMPTS = ["Who's there?", "The king", "To be, or not to be", "Long live the king!"]


def llm(**kw) -> LLM:
    engine = LLMEngine(loaded("llama"), EngineConfig(max_model_len=256, num_pages=1024, page_size=16, **kw))
    out = LLM.__new__(LLM)
    out.engine, out.tokenizer = engine, engine.tokenizer
    return out


def _scalar(r: random.Random) -> dict:
    kind = r.choice(["int", "number", "bool", "enum", "string", "null", "const"])
    if kind == "int":
        lo = r.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + r.randint(0, 500)}
    if kind == "number":
        lo = r.uniform(-10, 10)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + r.uniform(1, 100), 2)}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": r.sample(["red", "green", "blue", "to be", "not", 7, None, True], r.randint(1, 4))}
    if kind == "string":
        hi = r.randint(0, 8)
        return {"type": "string", "minLength": r.randint(0, hi), "maxLength": hi}
    if kind == "const":
        return {"const": r.choice(["ghost", 42, False])}
    return {"type": "null"}


def _schema(r: random.Random, depth: int, defs: dict) -> dict:
    roll = r.random()
    if depth == 0 or roll < 0.45:
        if defs and r.random() < 0.2:
            return {"$ref": f"#/$defs/{r.choice(sorted(defs))}"}
        return _scalar(r)
    if roll < 0.7:
        return {"type": "array", "items": _schema(r, depth - 1, defs), "minItems": r.randint(0, 1),
                "maxItems": r.randint(1, 2)}
    names = r.sample(["name", "age", "king", "ghost", "act", "scene", "line", "cue"], r.randint(1, 3))
    props = {n: _schema(r, depth - 1, defs) for n in names}
    return {"type": "object", "properties": props, "required": r.sample(names, r.randint(0, len(names))),
            "additionalProperties": False}


def make_schema(seed: int) -> dict:
    """A seeded random schema: up to 3 levels, sometimes with $defs reached through $ref."""
    r = random.Random(seed)
    defs = {f"d{i}": _scalar(r) for i in range(r.randint(0, 2))}
    schema = _schema(r, 3, defs)
    if schema.get("type") != "object":  # a top-level object holding it: the common API shape
        schema = {"type": "object", "properties": {"value": schema}, "required": ["value"]}
    if defs:
        schema["$defs"] = defs
    return schema


def test_generated_schemas_parse_and_validate():
    schemas = [make_schema(i) for i in range(NUM_SCHEMAS)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=192, structured_outputs=StructuredOutputsParams(
        json=s, disable_any_whitespace=True)) for i, s in enumerate(schemas)]
    outs = llm(max_num_seqs=NUM_SCHEMAS).generate([PROMPTS[i % len(PROMPTS)] for i in range(NUM_SCHEMAS)], params)
    for i, (schema, out) in enumerate(zip(schemas, outs)):
        assert out.finish_reason == "stop", (i, schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)  # strict json: no raw control characters either


def test_free_whitespace_is_bounded():
    """Without disable_any_whitespace a random model pads every gap it can (up to MAX_JSON_WHITESPACE);
    what finishes still validates."""
    from warpforge.llm.structured import MAX_JSON_WHITESPACE

    schemas = [make_schema(1000 + i) for i in range(16)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=128, structured_outputs={"json": s})
              for i, s in enumerate(schemas)]
    outs = llm().generate([PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))], params)
    done = [(s, o.text) for s, o in zip(schemas, outs) if o.finish_reason == "stop"]
    assert len(done) >= 4
    for schema, text in done:
        jsonschema.validate(json.loads(text), schema)
    runs = [len(m) for o in outs for m in re.findall(r"\s+", o.text)]
    assert max(runs) <= MAX_JSON_WHITESPACE


def test_regex_choice_grammar_and_json_object():
    rng = random.Random(0)
    regexes = [rf"[a-z]{{{n}}}-\d{{{m}}}" for n, m in ((rng.randint(1, 5), rng.randint(1, 4)) for _ in range(12))]
    regexes += [r"(yes|no|maybe)", r"\d{3}\.\d{2}", r"[A-Z][a-z]{2,5} (is|was) [a-z]{1,6}"]
    choices = [["Hamlet", "Ophelia", "Polonius"], ["to be", "not to be"], ["a", "ab", "abc"], ["ü", "naïve"]]
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'  # * unbounded: sampled exits end it
    so = [StructuredOutputsParams(regex=x) for x in regexes] + [StructuredOutputsParams(choice=c) for c in choices]
    so += [StructuredOutputsParams(grammar=grammar),
           StructuredOutputsParams(json_object=True, disable_any_whitespace=True)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=s) for i, s in enumerate(so)]
    outs = llm().generate([PROMPTS[i % len(PROMPTS)] for i in range(len(so))], params)
    for x, out in zip(regexes, outs):
        assert re.fullmatch(x, out.text) and out.finish_reason == "stop", (x, out.text)
    for c, out in zip(choices, outs[len(regexes):]):
        assert out.text in c and out.finish_reason == "stop", (c, out.text)
    assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", outs[-2].text), outs[-2].text
    assert isinstance(json.loads(outs[-1].text), dict) or outs[-1].finish_reason == "length"


def test_free_requests_beside_constrained_ones_are_unchanged():
    """Greedy ids of unconstrained requests are the same alone and in a batch with constrained ones."""
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine = llm()
    alone = [o.token_ids for o in engine.generate(PROMPTS[:2], free)]
    so = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"choice": ["yes", "no"]})
    mixed = engine.generate(PROMPTS[:2] + PROMPTS[2:], [free, free, so, so])
    assert [o.token_ids for o in mixed[:2]] == alone
    assert all(o.text in ("yes", "no") for o in mixed[2:])


def test_unconstrained_steps_build_no_bitmask():
    from warpforge.llm.sampler import SamplingTensors
    from warpforge.llm.sequence import Sequence

    seqs = [Sequence([1, 2, 3], SamplingParams()) for _ in range(3)]
    st = SamplingTensors.from_sequences(seqs, 512, "cpu")
    assert st.token_bitmask is None and st.bitmask_rows is None
    engine = llm().engine
    seqs[1].grammar = engine.grammars.matcher(StructuredOutputsParams(regex="ab"))
    st = SamplingTensors.from_sequences(seqs, 512, "cpu")
    assert st.bitmask_rows == [1] and st.token_bitmask.shape == (3, 16)
    logits = torch.zeros(3, 512)
    out = engine.runner.sampler(logits, st).token_ids.tolist()
    assert engine.tokenizer.decode([out[1]]) in ("a", "ab")  # the only tokens the grammar allows first


def test_ignore_eos_still_ends_a_finished_grammar():
    out = llm().generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                    structured_outputs={"choice": ["to be or not"]}))[0]
    assert out.text == "to be or not" and out.finish_reason == "stop"


@pytest.mark.parametrize("so, message", [
    ({"json": {"type": "wibble"}}, "structured_outputs.json: not a usable JSON schema: Unsupported type"),
    ({"json": "{not json"}, "structured_outputs.json: not a usable JSON schema"),
    ({"regex": "[a-"}, "structured_outputs.regex: not a usable regex"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar: not a usable EBNF grammar"),
    ({"choice": []}, "structured_outputs.choice: expected a non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs: expected exactly one of"),
    ({"jsn": {}}, "structured_outputs: unknown settings ['jsn']"),
])
def test_bad_constraints_are_refused_by_name(so, message):
    engine = llm()
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.generate(PROMPTS[0], SamplingParams(structured_outputs=so))
    assert not engine.engine.has_unfinished()


def test_speculative_decoding_beside_constrained_rows():
    """Constrained rows never draft; they decode one masked token per step in the drafting batch."""
    m = LLM(str(checkpoint("llama")), device="cpu", max_model_len=128,
            speculative={"method": "ngram", "k": 3, "adaptive": False})
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # repeats: prompt lookup drafts for the free row
    outs = m.generate([prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                         SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={
                                             "regex": "[a-z]{3,6}"})])
    assert len(outs[0].token_ids) == 16 and re.fullmatch("[a-z]{3,6}", outs[1].text)
    assert m.engine.spec.stats.num_draft_tokens > 0
