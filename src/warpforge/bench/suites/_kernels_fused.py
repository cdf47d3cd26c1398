"""Cases for suite ``kernels`` (fused part): conv2d on ResNet-50's layers, norms, rope, gated MLP, softmax.

``cases(quick)`` is concatenated with the matmul cases by ``suites/kernels.py``.

- conv2d: every distinct conv of torchvision's resnet50 (224x224 input) at batch 1 and 32, fp16,
  channels_last, bias + relu fused, against cuDNN's conv followed by torch's relu ("cudnn+epilogue");
  plus one case per batch that runs all 53 convs with their multiplicities as one function, for the
  summed-over-the-network target. FLOPs 2*M*N*K; bytes x + weight + bias + out.
- memory-bound ops at LLM shapes against torch eager and torch.compile (GPU only) of the same math;
  bytes are the ideal read + written (what one pass must move), so GB/s compares to the HBM ceiling.

On a CPU machine (and with ``quick``) sizes are tiny; the kernels then run their torch references.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from warpforge.bench.suite import Case
from warpforge.kernels import reference as ref
from warpforge.kernels.activation import gelu_and_mul, silu_and_mul, softmax
from warpforge.kernels.conv import conv2d
from warpforge.kernels.norm import layer_norm, rms_norm
from warpforge.kernels.rope import rope, rope_cache

CL = torch.channels_last
F32 = torch.float32


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _compiled(fn: Callable) -> Callable:
    # Static shapes: each case gets the kernel inductor would pick for exactly that shape. Compiled
    # lazily on the first (checked, untimed) call; a failure there is recorded as that peer's error.
    return torch.compile(fn, dynamic=False)


def _peers(eager: Callable, gpu: bool) -> dict[str, Callable]:
    return {"torch": eager, "torch.compile": _compiled(eager)} if gpu else {"torch": eager}


# ---- conv2d: ResNet-50 --------------------------------------------------------------------------

@dataclass(frozen=True)
class ConvLayer:
    cin: int
    hw: int  # input height = width
    cout: int
    k: int
    stride: int
    count: int  # how many convs of resnet50 have exactly this shape

    @property
    def pad(self) -> int:
        return self.k // 2

    @property
    def out_hw(self) -> int:
        return (self.hw + 2 * self.pad - self.k) // self.stride + 1

    @property
    def label(self) -> str:
        return f"{self.k}x{self.k}/{self.stride} {self.cin}->{self.cout} @{self.hw}"


# torchvision resnet50 (v1.5: stride on the 3x3), 224x224 input: 53 convs, 23 distinct shapes.
RESNET50 = [
    ConvLayer(3, 224, 64, 7, 2, 1),  # stem
    ConvLayer(64, 56, 64, 1, 1, 1),  # layer1
    ConvLayer(64, 56, 64, 3, 1, 3),
    ConvLayer(64, 56, 256, 1, 1, 4),  # 3 conv3 + the downsample (same shape)
    ConvLayer(256, 56, 64, 1, 1, 2),
    ConvLayer(256, 56, 128, 1, 1, 1),  # layer2
    ConvLayer(128, 56, 128, 3, 2, 1),
    ConvLayer(128, 28, 512, 1, 1, 4),
    ConvLayer(256, 56, 512, 1, 2, 1),  # downsample
    ConvLayer(512, 28, 128, 1, 1, 3),
    ConvLayer(128, 28, 128, 3, 1, 3),
    ConvLayer(512, 28, 256, 1, 1, 1),  # layer3
    ConvLayer(256, 28, 256, 3, 2, 1),
    ConvLayer(256, 14, 1024, 1, 1, 6),
    ConvLayer(512, 28, 1024, 1, 2, 1),  # downsample
    ConvLayer(1024, 14, 256, 1, 1, 5),
    ConvLayer(256, 14, 256, 3, 1, 5),
    ConvLayer(1024, 14, 512, 1, 1, 1),  # layer4
    ConvLayer(512, 14, 512, 3, 2, 1),
    ConvLayer(512, 7, 2048, 1, 1, 3),
    ConvLayer(1024, 14, 2048, 1, 2, 1),  # downsample
    ConvLayer(2048, 7, 512, 1, 1, 2),
    ConvLayer(512, 7, 512, 3, 1, 2),
]
assert sum(layer.count for layer in RESNET50) == 53
QUICK_LAYERS = (0, 2, 3, 6, 8, 16, 22)  # stem, 3x3, 1x1, strided 3x3, strided 1x1, late layers


def _conv_counts(layer: ConvLayer, batch: int, itemsize: int) -> tuple[float, float]:
    m = batch * layer.out_hw ** 2
    k = layer.cin * layer.k ** 2
    flops = 2.0 * m * layer.cout * k
    nbytes = itemsize * (batch * layer.cin * layer.hw ** 2 + layer.cout * k + layer.cout + m * layer.cout)
    return flops, nbytes


def _conv_inputs(layer: ConvLayer, batch: int, dtype: torch.dtype, gen: torch.Generator, device) -> tuple:
    x = torch.randn(batch, layer.cin, layer.hw, layer.hw, generator=gen, device=device).to(dtype)
    # He-scaled weights keep activations O(1) through the relu.
    w = torch.randn(layer.cout, layer.cin, layer.k, layer.k, generator=gen, device=device)
    w = w * (2.0 / (layer.cin * layer.k ** 2)) ** 0.5
    b = torch.randn(layer.cout, generator=gen, device=device) * 0.1
    return x.to(memory_format=CL), w.to(dtype).to(memory_format=CL), b.to(dtype)


def _ours_conv(layer: ConvLayer) -> Callable:
    return lambda x, w, b: conv2d(x, w, b, stride=layer.stride, padding=layer.pad, activation="relu")


def _cudnn_conv(layer: ConvLayer) -> Callable:
    return lambda x, w, b: F.relu(F.conv2d(x, w, b, layer.stride, layer.pad))


def _ref_conv(layer: ConvLayer) -> Callable:
    # float32 (cuDNN has no fast float64 conv); fp16 inputs are exact in tf32, so products are exact.
    return lambda x, w, b: ref.conv2d_reference(x, w, b, stride=layer.stride, padding=layer.pad,
                                                activation="relu", compute_dtype=F32)


def _network(fn_for: Callable[[ConvLayer], Callable], layers: list[ConvLayer]) -> Callable:
    """All convs with their multiplicities in one call; inputs are (x, w, b) per distinct layer, flat."""
    fns = [fn_for(layer) for layer in layers]

    def run(*flat):
        outs = []
        for i, (layer, fn) in enumerate(zip(layers, fns)):
            x, w, b = flat[3 * i:3 * i + 3]
            for _ in range(layer.count):
                y = fn(x, w, b)
            outs.append(y)
        return tuple(outs)

    return run


def _conv_cases(quick: bool, gpu: bool) -> list[Case]:
    dtype = torch.float16
    layers = RESNET50
    if not gpu:  # CPU smoke run: the same layer list, channels and spatial size cut down
        layers = [ConvLayer(max(3, la.cin // 32), max(la.k, la.hw // 16), max(4, la.cout // 32), la.k, la.stride,
                            la.count) for la in RESNET50]
    picked = [i for i in range(len(layers)) if not quick or i in QUICK_LAYERS]
    batches = (1, 32) if gpu else (1,)
    cases = []
    for batch in batches:
        for i in picked:
            layer = layers[i]
            flops, nbytes = _conv_counts(layer, batch, dtype.itemsize)
            scaled = "" if gpu else f" [cpu-scaled {layer.label}]"
            cases.append(Case(
                name=f"conv2d fp16 b{batch} {RESNET50[i].label} +bias+relu{scaled}",
                params={"op": "conv2d", "dtype": "float16", "batch": batch, "cin": layer.cin, "hw": layer.hw,
                        "cout": layer.cout, "k": layer.k, "stride": layer.stride, "pad": layer.pad,
                        "count_in_resnet50": layer.count},
                make_inputs=lambda gen, device, la=layer, bt=batch: _conv_inputs(la, bt, dtype, gen, device),
                ours=_ours_conv(layer), peers={"cudnn+epilogue": _cudnn_conv(layer)}, reference=_ref_conv(layer),
                flops=flops, bytes=nbytes, dtype=dtype, metric="tflops",
                cuda_graph=batch == 1))  # batch 1 is launch-bound: replay graphs for both sides
        flops = sum(_conv_counts(la, batch, dtype.itemsize)[0] * la.count for la in layers)
        nbytes = sum(_conv_counts(la, batch, dtype.itemsize)[1] * la.count for la in layers)

        def net_inputs(gen, device, bt=batch):
            return tuple(t for la in layers for t in _conv_inputs(la, bt, dtype, gen, device))

        cases.append(Case(
            name=f"conv2d fp16 b{batch} resnet50 all 53 convs +bias+relu",
            params={"op": "conv2d_network", "network": "resnet50", "dtype": "float16", "batch": batch,
                    "convs": sum(la.count for la in layers), "distinct": len(layers)},
            make_inputs=net_inputs, ours=_network(_ours_conv, layers),
            peers={"cudnn+epilogue": _network(_cudnn_conv, layers)}, reference=_network(_ref_conv, layers),
            flops=flops, bytes=nbytes, dtype=dtype, metric="tflops", cuda_graph=batch == 1))
    return cases


# ---- norms --------------------------------------------------------------------------------------

EPS = 1e-6


def _rms_eager(x, r, w):
    s = x + r
    sf = s.float()
    y = sf * torch.rsqrt(sf.square().mean(-1, keepdim=True) + EPS)
    return (y * w.float()).to(x.dtype), s


def _ln_eager(x, r, w, b):
    s = x + r
    return F.layer_norm(s, (s.shape[-1],), w, b, EPS), s


def _norm_cases(gpu: bool) -> list[Case]:
    m, n = (16384, 4096) if gpu else (64, 256)
    dtype = torch.bfloat16
    nbytes = 4 * m * n * dtype.itemsize + n * dtype.itemsize  # read x, r; write out, new residual; weight

    def inputs(gen, device, with_bias=False):
        x = torch.randn(m, n, generator=gen, device=device).to(dtype)
        r = torch.randn(m, n, generator=gen, device=device).to(dtype)
        w = (1 + 0.1 * torch.randn(n, generator=gen, device=device)).to(dtype)
        b = (0.1 * torch.randn(n, generator=gen, device=device)).to(dtype)
        return (x, r, w, b) if with_bias else (x, r, w)

    params = {"dtype": _name(dtype), "M": m, "N": n, "residual": True}
    return [
        Case(name=f"rms_norm+residual bf16 {m}x{n}", params={"op": "rms_norm", **params},
             make_inputs=inputs, ours=lambda x, r, w: rms_norm(x, w, EPS, residual=r),
             peers=_peers(_rms_eager, gpu),
             reference=lambda x, r, w: ref.rms_norm_reference(x, w, EPS, residual=r),
             flops=4.0 * m * n, bytes=nbytes, dtype=dtype, metric="GBps"),
        Case(name=f"layer_norm+residual bf16 {m}x{n}", params={"op": "layer_norm", **params},
             make_inputs=lambda gen, device: inputs(gen, device, True),
             ours=lambda x, r, w, b: layer_norm(x, w, b, EPS, residual=r),
             peers=_peers(_ln_eager, gpu),
             reference=lambda x, r, w, b: ref.layer_norm_reference(x, w, b, EPS, residual=r),
             flops=7.0 * m * n, bytes=nbytes + n * dtype.itemsize, dtype=dtype, metric="GBps"),
    ]


# ---- rope ---------------------------------------------------------------------------------------

def _rope_eager(q, k, pos, cache):
    # Out of place (torch's natural form; same bytes as in place): cat of the rotated halves.
    half = cache.shape[1] // 2
    cs = cache[pos]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rot(t):
        x1, x2 = t[..., :half].float(), t[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(t.dtype)

    return rot(q), rot(k)


def _rope_cases(gpu: bool) -> list[Case]:
    hq, hk, d, max_pos = 32, 8, 128, 8192  # Llama-3-8B attention
    dtype = torch.bfloat16
    cases = []
    for t in ((4096, 256) if gpu else (16,)):
        def inputs(gen, device, t=t):
            q = torch.randn(t, hq, d, generator=gen, device=device).to(dtype)
            k = torch.randn(t, hk, d, generator=gen, device=device).to(dtype)
            pos = torch.randint(0, max_pos, (t,), generator=gen, device=device)
            return q, k, pos, rope_cache(max_pos, d, base=500000.0, device=device)

        def reference(q, k, pos, cache):
            return ref.rope_reference(q, k, pos, cache[:, :d // 2], cache[:, d // 2:], layout="neox")

        cases.append(Case(
            name=f"rope neox bf16 T{t} q{hq} k{hk} d{d}",
            params={"op": "rope", "dtype": _name(dtype), "T": t, "Hq": hq, "Hk": hk, "D": d, "layout": "neox"},
            make_inputs=inputs, ours=lambda q, k, pos, cache: rope(q, k, pos, cache, check_values=False),
            peers=_peers(_rope_eager, gpu), reference=reference,
            flops=6.0 * t * (hq + hk) * d // 2,
            bytes=2 * t * (hq + hk) * d * dtype.itemsize + t * d * 4 + t * 8,  # q, k in + out; cos/sin; positions
            dtype=dtype, metric="GBps", cuda_graph=t <= 256))
    return cases


# ---- gated MLP and softmax ----------------------------------------------------------------------

def _silu_eager(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _gelu_tanh_eager(x):
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def _softmax_eager(x):
    return torch.softmax(x, dim=-1)


def _randn_inputs(shape, dtype, scale=1.0):
    return lambda gen, device: ((torch.randn(shape, generator=gen, device=device) * scale).to(dtype),)


def _elementwise_cases(gpu: bool) -> list[Case]:
    m, d = (4096, 14336) if gpu else (16, 64)  # Llama-3-8B MLP, a 4096-token prefill
    dtype = torch.bfloat16
    gated_bytes = 3 * m * d * dtype.itemsize  # read [m, 2d], write [m, d]
    cases = [
        Case(name=f"silu_and_mul bf16 {m}x{2 * d}", params={"op": "silu_and_mul", "dtype": "bfloat16", "M": m, "D": d},
             make_inputs=_randn_inputs((m, 2 * d), dtype), ours=silu_and_mul, peers=_peers(_silu_eager, gpu),
             reference=ref.silu_and_mul_reference, flops=5.0 * m * d, bytes=gated_bytes, dtype=dtype),
        Case(name=f"gelu_tanh_and_mul bf16 {m}x{2 * d}",
             params={"op": "gelu_and_mul", "approximate": "tanh", "dtype": "bfloat16", "M": m, "D": d},
             make_inputs=_randn_inputs((m, 2 * d), dtype), ours=lambda x: gelu_and_mul(x, "tanh"),
             peers=_peers(_gelu_tanh_eager, gpu), reference=lambda x: ref.gelu_and_mul_reference(x, "tanh"),
             flops=12.0 * m * d, bytes=gated_bytes, dtype=dtype),
    ]
    shapes = [(4096, 32768), (32 * 4096, 4096), (512, 131072)] if gpu else [(16, 512), (64, 64)]
    for rows, n in shapes:
        for dtype in (torch.float16, torch.bfloat16):
            cases.append(Case(
                name=f"softmax {_name(dtype)} {rows}x{n}",
                params={"op": "softmax", "dtype": _name(dtype), "M": rows, "N": n},
                # Scale 4: a realistic logit spread, so the max shift matters.
                make_inputs=_randn_inputs((rows, n), dtype, 4.0), ours=softmax, peers=_peers(_softmax_eager, gpu),
                reference=ref.softmax_reference, flops=4.0 * rows * n,
                bytes=2 * rows * n * dtype.itemsize,  # one read, one write (the looped variant re-reads from L2)
                dtype=dtype))
    return cases


def cases(quick: bool) -> list[Case]:
    """Every fused-kernel case; ``quick`` keeps 7 representative conv layers."""
    gpu = torch.cuda.is_available()
    return (_conv_cases(quick, gpu) + _norm_cases(gpu) + _rope_cases(gpu) + _elementwise_cases(gpu))
