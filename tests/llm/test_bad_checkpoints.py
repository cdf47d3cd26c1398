"""Damaged checkpoints: every one is a ValueError naming the file, never a struct.error, an
OverflowError, a SafetensorError traceback, a huge allocation or a crash."""

from __future__ import annotations

import functools
import random
import shutil
import struct

import pytest

from warpforge.llm.loader import GGUFFile, load
from warpforge.llm.testing import tiny_checkpoint, write_gguf

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    hf = tiny_checkpoint("qwen3", root / "hf")
    return hf, write_gguf(hf, root / "good.gguf")


def _named(path, fn):
    with pytest.raises(ValueError) as e:
        fn()
    assert str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)
    return str(e.value)


def _header_end(good) -> int:
    """Where the tensor data starts (everything before it is metadata and the tensor table)."""
    gf = GGUFFile(good)
    return min(off for _, _, off in gf.tensors.values())


def test_empty_and_tiny_gguf(tmp_path):
    for data in (b"", b"GGUF", b"GGUF\x03\x00\x00\x00"):
        p = tmp_path / "x.gguf"
        p.write_bytes(data)
        assert "empty or truncated" in _named(p, functools.partial(load, p))


def test_gguf_truncated_anywhere_is_named(files, tmp_path):
    _, good = files
    raw = good.read_bytes()
    cuts = sorted({24, 40, 100, _header_end(good) - 3, _header_end(good) + 10, len(raw) - 1}
                  | set(random.Random(0).sample(range(24, len(raw)), 6)))
    for n in cuts:
        p = tmp_path / f"cut{n}.gguf"
        p.write_bytes(raw[:n])
        _named(p, functools.partial(load, p))


def test_gguf_with_a_corrupt_body_is_named(files, tmp_path):
    """A valid magic and version, then damage: huge counts and lengths, a bad value type, random bytes."""
    _, good = files
    raw = bytearray(good.read_bytes())
    end = _header_end(good)
    cases = {
        "tensor count": lambda b: b.__setitem__(slice(8, 16), struct.pack("<Q", 2**62)),
        "kv count": lambda b: b.__setitem__(slice(16, 24), struct.pack("<Q", 2**40)),
        "first key length": lambda b: b.__setitem__(slice(24, 32), struct.pack("<Q", 2**63 - 1)),
    }
    rng = random.Random(1)
    for i in range(12):  # random bytes anywhere in the metadata and tensor table
        spots = [rng.randrange(24, end) for _ in range(4)]
        cases[f"random {i}"] = lambda b, spots=spots: [b.__setitem__(s, rng.randrange(256)) for s in spots]
    for name, damage in cases.items():
        b = bytearray(raw)
        damage(b)
        p = tmp_path / "bad.gguf"
        p.write_bytes(bytes(b))
        try:
            load(p)  # some random damage hits a float or a token string and still loads: that is fine
        except ValueError as e:
            assert str(p) in str(e) and "\n" not in str(e), f"{name}: {e}"


def test_gguf_metadata_that_would_size_a_huge_model_is_refused_before_allocating(files, tmp_path):
    _, good = files
    gf = GGUFFile(good)
    meta = dict(gf.meta)
    arch = meta["general.architecture"]
    w = gguf.GGUFWriter(str(tmp_path / "huge.gguf"), arch)
    w.add_embedding_length(1 << 20)  # a corrupt size: the real tensors are 64 wide
    w.add_block_count(meta[f"{arch}.block_count"])
    w.add_feed_forward_length(1 << 22)
    w.add_head_count(meta[f"{arch}.attention.head_count"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_tokenizer_model("gpt2")
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    for name in gf.tensors:
        w.add_tensor(name, gf.tensor(name))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    msg = _named(tmp_path / "huge.gguf", lambda: load(tmp_path / "huge.gguf"))
    assert "has shape" in msg


def test_truncated_safetensors_is_named(files, tmp_path):
    hf, _ = files
    bad = tmp_path / "ckpt"
    shutil.copytree(hf, bad)
    f = bad / "model.safetensors"
    raw = f.read_bytes()
    for n in (0, 7, 100, len(raw) // 2, len(raw) - 1):
        f.write_bytes(raw[:n])
        assert "safetensors" in _named(f, lambda: load(bad))


@pytest.mark.parametrize("name, text", [("config.json", "{not json"), ("config.json", "[1, 2]"),
                                         ("tokenizer_config.json", "{\"a\": "), ("tokenizer.json", "garbage"),
                                         ("generation_config.json", "\xff\xfe")])
def test_unreadable_json_names_the_file(files, tmp_path, name, text):
    hf, _ = files
    bad = tmp_path / "ckpt"
    shutil.copytree(hf, bad)
    (bad / name).write_text(text, encoding="latin-1")
    _named(bad / name, lambda: load(bad))


def test_the_cli_says_it_in_one_line_and_exits_2(files, tmp_path):
    from click.testing import CliRunner

    from warpforge.cli import main

    _, good = files
    p = tmp_path / "cut.gguf"
    p.write_bytes(good.read_bytes()[:200])
    r = CliRunner().invoke(main, ["generate", str(p), "hi"])
    loading, err = r.stderr.split("\n", 1)  # the line before the load, then the error in one line
    assert r.exit_code == 2 and loading == f"loading {p} ..." and err.count("\n") == 1
    assert err.startswith(f"warpforge generate: {p}")
    assert "Traceback" not in r.output
