"""What is simulated: the setup (`--setup colocated:N|pull:xPyD|push:xPyD|auto:...`) and each
node's scheduler settings and KV pool."""

from __future__ import annotations

import re
from dataclasses import dataclass

MODES = ("colocated", "pull", "push", "auto")


@dataclass(frozen=True)
class Setup:
    mode: str
    prefill: int  # P nodes (0 when colocated, or auto over colocated nodes)
    decode: int  # D nodes, or colocated nodes

    @classmethod
    def parse(cls, text: str) -> Setup:
        """`colocated:N`, `pull:xPyD`, `push:xPyD`, `auto:N` (N kv_both nodes: per request, one prefills
        and decodes, or one prefills and another pulls and decodes)
        or `auto:xPyD` (per request: prefill on D, or on a P then pull); ValueError names what is wrong."""
        mode, _, shape = text.partition(":")
        if mode in ("colocated", "auto") and shape.isdigit() and int(shape) > 0:
            return cls(mode, 0, int(shape))
        match = re.fullmatch(r"(\d+)P(\d+)D", shape)
        if mode in ("pull", "push", "auto") and match and int(match[1]) > 0 and int(match[2]) > 0:
            return cls(mode, int(match[1]), int(match[2]))
        raise ValueError(f"--setup {text!r}: expected colocated:N, pull:xPyD, push:xPyD, auto:N or auto:xPyD "
                         "(e.g. pull:1P3D)")



@dataclass(frozen=True)
class Batching:
    """A node's scheduler settings (`pdserve serve`'s --max-num-batched-tokens, --no-chunked-prefill,
    --max-prefill-tokens-while-decoding, --max-num-seqs) and its KV pool."""

    budget: int
    chunked: bool
    max_seqs: int
    capacity: int  # KV pool, tokens
    block_size: int = 16
    prefill_cap: int | None = None  # prompt tokens a step takes while streams decode (None: the budget)

    @classmethod
    def of(cls, node: dict, budget: int | None = None, chunked: bool = True,
           prefill_cap: int | None = None) -> Batching:
        """The profiled node's settings, with the token budget and chunking a setup asks for.
        Without chunked prefill the budget is at least max_model_len, as the engine makes it."""
        budget = budget or node["max_num_batched_tokens"]
        if budget < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {budget}")
        if not chunked:  # a profile without max_model_len: no prompt is too long for one step
            budget = max(budget, node.get("max_model_len", 1 << 30))
        if prefill_cap is not None and (prefill_cap < 1 or not chunked):
            raise ValueError(f"--max-prefill-tokens-while-decoding must be >= 1 and needs chunked prefill, got {prefill_cap}")
        return cls(budget, chunked, node["max_num_seqs"], node["kv_capacity_tokens"], node.get("block_size", 16),
                   prefill_cap)

    @property
    def num_blocks(self) -> int:
        return self.capacity // self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)
