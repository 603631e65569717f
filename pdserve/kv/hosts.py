"""Host addresses as KV peers compare them (the proxy too: it imports nothing else of kv's transports)."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def same_host(a: str, b: str) -> bool:
    """Whether two advertised KV hosts name one machine as far as their addresses tell: equal, or
    both loopback (a proxy pricing a pair cannot ask the nodes' interfaces)."""
    return bool(a) and (a == b or (is_loopback(a) and is_loopback(b)))
