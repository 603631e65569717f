"""The KV side channel on real sockets and real shared memory: bytes land intact, only the
blocks held for the named request can be read, and peers must prove the shared secret."""

from __future__ import annotations

import logging
import os
import socket
import time

import pytest
import torch

from helpers import corrupting, every_transport

from pdserve.kv.channel import AuthError, client_handshake
from pdserve.kv.holds import HeldBlocks
from pdserve.kv.inbox import TransferInbox
from pdserve.kv.leases import Lease, LeaseRenewer
from pdserve.kv.pool import POOL_OFFSET, KVPool
from pdserve.kv.protocol import PullRequest, recv_msg, send_msg
from pdserve.kv.pull import KVReceiver, KVSender, LoadSpec
from pdserve.kv.stats import KVStats
from pdserve.kv.transport import NodeTransports

SHAPE = (4, 2, 32, 16, 2, 8)  # layers, K/V, blocks, slots, kv heads, head dim


@pytest.fixture
def prefill_side():
    pool = KVPool(SHAPE, torch.bfloat16, "cpu", shared=True)
    pool.tensor.copy_(torch.randn(SHAPE).to(torch.bfloat16))
    held = HeldBlocks(lease_s=60)
    held.hold("req-a", [3, 4, 5, 9])
    transports = NodeTransports([pool])
    stats = KVStats()
    sender = KVSender(transports, held, stats, "127.0.0.1", 0, secret=b"right")
    yield pool, held, sender, stats
    sender.close()
    transports.close()
    pool.close()


def pull(sender: KVSender, served, transport: str, secret: bytes, src, dst, request_id="req-a", verify=False,
         corrupt=False, **proof):
    local = KVPool(SHAPE, torch.bfloat16, "cpu")
    transports, stats, inbox = NodeTransports([local]), KVStats(), TransferInbox()
    if corrupt:
        corrupting(transports[transport])
    receiver = KVReceiver(transports, stats, inbox, transport, timeout_s=10, secret=secret, verify_digests=verify)
    receiver.start(LoadSpec("d-1", [dst], [src], request_id, "127.0.0.1", sender.port, served, **proof))
    result = inbox.poll(timeout=30)[0]
    receiver.close()
    transports.close()
    return result, local, stats


@pytest.mark.parametrize("transport", every_transport())
def test_pulled_blocks_arrive_intact_and_both_ends_count_them(prefill_side, transport):
    pool, held, sender, p_stats = prefill_side
    src, dst = [3, 4, 5, 9], [20, 7, 8, 0]  # scattered on both sides
    result, local, d_stats = pull(sender, sender.transports.served(), transport, b"right", src, dst)
    assert result.error is None and (result.mode, result.transport) == ("pull", transport)
    assert torch.equal(local.tensor[:, :, dst], pool.tensor[:, :, src])
    assert local.tensor[:, :, 1].abs().sum() == 0  # nothing else written
    assert held.pop_releasable() == [("req-a", False)]  # D said done: P may free
    assert p_stats.snapshot().bytes_sent == d_stats.snapshot().bytes_received == result.nbytes == pool.nbytes(src) > 0


def test_a_transport_the_node_does_not_serve_is_refused(prefill_side):
    pool, held, sender, _ = prefill_side
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as sock:
        client_handshake(sock, b"right")
        send_msg(sock, PullRequest("req-a", [[3]], "carrier-pigeon", pool.layout))
        reply = recv_msg(sock)
    assert not reply.ok and "unknown KV transport 'carrier-pigeon'" in reply.error
    assert held.num_blocks == 4  # still held for a D that asks properly


def test_wrong_secret_is_refused_and_logged(prefill_side, caplog):
    pool, held, sender, _ = prefill_side
    with caplog.at_level(logging.WARNING):
        result, local, _ = pull(sender, sender.transports.served(), "tcp", b"wrong", [3], [0])
    assert result.error and "authentication failed" in result.error
    assert local.tensor.abs().sum() == 0
    assert held.num_blocks == 4 and held.pop_releasable() == []  # still held for the real D
    assert any("refused connection" in r.getMessage() for r in caplog.records)


def test_peer_that_skips_the_handshake_gets_nothing(prefill_side):
    pool, _, sender, _ = prefill_side
    layout = pool.layout
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as sock:
        recv_msg(sock)  # the challenge, ignored
        send_msg(sock, PullRequest("req-a", [[3]], "tcp", layout))
        reply = recv_msg(sock)
        assert not reply.ok  # AuthResult(ok=False)
        assert sock.recv(1 << 16) == b""  # closed: no block bytes
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as sock:
        with pytest.raises(AuthError):
            client_handshake(sock, b"")


@pytest.mark.parametrize("request_id, blocks, message", [
    ("req-a", [3, 6], "not held"),
    ("req-zzz", [3], "no KV held"),
])
def test_only_the_named_requests_blocks_can_be_read(prefill_side, request_id, blocks, message):
    pool, held, sender, _ = prefill_side
    served = sender.transports.served()
    result, local, _ = pull(sender, served, "tcp", b"right", blocks, list(range(len(blocks))), request_id)
    assert result.error and message in result.error
    assert local.tensor.abs().sum() == 0


