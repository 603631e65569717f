"""The machine's limits a decode step is held against: the memory read bandwidth, the compute
rate of a large GEMM in the dtype at hand, and the bytes and FLOPs a step streams."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

BANDWIDTH_MIB = 512  # a buffer well past the last-level cache
GEMM_SHAPE = (512, 2048, 2048)  # M, K, N: large enough for the best kernel a dtype has


def read_bandwidth_gbs(repeats: int = 5) -> float:
    """Memory read bandwidth of this process's threads: summing a buffer far larger than the cache."""
    data = torch.ones(BANDWIDTH_MIB * 2**20 // 4, dtype=torch.float32)
    data.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def streamed_weights(model: torch.nn.Module, dtype: torch.dtype) -> tuple[int, int]:
    """Parameters and bytes a batch-1 decode step reads whole: every projection (the LM head
    included, counted by shape since a pre-packed projection keeps no `weight`; its quantized codes'
    bytes where it has them, else its weight in `dtype`) and norm. The embedding table is read one
    row per token; tied to the LM head, it is counted as the LM head."""
    dense = torch.empty((), dtype=dtype).element_size()
    params = nbytes = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.in_features * module.out_features
            quantized = getattr(module, "quantized", None)
            params += weight
            nbytes += quantized.nbytes if quantized is not None else weight * dense
            if module.bias is not None:
                params += module.bias.numel()
                nbytes += module.bias.numel() * module.bias.element_size()
        elif not isinstance(module, torch.nn.Embedding):
            for p in module.parameters(recurse=False):
                params += p.numel()
                nbytes += p.numel() * p.element_size()
    return params, nbytes


def gemm_gflops(dtype: torch.dtype, repeats: int = 5) -> float:
    """The compute roofline this process reaches: the best of `repeats` [M, K] x [K, N] GEMMs in
    `dtype` (bf16 on oneDNN's pre-packed weights where it has them, as the engine runs it)."""
    m, k, n = GEMM_SHAPE
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    gemm = lambda: F.linear(x, w)  # noqa: E731
    if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        gemm = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
    gemm()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        gemm()
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9
