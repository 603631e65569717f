"""The KV pool: one tensor `[layer, plane, block, slot, kv_head, head_dim]`, optionally in shared
memory, shaped by the model's `KVCacheSpec` (planes are K and V for Llama-family attention). With
sliding-window layers its first dim is layer slots: each KV group's layers take one slot each, and
a block id belongs to one group at a time (models/kv_spec.py).

A block of one layer's plane is a contiguous `block_bytes` slice, so a transfer of whole blocks is
a list of (offset, length) segments over the pool's bytes, in the canonical order (layer, plane,
block); a transfer of some of the heads (between TP ranks that hold different heads) gathers them
into that same order.
"""

from __future__ import annotations

import _posixshmem
import math
import mmap
import os
import uuid
from multiprocessing import shared_memory

import torch
import xxhash

from pdserve.kv.protocol import KVLayout
from pdserve.procinfo import pool_name, remove_dead_pools
from pdserve.models.kv_spec import KVCacheSpec, first_needed_block, kv_groups

MADV_POPULATE_WRITE = 23  # Linux >= 5.14
# Where a shared pool's tensor starts in its mapping. Page-aligned, decode at a 2048-token context
# stepped x1.13 slower on an AMD EPYC (Zen 5) than with the pool 64 bytes past a page boundary, where
# torch's allocator puts a private one (docs/benchmarks.md, session 53): so shared pools sit there too.
POOL_OFFSET = 64


def prefault(mapping: mmap.mmap) -> None:
    """Map every page of a shared pool now, not on first touch during a transfer (a page fault per
    4 KiB otherwise lands in the middle of a prefill or a push)."""
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
    except (AttributeError, OSError, ValueError):
        pass  # older kernels: pages are faulted in lazily


def attach_shared(name: str) -> mmap.mmap:
    """Map a shared-memory pool another process created, without multiprocessing's resource tracker:
    Python 3.11 registers a name on attach, and unregistering it also drops the creator's
    registration when both share a tracker (as a spawned TP rank does)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """Consecutive ids merged into (first, count) runs: fewer, larger copies."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def block_offset(layer: int, plane: int, block: int, planes: int, blocks: int, block_bytes: int) -> int:
    """Byte offset of (layer slot, plane, block) in a pool laid out [slot, plane, block, ...] row-major."""
    return ((layer * planes + plane) * blocks + block) * block_bytes


