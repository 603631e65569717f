"""Batch-invariant mode (`--batch-invariant`): a token's numbers do not depend on its neighbours.

A GEMM's kernel is chosen by the shape of the whole call: on this AMD EPYC, MKL computes a row of a
1-, 2- or 3-row float32 GEMM in another order than the same row among 4 or more, and other CPUs
draw other lines. So a decode node, which computes the last prompt token alone, and a colocated
node, which computes it inside the prompt's GEMM, round differently, and so does one request
decoded alone or among 30. Nothing here is wrong, but a greedy near-tie can flip.

In this mode every row takes a path fixed by its own kind and position, never by the batch:
- dense GEMMs run in blocks of exactly INVARIANT_ROWS rows (the last zero-padded): one kernel of
  one shape for every row, whose row results do not depend on the other rows of the block;
- decode rows stay on the quantized kernel at any batch size (not the dense one above 16): torch's
  int4 / int8 kernels and pdserve's int8 head compute each row alone, at any row count (padding
  them to 16 rows made a decode step 2.9x slower);
- both properties are checked for every kernel the engine can pick, on the machine that runs the
  tests (tests/test_batch_invariant.py), AVX2 dispatch included;
- attention: every query row attends alone to its own context (its position + 1 tokens), prefill
  rows as decode rows do: pdserve's C++ paged kernel with a fixed partition size, or one SDPA per
  row on the portable path (models/attention.py, RowsAlone);
- norms, RoPE, SiLU and the sampler are per row already.

vLLM's VLLM_BATCH_INVARIANT and SGLang's --enable-deterministic-inference do the same on GPUs with
batch-invariant Triton kernels. The cost is in docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

INVARIANT_ROWS = 16  # rows per dense GEMM call: past MKL's small-M paths (1-3 rows round otherwise here)
# C++ paged attention: context blocks per work unit, fixed (the normal mode sizes it by the batch).
INVARIANT_PARTITION_BLOCKS = 8


def in_fixed_blocks(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`gemm` of x's rows, called on blocks of exactly INVARIANT_ROWS rows (the last zero-padded)."""
    rows = x.shape[0]
    padded = F.pad(x, (0, 0, 0, -rows % INVARIANT_ROWS))
    return torch.cat([gemm(block) for block in padded.split(INVARIANT_ROWS)])[:rows]
