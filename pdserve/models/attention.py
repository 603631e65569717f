"""Attention over the paged KV cache, for batches that mix decodes and prefill chunks.

The KV pool of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V), so a
block is a contiguous slice: a transfer backend can move it without reshaping. New keys and
values are scattered into their slots with one `index_copy_`. Decodes are attended by pdserve's C++
kernel, which reads the blocks where they lie (models/csrc, `decode_kernel`), or, on the portable
path, in batched SDPAs over block-table gathers, one per group of similar context lengths (so that a
few long contexts do not pad every short one to their length). Prefill chunks (few, long) get one
SDPA each. In batch-invariant mode every row attends alone (RowsAlone). A sliding-window layer
(`window` > 0) attends to the last `window` positions of each query's context only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """Tokens [start, end) of the batch are the query of one sequence's prefill chunk."""

    start: int
    end: int
    context_len: int  # tokens of the sequence in the cache once this chunk is stored
    block_table: torch.Tensor | None  # None: no earlier tokens cached, attend to the chunk only


@dataclass
class DecodeGroup:
    """Decode tokens [start, end) of the batch, their block tables padded to the longest."""

    start: int
    end: int
    block_tables: torch.Tensor  # [n, max_blocks] int64
    mask: torch.Tensor | None = None  # SDPA: additive 0 / -inf, [n, 1, 1, max_blocks * block_size]
    context_lens: torch.Tensor | None = None  # [n] int64 (the C++ kernel's input; SDPA's window mask)
    partition_blocks: int = 0  # the C++ kernel: context blocks per work unit
    window: int = 0  # SDPA: the mask already hides what lies before this window (a sliding group's)


@dataclass
class RowsAlone:
    """Batch-invariant mode (models/batch_invariant.py): every row of the batch, prefill or decode,
    attends alone to its own context, the first `context_lens[i]` tokens of its sequence's blocks, as
    a decode does; so its result depends on its own position only, not on its neighbours or on how
    its prompt was chunked."""

    block_tables: torch.Tensor  # [T, max_blocks] int64: each row's sequence's table, zero-padded
    context_lens: torch.Tensor  # [T] int64: the row's position + 1
    partition_blocks: int  # the C++ kernel: fixed, not sized by the batch
    sequences: list[tuple[int, int]]  # [start, end) rows of one sequence (the portable path gathers it once)


# (query, kv_cache, block_tables, context_lens, out, scale, partition_blocks, window) -> None, writing out.
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, int, int], None]


# (query [n, H, D], key [m, KVH, D], value, out, scale) -> None: causal, query i at position m - n + i.
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], None]


def prefill_kernel_takes(dtype: torch.dtype, head_dim: int, window: int = 0) -> bool:
    """Whether a layer's prefill chunks run the C++ kernel (when the CPU has one): bf16, head size
    64 or 128, the whole context (a sliding layer keeps SDPA)."""
    return dtype == torch.bfloat16 and head_dim in (64, 128) and not window


@dataclass
class AttentionMetadata:
    """Per-step layout of a batch, shared by every layer. Decode tokens come first."""

    slot_mapping: torch.Tensor  # [num_tokens] flat slot of each new token in the pool
    num_decodes: int = 0  # the batch's first rows are decodes (what the quantized kernels run on)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    decode_kernel: DecodeKernel | None = None  # None: SDPA over gathered blocks
    prefill_kernel: PrefillKernel | None = None  # bf16 prefill chunks (models/csrc); None: SDPA
    prefills: list[PrefillChunk] = field(default_factory=list)
    rows_alone: RowsAlone | None = None  # batch-invariant mode: every row, instead of the groups and chunks