class KVPool:
    """A KV pool in this process's memory, or (`shm_name`) one another process created in shared
    memory: a TP rank's, or a peer's on this host. Only the creator unlinks a shared pool."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: str, shared: bool = False,
                 model_kv_heads: int = 0, shm_name: str | None = None, layer_windows: tuple[int, ...] = ()) -> None:
        self.shape = shape
        self.layer_windows = layer_windows  # the model's (KVCacheSpec): part of the layout peers agree on
        self.dtype = dtype
        self.shm: shared_memory.SharedMemory | None = None  # ours, in shared memory
        self._mapping: mmap.mmap | None = None  # the shared memory of our pool or another process's
        self._shm_name = shm_name
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if shm_name is not None:
            self._mapping = attach_shared(shm_name)
        elif shared and torch.device(device).type == "cpu":
            # A fresh shared-memory file is zero-filled, like torch.zeros below. Pools a killed node
            # left behind go first (nothing else would ever free them).
            remove_dead_pools()
            self.shm = shared_memory.SharedMemory(create=True, size=POOL_OFFSET + nbytes,
                                                  name=pool_name(os.getpid(), uuid.uuid4().hex[:16]))
            self._mapping, self._shm_name = self.shm._mmap, self.shm.name  # noqa: SLF001
        if self._mapping is not None:
            if len(self._mapping) < POOL_OFFSET + nbytes:
                raise ValueError(f"shared KV pool {shm_name} holds {len(self._mapping)} bytes, not "
                                 f"{POOL_OFFSET + nbytes}")
            prefault(self._mapping)
            self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes,
                                           offset=POOL_OFFSET).view(dtype).view(shape)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers, self.num_planes, self.num_blocks, self.block_size, self.num_kv_heads = shape[:5]
        # The model's layers by KV group (models/kv_spec.py): layer groups[g].layers[i] is slot i of
        # dim 0 (num_layers counts slots), and reads the block ids of the request's table g.
        self.groups = kv_groups(layer_windows, len(layer_windows) or self.num_layers)
        self.layer_slots = {layer: (g, slot) for g, group in enumerate(self.groups)
                            for slot, layer in enumerate(group.layers)}
        self.layer_groups = [self.layer_slots[layer][0] for layer in range(len(self.layer_slots))]  # by model layer
        self.model_kv_heads = model_kv_heads or self.num_kv_heads  # this pool holds a TP rank's share of them
        self.block_bytes = nbytes // (self.num_layers * self.num_planes * self.num_blocks)
        self.head_bytes = self.block_bytes // (self.block_size * self.num_kv_heads)  # one head of one slot

    @classmethod
    def for_model(cls, spec: KVCacheSpec, num_blocks: int, block_size: int, device: str,
                  shared: bool = False, shm_name: str | None = None) -> KVPool:
        return cls(spec.pool_shape(num_blocks, block_size), spec.dtype, device, shared, spec.model_kv_heads, shm_name,
                   spec.layer_windows)

    @property
    def shm_name(self) -> str | None:
        return self._shm_name

    @property
    def layout(self) -> KVLayout:
        """What a peer must agree on, whatever its TP size (its ranks hold other shares of the heads)."""
        return KVLayout(self.num_layers, self.num_planes, self.block_size, self.model_kv_heads, self.head_bytes,
                        str(self.dtype).removeprefix("torch."), self.layer_windows)

    def byte_view(self) -> memoryview:
        """The pool as flat bytes (CPU pools only): sockets send from and receive into it."""
        if self.tensor.device.type != "cpu":
            raise RuntimeError("KV transfer needs a CPU KV pool")
        return tensor_bytes(self.tensor)

    def segments(self, block_ids: list[int], layers: range | None = None) -> list[tuple[int, int]]:
        """(offset, length) of the bytes of `block_ids` in layer slots `layers` (all by default), in
        canonical (slot, plane, block) order."""
        bb, nb, planes = self.block_bytes, self.num_blocks, self.num_planes
        runs = block_runs(block_ids)
        return [
            (block_offset(layer, plane, first, planes, nb, bb), count * bb)
            for layer in (layers if layers is not None else range(self.num_layers))
            for plane in range(planes)
            for first, count in runs
        ]

    def layer_caches(self) -> list[torch.Tensor]:
        """Each model layer's [plane, block, slot, kv_head, head_dim] view (its group's slot)."""
        return [self.tensor[self.layer_slots[layer][1]] for layer in range(len(self.layer_slots))]

    def group_runs(self, num_tokens: int, first_block: int, count: int) -> list[tuple[int, range, int]]:
        """What a transfer of `count` blocks of each group's table (blocks first_block.. of a sequence
        whose KV then ends at `num_tokens`) moves: [(group, its layer slots, leading blocks skipped)].
        A sliding group skips the blocks before its window, which it never reads again (and may no
        longer hold); one without anything left to move is left out."""
        runs = [(g, range(len(group.layers)), self.group_skip(g, num_tokens, first_block, count))
                for g, group in enumerate(self.groups)]
        return [run for run in runs if run[2] < count]

    def group_skip(self, group: int, num_tokens: int, first_block: int, count: int) -> int:
        """How many of such a transfer's leading blocks `group` skips (count: all of them)."""
        window = self.groups[group].window
        return min(count, max(0, first_needed_block(window, num_tokens, self.block_size) - first_block))

    def nbytes(self, block_ids: list[int], layers: range | None = None, heads: range | None = None) -> int:
        """Bytes of every plane of `block_ids` over `layers` (all by default), of `heads` (all)."""
        num_layers = len(layers) if layers is not None else self.num_layers
        num_heads = len(heads) if heads is not None else self.num_kv_heads
        return num_layers * self.num_planes * len(block_ids) * self.block_size * num_heads * self.head_bytes

    # -- a run of KV heads (TP: a peer's rank holds other heads than ours) ------------------------

    def holds_all(self, heads: range) -> bool:
        return heads == range(self.num_kv_heads)

    def heads_view(self, layers: range, heads: range) -> torch.Tensor:
        """[layer, plane, block, slot, head, head_dim] of `layers` and `heads`: a view, no copy."""
        return self.tensor[layers.start : layers.stop, :, :, :, heads.start : heads.stop]

    def gather(self, block_ids: list[int], layers: range, heads: range) -> torch.Tensor:
        """A contiguous copy of those heads of `block_ids`, in canonical order (layer, plane, block,
        slot, head): the order `segments` gives for all heads, so either end may slice. One copy
        per run of consecutive blocks (several times faster than indexing block by block)."""
        view = self.heads_view(layers, heads)
        out = torch.empty((*view.shape[:2], len(block_ids), *view.shape[3:]), dtype=self.dtype)
        copy_block_runs(view, block_ids, out, list(range(len(block_ids))))
        return out

    def digest(self, block_ids: list[int], layers: range, heads: range) -> int:
        """xxh3 of those heads of `block_ids` in canonical order (the bytes `gather` gives): equal on
        both ends of a transfer that moved them intact, whatever the block ids and TP ranks. All
        heads: streamed over `segments` in place (a gather's fresh 45 MiB cost 23 ms of page faults
        at 2048 tokens; xxh3 1.3 ms, zlib's crc32 7 ms)."""
        if not self.holds_all(heads):
            data = self.gather(block_ids, layers, heads)
            return xxhash.xxh3_64_intdigest(tensor_bytes(data))
        hasher, pool = xxhash.xxh3_64(), self.byte_view()
        for offset, length in self.segments(block_ids, layers):
            hasher.update(pool[offset : offset + length])
        return hasher.intdigest()

    def scatter(self, block_ids: list[int], layers: range, heads: range, data: torch.Tensor) -> None:
        """Write what `gather` returns (from any pool of the same layout) into our `block_ids`."""
        copy_block_runs(data, list(range(len(block_ids))), self.heads_view(layers, heads), block_ids)

    def close(self) -> None:
        if self._mapping is None:
            return
        del self.tensor
        try:
            (self.shm or self._mapping).close()
        except BufferError:  # a view is still alive; the mapping goes with the process
            pass
        if self.shm is not None:  # ours: only the creator unlinks
            self.shm.unlink()
        self.shm = self._mapping = None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes, shared with it (no copy)."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())


