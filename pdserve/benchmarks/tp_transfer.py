"""KV transfer time per request between P and D of each TP pair: the connector's real path (the side
channel's sockets, every rank's pool in shared memory, the read plan of kv/tp_plan.py) moving one
prompt's KV, without the model. Two KV layouts of SmolLM2's size (30 layers, head dim 64): its own
3 KV heads (TP 1 and 3) and the random Llama's 2 (TP 1, 2 and 4).

    python -m pdserve.benchmarks.tp_transfer [--prompt-len 1024] [--repeats 20] [--dtype bfloat16]

Pull: D's `KVReceiver` loads the request from P's `KVSender` (one connection; every D rank's share).
Push: P's `PushSender` writes every layer as the forward pass would (30 `save_kv_layer` calls, one
step) into D's `PushReceiver`. Both ends run in this process on threads (socket IO and copies
release the GIL), as each node's rank 0 does. The median of `--repeats` per pair, mode and transport.

Writes docs/results/tp_transfer.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.benchmarks.report import publish
from pdserve.kv.holds import HeldBlocks
from pdserve.kv.inbox import TransferInbox
from pdserve.kv.params import join_tables
from pdserve.kv.pool import KVPool
from pdserve.kv.pull import KVReceiver, KVSender, LoadSpec
from pdserve.kv.push import PushReceiver, PushSender, PushTarget, SaveSpec
from pdserve.kv.stats import KVStats
from pdserve.kv.transport import NodeTransports, available
from pdserve.models.parallel import kv_heads

LAYERS, HEAD_DIM, BLOCK = 30, 64, 16
LAYOUTS = {"3 KV heads (SmolLM2)": (3, [(1, 1), (3, 3), (3, 1), (1, 3)]),
           "2 KV heads (random Llama)": (2, [(1, 1), (2, 2), (2, 4), (4, 2)])}


def rank_pools(num_kv_heads: int, tp: int, num_blocks: int, dtype: torch.dtype) -> list[KVPool]:
    return [KVPool((LAYERS, 2, num_blocks, BLOCK, len(kv_heads(r, tp, num_kv_heads)), HEAD_DIM), dtype, "cpu",
                   shared=True, model_kv_heads=num_kv_heads) for r in range(tp)]


def time_pull(p: NodeTransports, d: NodeTransports, transport: str, blocks: list[list[int]], repeats: int,
              num_tokens: int = 0) -> list[float]:
    """Seconds per pull of `blocks` (a table per KV group, the same ids at both ends); `num_tokens` > 0:
    the KV ends there and sliding groups move their window."""
    held, inbox = HeldBlocks(lease_s=600), TransferInbox()
    sender = KVSender(p, held, KVStats(), "127.0.0.1", 0)
    receiver = KVReceiver(d, KVStats(), inbox, transport, timeout_s=60)
    seconds = []
    try:
        for i in range(repeats + 1):  # the first warms up (maps the peer's pools)
            held.hold(f"p-{i}", join_tables(blocks))
            start = time.perf_counter()
            receiver.start(LoadSpec(f"d-{i}", blocks, blocks, f"p-{i}", "127.0.0.1", sender.port, p.served(),
                                    num_tokens))
            [result] = inbox.poll(timeout=60)
            assert result.error is None, result.error
            seconds.append(time.perf_counter() - start)
            held.pop_releasable()
    finally:
        receiver.close()
        sender.close()
    return seconds[1:]


def time_push(p: NodeTransports, d: NodeTransports, transport: str, blocks: list[list[int]], repeats: int,
              num_tokens: int = 0) -> list[float]:
    """Seconds per push of `blocks`, every layer in one step; `num_tokens` as for time_pull."""
    inbox = TransferInbox()
    receiver = PushReceiver(d, KVStats(), inbox, "127.0.0.1", 0)
    sender = PushSender(p, KVStats(), transport, timeout_s=60)
    seconds = []
    try:
        for i in range(repeats + 1):
            receiver.expect(f"d-{i}", blocks, timeout_s=60)
            target = PushTarget(f"d-{i}", blocks, 0, "127.0.0.1", receiver.port, d.served())
            start = time.perf_counter()
            sender.begin_step([SaveSpec(f"p-{i}", target, blocks, blocks, last=True, num_tokens=num_tokens)])
            for layer in range(len(p.pool.layer_slots)):
                sender.save_kv_layer(layer)
            sender.wait_for_save({})
            [result] = inbox.poll(timeout=60)
            assert result.error is None, result.error
            seconds.append(time.perf_counter() - start)
    finally:
        receiver.close()
    return seconds[1:]


def measure(num_kv_heads: int, tp_p: int, tp_d: int, args, dtype: torch.dtype) -> dict:
    num_blocks = -(-args.prompt_len // BLOCK)
    return time_transfers(rank_pools(num_kv_heads, tp_p, num_blocks, dtype),
                          rank_pools(num_kv_heads, tp_d, num_blocks, dtype), args.repeats)


def time_transfers(p_pools: list[KVPool], d_pools: list[KVPool], repeats: int) -> dict:
    """Every block of P's pools to D's, pulled and pushed over each transport: median milliseconds
    per request (the pools are closed after)."""
    blocks = list(range(p_pools[0].num_blocks))
    for pool in p_pools:
        pool.tensor.normal_()
    p, d = NodeTransports(p_pools), NodeTransports(d_pools)
    out: dict = {"mib": sum(pool.nbytes(blocks) for pool in d_pools) / 2**20, "pieces": len(d.pieces(len(p_pools), False))}
    try:
        for transport in available():
            for mode, run in (("pull", time_pull), ("push", time_push)):
                out[f"{mode}_{transport}_ms"] = 1e3 * statistics.median(run(p, d, transport, [blocks], repeats))
    finally:
        p.close()
        d.close()
        for pool in p_pools + d_pools:
            pool.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", default="docs/results/tp_transfer.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "prompt_len": args.prompt_len, "dtype": args.dtype,
                 "layers": LAYERS, "head_dim": HEAD_DIM, "layouts": {}}
    for name, (heads, pairs) in LAYOUTS.items():
        res["layouts"][name] = {f"{tp_p}->{tp_d}": measure(heads, tp_p, tp_d, args, dtype) for tp_p, tp_d in pairs}
    lines = [f"Command: `python -m pdserve.benchmarks.tp_transfer` ({res['date']}; {args.dtype}; one "
             f"{args.prompt_len}-token prompt's KV, {LAYERS} layers x head dim {HEAD_DIM}; median of {args.repeats}; "
             "P and D on this host). Milliseconds per request.", "",
             "| KV layout | P TP -> D TP | MiB | pieces | pull tcp | pull shm | push tcp | push shm |",
             "|---|---|---|---|---|---|---|---|"]
    for name, pairs in res["layouts"].items():
        for pair, r in pairs.items():
            lines.append(f"| {name} | {pair.replace('->', ' -> ')} | {r['mib']:.1f} | {r['pieces']} | "
                         f"{r['pull_tcp_ms']:.1f} | {r['pull_shm_ms']:.1f} | {r['push_tcp_ms']:.1f} | "
                         f"{r['push_shm_ms']:.1f} |")
    lines += ["", "A piece is one run of KV heads from one P rank's pool to one D rank's (kv/tp_plan.py). A "
              "piece that is a whole rank's pool moves as the blocks' byte segments, no copy; one of some of a "
              "rank's heads (P and D of different TP) is gathered into one buffer on the sending side and "
              "scattered on the receiving one (tcp), or copied as a strided view (shm). D of larger TP receives "
              "more bytes than P holds when it replicates KV heads (TP 4 over 2 heads: each head twice). Both ends run "
              "in this one process and share its GIL, which a real P and D do not, so the tcp columns (Python "
              "threads on both ends of a socket) are upper bounds and vary run to run; the shm columns are copies. "
              "A push's layers are written while the prefill computes the next ones, so most of its time hides "
              "behind the forward pass (docs/benchmarks.md, push)."]
    publish(res, args.out, "tp_transfer", "KV transfer time per TP pair (issue 18)", "\n".join(lines))


if __name__ == "__main__":
    main()