def gather_blocks(kv_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """K and V of the blocks in `block_table` as one run each: [2, ..., n * block_size, KVH, D]."""
    two, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    # index_select over whole blocks is a row memcpy, ~3x faster than advanced indexing here.
    rows = kv_cache.view(two, num_blocks, -1).index_select(1, block_table.flatten())
    return rows.view(two, *block_table.shape[:-1], block_table.shape[-1] * block_size, kv_heads, head_dim)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,  # > 0: a sliding-window layer, each query sees its last `window` positions
) -> torch.Tensor:
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    # The cache may keep another dtype than the model's (--kv-cache-dtype): stored rounded to it,
    # read back as the query's dtype.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))

    out = torch.empty_like(q)
    if meta.rows_alone is not None:
        _attend_rows_alone(q, kv_cache, meta.rows_alone, meta.decode_kernel, scale, out, window)
        return out
    for group in meta.decode_groups:
        if meta.decode_kernel is not None:
            meta.decode_kernel(q[group.start : group.end], kv_cache, group.block_tables, group.context_lens,
                               out[group.start : group.end], scale, group.partition_blocks, window)
            continue
        keys, values = gather_blocks(kv_cache, group.block_tables).to(q.dtype).transpose(2, 3)  # [B, KVH, L, D]
        query = q[group.start : group.end].unsqueeze(2)  # [B, H, 1, D]
        mask = group.mask
        if window and group.window != window:  # positions before each row's window hidden too
            before = torch.arange(keys.shape[2], device=q.device) < (group.context_lens - window).unsqueeze(1)
            mask = mask.masked_fill(before[:, None, None, :], float("-inf"))
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[group.start : group.end] = o.squeeze(2)
    # Prefill chunks use 4-D [1, H, n, D] inputs: SDPA's fused CPU kernel only takes 4-D, and the
    # 3-D fallback is about 8x slower on long prompts.
    block_size = kv_cache.shape[2]
    kernel = meta.prefill_kernel if prefill_kernel_takes(q.dtype, q.shape[-1], window) else None
    for chunk in meta.prefills:
        if kernel is not None:  # [n, H, D] rows as they lie; the chunk's keys after its cached ones
            if chunk.block_table is None:
                keys, values = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
            else:
                keys, values = gather_blocks(kv_cache, chunk.block_table)[:, : chunk.context_len].to(q.dtype)
            o = torch.empty_like(q[chunk.start : chunk.end])
            kernel(q[chunk.start : chunk.end].contiguous(), keys.contiguous(), values.contiguous(), o, scale)
            out[chunk.start : chunk.end] = o
            continue
        query = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        n, ctx = chunk.end - chunk.start, chunk.context_len
        first_key = 0  # the position of keys[..., 0, :]
        if chunk.block_table is None:
            keys = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
            values = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        else:
            # A sliding layer gathers from the block of its first query's window on (the earlier
            # blocks of its table are the null block).
            first_block = max(0, ctx - n - window + 1) // block_size if window else 0
            first_key = first_block * block_size
            keys, values = gather_blocks(kv_cache, chunk.block_table[first_block:])[:, : ctx - first_key].to(
                q.dtype).transpose(1, 2).unsqueeze(1)
        if window:
            o = _windowed_prefill(query, keys, values, ctx - n, first_key, window, scale)
        elif chunk.block_table is None:
            o = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query i sits at position ctx - n + i and sees keys up to there (bottom-right causal).
            mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(ctx - n)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out


PREFILL_TILE = 256  # a sliding layer's prefill: at least this many queries per SDPA


def _windowed_prefill(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_query: int,
                      first_key: int, window: int, scale: float) -> torch.Tensor:
    """A sliding layer's prefill chunk ([1, H, n, D] queries at positions first_query.., keys from
    position first_key on) in tiles of queries, each over only the keys its window reaches: work and
    masks of n x (tile + window), not n x context."""
    n, tile = query.shape[2], max(window, PREFILL_TILE)
    out = torch.empty_like(query)
    for start in range(0, n, tile):
        end = min(n, start + tile)
        lo = max(first_key, first_query + start - window + 1)  # the tile's first query's window start
        hi = first_query + end  # its last query's own position, exclusive
        # Key position minus query position: visible in (-window, 0].
        offset = (torch.arange(lo, hi, device=query.device).unsqueeze(0) -
                  torch.arange(first_query + start, first_query + end, device=query.device).unsqueeze(1))
        mask = (offset <= 0) & (offset > -window)
        out[:, :, start:end] = F.scaled_dot_product_attention(
            query[:, :, start:end], keys[:, :, lo - first_key : hi - first_key],
            values[:, :, lo - first_key : hi - first_key], attn_mask=mask, scale=scale, enable_gqa=True)
    return out


def _attend_rows_alone(q: torch.Tensor, kv_cache: torch.Tensor, rows: RowsAlone, kernel: DecodeKernel | None,
                       scale: float, out: torch.Tensor, window: int = 0) -> None:
    """Each query row over its own context: one C++ kernel call (its work units are per row), or on
    the portable path one SDPA per row whose shape is fixed by that row's context length alone."""
    if kernel is not None:
        kernel(q, kv_cache, rows.block_tables, rows.context_lens, out, scale, rows.partition_blocks, window)
        return
    lens, block_size = rows.context_lens.tolist(), kv_cache.shape[2]
    for start, end in rows.sequences:
        table = rows.block_tables[start, : -(-lens[end - 1] // block_size)]
        keys, values = gather_blocks(kv_cache, table).to(q.dtype).transpose(1, 2).unsqueeze(1)  # [2, 1, KVH, L, D]
        for i in range(start, end):
            first = max(0, lens[i] - window) if window else 0
            o = F.scaled_dot_product_attention(q[i, None, :, None], keys[..., first : lens[i], :],
                                               values[..., first : lens[i], :], scale=scale, enable_gqa=True)  # [1, H, 1, D]
            out[i] = o[0, :, 0]
