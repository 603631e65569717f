"""A tensor-parallel rank's model, set up the same way on every rank: rank 0 (the engine) and the
spawned ranks 1.. (tp_workers.py) call `set_up_rank` with the one `RankSpec` rank 0 decided."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.models.attention import DecodeKernel, PrefillKernel
from pdserve.models.loader import load_model
from pdserve.models.native import native_ops
from pdserve.models.parallel import TensorParallel
from pdserve.models.quantization import native_int4_kernel


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its slices: the choices rank 0 made."""

    model_dir: str
    dtype: torch.dtype
    device: str
    max_model_len: int
    prepack: bool
    quantization: str
    compiled: bool  # pdserve's C++ kernels
    num_blocks: int
    block_size: int
    threads: int | None
    batch_invariant: bool  # models/batch_invariant.py
    pool_shm_names: tuple[str, ...] = ()  # a node with a KV role: rank 0 made every rank's pool, by rank
    kv_dtype: torch.dtype | None = None  # the KV pool's (--kv-cache-dtype); None: the model's dtype


def set_up_rank(spec: RankSpec, tp: TensorParallel) -> tuple[torch.nn.Module, DecodeKernel | None,
                                                              PrefillKernel | None]:
    """Rank `tp.rank`'s slice of the model with the kernels of `spec`, and its decode and prefill
    attention kernels (None: the model's torch path)."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    # The decode attention, int4 projections and the fused elementwise ops on pdserve's C++ kernels
    # unless forced portable or they cannot be built here (no compiler): then torch ops, SDPA over
    # gathered blocks, torch's int4 kernel.
    ops = native_ops() if spec.compiled else None
    model = load_model(Path(spec.model_dir), spec.dtype, spec.device, spec.max_model_len, prepack=spec.prepack,
                       quantization=spec.quantization, tp=tp, int4_kernel=native_int4_kernel(ops))
    if ops is not None:
        model.use_native_kernels(ops)
    if spec.batch_invariant:
        model.set_batch_invariant()  # ValueError for a model without a batch-invariant path
    return model, model.decode_kernel(ops), model.prefill_kernel(ops)
