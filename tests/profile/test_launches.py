"""record_launches: Triton launches are recorded and skipped, torch ops that launch a kernel recorded."""

from __future__ import annotations

import torch

from warpforge.kernels.conv import conv2d
from warpforge.kernels.quantize import quantize_int8
from warpforge.profile.launches import record_launches

CL = torch.channels_last


def test_records_triton_launches_without_running_them():
    x = torch.randn(2, 16, 5, 5).to(memory_format=CL)
    w = torch.randn(8, 16, 1, 1)
    out = torch.full((2, 8, 5, 5), 7.0).to(memory_format=CL)
    with record_launches() as log:
        conv2d(x, w, activation="relu", out=out)
        q = quantize_int8(out, 0.1)
        (out + 1.0).permute(0, 2, 3, 1).reshape(-1)  # a torch kernel, then views (no kernel)
    assert torch.equal(out, torch.full_like(out, 7.0)), "the conv kernel ran"
    assert q.dtype == torch.int8
    names = [(x.kind, x.name) for x in log.launches]
    assert names == [("triton", "_conv_gemm_kernel"), ("triton", "_quantize_int8_kernel"), ("torch", "add")], names
    conv = log.launches[0]
    assert "MODE=0" in conv.detail and "ACT=1" in conv.detail
    assert conv.bytes == (x.numel() + w.numel() + out.numel()) * 4  # x, weight, out: each once
    s = log.summary()
    assert s["total"] == 3 and s["triton"] == 2 and s["torch"] == 1
    assert s["by_name"] == {"triton:_conv_gemm_kernel": 1, "triton:_quantize_int8_kernel": 1, "torch:add": 1}
    assert "total 3 launches (2 Triton, 1 torch)" in log.table()


def test_restores_the_launchers_afterwards():
    from triton.runtime import interpreter, jit

    runs = (jit.JITFunction.run, interpreter.InterpretedFunction.run)
    with record_launches():
        pass
    assert (jit.JITFunction.run, interpreter.InterpretedFunction.run) == runs
    x = torch.randn(1, 16, 3, 3).to(memory_format=CL)
    w = torch.randn(4, 16, 1, 1)
    torch.testing.assert_close(conv2d(x, w), torch.nn.functional.conv2d(x, w))  # outside: the reference runs
