"""Tensor parallelism's other ranks. Rank 0 is the engine: it schedules, prepares each step's
inputs (token ids, positions, attention metadata: the same for every rank, since every rank's KV
pool has the same blocks, each holding that rank's heads), broadcasts them, runs its own slice of
the forward pass and samples. Ranks 1..N-1 are spawned processes that load their slices of the
model and of the KV pool (on a P or D node, the pool rank 0 made for them in shared memory, which
its KV connector reads and writes) and run each broadcast step; the model's all-reduces join them. So no
rank schedules on its own, and none can drift.

A rank that dies fails rank 0's next step (it checks the processes, and gloo the connections):
the engine loop stops and the node reports unhealthy. A rank that hangs fails it after `TIMEOUT_S`.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.rank import RankSpec, set_up_rank
from pdserve.models.attention import AttentionMetadata
from pdserve.models.parallel import TensorParallel

TIMEOUT_S = 600.0  # a collective that waits longer fails (the first waits for every rank's model to load)


def tp_threads(size: int) -> int:
    """Each rank's share of this process's cores."""
    return max(1, len(os.sched_getaffinity(0)) // size)


def backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class TPWorkers:
    """Ranks 1..size-1 of this engine's TP group; rank 0 (this process) joins the group here."""

    def __init__(self, spec: RankSpec, size: int) -> None:
        self.size = size
        # The group meets at a TCP store on loopback, not a file: a file store outlives a node that is
        # killed. Torch's own listener binds every interface, so it is handed (and owns) a socket bound here.
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.detach(), timeout=timedelta(seconds=TIMEOUT_S))
        context = multiprocessing.get_context("spawn")
        started = [context.Event() for _ in range(1, size)]
        self.procs = [context.Process(target=_rank_main, args=(spec, rank, size, port, started[rank - 1]),
                                      name=f"pdserve-tp-{rank}", daemon=True) for rank in range(1, size)]
        for proc in self.procs:
            proc.start()
        # Join the group only once every rank is up: one that failed to start is an error now, not a
        # rendezvous that waits for it until the timeout.
        while not all(event.wait(0.1) for event in started):
            self.check_alive()
        dist.init_process_group(backend(spec.device), store=store, rank=0, world_size=size,
                                timeout=timedelta(seconds=TIMEOUT_S))

    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, metas: list[AttentionMetadata]) -> None:
        """Send this step's inputs (each KV group's metadata) to every rank: each runs the forward with rank 0."""
        self.check_alive()
        plain = [replace(m, decode_kernel=None, prefill_kernel=None) for m in metas]  # each rank sets its own
        dist.broadcast_object_list([(input_ids, positions, plain)], src=0)

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def check_alive(self) -> None:
        for proc in self.procs:
            if not proc.is_alive():
                raise RuntimeError(f"tensor parallel rank {self.procs.index(proc) + 1} exited "
                                   f"(status {proc.exitcode})")

    def close(self) -> None:
        if self.alive():
            dist.broadcast_object_list([None], src=0)  # each rank leaves its loop
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        dist.destroy_process_group()


def _rank_main(spec: RankSpec, rank: int, size: int, port: int, started) -> None:
    """A rank's process: its slices of the model and the pool, then every broadcast step."""
    from pdserve.kv.pool import KVPool
    from pdserve.models.loader import kv_cache_spec
    from pdserve.models.registry import read_model_config
    from pdserve.registry import load_plugins

    load_plugins()  # a spawned rank runs no CLI: a plugin's model family must be registered here too
    started.set()
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    dist.init_process_group(backend(spec.device), store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=TIMEOUT_S))
    tp = TensorParallel(rank, size)
    model, kernel, prefill_kernel = set_up_rank(spec, tp)
    pool = KVPool.for_model(kv_cache_spec(read_model_config(spec.model_dir), spec.kv_dtype or spec.dtype, tp),
                            spec.num_blocks,
                            spec.block_size, spec.device,
                            shm_name=spec.pool_shm_names[rank] if spec.pool_shm_names else None)
    kv_caches = pool.layer_caches()
    with torch.inference_mode():
        while True:
            received = [None]
            dist.broadcast_object_list(received, src=0)
            if received[0] is None:
                break
            input_ids, positions, metas = received[0]  # each KV group's
            metas = [replace(meta, decode_kernel=kernel, prefill_kernel=prefill_kernel) for meta in metas]
            model(input_ids, positions, kv_caches, [metas[g] for g in pool.layer_groups])
    dist.destroy_process_group()
