"""The identity of a full KV block: a hash chained over the blocks before it.

A block's hash covers its parent's hash and its token ids, so equal hashes mean equal prefixes.
The hash is stable across processes, machines and Python versions (blake2b, not `hash()`), so a
proxy that tokenizes a prompt computes the very hashes a node's prefix cache files its blocks
under, and can tell how much of that prompt a node holds from the node's KV events.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

ROOT = 0x9E3779B97F4A7C15  # the parent of a prompt's first block


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    data = (ROOT if parent is None else parent).to_bytes(8, "little") + array("q", token_ids).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prompt_digest(token_ids: Sequence[int], num_tokens: int) -> int:
    """Which prompt a transfer's KV is of: a digest of its first `num_tokens` token ids. P and D each
    compute it from their own request, so KV prefilled for another prompt is refused (issue 39)."""
    return chain_hash(None, token_ids[:num_tokens])


def block_hashes(token_ids: Sequence[int], block_size: int, start: list[int] | None = None) -> list[int]:
    """Hashes of the full blocks of token_ids; `start`: hashes already known for its first blocks."""
    hashes = list(start or [])
    for i in range(len(hashes), len(token_ids) // block_size):
        hashes.append(chain_hash(hashes[-1] if hashes else None, token_ids[i * block_size:(i + 1) * block_size]))
    return hashes
