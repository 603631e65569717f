"""A pdserve node as a Ray actor.

The actor owns its node: a `pdserve serve` process started on the actor's Ray node, listening
(HTTP and KV side channel) on that node's address, so peers on other hosts reach it. The two
live and die together: the node process dies with the actor (PR_SET_PDEATHSIG), and the actor
exits when its node process does, so Ray restarts the pair (`max_restarts`) on a fresh port.

The cluster's KV secret and API key come in as constructor arguments, through Ray, and reach
the node process in its environment: never on a command line, never in a log.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass

from pdserve.api.guards import API_KEY_ENV
from pdserve.kv.channel import SECRET_ENV
from pdserve.procs import Child, ProcessGroup, free_port


@dataclass(frozen=True)
class NodeAddress:
    """What the launcher learns of a node actor: enough for the proxy's membership."""

    name: str
    role: str
    url: str
    host: str  # the Ray node's address the node listens on
    pid: int  # the node process (tests kill it; ps shows it)


class NodeActor:
    """Wrapped with ray.remote by the launcher (pdserve.raycluster.up)."""

    def __init__(self, name: str, role: str, node_args: list[str], secret: str, api_key: str | None,
                 startup_timeout_s: float) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        port = free_port(host)
        env = {**os.environ, SECRET_ENV: secret}
        if api_key:
            env[API_KEY_ENV] = api_key
        self.child = Child(name, ["serve", "--role", role, "--host", host, "--port", str(port), "--kv-host", host,
                                  *node_args], f"http://{host}:{port}", role=role)
        self.group = ProcessGroup(env)
        self.group.launch([self.child], startup_timeout_s)  # raises ChildFailed / TimeoutError: the actor fails
        self.address = NodeAddress(name, role, self.child.url, host, self.child.proc.pid)
        threading.Thread(target=self._exit_with_node, name="node-watch", daemon=True).start()

    def address_of(self) -> NodeAddress:
        return self.address

    def _exit_with_node(self) -> None:
        self.child.proc.wait()
        print(f"pdserve node {self.address.name} exited with status {self.child.proc.returncode}; "
              "its actor exits too (Ray restarts it)", file=sys.stderr, flush=True)
        os._exit(1)
