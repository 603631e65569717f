"""A model's KV cache as the rest of the system sees it: the model says what it keeps per token,
and the pool, the attention metadata and the transfers are built from that."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Per layer, `planes` tensors of [block, slot, kv_heads, head_dim]: K and V for multi-head
    and grouped-query attention (a latent-attention model would keep one compressed plane)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    planes: int = 2
    model_kv_heads: int = 0  # the model's KV heads, of which a TP rank keeps num_kv_heads (0: all)

    def pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The pool tensor: [layer, plane, block, slot, kv_head, head_dim]."""
        return (self.num_layers, self.planes, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.planes * self.num_kv_heads * self.head_dim * elem