PROMPT = list(range(1000, 1064))  # the prompt P held the KV of: 64 tokens, the 4 blocks of 16


def test_a_duplicated_pull_and_a_reference_to_blocks_freed_and_reused_since_are_refused(prefill_side):
    """A hold's blocks are readable only under the request id they were held for (never reused) on
    the engine that prefilled them: that pair is the blocks' allocation epoch. A second pull of a
    pulled request, and a pull naming it after its blocks went to another request, get nothing."""
    _, held, sender, _ = prefill_side
    served = sender.transports.served()
    first, _, _ = pull(sender, served, "tcp", b"right", [3, 4], [0, 1])
    assert first.error is None and held.pop_releasable() == [("req-a", False)]
    duplicate, local, _ = pull(sender, served, "tcp", b"right", [3, 4], [0, 1])
    assert "no KV held for request 'req-a'" in duplicate.error and local.tensor.abs().sum() == 0
    held.hold("req-b", [4, 3], PROMPT)  # the same blocks, now another request's
    stale, local, _ = pull(sender, served, "tcp", b"right", [3, 4], [0, 1])
    assert "no KV held for request 'req-a'" in stale.error and local.tensor.abs().sum() == 0
    assert held.num_blocks == 2  # req-b's hold untouched


@pytest.mark.parametrize("proof, message", [
    ({"num_tokens": 64, "prompt_token_ids": list(range(2000, 2064))}, "of another prompt"),
    ({"num_tokens": 64, "prompt_token_ids": [*PROMPT[:63], 5]}, "of another prompt"),
    ({"num_tokens": 65, "prompt_token_ids": [*PROMPT, 1]}, "covers 64 prompt tokens, not the 65"),
    ({"num_tokens": 64, "prompt_token_ids": PROMPT, "remote_engine_id": "before-restart"},
     "prefilled by engine before-restart; this prefill node is engine p-engine"),
    ({}, "covers 64 prompt tokens, not the 0"),  # a pull that proves nothing
    (None, None),  # the right prompt (its first 63 tokens: D computes the last one itself)
])
def test_a_pull_is_served_only_for_the_prompt_and_engine_the_kv_is_of(proof, message):
    """Issue 39: P holds a prompt's KV; a D asking for it must name the same prompt (a digest of its
    first num_tokens tokens) and P's engine (a restarted P is another). Refused pulls move nothing
    and leave the hold for the D that asks properly."""
    pool = KVPool(SHAPE, torch.bfloat16, "cpu", shared=True)
    pool.tensor.copy_(torch.randn(SHAPE).to(torch.bfloat16))
    held = HeldBlocks(lease_s=60)
    held.hold("req-a", [3, 4, 5, 9], PROMPT)
    transports = NodeTransports([pool])
    sender = KVSender(transports, held, KVStats(), "127.0.0.1", 0, engine_id="p-engine")
    try:
        right = {"num_tokens": 63, "prompt_token_ids": PROMPT, "remote_engine_id": "p-engine"}
        result, local, _ = pull(sender, transports.served(), "tcp", b"", [3, 4, 5, 9], [0, 1, 2, 3],
                                **(right if proof is None else proof))
    finally:
        sender.close()
        transports.close()
    if proof is None:
        assert result.error is None and torch.equal(local.tensor[:, :, :4], pool.tensor[:, :, [3, 4, 5, 9]])
        assert held.pop_releasable() == [("req-a", False)]
    else:
        assert result.error and message in result.error, result.error
        assert local.tensor.abs().sum() == 0
        assert held.num_blocks == 4 and held.pop_releasable() == []
    pool.close()


def test_a_shared_pool_sits_off_a_page_boundary_as_a_private_one_and_a_peer_maps_it_there():
    """A shared pool's tensor starts POOL_OFFSET bytes into its mapping, 64 past a page boundary as
    torch puts a private pool (page-aligned, decode at a 2048-token context ran x1.13 slower on an
    AMD EPYC: docs/benchmarks.md). A peer or TP rank that attaches it by name sees the same bytes."""
    pool = KVPool(SHAPE, torch.bfloat16, "cpu", shared=True)
    try:
        assert POOL_OFFSET == 64 and pool.tensor.data_ptr() % 4096 == POOL_OFFSET
        pool.tensor.copy_(torch.randn(SHAPE).to(torch.bfloat16))
        peer = KVPool(SHAPE, torch.bfloat16, "cpu", shm_name=pool.shm_name)
        assert peer.tensor.data_ptr() % 4096 == POOL_OFFSET and torch.equal(peer.tensor, pool.tensor)
        peer.tensor[0, 0, 1].fill_(1.0)  # one mapping: a write through either is seen by the other
        assert torch.equal(pool.tensor[0, 0, 1], peer.tensor[0, 0, 1])
        peer.close()
    finally:
        pool.close()


