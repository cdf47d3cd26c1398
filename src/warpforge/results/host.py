"""Is the machine quiet enough to time on? The load average against the cores, and other GPU processes.

A timing is only as good as the machine under it: on a busy host, launch-bound calls wait for a CPU and
their times inflate by whatever the other work costs (``warpforge optimize`` once printed "313.98x
eager-fp32" with eager's median at 113 ms against a minimum of 0.49 ms); another process on the GPU
takes SMs and memory bandwidth. ``bench``, ``optimize`` and ``profile`` call :func:`check_host` before
timing, print its one-line ``warning`` when the machine is busy, and keep :meth:`HostState.as_dict` in
what they record.

Busy means: the 1-minute load average, less the timing process's own 1, is above ``BUSY_LOAD`` x the cores
this process may run on, or another process holds the GPU (where the driver shows it:
``nvidia-smi`` inside a container often lists none, and then nothing is claimed).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Above half the cores in runnable work, a timing thread competes for a core often enough to show in a
# launch-bound call's p80 (the host's time per call is what eager and compiled-with-guards models measure).
BUSY_LOAD = 0.5
OWN_LOAD = 1.0  # the process about to time is runnable itself: its own share of the load average


@dataclass(frozen=True)
class HostState:
    """The machine's load when a timing started."""

    load1: float | None  # 1-minute load average (None where the OS has none)
    cores: int  # cores this process may run on
    gpu_processes: list[dict[str, Any]] | None = field(default=None)  # other processes on the GPU; None: unknown

    @property
    def busy_reasons(self) -> list[str]:
        out = []
        if self.load1 is not None and self.load1 - OWN_LOAD > BUSY_LOAD * self.cores:
            out.append(f"load average {self.load1:.1f} on {self.cores} core{'s' * (self.cores != 1)}")
        if self.gpu_processes:
            shown = ", ".join(f"pid {p.get('pid')} {p.get('name') or '?'}"
                              + (f" ({p['used_MiB']:,.0f} MiB)" if isinstance(p.get("used_MiB"), (int, float)) else "")
                              for p in self.gpu_processes[:3])
            more = len(self.gpu_processes) - 3
            out.append(f"{len(self.gpu_processes)} other process{'es' * (len(self.gpu_processes) != 1)} on the GPU "
                       f"({shown}{f', {more} more' if more > 0 else ''})")
        return out

    @property
    def busy(self) -> bool:
        return bool(self.busy_reasons)

    @property
    def warning(self) -> str | None:
        """One line for the terminal (and the record), or None when the machine looks quiet."""
        reasons = self.busy_reasons
        if not reasons:
            return None
        return ("busy machine: " + "; ".join(reasons) + ". Timings may be inflated (launch-bound ones most); "
                "noisy cases are re-timed and marked")

    def as_dict(self) -> dict[str, Any]:
        return {"busy": self.busy, "load1": self.load1, "cores": self.cores,
                "gpu_processes": self.gpu_processes, "warning": self.warning}


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def gpu_processes(device_index: int | None = None, *, timeout: float = 5.0) -> list[dict[str, Any]] | None:
    """Compute processes on the GPU other than this one, as the driver lists them through ``nvidia-smi``
    (pid, name, used MiB); None when that cannot be asked (no driver tool, an error)."""
    query = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
             "--format=csv,noheader,nounits"]
    uuid = None
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=timeout, check=True).stdout
        if device_index is not None:
            uuids = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=timeout, check=True).stdout
            for line in uuids.splitlines():
                idx, _, u = (x.strip() for x in line.partition(","))
                if idx == str(device_index):
                    uuid = u
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_compute_apps(out, own_pid=os.getpid(), gpu_uuid=uuid)


def parse_compute_apps(text: str, *, own_pid: int, gpu_uuid: str | None = None) -> list[dict[str, Any]]:
    """Rows of ``nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory`` (CSV, no header, no
    units), this process and other GPUs' rows left out."""
    procs = []
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) < 4:
            continue
        uuid, pid, name, mem = parts[0], parts[1], ",".join(parts[2:-1]), parts[-1]
        if gpu_uuid is not None and uuid != gpu_uuid:
            continue
        try:
            pid_i = int(pid)
        except ValueError:
            continue
        if pid_i == own_pid:
            continue
        try:
            used: float | None = float(mem)
        except ValueError:
            used = None
        procs.append({"pid": pid_i, "name": os.path.basename(name), "used_MiB": used})
    return procs


def check_host(device: Any = None, *, loadavg: Callable[[], float | None] = _loadavg,
               cores: Callable[[], int] = usable_cores,
               gpu_procs: Callable[[int | None], list[dict[str, Any]] | None] = gpu_processes) -> HostState:
    """The machine's state now. ``device``: a torch device (or its type as a string); the GPU's processes are
    asked for only when it is a CUDA device. The probes are parameters so a test can simulate a busy host."""
    dev_type = getattr(device, "type", device)
    procs = None
    if dev_type == "cuda":
        procs = gpu_procs(getattr(device, "index", None))
    return HostState(load1=loadavg(), cores=cores(), gpu_processes=procs)


__all__ = ["BUSY_LOAD", "OWN_LOAD", "HostState", "check_host", "gpu_processes", "parse_compute_apps", "usable_cores"]
