"""Tokenizer: HF directories against transformers' AutoTokenizer, GGUF sentencepiece vocabularies
against transformers' GGUF converter, chat templates, errors."""

from __future__ import annotations

import json

import pytest

from warpforge.llm.testing import BOS_ID, CHAT_TEMPLATE, EOS_ID, hamlet_text, tiny_checkpoint
from warpforge.llm.tokenizer import GEMMA_CHAT_TEMPLATE, Tokenizer, spm_merges

transformers = pytest.importorskip("transformers")

TEXT = (hamlet_text()[:6000] or "Who's there? Nay, answer me: stand, and unfold yourself.") + \
    "  two  spaces,\ttabs\n\n\nnewlines, digits 12345, émigré — «quotes» 😀"
MESSAGES = [{"role": "system", "content": "You are Horatio."}, {"role": "user", "content": "Who's there?"},
            {"role": "assistant", "content": "Friends to this ground."}, {"role": "user", "content": "Stand, ho!"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_checkpoint("qwen3", tmp_path_factory.mktemp("tok"))
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path), path


def test_encode_decode_match_transformers(tiny):
    ours, hf, _ = tiny
    for add in (True, False):
        assert ours.encode(TEXT, add_special_tokens=add) == hf.encode(TEXT, add_special_tokens=add)
    ids = ours.encode(TEXT)
    assert ids[0] == BOS_ID == ours.bos_token_id and ours.eos_token_ids == [EOS_ID]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids) == TEXT  # byte-level BPE round-trips any text
    assert ours.vocab_size == len(hf)


def test_chat_template_matches_transformers(tiny):
    ours, hf, _ = tiny
    for gen in (True, False):
        text = ours.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.encode_chat(MESSAGES) == list(ids) and ours.encode_chat(MESSAGES).count(BOS_ID) == 1


def test_chat_template_file_and_list_forms(tiny, tmp_path):
    _, _, path = tiny
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((path / name).read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHAT_TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_dir(tmp_path).chat_template == CHAT_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES) == "You are Horatio."


def test_a_new_template_replaces_the_compiled_one_and_a_copy_leaves_the_original(tiny):
    _, _, path = tiny
    tok = Tokenizer.from_dir(path)
    before = tok.apply_chat_template(MESSAGES)  # compiles and caches the checkpoint's template
    other = tok.with_chat_template("{{ messages[0]['content'] }}")
    assert other.apply_chat_template(MESSAGES) == "You are Horatio."
    assert tok.apply_chat_template(MESSAGES) == before  # the original (say, the engine's) is unchanged
    tok.chat_template = "{{ messages[-1]['content'] }}"  # set in place: the cached compiled template is dropped
    assert tok.apply_chat_template(MESSAGES) == MESSAGES[-1]["content"]


