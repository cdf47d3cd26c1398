"""What Inductor decided while a compiled peer was built: a peer whose CUDA graphs were skipped ("skipping
cudagraphs" in Inductor's log) launches every kernel one by one, a handicapped peer; its record says so."""

from __future__ import annotations


def cudagraph_skips() -> int:
    """Inductor's running count of skipped CUDA-graph partitions in this process (0 without Inductor)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # a torch without dynamo has no compiled peers either
        return 0
    return int(counters["inductor"]["cudagraph_skips"])


__all__ = ["cudagraph_skips"]
