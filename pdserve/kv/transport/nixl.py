"""nixl: NVIDIA's NIXL (vLLM's NixlConnector, SGLang's NIXL backend) as a one-sided transport
(onesided.py), on its UCX backend, which runs on a CPU-only machine. Each node's agent (a unique name)
registers its pools as DRAM; its endpoint is the agent's metadata, which the active side loads once
per peer (`add_remote_agent`) before it reads or writes by descriptor lists; completion is NIXL's
transfer state, polled.

Needs `pip install 'pdserve[nixl]'`.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from types import SimpleNamespace

from pdserve.kv.protocol import ProtocolError
from pdserve.kv.transport.onesided import OneSidedTransport

TIMEOUT_S = 60.0  # a transfer not done by then failed (the side channel's own timeout is the caller's)
# The agent's progress thread waits this long for UCX events between rounds. NIXL's Python wrapper
# fixes it at 0, a thread that spins a core for as long as the agent lives (2.97 s of CPU in 3 s
# idle here, and a third of the throughput on 2 cores: it competes with the transfer's own thread);
# 1 ms measured 0.09 s idle and 3x the throughput (docs/benchmarks.md, transfer).
PROGRESS_DELAY_US = int(os.environ.get("PDSERVE_NIXL_PROGRESS_DELAY_US", "1000"))
_start_lock = threading.Lock()  # _agent swaps the wrapper's bindings module while it builds an agent


class NixlTransport(OneSidedTransport):
    name = "nixl"
    package = "nixl"
    install = "pip install 'pdserve[nixl]'"

    @classmethod
    def load(cls):
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # its INFO lines go to stdout; set it to see them
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as exc:
            raise ImportError(f"the nixl transport needs NIXL ({cls.install}): {exc}") from exc
        return nixl_agent, nixl_agent_config

    def _start(self) -> None:
        self.agent = self._agent(f"pdserve-{uuid.uuid4().hex[:12]}")
        self._registered: dict[int, object] = {}
        self._peers: dict[bytes, str] = {}  # a peer's metadata -> its agent's name, once loaded
        self._lock = threading.Lock()  # loads and pushes run on several threads

    @classmethod
    def _agent(cls, name: str):
        """An agent on UCX whose progress thread sleeps PROGRESS_DELAY_US between rounds: the wrapper
        has no setting for it, so the bindings it builds the agent with set it on the way."""
        agent, config = cls.load()
        import nixl._api as api

        bindings = api.nixlBind

        def with_delay(agent_name, agent_config):
            agent_config.pthrDelay = PROGRESS_DELAY_US
            return bindings.nixlAgent(agent_name, agent_config)

        with _start_lock:
            api.nixlBind = SimpleNamespace(**{k: getattr(bindings, k) for k in dir(bindings) if not k.startswith("__")})
            api.nixlBind.nixlAgent = with_delay
            try:
                return agent(name, config(backends=["UCX"]))
            finally:
                api.nixlBind = bindings

    def _register(self, base: int, nbytes: int) -> None:
        descs = self.agent.register_memory([(base, nbytes, 0, "")], "DRAM")
        if not descs:
            raise RuntimeError("NIXL could not register the KV pool")
        self._registered[base] = descs

    def _unregister(self, base: int) -> None:
        descs = self._registered.pop(base, None)
        if descs is not None:
            self.agent.deregister_memory(descs)

    def close(self) -> None:
        super().close()
        self.agent = None  # its progress thread stops with it

    def _endpoint(self) -> bytes:
        return self.agent.get_agent_metadata()

    def _peer(self, metadata: bytes) -> str:
        with self._lock:
            name = self._peers.get(metadata)
            if name is None:
                added = self.agent.add_remote_agent(metadata)
                name = self._peers[metadata] = added.decode() if isinstance(added, bytes) else added
            return name

    def _batch(self, write: bool, endpoint: bytes, local: list[int], remote: list[int], lengths: list[int]) -> None:
        peer = self._peer(endpoint)
        ours = self.agent.get_xfer_descs([(a, n, 0) for a, n in zip(local, lengths)], "DRAM")
        theirs = self.agent.get_xfer_descs([(a, n, 0) for a, n in zip(remote, lengths)], "DRAM")
        handle = self.agent.initialize_xfer("WRITE" if write else "READ", ours, theirs, peer, b"")
        try:
            state, deadline, polls = self.agent.transfer(handle), time.monotonic() + TIMEOUT_S, 0
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise ProtocolError(f"NIXL transfer with {peer} not done in {TIMEOUT_S:.0f} s")
                polls += 1
                time.sleep(0 if polls < 1000 else 1e-4)  # checking drives UCX's progress; later, yield the core
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise ProtocolError(f"NIXL transfer with {peer} failed")
        finally:
            self.agent.release_xfer_handle(handle)
