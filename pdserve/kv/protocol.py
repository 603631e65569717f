"""Typed control messages of the KV side channel, framed as length-prefixed msgpack.

Every connection starts with an HMAC-SHA256 challenge-response over the cluster's shared secret
(`--kv-secret`), both ways, before any other message: a peer without the secret cannot read or
write a block, and a node never sends KV to a peer that cannot prove it holds the secret.

Pull, one TCP connection per transfer: D sends `PullRequest`; P answers `PullReply` (and, for the
tcp transport, the block bytes right after it); D sends `PullDone` once the bytes are in place; P
answers `Ack` after it has released its hold on the blocks. A D that drops a request before
pulling it opens a connection with `PullDone` alone, and P frees that hold at once.

Push, one connection per request: P sends `PushBegin`, D accepts with `Ack`; then `PushLayers`
messages naming D's blocks and the layers written into them, which D checks against the blocks it
reserved: over tcp one per layer and chunk, with the bytes right after it; over shm, where P copies
each layer straight into D's shared pool, one per chunk once its layers are copied (a message per
layer cost P ~8 % of a 512-token prefill); then `PushDone`, which D acknowledges once the request
is marked as arrived. D cancels by sending `Ack(ok=False)` at any time, which P sees before its
next layer.

`transport` in `PullRequest` and `PushBegin` names a registered transport (kv/transport/); the
passive side refuses one it does not serve, and accepts with that transport's handshake (`PullReply`,
`Ack`): opaque bytes only the transport reads (shm: the passive side's segment names).

Verified handoff: D's `PullRequest` names the prompt it needs the KV of (a digest of its first
`num_tokens` token ids) and the engine that prefilled it; P's `PushBegin` names the prompt it
pushes. The passive side compares them with its own request and refuses another prompt's KV, so a
decode node handed the wrong `kv_transfer_params` never answers from them. Where D asks for them
(`--kv-verify-digest`), the transfer ends with an xxh3 digest of the bytes moved of each (piece, KV group),
which D compares with its own of what landed: bytes corrupted or misplaced fail the load.

Tensor parallelism: each side names its TP size (D in `PullRequest` and its push `Ack`, P in
`PullReply` and `PushBegin`), and both derive the same read plan from the two sizes
(kv/tp_plan.py). A transfer moves the plan's pieces in plan order, each a run of KV heads from one
P rank's pool to one D rank's; over tcp their bytes follow one another on the connection. The one
connection carries every rank's share, so `PullDone` and `PushDone` come once every D rank has its data.
"""

from __future__ import annotations

import socket
import struct

import msgspec

MAX_FRAME = 1 << 20  # control messages are small; anything larger is a protocol error


class KVLayout(msgspec.Struct, frozen=True):
    """What two nodes must agree on to exchange blocks byte for byte, whatever their TP sizes."""

    num_layers: int
    num_planes: int  # K and V
    block_size: int
    num_kv_heads: int  # the model's (a TP rank holds a share)
    head_bytes: int  # one KV head of one token in one plane
    dtype: str
    layer_windows: tuple[int, ...] = ()  # each layer's attention window (0: all); (): every layer sees all


class PullRequest(msgspec.Struct, tag=True):
    request_id: str  # P's request id (remote_request_id)
    block_ids: list[list[int]]  # P's block ids to read, in order, a table per KV group (models/kv_spec.py)
    transport: str  # a registered transport's name
    layout: KVLayout
    tp_size: int = 1  # D's: with P's, it fixes the read plan (kv/tp_plan.py)
    # Sliding groups (layout.layer_windows) move only their window: the KV ends at num_tokens (0:
    # every group moves every block), and each table's first entry is block first_block of the sequence.
    num_tokens: int = 0
    first_block: int = 0
    # What D proves it asks for (issue 39): the prompt the KV must be of (prefix_hash.prompt_digest
    # of D's first num_tokens tokens) and the P engine that prefilled it (P's remote_engine_id: a
    # restarted P is another engine, whatever request ids it reuses). P refuses a mismatch.
    tokens_digest: int | None = None
    engine_id: str | None = None
    want_digests: bool = False  # D checks the bytes: P's final Ack carries its blocks' digests
    traceparent: str | None = None  # D's kv.pull span (tracing on): P's serving span is its child


