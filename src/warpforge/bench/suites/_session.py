"""What the sessions of the end-to-end suites share (``_vision_run``, ``_splat_run``): a case's callables (ours
and each peer, ``EndToEndCase`` run functions) share one session, whose first call builds, checks and times
every candidate together; each callable then returns its own share of the runs."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from warpforge.bench.compare import error_line
from warpforge.bench.suite import Run


@dataclass(frozen=True)
class Protocol:
    """Harness timing: ``blocks`` calls of time_interleaved, each ``warmup`` + ``rep`` calls of everyone."""

    warmup: int
    rep: int
    blocks: int


class CaseSession:
    """Measures every candidate of one case once (``_measure``, the suite's own); each callable reads its share.

    ``_measure(device)`` returns each candidate's runs, or a string: why it has none (the callable raises it).
    """

    def __init__(self, names: list[str], label: str) -> None:
        self.names, self.label = names, label  # label: the case in stderr lines ("resnet50 batch 8")
        self._results: dict[str, list[Run] | str] | None = None
        self._unread: set[str] = set()

    def _measure(self, device: torch.device) -> dict[str, list[Run] | str]:
        raise NotImplementedError

    def fn(self, name: str) -> Callable[[torch.device, int], list[Run]]:
        """The EndToEndCase run function of candidate ``name`` (rep: ignored, the protocol decides)."""
        def run(device: torch.device, rep: int) -> list[Run]:
            if self._results is None:
                try:
                    self._results = self._measure(device)
                except Exception as e:  # noqa: BLE001 - measured once: every callable reports the failure
                    self._results = {n: f"session failed: {error_line(e)}" for n in self.names}
                    # the record keeps the message; where it failed (a kernel fault needs the frames) goes to stderr
                    print(f"{self.label}: the session failed:\n{traceback.format_exc(limit=-16)}", file=sys.stderr)
                self._unread = set(self.names)
            got = self._results[name]
            self._unread.discard(name)
            if not self._unread:  # every callable has read its share: a re-run measures again
                self._results = None
            if isinstance(got, str):
                raise RuntimeError(got)
            return got
        return run


__all__ = ["CaseSession", "Protocol"]
