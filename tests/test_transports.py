"""Conformance suite: every registered KV transport, on real TCP sockets and real shared memory.

A transport moves bytes and nothing else: the active side's read (pull) and write (push) land
exactly the named blocks of the named layers, the passive side's serve calls agree on the byte
count, and a full push through PushSender / PushReceiver arrives intact and is counted once on
each end. A new transport registered in kv/transport/ is tested here without a new line.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import corrupting, every_transport, push_in_chunks

from pdserve.kv.inbox import TransferInbox
from pdserve.kv.pool import KVPool
from pdserve.kv.push import PushReceiver, PushSender, PushTarget, SaveSpec
from pdserve.kv.stats import KVStats
from pdserve.kv.tp_plan import Piece
from pdserve.kv.transport import (TRANSPORTS, NodeTransports, PeerAddress, PeerPool, choose_transport,
                                  transport_class)

SHAPE = (4, 2, 32, 16, 2, 8)  # layers, K/V, blocks, slots, kv heads, head dim
SRC, DST = [3, 4, 5, 9, 10], [20, 7, 8, 0, 1]  # scattered, with a run on both sides
ALL = every_transport()


@pytest.fixture
def pools():
    """A filled pool (the peer that owns the KV) and an empty one, both in shared memory."""
    full = KVPool(SHAPE, torch.bfloat16, "cpu", shared=True)
    full.tensor.copy_(torch.randn(SHAPE).to(torch.bfloat16))
    empty = KVPool(SHAPE, torch.bfloat16, "cpu", shared=True)
    yield full, empty
    full.close()
    empty.close()


@pytest.fixture
def connection():
    """Both ends of one loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    yield client, accepted
    client.close()
    accepted.close()


WHOLE = Piece(0, range(SHAPE[4]), 0, range(SHAPE[4]))  # without TP: all heads, rank 0 to rank 0


def peer(passive) -> PeerPool:
    """What the active side knows of `passive` (a transport) once it has accepted: its handshake."""
    return PeerPool("127.0.0.1", passive.pool.num_blocks, 1, passive.handshake())


def only_blocks_written(pool: KVPool, blocks: list[int], layers: range) -> bool:
    untouched = torch.ones(SHAPE[:3], dtype=torch.bool)
    for layer in layers:
        untouched[layer, :, blocks] = False
    return bool(pool.tensor[untouched].abs().sum() == 0)


@pytest.mark.parametrize("name", ALL)
def test_read_lands_the_peers_blocks(name, pools, connection):
    owner, reader = pools
    active, passive = transport_class(name)([reader]), transport_class(name)([owner])
    client, server = connection
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(passive.serve_read, server, WHOLE, SRC, range(SHAPE[0]))
        got = active.read(client, peer(passive), WHOLE, SRC, DST, range(SHAPE[0]))
    active.close()
    passive.close()
    assert got == served.result() == owner.nbytes(SRC) > 0
    assert torch.equal(reader.tensor[:, :, DST], owner.tensor[:, :, SRC])
    assert only_blocks_written(reader, DST, range(SHAPE[0]))


@pytest.mark.parametrize("name", ALL)
def test_write_lands_one_layer_in_the_peers_blocks(name, pools, connection):
    owner, target = pools
    active, passive = transport_class(name)([owner]), transport_class(name)([target])
    client, server = connection
    layer = range(2, 3)
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(passive.serve_write, server, WHOLE, DST, layer)
        got = active.write(client, peer(passive), WHOLE, SRC, DST, layer)
    active.close()
    passive.close()
    assert got == served.result() == owner.nbytes(SRC, layer) > 0
    assert torch.equal(target.tensor[2][:, DST], owner.tensor[2][:, SRC])
    assert only_blocks_written(target, DST, layer)


