"""The KV pool: one tensor `[layer, plane, block, slot, kv_head, head_dim]`, optionally in shared
memory, shaped by the model's `KVCacheSpec` (planes are K and V for Llama-family attention).

A block of one layer's plane is a contiguous `block_bytes` slice, so a transfer is a list of
(offset, length) segments over the pool's bytes, in the canonical order (layer, plane, block).
"""

from __future__ import annotations

import math
import uuid
from multiprocessing import resource_tracker, shared_memory

import torch

from pdserve.kv.protocol import KVLayout
from pdserve.models.kv_spec import KVCacheSpec

MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def prefault(shm: shared_memory.SharedMemory) -> None:
    """Map every page of a shared pool now, not on first touch during a transfer (a page fault per
    4 KiB otherwise lands in the middle of a prefill or a push)."""
    try:
        shm._mmap.madvise(MADV_POPULATE_WRITE)  # noqa: SLF001
    except (AttributeError, OSError, ValueError):
        pass  # older kernels: pages are faulted in lazily


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive ids merged into (first, count) runs: fewer, larger copies."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


class KVPool:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: str, shared: bool = False) -> None:
        self.shape = shape
        self.dtype = dtype
        self.shm: shared_memory.SharedMemory | None = None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if shared and torch.device(device).type == "cpu":
            # A fresh shared-memory file is zero-filled, like torch.zeros below.
            self.shm = shared_memory.SharedMemory(create=True, size=nbytes, name=f"pdserve-kv-{uuid.uuid4().hex[:16]}")
            prefault(self.shm)
            self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers, self.num_planes, self.num_blocks, self.block_size = shape[:4]
        self.block_bytes = nbytes // (self.num_layers * self.num_planes * self.num_blocks)

    @classmethod
    def for_model(cls, spec: KVCacheSpec, num_blocks: int, block_size: int, device: str,
                  shared: bool = False) -> KVPool:
        return cls(spec.pool_shape(num_blocks, block_size), spec.dtype, device, shared)

    @property
    def shm_name(self) -> str | None:
        return self.shm.name if self.shm is not None else None

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.block_size, self.block_bytes, str(self.dtype).removeprefix("torch."))

    def byte_view(self) -> memoryview:
        """The pool as flat bytes (CPU pools only): sockets send from and receive into it."""
        if self.tensor.device.type != "cpu":
            raise RuntimeError("KV transfer needs a CPU KV pool")
        return memoryview(self.tensor.view(-1).view(torch.uint8).numpy())

    def segments(self, block_ids: list[int], layers: range | None = None) -> list[tuple[int, int]]:
        """(offset, length) of the bytes of `block_ids`, in canonical (layer, plane, block) order."""
        bb, nb, planes = self.block_bytes, self.num_blocks, self.num_planes
        runs = block_runs(block_ids)
        return [
            (((layer * planes + plane) * nb + first) * bb, count * bb)
            for layer in (layers if layers is not None else range(self.num_layers))
            for plane in range(planes)
            for first, count in runs
        ]

    def nbytes(self, block_ids: list[int], layers: range | None = None) -> int:
        """Bytes of every plane of `block_ids` over `layers` (all by default)."""
        num_layers = len(layers) if layers is not None else self.num_layers
        return num_layers * self.num_planes * len(block_ids) * self.block_bytes

    def close(self) -> None:
        if self.shm is not None:
            del self.tensor
            try:
                self.shm.close()
            except BufferError:  # a view is still alive; the mapping goes with the process
                pass
            self.shm.unlink()
            self.shm = None


class RemotePool:
    """Another process's shared-memory pool, mapped read-only in spirit (we only copy out of it)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shm = shared_memory.SharedMemory(name=name, create=False)
        # Only the creator may unlink it: stop this process's tracker from doing so at exit.
        resource_tracker.unregister(self.shm._name, "shared_memory")  # noqa: SLF001
        prefault(self.shm)
        count = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=count).view(dtype).view(shape)

    def copy_blocks(self, src_ids: list[int], dst: KVPool, dst_ids: list[int]) -> int:
        """Copy blocks src_ids (here) into dst_ids (local pool); returns bytes copied."""
        return copy_block_runs(self.tensor, src_ids, dst.tensor, dst_ids)

    def close(self) -> None:
        del self.tensor
        try:
            self.shm.close()
        except BufferError:
            pass


def copy_block_runs(src: torch.Tensor, src_ids: list[int], out: torch.Tensor, dst_ids: list[int]) -> int:
    """Copy blocks along dim 2 of [layers, planes, blocks, ...] tensors, one copy per common run."""
    # Align source and destination runs: walk both lists in step and copy maximal common runs.
    copied, i, n = 0, 0, len(src_ids)
    while i < n:
        j = i + 1
        while j < n and src_ids[j] == src_ids[j - 1] + 1 and dst_ids[j] == dst_ids[j - 1] + 1:
            j += 1
        out[:, :, dst_ids[i] : dst_ids[i] + (j - i)].copy_(src[:, :, src_ids[i] : src_ids[i] + (j - i)])
        copied += j - i
        i = j
    return copied * out[:, :, 0].numel() * out.element_size()