class PullReply(msgspec.Struct, tag=True):
    ok: bool
    error: str | None = None
    pool_num_blocks: int = 0
    tp_size: int = 1  # P's
    handshake: bytes = b""  # what P's transport tells D of P's side (Transport.handshake: shm, P's pools)


class PullDone(msgspec.Struct, tag=True):
    request_id: str
    ok: bool = True


class Renew(msgspec.Struct, tag=True):
    """D -> P: these requests (P's ids) are admitted on D and still coming: extend their leases."""

    request_ids: list[str]


class Ack(msgspec.Struct, tag=True):
    ok: bool = True
    error: str | None = None
    pool_num_blocks: int = 0  # D accepting a push: the size of its pools (an shm pusher maps them)
    tp_size: int = 1  # D accepting a push: its TP size
    handshake: bytes = b""  # D accepting a push: what its transport tells P of D's side (Transport.handshake)
    want_digests: bool = False  # D accepting a push: end it with the digests of what was pushed (PushDone)
    # P's last Ack of a pull that asked for them: the digest of each (piece, KV group) it served
    # (NodeTransports.digests), computed while the blocks were still held.
    digests: list[int] | None = None


class PushBegin(msgspec.Struct, tag=True):
    """P -> D: a push session for D's request (D answers Ack, or Ack(ok=False) to refuse)."""

    request_id: str  # D's request id
    transport: str  # a registered transport's name
    layout: KVLayout
    tp_size: int = 1  # P's
    # The prompt P pushes the KV of: its first num_tokens tokens' digest (prefix_hash.prompt_digest);
    # D refuses the session unless its request is of the same prompt and needs as many tokens.
    num_tokens: int = 0
    tokens_digest: int | None = None
    traceparent: str | None = None  # P's kv.push span (tracing on): D's receiving span is its child


class PushLayers(msgspec.Struct, tag=True):
    """P -> D: layer slots [first_layer, first_layer + num_layers) of `block_ids` (D's ids, of the
    KV group those slots hold here), written over the session's transport (tcp: the bytes follow;
    shm: already copied)."""

    first_layer: int
    num_layers: int
    block_ids: list[int]


class PushDone(msgspec.Struct, tag=True):
    """P -> D: every layer of the prompt has been written (ok), or the push was abandoned."""

    ok: bool = True
    error: str | None = None
    first_token_id: int | None = None  # the first output token P sampled (D decodes from it if it asked)
    digests: list[int] | None = None  # where D asked for them: of every block pushed (NodeTransports.digests)


class Challenge(msgspec.Struct, tag=True):
    """Server -> client, first on every side-channel connection."""

    nonce: bytes


class Auth(msgspec.Struct, tag=True):
    """Client -> server: proof of the shared secret, and a nonce for the server to prove itself."""

    mac: bytes
    nonce: bytes


class AuthResult(msgspec.Struct, tag=True):
    ok: bool
    mac: bytes = b""  # the server's proof (mutual authentication)
    error: str | None = None


Message = PullRequest | PullReply | PullDone | Renew | Ack | PushBegin | PushLayers | PushDone | Challenge | Auth | AuthResult
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class ProtocolError(ConnectionError):
    pass


def send_msg(sock: socket.socket, msg: Message) -> None:
    payload = _encoder.encode(msg)
    sock.sendall(struct.pack("!I", len(payload)) + payload)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ProtocolError("connection closed by peer")
        got += k
    return bytes(buf)


def recv_msg(sock: socket.socket) -> Message:
    (length,) = struct.unpack("!I", recv_exactly(sock, 4))
    if length > MAX_FRAME:
        raise ProtocolError(f"control frame of {length} bytes exceeds {MAX_FRAME}")
    try:
        return _decoder.decode(recv_exactly(sock, length))
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad control message: {exc}") from exc


def check_digests(ours: list[int], theirs: list[int] | None, peer: str) -> None:
    """ProtocolError unless the peer's digests of a transfer equal ours (issue 39's verified handoff)."""
    if theirs is None:
        raise ProtocolError(f"the {peer} sent no digest of the KV it moved")
    differ = sum(a != b for a, b in zip(ours, theirs)) + abs(len(ours) - len(theirs))
    if differ:
        raise ProtocolError(f"KV arrived corrupted: {differ} of {len(ours)} digests differ from the {peer}'s")
