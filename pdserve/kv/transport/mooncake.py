"""mooncake: the Mooncake Transfer Engine (vllm-ascend's MooncakeConnector, SGLang's default) as a
one-sided transport (onesided.py). Each node's engine starts on its KV host with Mooncake's own P2P
handshake (no metadata server) and the protocol of `PDSERVE_MOONCAKE_PROTOCOL` (tcp by default; rdma
where the hosts have it); its endpoint is the engine's session, host:rpc port.

Needs `pip install 'pdserve[mooncake]'` and, on Debian, libibverbs1, librdmacm1 and libnuma1.
"""

from __future__ import annotations

import os
import threading

from pdserve.kv.protocol import ProtocolError
from pdserve.kv.transport.onesided import OneSidedTransport

PROTOCOL_ENV = "PDSERVE_MOONCAKE_PROTOCOL"
BATCH = 256  # entries per batched call (a tcp lane's queue holds a bounded number)


class MooncakeTransport(OneSidedTransport):
    name = "mooncake"
    package = "mooncake"
    install = "pip install 'pdserve[mooncake]'; Debian: libibverbs1 librdmacm1 libnuma1"

    @classmethod
    def load(cls):
        # Its INFO lines (topology, handshakes, every segment removed) would flood a node's log;
        # set MC_LOG_LEVEL to see them.
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ImportError(f"the mooncake transport needs the Mooncake Transfer Engine ({cls.install}): "
                              f"{exc}") from exc
        return TransferEngine

    def _start(self) -> None:
        self.engine = self.load()()
        protocol = os.environ.get(PROTOCOL_ENV, "tcp")
        if self.engine.initialize(self.host, "P2PHANDSHAKE", protocol, "") != 0:
            raise RuntimeError(f"Mooncake Transfer Engine did not start on {self.host} over {protocol}")
        self.session = f"{self.host}:{self.engine.get_rpc_port()}"
        # One batch in flight per engine: its tcp lanes refuse entries past their queue (four loads
        # of 1024 entries at once failed), and the engine spreads one batch over its lanes itself.
        self._lock = threading.Lock()

    def _register(self, base: int, nbytes: int) -> None:
        if self.engine.register_memory(base, nbytes) != 0:
            raise RuntimeError("Mooncake Transfer Engine could not register the KV pool")

    def _unregister(self, base: int) -> None:
        self.engine.unregister_memory(base)

    def _endpoint(self) -> bytes:
        return self.session.encode()

    def _batch(self, write: bool, endpoint: bytes, local: list[int], remote: list[int], lengths: list[int]) -> None:
        call = self.engine.batch_transfer_sync_write if write else self.engine.batch_transfer_sync_read
        session = endpoint.decode()
        for i in range(0, len(lengths), BATCH):
            with self._lock:
                failed = call(session, local[i : i + BATCH], remote[i : i + BATCH], lengths[i : i + BATCH])
            if failed:
                raise ProtocolError(f"Mooncake transfer with {session} failed")
