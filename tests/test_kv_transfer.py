"""The KV side channel on real sockets and real shared memory: bytes land intact, only the
blocks held for the named request can be read, and peers must prove the shared secret."""

from __future__ import annotations

import logging
import socket

import pytest
import torch

from pdserve.kv.channel import AuthError, client_handshake
from pdserve.kv.pool import KVPool
from pdserve.kv.protocol import PullRequest, recv_msg, send_msg
from pdserve.kv.pull import HeldBlocks, KVReceiver, KVSender, LoadSpec
from pdserve.kv.stats import KVStats

SHAPE = (4, 2, 32, 16, 2, 8)  # layers, K/V, blocks, slots, kv heads, head dim


@pytest.fixture
def prefill_side():
    pool = KVPool(SHAPE, torch.bfloat16, "cpu", shared=True)
    pool.tensor.copy_(torch.randn(SHAPE).to(torch.bfloat16))
    held = HeldBlocks(timeout_s=60)
    held.hold("req-a", [3, 4, 5, 9])
    sender = KVSender(pool, held, KVStats(), "127.0.0.1", 0, secret=b"right")
    yield pool, held, sender
    sender.close()
    pool.close()


def pull(sender: KVSender, shm_name, transport: str, secret: bytes, src, dst, request_id="req-a"):
    local = KVPool(SHAPE, torch.bfloat16, "cpu")
    receiver = KVReceiver(local, KVStats(), transport, timeout_s=10, secret=secret)
    receiver.start(LoadSpec("d-1", dst, src, request_id, "127.0.0.1", sender.port, shm_name))
    result = receiver.poll(timeout=30)[0]
    receiver.close()
    return result, local


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pulled_blocks_arrive_intact(prefill_side, transport):
    pool, held, sender = prefill_side
    src, dst = [3, 4, 5, 9], [20, 7, 8, 0]  # scattered on both sides
    result, local = pull(sender, pool.shm_name, transport, b"right", src, dst)
    assert result.error is None and result.transport == transport
    assert torch.equal(local.tensor[:, :, dst], pool.tensor[:, :, src])
    assert local.tensor[:, :, 1].abs().sum() == 0  # nothing else written
    assert held.pop_releasable() == [("req-a", False)]  # D said done: P may free


def test_wrong_secret_is_refused_and_logged(prefill_side, caplog):
    pool, held, sender = prefill_side
    with caplog.at_level(logging.WARNING):
        result, local = pull(sender, pool.shm_name, "tcp", b"wrong", [3], [0])
    assert result.error and "authentication failed" in result.error
    assert local.tensor.abs().sum() == 0
    assert held.num_blocks == 4 and held.pop_releasable() == []  # still held for the real D
    assert any("refused connection" in r.getMessage() for r in caplog.records)


def test_peer_that_skips_the_handshake_gets_nothing(prefill_side):
    pool, _, sender = prefill_side
    layout = pool.layout
    with socket.create_connection(("127.0.0.1", sender.port), timeout=5) as sock:
        recv_msg(sock)  # the challenge, ignored
        send_msg(sock, PullRequest("req-a", [3], "tcp", layout))
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
    pool, held, sender = prefill_side
    result, local = pull(sender, pool.shm_name, "tcp", b"right", blocks, list(range(len(blocks))), request_id)
    assert result.error and message in result.error
    assert local.tensor.abs().sum() == 0
