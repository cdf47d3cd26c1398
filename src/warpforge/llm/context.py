"""Per-step attention state, kept out of ``forward()`` so CUDA-graph capture only refills buffers.

The runner fills one :class:`StepContext` before each model call (``set_context``) and clears it
after; every attention layer reads it (``get_context``). Tensors live on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepContext:
    """What attention needs for one step over a batch of B sequences and T new tokens.

    slot_mapping   int64 [T]      cache slot of each new token (page * page_size + row); -1: do not store
    block_tables   int32 [B, P]   pages of each sequence, in order (padded with any valid page id)
    seq_lens       int32 [B]      context length after this step (cached tokens + new tokens)
    cu_seqlens_q   int32 [B + 1]  new-token offsets: sequence b's new tokens are q[cu[b]:cu[b+1]]
    max_seqlen_q   int            longest run of new tokens (sizes the prefill grid without a sync)
    max_seq_len    int            longest context the grid is built for (decode split count; fixed
                                  per captured CUDA graph)
    decode_only    bool           every sequence has exactly one new token: use paged decode
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    max_seq_len: int
    decode_only: bool


_CONTEXT: StepContext | None = None


def set_context(ctx: StepContext | None) -> None:
    global _CONTEXT
    _CONTEXT = ctx


def get_context() -> StepContext:
    if _CONTEXT is None:
        raise RuntimeError("no step context: the runner must set_context() before calling the model")
    return _CONTEXT
