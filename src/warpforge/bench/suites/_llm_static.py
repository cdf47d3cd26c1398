"""Suite ``llm``, the plain-PyTorch decode peer: what a performance engineer writes first for batch-1 Llama decode
when HF ``generate`` is too slow, in the style of gpt-fast.

The model is rebuilt from the same HF checkpoint as plain modules: fused qkv and gate/up projections, a static
KV cache held as module buffers, RoPE from the checkpoint's own scaling, SDPA over the cache with a position
mask. On CUDA the one-token step is compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)``
(Inductor kernels replayed as CUDA graphs), the prefill with the default mode; on the CPU it runs eager (the
fp32 reference path of ``--quick``). Greedy, batch 1. Its output is judged exactly as ours: against HF, by the
same teacher-forced check (:func:`warpforge.bench.suites.llm.hf_run` scores its continuation too).

Whether Inductor skipped its CUDA graphs (a handicapped peer: every kernel launched one by one) is recorded:
``cudagraph_skips`` counts Inductor's own "skipping cudagraphs" decisions during the peer's compile.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

NAME = "pytorch-static-cache"


def _rope_inv_freq(cfg: dict[str, Any]) -> torch.Tensor:
    """The checkpoint's RoPE frequencies, with Llama 3's scaling when it names one (as HF computes them)."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    inv = 1.0 / (cfg.get("rope_theta", 10000.0) ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rs = cfg.get("rope_scaling") or {}
    if rs.get("rope_type", rs.get("type")) == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(is_mid, mid, scaled)
    elif rs:
        raise ValueError(f"{NAME}: rope scaling {rs!r} is not supported by the peer")
    return inv.float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _Block(nn.Module):
    def __init__(self, cfg: dict[str, Any], max_len: int, dtype: torch.dtype):
        super().__init__()
        d, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or d // nh
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.wqkv = nn.Linear(d, (nh + 2 * nkv) * hd, bias=False, dtype=dtype)
        self.wo = nn.Linear(nh * hd, d, bias=False, dtype=dtype)
        self.w13 = nn.Linear(d, 2 * cfg["intermediate_size"], bias=False, dtype=dtype)
        self.w2 = nn.Linear(cfg["intermediate_size"], d, bias=False, dtype=dtype)
        self.n1 = nn.RMSNorm(d, eps=cfg["rms_norm_eps"], dtype=dtype)
        self.n2 = nn.RMSNorm(d, eps=cfg["rms_norm_eps"], dtype=dtype)
        self.register_buffer("k", torch.zeros(1, nkv, max_len, hd, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(1, nkv, max_len, hd, dtype=dtype), persistent=False)

    def forward(self, x, pos, cos, sin, mask):
        b, t, _ = x.shape
        qkv = self.wqkv(self.n1(x))
        q, k, v = qkv.split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], dim=-1)
        q = _rotate(q.view(b, t, self.nh, self.hd).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, t, self.nkv, self.hd).transpose(1, 2), cos, sin)
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v.view(b, t, self.nkv, self.hd).transpose(1, 2))
        o = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, t, self.nh * self.hd))
        gate, up = self.w13(self.n2(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class StaticLlama(nn.Module):
    """A Llama-family decoder for batch-1 greedy decode over a static cache of ``max_len`` positions."""

    def __init__(self, cfg: dict[str, Any], max_len: int, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"], dtype=dtype)
        self.layers = nn.ModuleList(_Block(cfg, max_len, dtype) for _ in range(cfg["num_hidden_layers"]))
        self.norm = nn.RMSNorm(cfg["hidden_size"], eps=cfg["rms_norm_eps"], dtype=dtype)
        self.head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False, dtype=dtype)
        ang = torch.arange(max_len, dtype=torch.float32)[:, None] * _rope_inv_freq(cfg)[None]
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("cos", ang.cos().to(dtype), persistent=False)
        self.register_buffer("sin", ang.sin().to(dtype), persistent=False)
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril(), persistent=False)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [1, t] at positions ``pos`` [t] -> logits of the last position, float32 [1, vocab]."""
        x = self.embed(ids)
        cos, sin, mask = self.cos[pos], self.sin[pos], self.causal[pos][None, None]
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        return self.head(self.norm(x[:, -1])).float()


def load_static(path: Path, max_len: int, dtype: torch.dtype, device: torch.device) -> StaticLlama:
    """The HF checkpoint at ``path`` (config.json + safetensors) as a :class:`StaticLlama`, qkv and gate/up fused."""
    from safetensors.torch import load_file

    cfg = json.loads((path / "config.json").read_text())
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"{NAME}: a Llama checkpoint is needed, got model_type {cfg.get('model_type')!r}")
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    with torch.device("meta"):
        m = StaticLlama(cfg, max_len, dtype)
    m = m.to_empty(device=device)
    w = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
    with torch.no_grad():
        m.embed.weight.copy_(w["model.embed_tokens.weight"])
        m.norm.weight.copy_(w["model.norm.weight"])
        m.head.weight.copy_(w.get("lm_head.weight", w["model.embed_tokens.weight"]))
        for i, layer in enumerate(m.layers):
            p = f"model.layers.{i}."
            layer.wqkv.weight.copy_(torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
            layer.wo.weight.copy_(w[p + "self_attn.o_proj.weight"])
            layer.w13.weight.copy_(torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
            layer.w2.weight.copy_(w[p + "mlp.down_proj.weight"])
            layer.n1.weight.copy_(w[p + "input_layernorm.weight"])
            layer.n2.weight.copy_(w[p + "post_attention_layernorm.weight"])
    # The buffers of to_empty are uninitialised: the caches zeroed, the tables computed again on the device.
    fresh = StaticLlama(cfg, max_len, dtype)
    for name, buf in fresh.named_buffers():
        m.get_buffer(name).copy_(buf)
    return m.eval()


def static_run(preset_dir: Any, prompts: Any, out_lens: list[int], *, handoff: dict | None = None):
    """A bench callable (device, rep) -> runs: greedy batch-1 decode of each prompt with :class:`StaticLlama`.
    ``preset_dir(device)`` gives the checkpoint folder; ``handoff["others"][NAME]`` receives the runs and the
    prompt/ids of request 0 so that the HF peer scores this continuation as it scores ours."""
    def fn(device: torch.device, rep: int) -> list:
        from warpforge.bench.e2e import release_memory, timed_wall
        from warpforge.bench.suite import Run

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        max_len = max(len(p) for p in prompts(0)) + max(out_lens) + 8
        model = load_static(Path(preset_dir(device)), max_len, dtype, device)
        compiled = device.type == "cuda"
        skips = 0
        prefill, step = model, model
        if compiled:
            from warpforge.bench.suites._inductor import cudagraph_skips

            before = cudagraph_skips()
            step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
            prefill = torch.compile(model, fullgraph=True, dynamic=True)

        def generate(prompt: list[int], n: int) -> list[int]:
            out = []
            with torch.inference_mode():
                ids = torch.tensor([prompt], device=device)
                pos = torch.arange(len(prompt), device=device)
                nxt = prefill(ids, pos).argmax(-1)
                for i in range(n):
                    out.append(nxt)
                    if i + 1 == n:
                        break
                    p = torch.tensor([len(prompt) + i], device=device)
                    nxt = step(nxt.view(1, 1), p).argmax(-1).clone()
            return torch.cat(out).tolist()

        warm = prompts(-1)[0]
        generate(warm, min(16, max(out_lens)))  # compile and capture (the step graph at every position count)
        generate(warm, min(16, max(out_lens)))
        if compiled:
            skips = cudagraph_skips() - before
        runs = []
        for i in range(rep):
            p = prompts(i)
            ids, wall = timed_wall(device, _one_by_one, generate, p, out_lens)
            runs.append(Run(ms=wall, tokens=sum(map(len, ids)),
                            extra={"wall_ms": wall, "batch": 1, "compile": "reduce-overhead, fullgraph" if compiled
                                   else "none (CPU: eager)", "cudagraph_skips": skips},
                            output={"ids": ids, "want": out_lens, "exact": dtype == torch.float32},
                            ran={"requests": len(p), "prompt_tokens": sum(map(len, p)),
                                 "output_tokens": sum(out_lens)}))
        if handoff is not None:
            handoff.setdefault("others", {})[NAME] = {"prompt": list(prompts(0)[0]), "ids": runs[0].output["ids"][0],
                                                      "runs": runs}
        # Rebound, not del: generate() reads step and prefill (a del there reads as an undefined name to ruff).
        model = step = prefill = None
        if compiled:
            torch._dynamo.reset()
        release_memory(device)
        return runs
    return fn


def _one_by_one(generate: Any, prompts: list, out_lens: list[int]) -> list[list[int]]:
    return [generate(list(x), n) for x, n in zip(prompts, out_lens)]


__all__ = ["NAME", "StaticLlama", "load_static", "static_run"]