@pytest.mark.parametrize("name", ALL)
def test_push_session_arrives_intact_and_both_ends_count_it(name, pools):
    owner, target = pools
    p_transports, d_transports = NodeTransports([owner]), NodeTransports([target])
    p_stats, d_stats, inbox = KVStats(), KVStats(), TransferInbox()
    receiver = PushReceiver(d_transports, d_stats, inbox, "127.0.0.1", 0)
    sender = PushSender(p_transports, p_stats, name, timeout_s=10)
    try:
        receiver.expect("d-1", [DST], timeout_s=30)
        push = PushTarget("d-1", [DST], 0, "127.0.0.1", receiver.port, d_transports.served())
        # Two steps (chunks), as a chunked prefill pushes them: the first three blocks, then the rest.
        # The last step's sampled token ends the session: D decodes from it.
        push_in_chunks(sender, "p-1", push, [(SRC[:3], DST[:3]), (SRC[3:], DST[3:])], SHAPE[0], first_token=7)
        [result] = inbox.poll(timeout=30)
    finally:
        receiver.close()
        p_transports.close()
        d_transports.close()
    assert result.error is None and (result.request_id, result.mode, result.transport) == ("d-1", "push", name)
    assert result.first_token_id == 7
    assert sender.failed_requests() == []
    assert torch.equal(target.tensor[:, :, DST], owner.tensor[:, :, SRC])
    assert only_blocks_written(target, DST, range(SHAPE[0]))
    assert p_stats.snapshot().bytes_sent == d_stats.snapshot().bytes_received == result.nbytes == owner.nbytes(SRC) > 0


@pytest.mark.parametrize("name", ALL)
def test_a_push_the_decode_node_does_not_expect_is_refused(name, pools):
    owner, target = pools
    p_transports, d_transports = NodeTransports([owner]), NodeTransports([target])
    receiver = PushReceiver(d_transports, KVStats(), TransferInbox(), "127.0.0.1", 0)
    sender = PushSender(p_transports, KVStats(), name, timeout_s=10)
    try:
        push = PushTarget("nobody", [DST], 0, "127.0.0.1", receiver.port, d_transports.served())
        sender.begin_step([SaveSpec("p-1", push, [SRC], [DST], last=True)])
        sender.save_kv_layer(0)
        sender.wait_for_save({})
        [(request_id, error)] = sender.failed_requests()
    finally:
        receiver.close()
        p_transports.close()
        d_transports.close()
    assert request_id == "p-1" and "not waiting for a push of request 'nobody'" in error
    assert target.tensor.abs().sum() == 0


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("corrupt", [False, True])
def test_a_push_is_checked_by_its_digests_and_one_gone_wrong_fails(name, pools, corrupt):
    """Issue 39: D asks for the pushed blocks' digests; P sends them with PushDone (its blocks of
    every chunk, the partial block pushed twice counted once). Intact, the push arrives; one bit
    sent flipped (test-only), the push fails naming the corruption."""
    owner, target = pools
    p_transports, d_transports = NodeTransports([owner]), NodeTransports([target])
    if corrupt:
        corrupting(p_transports[name])
    inbox = TransferInbox()
    receiver = PushReceiver(d_transports, KVStats(), inbox, "127.0.0.1", 0, verify_digests=True)
    sender = PushSender(p_transports, KVStats(), name, timeout_s=10)
    try:
        receiver.expect("d-1", [DST], timeout_s=30)
        push = PushTarget("d-1", [DST], 0, "127.0.0.1", receiver.port, d_transports.served())
        push_in_chunks(sender, "p-1", push, [(SRC[:3], DST[:3]), (SRC[2:], DST[2:])], SHAPE[0], first_token=7)
        [result] = inbox.poll(timeout=30)
    finally:
        receiver.close()
        p_transports.close()
        d_transports.close()
    if corrupt:
        assert result.error and "KV arrived corrupted" in result.error, result.error
    else:
        assert result.error is None and torch.equal(target.tensor[:, :, DST], owner.tensor[:, :, SRC])


