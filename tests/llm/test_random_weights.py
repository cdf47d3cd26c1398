"""Random-weight checkpoints at public shapes: shapes, shards with an index, the cache, loadable by the engine."""

from __future__ import annotations

import json

import pytest
import torch

from warpforge.llm.random_weights import PRESETS, cached_checkpoint, preset, random_checkpoint


def test_presets_have_the_public_shapes():
    b8, b1 = PRESETS["llama-8b"], PRESETS["llama-1b"]
    shape = ("num_hidden_layers", "hidden_size", "intermediate_size", "head_dim")
    assert tuple(b8[k] for k in shape) == (32, 4096, 14336, 128)
    assert not b8["tie_word_embeddings"] and b1["tie_word_embeddings"]
    assert tuple(b1[k] for k in shape) == (16, 2048, 8192, 64)
    with pytest.raises(ValueError, match="preset"):
        preset("llama-70b")


def test_shards_with_an_index_load_into_the_engine(tmp_path):
    from warpforge.llm.loader import load

    one = random_checkpoint(tmp_path / "one", "llama-tiny-untied", dtype=torch.float32)
    many = random_checkpoint(tmp_path / "many", "llama-tiny-untied", dtype=torch.float32, shard_bytes=200_000)
    index = json.loads((many / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all((many / f).is_file() for f in shards)
    assert not (one / "model.safetensors.index.json").exists()
    m1, _, cfg = load(one)
    m2, _, _ = load(many)
    assert cfg.num_layers == 3 and cfg.vocab_size == 1024
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)  # same seed, same weights


def test_cached_checkpoint_is_written_once(tmp_path):
    a = cached_checkpoint("llama-tiny", dtype=torch.float32, root=tmp_path)
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    b = cached_checkpoint("llama-tiny", dtype=torch.float32, root=tmp_path)
    assert a == b and (b / "model.safetensors").stat().st_mtime_ns == stamp
    (a / ".complete").unlink()  # an interrupted write is redone
    cached_checkpoint("llama-tiny", dtype=torch.float32, root=tmp_path)
    assert (a / ".complete").is_file()
