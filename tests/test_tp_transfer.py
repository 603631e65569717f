"""KV transfer between nodes of different TP sizes, on real sockets and real shared memory: a pull
(KVSender / KVReceiver) and a push (PushSender / PushReceiver) move every D rank's heads from the P
ranks that hold them (kv/tp_plan.py), over every transport, and write nothing else; D's digests of
what landed equal P's of what it sent."""

from __future__ import annotations

import pytest
import torch
from helpers import every_transport, push_in_chunks

from pdserve.kv.holds import HeldBlocks
from pdserve.kv.inbox import TransferInbox
from pdserve.kv.pool import KVPool
from pdserve.kv.pull import KVReceiver, KVSender, LoadSpec
from pdserve.kv.push import PushReceiver, PushSender, PushTarget
from pdserve.kv.stats import KVStats
from pdserve.kv.transport import NodeTransports
from pdserve.models.parallel import kv_heads

LAYERS, BLOCKS, SLOTS, HEAD_DIM = 3, 16, 4, 8
SRC, DST = [3, 4, 5, 9], [12, 7, 8, 0]
# (model KV heads, P TP, D TP): the issue's pairs (SmolLM2's 3 heads both ways, 2 heads with D
# replicating), and a D smaller than P, which reads each rank from several P ranks.
PAIRS = [(3, 3, 1), (3, 1, 3), (2, 2, 4), (2, 4, 2), (4, 4, 2), (2, 2, 2)]


def rank_pools(model: torch.Tensor | None, num_kv_heads: int, tp: int) -> list[KVPool]:
    """One shared pool per rank, each holding that rank's heads of `model` (zeros if None)."""
    pools = []
    for rank in range(tp):
        heads = kv_heads(rank, tp, num_kv_heads)
        pool = KVPool((LAYERS, 2, BLOCKS, SLOTS, len(heads), HEAD_DIM), torch.float32, "cpu", shared=True,
                      model_kv_heads=num_kv_heads)
        if model is not None:
            pool.tensor.copy_(model[:, :, :, :, heads.start : heads.stop])
        pools.append(pool)
    return pools


def assert_landed(d_pools: list[KVPool], model: torch.Tensor, num_kv_heads: int) -> None:
    """Each D rank holds exactly its heads of the model's SRC blocks in DST, and nothing else."""
    for rank, pool in enumerate(d_pools):
        heads = kv_heads(rank, len(d_pools), num_kv_heads)
        assert torch.equal(pool.tensor[:, :, DST], model[:, :, SRC][:, :, :, :, heads.start : heads.stop])
        others = [b for b in range(BLOCKS) if b not in DST]
        assert pool.tensor[:, :, others].abs().sum() == 0


@pytest.fixture
def model():
    return torch.randn(LAYERS, 2, BLOCKS, SLOTS, 4, HEAD_DIM)  # up to 4 heads; a case takes the first K


def close(*items) -> None:
    for item in items:
        for pool in item if isinstance(item, list) else [item]:
            pool.close()


def pull(p_pools: list[KVPool], d_pools: list[KVPool], held: HeldBlocks, transport: str, p_stats: KVStats,
         d_stats: KVStats):
    """D pulls P's request "p-1" (blocks SRC) into DST over the side channel; the transfer's result."""
    held.hold("p-1", SRC)
    p_transports, d_transports = NodeTransports(p_pools), NodeTransports(d_pools)
    sender = KVSender(p_transports, held, p_stats, "127.0.0.1", 0)
    inbox = TransferInbox()
    receiver = KVReceiver(d_transports, d_stats, inbox, transport, timeout_s=10, verify_digests=True)
    try:
        receiver.start(LoadSpec("d-1", [DST], [SRC], "p-1", "127.0.0.1", sender.port, p_transports.served()))
        [result] = inbox.poll(timeout=30)
    finally:
        receiver.close()
        sender.close()
        p_transports.close()
        d_transports.close()
    return result


@pytest.mark.parametrize("transport", every_transport())
@pytest.mark.parametrize("num_kv_heads, tp_p, tp_d", PAIRS)
def test_a_pull_fills_every_decode_rank_from_the_prefill_ranks_holding_its_heads(model, transport, num_kv_heads,
                                                                               tp_p, tp_d):
    model = model[..., :num_kv_heads, :].contiguous()
    p_pools, d_pools = rank_pools(model, num_kv_heads, tp_p), rank_pools(None, num_kv_heads, tp_d)
    held = HeldBlocks(lease_s=60)
    p_stats, d_stats = KVStats(), KVStats()
    result = pull(p_pools, d_pools, held, transport, p_stats, d_stats)
    try:
        assert result.error is None and result.transport == transport
        assert_landed(d_pools, model, num_kv_heads)
        # P frees the blocks only now: every D rank's share came over the one pull.
        assert held.pop_releasable() == [("p-1", False)]
        wanted = sum(pool.nbytes(DST) for pool in d_pools)
        assert p_stats.snapshot().bytes_sent == d_stats.snapshot().bytes_received == result.nbytes == wanted
    finally:
        close(p_pools, d_pools)


@pytest.mark.parametrize("transport", every_transport())
@pytest.mark.parametrize("num_kv_heads, tp_p, tp_d", PAIRS)
def test_a_layerwise_push_fills_every_decode_rank(model, transport, num_kv_heads, tp_p, tp_d):
    model = model[..., :num_kv_heads, :].contiguous()
    p_pools, d_pools = rank_pools(model, num_kv_heads, tp_p), rank_pools(None, num_kv_heads, tp_d)
    p_transports, d_transports = NodeTransports(p_pools), NodeTransports(d_pools)
    p_stats, d_stats, inbox = KVStats(), KVStats(), TransferInbox()
    receiver = PushReceiver(d_transports, d_stats, inbox, "127.0.0.1", 0, verify_digests=True)
    sender = PushSender(p_transports, p_stats, transport, timeout_s=10)
    try:
        receiver.expect("d-1", [DST], timeout_s=30)
        target = PushTarget("d-1", [DST], 0, "127.0.0.1", receiver.port, d_transports.served())
        push_in_chunks(sender, "p-1", target, [(SRC[:2], DST[:2]), (SRC[2:], DST[2:])], LAYERS)  # two chunks
        [result] = inbox.poll(timeout=30)
    finally:
        receiver.close()
        p_transports.close()
        d_transports.close()
    try:
        assert result.error is None and sender.failed_requests() == []
        assert_landed(d_pools, model, num_kv_heads)
        wanted = sum(pool.nbytes(DST) for pool in d_pools)
        assert p_stats.snapshot().bytes_sent == d_stats.snapshot().bytes_received == result.nbytes == wanted
    finally:
        close(p_pools, d_pools)


def test_a_peer_whose_tp_cannot_split_the_heads_is_refused(model):
    """A D of TP 3 asking a P of a 2-head model (a peer misconfigured by hand): a clear error, no bytes."""
    p_pools = rank_pools(model[..., :2, :].contiguous(), 2, 1)
    d_pools = [KVPool((LAYERS, 2, BLOCKS, SLOTS, 1, HEAD_DIM), torch.float32, "cpu", shared=True, model_kv_heads=2)
               for _ in range(3)]
    try:
        result = pull(p_pools, d_pools, HeldBlocks(lease_s=60), "tcp", KVStats(), KVStats())
    finally:
        close(p_pools, d_pools)
    assert "decode node's TP size 3 cannot split the model's 2 KV heads" in result.error
