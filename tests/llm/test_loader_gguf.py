"""GGUF loading: tiny checkpoints exported as llama.cpp writes them must load into the same model.

``testing.write_gguf`` applies llama.cpp's conventions (tensor names, Llama Q/K permutation, Gemma
norms + 1, Llama 3.1 rope factors, a byte-level vocabulary); loading must undo every one of them:
F32 files give the HF directory's logits bit for bit, quantized files the dequantized weights.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from warpforge.llm.config import SLIDING
from warpforge.llm.loader import GGUFFile, load, unpermute_qk
from warpforge.llm.testing import PagedDriver, hamlet_text, permute_qk, tiny_checkpoint, write_gguf

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

# Gemma 3 GGUFs carry no softmax scale: llama.cpp uses head_dim, so the tiny model must too.
ARCHS = {"llama": {}, "llama3": {}, "qwen2": {}, "qwen3": {}, "gemma3": {"query_pre_attn_scalar": 32}}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def exported(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = tiny_checkpoint(request.param, root / "hf", **ARCHS[request.param])
    return request.param, hf_dir, write_gguf(hf_dir, root / "f32.gguf"), root


def test_f32_gguf_is_the_hf_model(exported):
    arch, hf_dir, path, _ = exported
    a, b = load(hf_dir), load(path)
    ids = a.tokenizer.encode(hamlet_text()[:400])[:40]
    la = PagedDriver(a.model).step([(0, ids)])[0]
    lb = PagedDriver(b.model).step([(0, ids)])[0]
    assert torch.equal(la, lb)
    assert b.config.architecture == a.config.architecture and b.config.layer_types == a.config.layer_types
    assert b.config.tie_word_embeddings == a.config.tie_word_embeddings
    if arch == "llama3":  # scaling comes from the rope_freqs tensor, not from metadata
        assert b.config.rope_scaling is None and b.config.rope_freq_factors is not None
    if arch == "gemma3":
        assert SLIDING in b.config.layer_types and b.config.final_logit_softcapping == 30.0


def test_gguf_tokenizer_matches_the_hf_directory(exported):
    _, hf_dir, path, _ = exported
    a, b = load(hf_dir).tokenizer, load(path).tokenizer
    text = hamlet_text()[:5000] or "Who's there? Nay, answer me."
    assert b.encode(text) == a.encode(text) and b.encode(text)[0] == b.bos_token_id
    assert b.decode(a.encode(text)) == a.decode(a.encode(text))
    msgs = [{"role": "user", "content": "Who's there?"}]
    assert b.encode_chat(msgs) == a.encode_chat(msgs)


@pytest.mark.parametrize("qtype", ["Q8_0", "F16"])
def test_quantized_weights_are_dequantized(exported, qtype):
    arch, hf_dir, _, root = exported
    path = write_gguf(hf_dir, root / f"{qtype}.gguf", qtype=qtype)
    model, _, cfg = load(path)
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    t = raw["blk.1.attn_q.weight"]
    assert t.tensor_type == gguf.GGMLQuantizationType[qtype]
    want = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).copy())
    if arch in ("llama", "llama3"):  # GGUF architecture "llama": rows permuted by the converter
        want = unpermute_qk(want, cfg.num_heads)
    got = model.model.layers[1].self_attn.qkv_proj.weight[: cfg.num_heads * cfg.head_dim]
    assert torch.equal(got, want)
    ref = load(hf_dir)
    ids = list(range(5, 45))
    la = PagedDriver(ref.model).step([(0, ids)])[0]
    lb = PagedDriver(model).step([(0, ids)])[0]
    assert ((lb - la).norm() / la.norm()).item() < 5e-2  # 8-bit weights: ~1e-2 on these logits


def test_reader_agrees_with_gguf_package(exported):
    _, hf_dir, _, root = exported
    path = write_gguf(hf_dir, root / "q8.gguf", qtype="Q8_0")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.meta[key] == pytest.approx(value) if isinstance(value, float) else ours.meta[key] == value, key
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    for t in theirs.tensors:
        ttype, shape, _ = ours.tensors[t.name]
        assert ttype == t.tensor_type and shape == tuple(int(d) for d in reversed(t.shape))
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        assert np.array_equal(ours.tensor(t.name), want), t.name


def test_permutation_round_trip():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(unpermute_qk(permute_qk(w, 4), 4), w)
    assert not torch.equal(permute_qk(w, 4), w)


def test_unsupported_gguf_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' is not supported.*gemma3.*llama"):
        load(tmp_path / "x.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load(tmp_path / "x.gguf")


def test_incomplete_gguf_metadata_is_named():
    from warpforge.llm.config import ModelConfig

    meta = {"general.architecture": "qwen3", "qwen3.embedding_length": 64, "qwen3.block_count": 2,
            "qwen3.attention.head_count": 4, "tokenizer.ggml.tokens": ["a"] * 10}
    with pytest.raises(ValueError, match="missing metadata qwen3.feed_forward_length"):
        ModelConfig.from_gguf(meta, [])
    meta["qwen3.feed_forward_length"] = 128
    assert ModelConfig.from_gguf(meta, ["blk.0.attn_q_norm.weight"]).qk_norm
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        ModelConfig.from_gguf({**meta, "qwen3.rope.scaling.type": "yarn"}, [])
    no_vocab = {k: v for k, v in meta.items() if k != "tokenizer.ggml.tokens"}
    with pytest.raises(ValueError, match="no qwen3.vocab_size and no tokenizer.ggml.tokens"):
        ModelConfig.from_gguf(no_vocab, [])
