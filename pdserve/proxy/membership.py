"""Which nodes the proxy routes to: the flags it started with, a watched nodes file, the admin API.

A nodes file is JSON, `{"prefill": [URL, ...], "decode": [URL, ...]}` (pull / push),
`{"node": [URL, ...]}` (colocated) or `{"kv_both": [URL, ...]}` (auto). The proxy re-reads it
when it changes: every node it lists is added if missing, and nodes that disappear from it are
removed. Removing a node only takes it out of rotation; requests already on it finish there.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlparse

from pdserve.proxy.policies import Node

logger = logging.getLogger(__name__)

FILE_KEYS = {"prefill": "prefill", "decode": "decode", "node": "both", "kv_both": "kv_both"}  # key -> role
ROLE_FLAGS = {"prefill": "--prefill", "decode": "--decode", "both": "--node", "kv_both": "--kv-both"}
ROLE_NAMES = {"prefill": "prefill", "decode": "decode", "both": "colocated", "kv_both": "kv_both"}


class DuplicateNode(ValueError):
    pass


def check_url(url: str) -> str:
    """`http(s)://host:port` with no path; ValueError naming the problem."""
    if not isinstance(url, str):
        raise ValueError(f"a node URL must be a string, got {url!r}")
    parsed = urlparse(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{url!r} is not an http(s)://host:port URL")
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        raise ValueError(f"{url!r}: a node URL has no path, query or fragment")
    try:
        parsed.port
    except ValueError:
        raise ValueError(f"{url!r}: the port is not a number in 0..65535") from None
    return url.strip().rstrip("/")


@dataclass
class Membership:
    mode: str
    roles: tuple[str, ...]  # what the mode's flow routes to (Flow.roles)
    # A kv_both node is in both lists (it may prefill for another node, or decode).
    prefillers: list[Node] = field(default_factory=list)
    decoders: list[Node] = field(default_factory=list)  # decode nodes, or the colocated nodes
    on_add: Callable[[Node], None] = lambda node: None
    on_remove: Callable[[Node], None] = lambda node: None

    def nodes(self) -> list[Node]:
        return self.prefillers + [d for d in self.decoders if d.role != "kv_both"]

    def find(self, url: str) -> Node | None:
        url = url.rstrip("/")
        return next((n for n in self.nodes() if n.url == url), None)

    def add(self, url: str, role: str) -> Node:
        if role not in self.roles:
            raise ValueError(f"role must be one of {list(self.roles)} in {self.mode} mode, got {role!r}")
        url = check_url(url)
        if self.find(url) is not None:
            raise DuplicateNode(f"{url} is already a node of this proxy")
        node = Node(url, role)
        for nodes in self._lists(role):
            nodes.append(node)
        self.on_add(node)
        logger.info("%s node %s added", role, url)
        return node

    def remove(self, url: str) -> Node:
        node = self.find(url)
        if node is None:
            raise LookupError(f"{url} is not a node of this proxy")
        for nodes in self._lists(node.role):
            nodes.remove(node)
        self.on_remove(node)
        logger.info("%s node %s removed", node.role, node.url)
        return node

    def _lists(self, role: str) -> list[list[Node]]:
        """The lists a node of `role` is in."""
        return {"prefill": [self.prefillers], "kv_both": [self.prefillers, self.decoders]}.get(role, [self.decoders])


def read_nodes_file(path: str, mode: str, roles: tuple[str, ...]) -> set[tuple[str, str]]:
    """The (role, url) pairs a nodes file lists; ValueError naming what is wrong with it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ValueError(f"nodes file {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"nodes file {path}: not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"nodes file {path}: expected a JSON object like {{\"prefill\": [...], \"decode\": [...]}}")
    pairs = set()
    for key, urls in data.items():
        role = FILE_KEYS.get(key)
        if role is None or role not in roles:
            keys = [k for k, r in FILE_KEYS.items() if r in roles]
            raise ValueError(f"nodes file {path}: key {key!r} is not one of {keys} ({mode} mode)")
        if not isinstance(urls, list):
            raise ValueError(f"nodes file {path}: {key!r} must be a list of URLs")
        for url in urls:
            try:
                pairs.add((role, check_url(url)))
            except ValueError as exc:
                raise ValueError(f"nodes file {path}: {exc}") from None
    return pairs


@dataclass
class NodesFile:
    """Applies a nodes file to the membership whenever the file changes (checked on each poll)."""

    path: str
    listed: set[tuple[str, str]] = field(default_factory=set)
    mtime_ns: int | None = None

    def load(self, membership: Membership) -> None:
        """First read: a bad file is a start-up error."""
        self.mtime_ns = os.stat(self.path).st_mtime_ns if os.path.exists(self.path) else None
        self._apply(membership, read_nodes_file(self.path, membership.mode, membership.roles))

    def poll(self, membership: Membership) -> None:
        """Later reads: a bad file is logged and the previous membership kept."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return
        if mtime == self.mtime_ns:
            return
        self.mtime_ns = mtime
        try:
            self._apply(membership, read_nodes_file(self.path, membership.mode, membership.roles))
        except ValueError as exc:
            logger.error("%s; keeping the current nodes", exc)

    def _apply(self, membership: Membership, wanted: set[tuple[str, str]]) -> None:
        for role, url in sorted(self.listed - wanted):
            if membership.find(url) is not None:
                membership.remove(url)
        for role, url in sorted(wanted):  # listed nodes missing now (removed by the admin API) come back
            if membership.find(url) is None:
                membership.add(url, role)
        self.listed = wanted
