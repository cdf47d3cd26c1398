"""Put each nn.MaxPool2d of a graph on warpforge's max-pool kernel (kernels/pool.py).

Why: torch's channels_last fp16 max pool runs far below the memory bandwidth on a memory-bound op, a visible
share of ResNet-50's fp16 forward (benchmarks/notes/optimize.md). The kernel reads each pixel's channels as
16-byte vectors;
it also pools int8 codes, which the int8 pass uses after an int8 stem (optimize/quant.py). On CPU the
module calls torch (no kernel to gain there).
"""

from __future__ import annotations

from torch import fx, nn

from warpforge.kernels.pool import POOL_DTYPES, max_pool2d
from warpforge.optimize.passes import _fx
from warpforge.optimize.passes.base import PassContext


def poolable(m: nn.Module) -> bool:
    """An nn.MaxPool2d the kernel runs: no dilation, floor mode, no indices, padding <= kernel / 2."""
    if not isinstance(m, nn.MaxPool2d) or m.ceil_mode or m.return_indices:
        return False
    pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    k, p, d = pair(m.kernel_size), pair(m.padding), pair(m.dilation)
    return d == (1, 1) and p[0] <= k[0] // 2 and p[1] <= k[1] // 2


class MaxPool2d(nn.Module):
    """nn.MaxPool2d on kernels.pool.max_pool2d for 4-D fp16/bf16/fp32/int8 input (channels_last out);
    anything else (3-D input, other dtypes) through torch."""

    def __init__(self, pool: nn.MaxPool2d) -> None:
        super().__init__()
        if not poolable(pool):
            raise ValueError(f"pool: expected an nn.MaxPool2d without dilation, ceil_mode or indices, got {pool}")
        self.kernel_size, self.padding = pool.kernel_size, pool.padding
        self.stride = pool.stride if pool.stride is not None else pool.kernel_size

    def forward(self, x):
        if x.dim() == 4 and x.dtype in POOL_DTYPES:
            return max_pool2d(x, self.kernel_size, self.stride, self.padding)
        return nn.functional.max_pool2d(x, self.kernel_size, self.stride, self.padding)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class FastMaxPool:
    """Pass: each qualifying nn.MaxPool2d module becomes a :class:`MaxPool2d`."""

    name = "max_pool"

    def apply(self, model: nn.Module, ctx: PassContext) -> nn.Module:
        if not isinstance(model, fx.GraphModule):
            return model
        for node in list(model.graph.nodes):
            m = _fx.called_module(model, node)
            if type(m) is not nn.MaxPool2d:  # (a path already replaced holds a MaxPool2d of ours)
                continue
            if not poolable(m):
                ctx.record(self.name, "skipped", node.target, "dilation, ceil_mode, indices or padding > kernel / 2")
                continue
            _fx.replace_module(model, node.target, MaxPool2d(m))
            ctx.record(self.name, "replaced", node.target, "max pool kernel (kernels/pool.py)")
        _fx.finish(model)
        return model


__all__ = ["FastMaxPool", "MaxPool2d", "poolable"]
