"""Synthetic Kineto-shaped timelines for the analysis tests, with the counted work that goes with them.

A host clock and a device clock advance as a real eager run would: each op takes host time, its
launch calls sit inside it, and each kernel starts when the device is free and its launch has
returned (+ the GPU's own queue latency). Device work of one launch shares its correlation id.

``bare=True`` builds what the light window records of the same run (CUDA activity alone: launch calls, syncs
and device work; no operator or module spans, no iteration ranges), ``host_scale`` scales the host's costs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from warpforge.hw.roofline import Ceilings
from warpforge.profile.events import module_annotation
from warpforge.profile.events import ITER_ANNOTATION, GpuEvent, HostSpan, Trace
from warpforge.profile.flops import Counts, OpCount

H200 = Ceilings(device="NVIDIA H200", hbm_GBps=4800.0,
                tflops={"fp32": 67.0, "tf32": 494.5, "fp16": 989.5, "bf16": 989.5, "fp8": 1979.0, "int8": 1979.0},
                l2_GBps=9000.0, source="synthetic test ceilings")


@dataclass
class Builder:
    root_type: str = "Toy"
    queue_us: float = 1.0  # device latency between a launch returning and the kernel starting
    t: float = 0.0  # host clock
    g: float = 0.0  # device free at
    corr: int = 0
    host: list[HostSpan] = field(default_factory=list)
    gpu: list[GpuEvent] = field(default_factory=list)
    records: list[OpCount] = field(default_factory=list)
    iteration_index: int = -1
    count_now: bool = False  # record counted work (first iteration only: the counter runs once)
    bare: bool = False  # runtime calls and device work only, as under the CUDA activity alone
    host_scale: float = 1.0  # the host's costs (ops, launches, module hooks, Python) scaled by this

    def _keep(self, span: HostSpan) -> None:
        if not (self.bare and span.kind in ("op", "annotation")):
            self.host.append(span)

    def _host(self, us: float) -> None:
        self.t += us * self.host_scale

    @contextlib.contextmanager
    def iteration(self):
        self.iteration_index += 1
        self.count_now = self.iteration_index == 0
        t0 = self.t
        yield
        self._host(0.5)
        self._keep(HostSpan(ITER_ANNOTATION, "annotation", t0, self.t - t0))

    @contextlib.contextmanager
    def module(self, path: str):
        t0 = self.t
        self._host(0.3)
        self._path = getattr(self, "_path", [])
        self._path.append(path)
        yield
        self._path.pop()
        self._host(0.3)
        self._keep(HostSpan(module_annotation(path, self.root_type), "op", t0, self.t - t0))

    @contextlib.contextmanager
    def region(self, name: str):
        """A host range that is not an aten op (a compiled region, a user record_function)."""
        t0 = self.t
        self._host(0.5)
        yield
        self._host(0.5)
        self._keep(HostSpan(name, "op", t0, self.t - t0))

    @property
    def path(self) -> str:
        p = getattr(self, "_path", [])
        return p[-1] if p else ""

    def _launch(self, kernels: list[tuple[str, float]], name: str = "cudaLaunchKernel", kind: str = "kernel",
                launch_us: float = 4.0, nbytes: int | None = None) -> None:
        for kname, dur in kernels:
            self.corr += 1
            t0 = self.t
            self._host(launch_us)
            self.host.append(HostSpan(name, "runtime", t0, self.t - t0, correlation=self.corr))
            start = max(self.g, self.t + self.queue_us)
            self.gpu.append(GpuEvent(kname, kind, start, dur, stream=7, correlation=self.corr, bytes=nbytes))
            self.g = start + dur
            self._host(0.2)

    def op(self, name: str, kernels: list[tuple[str, float]], *, flops: float = 0, nbytes: float = 0,
           kind: str = "pointwise", ceiling: str = "fp32", host_us: float = 2.0, inner: str | None = None,
           counted: bool = True) -> None:
        """An aten op (optionally wrapping an inner op that does the launching, like linear -> addmm)."""
        t0 = self.t
        self._host(host_us / 2)
        if inner is not None:
            ti = self.t
            self._launch(kernels)
            self._keep(HostSpan(inner, "op", ti, self.t - ti))
        else:
            self._launch(kernels)
        self._host(host_us / 2)
        self._keep(HostSpan(name, "op", t0, self.t - t0))
        if self.count_now and counted:
            self.records.append(OpCount(self.path, name, kind, int(flops), int(nbytes), ceiling, ""))

    def triton(self, kname: str, dur: float, *, nbytes: float) -> None:
        """A Triton kernel launched from Python: a bare driver launch, no aten op around it."""
        self._launch([(kname, dur)], name="cuLaunchKernelEx")
        if self.count_now:
            self.records.append(OpCount(self.path, f"triton::{kname}", "triton", 0, int(nbytes), "fp32", ""))

    def graph(self, kernels: list[tuple[str, float]]) -> None:
        """One cudaGraphLaunch replaying several kernels back to back."""
        self.corr += 1
        t0 = self.t
        self._host(6.0)
        self.host.append(HostSpan("cudaGraphLaunch", "runtime", t0, self.t - t0, correlation=self.corr))
        start = max(self.g, self.t + self.queue_us)
        for kname, dur in kernels:
            self.gpu.append(GpuEvent(kname, "kernel", start, dur, stream=7, correlation=self.corr))
            start += dur + 0.3
        self.g = start

    def memcpy(self, nbytes: int, dur: float) -> None:
        t0 = self.t
        self._launch([("Memcpy HtoD (Pageable -> Device)", dur)], name="cudaMemcpyAsync", kind="memcpy",
                     nbytes=nbytes)
        self._keep(HostSpan("aten::copy_", "op", t0, self.t - t0))
        if self.count_now:
            self.records.append(OpCount(self.path, "aten::copy_", "movement", 0, 2 * nbytes, "fp32", ""))

    def sync(self) -> None:
        """aten::item: the host blocks until the device is done."""
        t0 = self.t
        end = max(self.g, self.t) + 2.0
        self.host.append(HostSpan("cudaStreamSynchronize", "runtime", self.t + 0.5, end - self.t - 0.5,
                                  correlation=None))
        self.t = end + 0.5
        self._keep(HostSpan("aten::item", "op", t0, self.t - t0))

    def python(self, us: float) -> None:
        """Host work outside any op (Python between calls)."""
        self._host(us)

    def pad(self, us: float) -> None:
        """The GPU sleep the capture queues in front of a window (outside any iteration)."""
        self._launch([("at::cuda::(anonymous namespace)::spin_kernel(long)", us)], launch_us=3.0)

    def trace(self) -> Trace:
        return Trace(host=list(self.host), gpu=list(self.gpu), device_type="cuda")

    def counts(self) -> Counts:
        return Counts(records=list(self.records))


def launch_bound_toy(n: int = 1000) -> Builder:
    """n kernels of 2 us, each launched by an op of 10 us of host time: the GPU idles ~8 us between."""
    b = Builder()
    with b.iteration():
        for _ in range(n):
            b.op("aten::add", [("void at::native::vectorized_elementwise_kernel<4, AddFunctor<float>>()", 2.0)],
                 flops=1024, nbytes=12288, host_us=5.8)
    return b


def bandwidth_bound_toy(fraction: float = 0.9, iters: int = 3) -> Builder:
    """One long copy-like kernel per iteration at ``fraction`` of the HBM roof (1 ms each)."""
    b = Builder()
    nbytes = fraction * H200.hbm_GBps * 1e9 * 1e-3  # bytes that take `fraction` of 1 ms at the roof
    for _ in range(iters):
        with b.iteration():
            b.op("aten::copy_", [("void at::native::elementwise_kernel<128, 4, copy_kernel>()", 1000.0)],
                 nbytes=nbytes, kind="movement")
            b.python(990.0)  # the host goes on to the next iteration while the copy runs
    return b


def toy_model(iters: int = 3) -> Builder:
    """A small model with a bit of everything: a compute-bound conv, memory-bound pointwise ops, a
    linear that launches from an inner addmm, a Triton kernel, a graph replay, a copy and a sync."""
    b = Builder(root_type="ToyNet")
    for _ in range(iters):
        with b.iteration():
            with b.module("stem"):
                b.memcpy(4 << 20, 12.0)
                with b.module("stem.conv"):
                    b.op("aten::conv2d", [("sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc", 300.0)],
                         flops=1.2e11, nbytes=60e6, kind="conv", ceiling="tf32")
                with b.module("stem.relu"):
                    b.op("aten::relu", [("void at::native::vectorized_elementwise_kernel<4, relu>()", 40.0)],
                         flops=5e6, nbytes=1.4e8, host_us=4.0)
            for i in range(3):
                with b.module(f"blocks.{i}"):
                    with b.module(f"blocks.{i}.fc"):
                        b.op("aten::linear", [("sm90_xmma_gemm_tf32f32_tf32f32_f32_tn_n_tilesize128x128x32", 80.0)],
                             flops=2.0e10, nbytes=3e7, kind="matmul", ceiling="tf32", inner="aten::addmm")
                    with b.module(f"blocks.{i}.norm"):
                        b.op("aten::layer_norm", [("void at::native::vectorized_layer_norm_kernel<float>()", 30.0)],
                             flops=3.5e7, nbytes=4e7, kind="norm")
                    for _ in range(8):  # a tail of tiny pointwise ops
                        b.op("aten::mul", [("void at::native::vectorized_elementwise_kernel<4, MulFunctor<float>>()",
                                            2.0)], flops=4096, nbytes=49152, host_us=6.0)
                    b.triton("_fused_gelu_kernel", 20.0, nbytes=8e7)
            with b.module("head"):
                b.graph([("void gemv_kernel<float>()", 6.0), ("void softmax_warp_forward<float>()", 3.0)] * 3)
                b.sync()
            b.python(50.0)
    return b