def test_errors(tiny, tmp_path):
    ours, _, path = tiny
    with pytest.raises(ValueError, match="messages"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match="text: expected a str"):
        ours.encode(["a"])
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text((path / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="tokenizer model 'bert'"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


# ---- GGUF sentencepiece vocabularies (Llama 2 style and Gemma style) --------------------------


@pytest.fixture(scope="module")
def spm_vocab():
    """A sentencepiece-like vocabulary as llama.cpp stores it: control tokens, 256 byte tokens,
    "▁"-words from a BPE trained on Hamlet, a user-defined "\\n\\n", whitespace tokens with real spaces."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Backend(BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(TEXT.splitlines(), BpeTrainer(vocab_size=600, show_progress=False))
    learned = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + ["\n\n", "  ", "   "] + learned
    types = [3] * len(specials) + [6] * 256 + [4, 1, 1] + [1] * len(learned)
    return tokens, types


def _meta(tokens, types, arch):
    return {"general.architecture": arch, "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))], "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.add_space_prefix": arch != "gemma3"}


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_gguf_sentencepiece_matches_transformers_converter(spm_vocab, arch):
    conv = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    tokens, types = spm_vocab
    meta = _meta(tokens, types, arch)
    ours = Tokenizer.from_gguf(meta)
    hf_dict = {"tokenizer_type": "llama", "tokens": tokens, "scores": meta["tokenizer.ggml.scores"],
               "token_type": types, "bos_token_id": 2, "eos_token_id": 1, "unk_token_id": 3, "pad_token_id": 0,
               "add_prefix_space": arch != "gemma3"}
    hf, _ = conv.convert_gguf_tokenizer(arch, hf_dict)
    text = TEXT + " <start_of_turn>user\nhi<end_of_turn>\n\n"
    ids = ours.encode(text, add_special_tokens=False)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert ours.token_to_id("<start_of_turn>") in ids and any(tokens[i].startswith("<0x") for i in ids)  # byte fallback
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert ours.encode("Who")[0] == 2  # add_bos_token defaults on for sentencepiece files
    if arch == "gemma3":  # Gemma files often lack a template; Gemma 3's own is the fallback
        assert ours.chat_template == GEMMA_CHAT_TEMPLATE and ours.eos_token_ids == [1, 5]


def test_spm_merges_order_matches_transformers():
    utils = pytest.importorskip("transformers.tokenization_utils_base")
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "abca", "▁", "▁a", "▁ab"]
    rank = {t: -i for i, t in enumerate(tokens)}
    assert spm_merges(tokens, rank) == utils.generate_merges({t: i for i, t in enumerate(tokens)}, rank)


def test_gemma_chat_prompt_is_token_for_token_transformers(spm_vocab):
    """The fallback a Gemma GGUF without a template gets is Gemma 3's published template: rendered and
    tokenized, the prompt equals transformers' apply_chat_template with that template, token for token,
    on a Gemma-style vocabulary (system prompt folded into the first turn, contents trimmed, content
    given as a list of parts, generation prompt on and off); and the user is told it is a fallback."""
    conv = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    tokens, types = spm_vocab
    meta = {**_meta(tokens, types, "gemma3"), "general.name": "Tiny Gemma"}
    ours = Tokenizer.from_gguf(meta)
    assert ours.chat_template == GEMMA_CHAT_TEMPLATE
    assert ours.chat_template_note.startswith("Tiny Gemma carries no chat template: using Gemma 3's published one")
    hf_dict = {"tokenizer_type": "llama", "tokens": tokens, "scores": meta["tokenizer.ggml.scores"],
               "token_type": types, "bos_token_id": 2, "eos_token_id": 1, "unk_token_id": 3, "pad_token_id": 0,
               "add_prefix_space": False}
    backend, _ = conv.convert_gguf_tokenizer("gemma3", hf_dict)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>")
    conversations = [
        MESSAGES,
        [{"role": "user", "content": "  Who's there?\n"}],
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "text", "text": " Stand, ho! "}]}],
    ]
    for messages in conversations:
        for gen in (True, False):
            want = hf.apply_chat_template(messages, chat_template=GEMMA_CHAT_TEMPLATE, tokenize=True,
                                          add_generation_prompt=gen, return_dict=False)
            assert ours.encode_chat(messages, add_generation_prompt=gen) == list(want)
            assert want[0] == 2 and list(want).count(2) == 1  # one <bos>, written by the template
    with_template = Tokenizer.from_gguf({**meta, "tokenizer.chat_template": "{{ messages[0]['content'] }}"})
    assert with_template.chat_template_note is None  # the file's own template: nothing to say


def test_gemma_template_renders_gemma_turns():
    tok = Tokenizer(Tokenizer.from_gguf({"general.architecture": "gemma3", "tokenizer.ggml.model": "gpt2",
                                         "tokenizer.ggml.tokens": ["<bos>", "a"], "tokenizer.ggml.merges": [],
                                         "tokenizer.ggml.bos_token_id": 0}).backend,
                    bos_token="<bos>", chat_template=GEMMA_CHAT_TEMPLATE)
    assert tok.apply_chat_template(MESSAGES) == (
        "<bos><start_of_turn>user\nYou are Horatio.\n\nWho's there?<end_of_turn>\n"
        "<start_of_turn>model\nFriends to this ground.<end_of_turn>\n"
        "<start_of_turn>user\nStand, ho!<end_of_turn>\n<start_of_turn>model\n")
    with pytest.raises(Exception, match="alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