def test_a_push_of_another_prompt_is_refused_before_any_layer_lands(pools):
    """Issue 39: D expects the KV of its own prompt's first tokens; a push that names another
    prompt (or another token count) is refused at the session's start and writes nothing."""
    owner, target = pools
    p_transports, d_transports = NodeTransports([owner]), NodeTransports([target])
    receiver = PushReceiver(d_transports, KVStats(), TransferInbox(), "127.0.0.1", 0)
    sender = PushSender(p_transports, KVStats(), "tcp", timeout_s=10)
    ours, theirs = list(range(100, 180)), list(range(200, 280))
    try:
        for i, (tokens, count) in enumerate(((theirs, 80), (ours, 79))):
            receiver.expect(f"d-{i}", [DST], timeout_s=30, num_tokens=80, prompt_token_ids=ours)
            push = PushTarget(f"d-{i}", [DST], 0, "127.0.0.1", receiver.port, d_transports.served(), count, tokens)
            sender.begin_step([SaveSpec(f"p-{i}", push, [SRC], [DST], last=True)])
            sender.save_kv_layer(0)
            sender.wait_for_save({})
            [(request_id, error)] = sender.failed_requests()
            assert request_id == f"p-{i}" and "another prompt" in error, error
    finally:
        receiver.close()
        p_transports.close()
        d_transports.close()
    assert target.tensor.abs().sum() == 0


def test_auto_takes_shared_memory_on_this_host_and_tcp_elsewhere():
    both = ("shm", "tcp")
    assert choose_transport("auto", PeerAddress("127.0.0.1", both)) == "shm"
    assert choose_transport("auto", PeerAddress("198.18.0.2", both)) == "tcp"  # another host
    assert choose_transport("auto", PeerAddress("127.0.0.1", ("tcp",))) == "tcp"  # the peer has no shared pool
    assert choose_transport("auto", PeerAddress("127.0.0.1")) == "tcp"  # params that name no transport
    assert choose_transport("tcp", PeerAddress("127.0.0.1", both)) == "tcp"
    with pytest.raises(ValueError, match="KV transport must be one of shm, tcp, mooncake, nixl, got 'rdma'"):
        transport_class("rdma")


def test_a_node_makes_a_transport_when_first_asked_and_advertises_what_it_serves(pools):
    """Nothing is made up front (an engine a node never uses is never imported); a node whose
    pools are in shared memory serves every transport, one whose pools are not serves no shm, and
    a peer naming shm to it is refused with the reason, naming the transport's own words."""
    shared, _ = pools
    private = KVPool(SHAPE, torch.bfloat16, "cpu")
    node, plain = NodeTransports([shared]), NodeTransports([private])
    installed = tuple(name for name in TRANSPORTS if not transport_class(name).unavailable())
    assert dict(node) == {} and node.served() == installed and installed[:2] == ("shm", "tcp")
    assert plain.served() == tuple(name for name in installed if name != "shm")
    assert plain.to_serve("shm", private.layout, 1, producer=True) == "this node has no shared-memory KV pool"
    assert plain.to_serve("rdma", private.layout, 1, producer=True) == "unknown KV transport 'rdma'"
    transport, plan = node.to_serve("tcp", shared.layout, 1, producer=True)
    assert list(node) == ["tcp"] and node["tcp"] is transport and plan == [WHOLE]


def test_a_transport_reads_only_its_own_handshake(pools, connection):
    """shm's handshake names the passive side's segments by rank; bytes that are not one (another
    transport's, or none) are refused with a protocol error, not mapped."""
    owner, reader = pools
    active, passive = transport_class("shm")([reader]), transport_class("shm")([owner])
    client, _ = connection
    with pytest.raises(ConnectionError, match="no shm handshake"):
        active.read(client, PeerPool("127.0.0.1", owner.num_blocks, 1, b""), WHOLE, SRC, DST, range(1))
    good = peer(passive)
    assert active.read(client, good, WHOLE, SRC, DST, range(1)) == owner.nbytes(SRC, range(1))
    active.close()
    passive.close()
