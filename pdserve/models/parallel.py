"""Tensor parallelism inside a model: which slice of the heads and the MLP a rank holds, and the
all-reduce that joins the ranks' partial sums (torch.distributed: gloo on CPU, NCCL on CUDA).

Megatron's split: Q, K, V and gate / up are column-parallel (each rank computes its heads and its
slice of the intermediate size), o and down are row-parallel (each rank's partial product, summed
by an all-reduce). Embeddings, norms and the output head are whole on every rank, so every rank
ends a forward pass with the same hidden states; rank 0 samples.

A model with K KV heads under TP t (`kv_heads`):
- t <= K: rank r holds the contiguous heads [r K/t, (r + 1) K/t) (t divides K);
- t > K: each rank holds one head, head r // (t/K) (K divides t): every head is replicated t/K times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


def check_tp(tp: int, num_heads: int, num_kv_heads: int) -> None:
    """ValueError unless TP `tp` splits the model's heads evenly (replicating KV heads if it must)."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    if num_heads % tp:
        raise ValueError(f"tensor parallel size {tp} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tensor parallel size {tp} must divide the model's {num_kv_heads} KV heads or be a "
                         "multiple of them (then each KV head is replicated)")


def kv_heads(rank: int, tp: int, num_kv_heads: int) -> range:
    """The global KV heads rank `rank` of TP `tp` holds, in the order of its pool."""
    if tp <= num_kv_heads:
        per_rank = num_kv_heads // tp
        return range(rank * per_rank, (rank + 1) * per_rank)
    head = rank // (tp // num_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its node's tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def heads(self, num_heads: int) -> range:
        """This rank's attention (query) heads."""
        per_rank = num_heads // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def kv_heads(self, num_kv_heads: int) -> range:
        return kv_heads(self.rank, self.size, num_kv_heads)

    def rows(self, total: int) -> range:
        """This rank's slice of a dimension split evenly (the MLP's intermediate size)."""
        per_rank = total // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    def check(self, num_heads: int, num_kv_heads: int, intermediate_size: int) -> None:
        check_tp(self.size, num_heads, num_kv_heads)
        if intermediate_size % self.size:
            raise ValueError(f"tensor parallel size {self.size} does not divide the MLP's {intermediate_size} rows")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (a no-op without TP)."""
        if self.size > 1:
            dist.all_reduce(x)
        return x


SINGLE = TensorParallel()
