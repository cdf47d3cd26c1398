"""Tensor parallelism: the checks, the process group, and ``apply_tp`` (a loaded model cut to one rank's share).

Megatron's layout, as vLLM and gpt-fast run it. Each rank holds:

- qkv_proj (column parallel): its block of query heads and of KV heads; gate_up_proj (column parallel): its
  block of the intermediate features, gate and up alike. No communication: every rank has the whole input.
- o_proj and down_proj (row parallel): the input columns matching those blocks. Each rank's output is a
  partial sum; one all-reduce (a forward hook on the module) completes it. That is exactly one all-reduce per
  attention block and one per MLP block, and the hook runs inside the decode CUDA graphs, so under NCCL the
  collective is captured with the kernels around it.
- its share of the paged KV cache: the KV heads of its query heads. With fewer KV heads than ranks
  (N % num_kv_heads == 0), each KV head is replicated on N / num_kv_heads ranks, as vLLM does: the cache
  then holds one head per rank.
- the embedding and the LM head whole (replicated). The head's logits are then the same on every rank
  with no gather, so the driver samples from its own logits and workers skip the head. The cost is the
  head's weight read on each rank: on the Llama-3.1-8B shape at N = 2, ~1.05 GB of ~8.05 GB read per
  decode step, 1.87x the one-GPU bytes per rank instead of 2.0x for a vocab-parallel head.

Biases of row-parallel projections are kept on rank 0 only (zeroed elsewhere), so the sum adds them once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from warpforge.llm.config import ModelConfig


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group.

    group       the device collectives (NCCL on GPUs, gloo on CPU): the all-reduces, the lookahead ids
    cpu_group   gloo, for the driver's per-step messages to the workers (host objects)
    """

    rank: int
    world_size: int
    group: object
    cpu_group: object
    all_reduces: int = 0  # eager all-reduces run by this process (tests check the count per step)


def read_config(path: str | Path) -> ModelConfig:
    """The model's config without its weights (HF directory or .gguf), to check the sizes before any
    process starts or any weight is read."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        from warpforge.llm.loader import GGUFFile

        gf = GGUFFile(path)
        return ModelConfig.from_gguf(gf.meta, gf.tensors.keys())
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{path}: expected an HF checkpoint directory or a .gguf file")
    return ModelConfig.from_hf(json.loads(cfg_file.read_text()))


def check_tensor_parallel(config: ModelConfig, n: int, device_type: str) -> None:
    """ValueError (one line, naming the numbers) when ``n`` ranks cannot split this model here."""
    if n == 1:
        return
    if config.num_heads % n:
        raise ValueError(f"tensor_parallel_size: {n} does not divide the model's {config.num_heads} attention heads")
    kv = config.num_kv_heads
    if (n <= kv and kv % n) or (n > kv and n % kv):
        raise ValueError(f"tensor_parallel_size: {n} neither divides the model's {kv} KV heads nor is a multiple "
                         f"of them (KV heads are split, or replicated when there are fewer than ranks)")
    if config.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size: {n} does not divide the model's MLP width "
                         f"{config.intermediate_size}")
    if device_type == "cuda":
        gpus = torch.cuda.device_count()
        if n > gpus:
            raise ValueError(f"tensor_parallel_size: {n} ranks need {n} GPUs, this machine has {gpus}")


def kv_heads_of(rank: int, n: int, num_kv_heads: int) -> tuple[int, int]:
    """(first KV head, count) held by ``rank``: a block of num_kv_heads / n, or one replicated head."""
    if n <= num_kv_heads:
        per = num_kv_heads // n
        return rank * per, per
    return rank * num_kv_heads // n, 1


def shard_config(config: ModelConfig, n: int) -> ModelConfig:
    """One rank's sizes: what its KV cache and its runner are built for."""
    return dataclasses.replace(config, num_heads=config.num_heads // n,
                               num_kv_heads=kv_heads_of(0, n, config.num_kv_heads)[1],
                               intermediate_size=config.intermediate_size // n)


def _set(module: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(value.contiguous(), requires_grad=False))


def _rows(w: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:  # [N, ...] -> [sum of lengths, ...]
    return torch.cat([w.narrow(0, start, length) for start, length in blocks])


def apply_tp(model: nn.Module, tp: TPGroup) -> nn.Module:
    """Cut a loaded model (every weight whole) to ``tp.rank``'s share, in place, and hook the all-reduces.

    Works on the models' shared Attention and GatedMLP, so every architecture of the registry is covered."""
    from warpforge.llm.layers import Attention, GatedMLP

    n, r = tp.world_size, tp.rank
    if n == 1:
        return model
    c = model.config
    check_tensor_parallel(c, n, "cpu")  # the device count was checked before the processes started
    d = c.head_dim
    hq = c.num_heads // n
    kv0, hkv = kv_heads_of(r, n, c.num_kv_heads)
    inter = c.intermediate_size // n
    q_size, kv_size = c.num_heads * d, c.num_kv_heads * d
    hook = _all_reduce_hook(tp)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Attention):
                blocks = [(r * hq * d, hq * d), (q_size + kv0 * d, hkv * d), (q_size + kv_size + kv0 * d, hkv * d)]
                qkv = m.qkv_proj
                _set(qkv, "weight", _rows(qkv.weight, blocks))
                if qkv.bias is not None:
                    _set(qkv, "bias", _rows(qkv.bias, blocks))
                qkv.shards = tuple((name, length) for (name, _), (_, length) in zip(qkv.shards, blocks))
                m.num_heads, m.num_kv_heads = hq, hkv
                m.sizes = [hq * d, hkv * d, hkv * d]
                _row_parallel(m.o_proj, r * hq * d, hq * d, r, hook)
            elif isinstance(m, GatedMLP):
                gu = m.gate_up_proj
                blocks = [(r * inter, inter), (c.intermediate_size + r * inter, inter)]  # gate | up, this rank's
                _set(gu, "weight", _rows(gu.weight, blocks))
                if gu.bias is not None:
                    _set(gu, "bias", _rows(gu.bias, blocks))
                gu.shards = tuple((name, inter) for name, _ in gu.shards)
                _row_parallel(m.down_proj, r * inter, inter, r, hook)
    model.tp = tp
    return model


def _row_parallel(linear: nn.Module, start: int, length: int, rank: int, hook) -> None:
    _set(linear, "weight", linear.weight.narrow(1, start, length))
    if linear.bias is not None and rank != 0:
        linear.bias.zero_()  # added once, by rank 0's partial sum
    linear.register_forward_hook(hook)


def _all_reduce_hook(tp: TPGroup):
    def hook(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(out, group=tp.group)
        tp.all_reduces += 1
        return out

    return hook


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def init_group(rank: int, n: int, device_type: str, init_method: str | None) -> TPGroup:
    """Join the process group (``init_method`` None: torchrun's environment) and make the control group."""
    from datetime import timedelta

    backend = "nccl" if device_type == "cuda" else "gloo"
    if not dist.is_initialized():
        kw = {"init_method": init_method} if init_method else {}
        dist.init_process_group(backend, rank=rank, world_size=n, **kw)
    if dist.get_world_size() != n:
        raise ValueError(f"tensor_parallel_size: {n}, but the process group (torchrun) has {dist.get_world_size()} "
                         f"ranks")
    # Workers wait on the control group between requests, which may be hours apart: no practical timeout.
    cpu_group = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    return TPGroup(dist.get_rank(), n, dist.group.WORLD, cpu_group)
