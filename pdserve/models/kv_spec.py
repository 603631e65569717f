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

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        return kv_groups(self.layer_windows, self.num_layers)

    @property
    def group_windows(self) -> tuple[int, ...]:
        """Each KV group's window (0: full attention): what the block manager and connector need."""
        return tuple(group.window for group in self.groups)

    @property
    def layer_slots(self) -> int:
        """The pool's first dim: the most layers of one group (each group's layers take one slot each)."""
        return max(len(group.layers) for group in self.groups)

    def pool_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The pool tensor: [layer slot, plane, block, slot, kv_head, head_dim]; a block id belongs to
        one KV group at a time, whose layers take one layer slot each (`kv_groups`)."""
        return (self.layer_slots, self.planes, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block_token(self) -> int:
        """Pool bytes per token of one block (every layer slot): what the pool is sized by."""
        return self.layer_slots * self.layer_bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.layer_bytes_per_token

    @property
    def layer_bytes_per_token(self) -> int:
        return self.planes * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def capacity_tokens(self, num_blocks: int, block_size: int, chunk_tokens: int | None) -> int:
        """The longest sequence a pool of `num_blocks` holds alone: a full-attention group takes a
        block per `block_size` tokens; a sliding group at most its window and one prefill chunk's
        (None: a whole prompt in one step, so every group takes every block while it is computed)."""
        groups = self.groups
        if not any(g.window for g in groups):
            return num_blocks * block_size

        def blocks(n: int) -> int:
            every = -(-n // block_size)
            return NULL_BLOCKS + sum(every if not g.window or chunk_tokens is None else
                                     min(every, -(-(g.window + chunk_tokens) // block_size) + 1) for g in groups)

        if all(g.window for g in groups) and chunk_tokens is not None and blocks(UNBOUNDED_TOKENS) <= num_blocks:
            return UNBOUNDED_TOKENS  # every layer slides: any length fits once the windows do
        low, high = 0, num_blocks * block_size  # blocks(n) grows with n: the largest n that fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if blocks(mid) <= num_blocks else (low, mid - 1)
        return low


UNBOUNDED_TOKENS = 1 << 40
NULL_BLOCKS = 1  # with sliding groups, block 0 is every table's entry for a block before its window


@dataclass(frozen=True)
class KVGroup:
    """Layers that share block tables: one kind of attention (window 0: all of the context)."""

    window: int
    layers: tuple[int, ...]  # model layers; layers[i] lives in pool layer slot i


def kv_groups(layer_windows: tuple[int, ...], num_layers: int) -> tuple[KVGroup, ...]:
    """Every layer in one group when all see the whole context. With sliding layers (vLLM's hybrid
    layout), each kind of layer is cut into groups of as many layers as the rarest kind has, full
    attention first: a sliding group's blocks are freed as they leave its window, and every group's
    block takes the same bytes (one per layer slot), so all draw from one pool of block ids."""
    kinds: dict[int, list[int]] = {}
    for layer in range(num_layers):
        kinds.setdefault(layer_windows[layer] if layer_windows else 0, []).append(layer)
    if len(kinds) == 1:
        return (KVGroup(next(iter(kinds)), tuple(range(num_layers))),)
    size = min(len(layers) for layers in kinds.values())
    return tuple(KVGroup(window, tuple(layers[i : i + size]))
                 for window, layers in sorted(kinds.items()) for i in range(0, len(layers), size))


def first_needed_block(window: int, num_tokens: int, block_size: int) -> int:
    """The first block a layer with this window (0: none) still reads once a sequence holds
    `num_tokens` tokens: 0, or for a sliding layer the block of its last window - 1 tokens (the next
    token is the window's last)."""
    return max(0, num_tokens - window + 1) // block_size if window else 0
