"""Autotuning with the winners cached on disk, so a second process does not tune again.

Triton's own ``@triton.autotune(cache_results=True)`` keys its cache on exact argument values,
stores it in Triton's cache directory, and gives up on configs with pre-hooks; our TMA kernels
build host-side tensor descriptors whose block shape depends on the config. So we tune in the
launcher: a :class:`Tuner` times each candidate config on the caller's tensors and remembers the
winner per *shape bucket* (sizes rounded up to powers of two) in

    cache_dir()/autotune/<device name>--triton-<version>--<kernel>.json

Winners tuned on a GPU warpforge was measured on ship with the package, in

    warpforge/kernels/tuned/<device name>--triton-<version>--<kernel>.json  (same format)

and serve a bucket the user's cache lacks (when their candidate list is the current one), so the first
process on such a GPU does not spend minutes compiling candidates (a Gemma 3 270M batch-64 bench on a
fresh H200 had not finished tuning after 150 s). ``benchmarks/run_gpu.sh`` brings a box's cache back.

Settings (:mod:`warpforge.settings`, docs/settings.md):
  WARPFORGE_AUTOTUNE=0        never tune; use each kernel's default config (first in its list)
  WARPFORGE_AUTOTUNE=cold     ignore the shipped winners (a truly cold start: the vision suite's
                              wall-time case measures optimize() so)
  WARPFORGE_AUTOTUNE=retune   ignore cached winners and tune again (and overwrite them)
  WARPFORGE_AUTOTUNE_VERBOSE=1  print each config's time while tuning
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
import triton

from warpforge import settings

C = TypeVar("C")  # a frozen dataclass config
SHIPPED_DIR = Path(__file__).resolve().parent / "tuned"


def pow2_bucket(n: int, lo: int = 1, hi: int = 1 << 20) -> int:
    """``n`` rounded up to a power of two, clamped to [lo, hi]: configs tuned for 4096 serve 3000..4096."""
    n = max(int(n), 1)
    return max(lo, min(hi, 1 << (n - 1).bit_length()))


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("_") or "unknown"


class Tuner(Generic[C]):
    """Pick the fastest of ``configs`` per shape bucket on the current device, cached in memory and on disk.

    ``configs[0]`` is the default: used when tuning is off, on a miss during CUDA-graph capture (timing
    would break the capture; a bucket tuned by an earlier eager call is used), and when only one
    candidate is valid.
    """

    def __init__(self, kernel: str, configs: Sequence[C], config_type: type):
        if not configs:
            raise ValueError(f"Tuner {kernel!r}: configs must not be empty")
        self.kernel = kernel
        self.configs = list(configs)
        self.config_type = config_type
        # A changed candidate list invalidates old winners (the lead sweeps by editing the list).
        self.candidates_hash = hashlib.sha256(repr(self.configs).encode()).hexdigest()[:16]
        self._memory: dict[tuple[str, str], C] = {}
        self._lock = threading.Lock()

    # ---- disk cache ---------------------------------------------------------------------------
    def _path(self, device: torch.device) -> Path:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        file = f"{_slug(name)}--triton-{_slug(triton.__version__)}--{self.kernel}.json"
        return settings.cache_dir() / "autotune" / file

    def _shipped(self, path: Path) -> dict[str, Any]:
        """The package's winners for the same device, Triton version and kernel (see the module docstring)."""
        if settings.current().autotune == "cold":
            return {}
        return self._load(SHIPPED_DIR / path.name)

    def _load(self, path: Path) -> dict[str, Any]:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def _save(self, path: Path, key: str, cfg: C, ms: float) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self._load(path)  # re-read: another process may have added buckets meanwhile
        data[key] = {"config": dataclasses.asdict(cfg), "ms": ms, "candidates": self.candidates_hash}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one

    # ---- choose -------------------------------------------------------------------------------
    def choose(self, bucket: tuple, device: torch.device, run: Callable[[C], Any],
               valid: Callable[[C], bool] | None = None) -> C:
        """The config to use for ``bucket``; tunes (calling ``run(cfg)`` repeatedly) on a miss.

        ``run`` must be safe to call many times (it rewrites the output each time). ``valid`` drops
        candidates that cannot serve this call (e.g. a block larger than a quantization group).
        """
        candidates = [c for c in self.configs if valid is None or valid(c)]
        if not candidates:
            raise ValueError(f"{self.kernel}: no candidate config fits bucket {bucket}")
        mode = settings.current().autotune
        if mode == "off" or len(candidates) == 1 or device.type != "cuda":
            return candidates[0]
        key = repr(bucket)
        mem_key = (str(device), key)
        with self._lock:
            if mode != "retune" and mem_key in self._memory:
                return self._memory[mem_key]
            path = self._path(device)
            entry = None
            if mode != "retune":
                entry = self._load(path).get(key)
                if not entry or entry.get("candidates") != self.candidates_hash:
                    entry = self._shipped(path).get(key)
            if entry and entry.get("candidates") == self.candidates_hash:
                cfg = self.config_type(**entry["config"])
                self._memory[mem_key] = cfg
                return cfg
            if torch.cuda.is_current_stream_capturing():
                return candidates[0]  # timing would break the capture; tune on an eager call instead
            cfg, ms = self._tune(candidates, run, bucket)
            self._memory[mem_key] = cfg
            try:
                self._save(path, key, cfg, ms)
            except OSError as e:  # a read-only cache costs a re-tune next process, not a failure
                print(f"warpforge autotune: could not write {path}: {e}", file=sys.stderr)
            return cfg

    def _tune(self, candidates: list[C], run: Callable[[C], Any], bucket: tuple) -> tuple[C, float]:
        verbose = settings.current().autotune_verbose
        best, best_ms = None, float("inf")
        for cfg in candidates:
            try:
                run(cfg)  # compile outside the timed region
                ms = _time_ms(functools.partial(run, cfg))
            except Exception as e:  # noqa: BLE001 - out of shared memory, unsupported combination
                ms = float("inf")
                if verbose:
                    print(f"[autotune {self.kernel} {bucket}] {cfg}: failed: {type(e).__name__}: {e}", file=sys.stderr)
            else:
                if verbose:
                    print(f"[autotune {self.kernel} {bucket}] {cfg}: {ms:.4f} ms", file=sys.stderr)
            if ms < best_ms:
                best, best_ms = cfg, ms
        if best is None:
            raise RuntimeError(f"{self.kernel}: every candidate config failed for bucket {bucket} "
                               f"(WARPFORGE_AUTOTUNE_VERBOSE=1 shows why)")
        return best, best_ms


def _time_ms(fn: Callable[[], Any]) -> float:
    """One candidate's GPU time from replays of a CUDA graph of its launches (triton's
    ``do_bench_cudagraph``, median), so the host's launch cost is not in it. triton's ``do_bench``
    times back-to-back eager launches: for a ~10 us kernel behind a ~20-40 us Python launcher every
    candidate read the host's time and the winner was a coin toss (ResNet-50's batch-1 3x3 convs
    tuned to 25 us in one H200 run, 10 us with graph timing). Falls back to ``do_bench`` for a
    launch that cannot be captured."""
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=20, return_mode="median")
    except Exception:  # noqa: BLE001 - e.g. a launcher that synchronizes: time it the plain way
        return do_bench(fn, warmup=5, rep=25)