_SAME_BYTES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_block_runs(src: torch.Tensor, src_ids: list[int], out: torch.Tensor, dst_ids: list[int]) -> int:
    """Copy blocks along dim 2 of [layers, planes, blocks, ...] tensors, one copy per common run.

    On CPU through numpy views of the same bytes: a copy of one scattered block is 60 strided
    chunks, which torch's copy_ ran ~6x slower single-threaded and ~300x slower with 2 intra-op
    threads while another process kept a core busy (a 2048-token scattered request: 3.5 ms here,
    20 ms, 1 s)."""
    block_bytes = out[:, :, 0].numel() * out.element_size()
    if src.device.type == "cpu" and out.device.type == "cpu":
        int_type = _SAME_BYTES[out.element_size()]
        src, out = src.view(int_type).numpy(), out.view(int_type).numpy()
    copied = 0
    for first_src, first_dst, count in common_runs(src_ids, dst_ids):
        out[:, :, first_dst : first_dst + count] = src[:, :, first_src : first_src + count]
        copied += count
    return copied * block_bytes


def common_runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]]:
    """(first of a, first of b, count) of the maximal runs where both lists go up by one in step."""
    runs, i = [], 0
    while i < len(a):
        j = i + 1
        while j < len(a) and a[j] == a[j - 1] + 1 and b[j] == b[j - 1] + 1:
            j += 1
        runs.append((a[i], b[i], j - i))
        i = j
    return runs
