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
    # Each layer's attention window (0: the whole context); () when every layer sees it all. A
    # sliding layer reads only its last `window` positions: D needs no more of it from P.
    layer_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")

    def pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The pool tensor: [layer, plane, block, slot, kv_head, head_dim]."""
        return (self.num_layers, self.planes, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.layer_bytes_per_token

    @property
    def layer_bytes_per_token(self) -> int:
        return self.planes * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def blocks_needed(self, layer: int, num_tokens: int, block_size: int) -> range:
        """The blocks of a `num_tokens` sequence that `layer` still reads at its next position."""
        return range(first_needed_block(self.window(layer), num_tokens, block_size), -(-num_tokens // block_size))


def first_needed_block(window: int, num_tokens: int, block_size: int) -> int:
    """The first block a layer with this window (0: none) still reads once a sequence holds
    `num_tokens` tokens: 0, or for a sliding layer the block of its last window - 1 tokens (the next
    token is the window's last)."""
    return max(0, num_tokens - window + 1) // block_size if window else 0