@pytest.mark.parametrize("transport", every_transport())
def test_a_pull_whose_bytes_went_wrong_fails_when_digests_are_checked(prefill_side, transport):
    """Issue 39: one bit flipped in flight. D's digest of what landed differs from P's and the load
    fails (D then recomputes, or answers 5xx); unchecked, the same pull reports success. P frees
    its hold either way (the bytes were sent)."""
    _, held, sender, _ = prefill_side
    for verify in (True, False):
        held.hold("req-a", [3, 4, 5, 9])
        result, _, _ = pull(sender, sender.transports.served(), transport, b"right", [3, 4, 5, 9], [20, 7, 8, 0],
                            verify=verify, corrupt=True)
        if verify:
            assert result.error and "KV arrived corrupted: 1 of 1 digests differ" in result.error, result.error
        else:
            assert result.error is None
        assert held.pop_releasable() == [("req-a", False)]
    # Intact bytes pass the check.
    held.hold("req-a", [3, 4, 5, 9])
    result, local, _ = pull(sender, sender.transports.served(), transport, b"right", [3, 4, 5, 9], [20, 7, 8, 0],
                            verify=True)
    assert result.error is None and torch.equal(local.tensor[:, :, [20, 7, 8, 0]], sender.transports.pool.tensor[:, :, [3, 4, 5, 9]])


def test_a_pool_whose_creator_died_is_removed_and_a_live_ones_is_kept():
    """A node killed with its resource tracker leaves its shared pool: the next pool made (or the
    process group's stop) removes it by the creator's pid in its name; a live process's stays."""
    import subprocess
    import sys
    from multiprocessing import resource_tracker, shared_memory

    from pdserve.procinfo import pool_name, remove_dead_pools

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = shared_memory.SharedMemory(create=True, size=4096, name=pool_name(int(dead.stdout), "orphan"))
    resource_tracker.unregister(orphan._name, "shared_memory")  # as if its tracker had died with it
    ours = KVPool(SHAPE, torch.bfloat16, "cpu", shared=True)  # made after the orphan: sweeps it
    try:
        assert orphan.name not in os.listdir("/dev/shm") and ours.shm_name in os.listdir("/dev/shm")
        assert remove_dead_pools() == []
    finally:
        orphan.close()
        ours.close()


def test_a_renewed_lease_outlives_its_first_deadline_and_an_unrenewed_one_expires(prefill_side):
    """D's renewer (a real side channel connection every third of the lease) keeps P's hold; the
    holds nobody renews are freed once their lease is over, the earliest deadline first."""
    _, held, sender, _ = prefill_side
    held.lease_s = 0.6
    held.hold("renewed", [1, 2])
    held.hold("late", [6])
    held.hold("early", [7])
    time.sleep(0.05)
    assert held.renew(["late"]) == 1  # inserted before "early", its deadline is now after it
    renewer = LeaseRenewer(timeout_s=5, secret=b"right", tick_s=0.05)
    try:
        renewer.track(Lease("d-1", "renewed", "127.0.0.1", sender.port, lease_s=0.6))
        time.sleep(1.5)  # over two leases
        assert held.pop_releasable() == [("early", True), ("late", True)]  # (req-a's lease is 60 s)
        assert held.num_blocks == 4 + 2 and held.pin("renewed", [1, 2]) is None  # still readable
        held.unpin("renewed", done=True)
        renewer.untrack("d-1")
        assert held.pop_releasable() == [("renewed", False)] and len(renewer) == 0
    finally:
        renewer.close()


def test_a_p_that_never_answers_does_not_delay_another_ps_renewals(prefill_side):
    """Each P is renewed on its own worker: a P whose side channel accepts and never answers (the
    renewal waits out its 3 s timeout) is tracked first, and the live P's hold, on a 0.6 s lease,
    is still renewed every 0.2 s."""
    _, held, sender, _ = prefill_side
    held.lease_s = 0.6
    held.hold("renewed", [1, 2])
    silent = socket.create_server(("127.0.0.1", 0))  # the kernel completes connects; nobody replies
    renewer = LeaseRenewer(timeout_s=3, secret=b"right", tick_s=0.05)
    try:
        renewer.track(Lease("d-silent", "lost", "127.0.0.1", silent.getsockname()[1], lease_s=0.6))
        renewer.track(Lease("d-1", "renewed", "127.0.0.1", sender.port, lease_s=0.6))
        time.sleep(1.5)
        assert held.pop_releasable() == [] and held.pin("renewed", [1, 2]) is None
        held.unpin("renewed", done=True)
        assert held.pop_releasable() == [("renewed", False)]
    finally:
        renewer.close()
        silent.close()


def test_the_reaper_frees_every_expired_hold_behind_an_unexpired_one():
    """vLLM #58222: a reaper that stops at the first live hold strands the expired ones behind it."""
    held = HeldBlocks(lease_s=60)
    held.hold("live", [1])
    held.lease_s = 0.01
    held.hold("a", [2])
    held.hold("b", [3])
    time.sleep(0.05)
    assert held.pop_releasable() == [("a", True), ("b", True)] and held.num_blocks == 1
