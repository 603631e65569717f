"""The proxy's copy of each node's prefix cache, kept from the nodes' KV events.

One task per node long-polls `GET /kv/events?after=SEQ` and applies each batch to a set of block
hashes. The copy is good only while the batches arrive in order within one epoch: a gap (the
node's log dropped batches this proxy had not read), another epoch (the node restarted) or a node
that stops answering makes it stale, and the task loads `GET /kv/snapshot` again (resync). While
a copy is stale, routing must not trust it (`NodeCache.synced`): it routes such a node by load.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import msgspec

from pdserve.kv.events import KVEventPage, KVSnapshot
from pdserve.proxy.client import NodeClient, NodeError
from pdserve.proxy.membership import Membership
from pdserve.proxy.policies import Node

logger = logging.getLogger(__name__)

POLL_WAIT_S = 1.0  # how long a node may hold a long poll open before answering "nothing new"
RETRY_S = 0.5  # after a node failed to answer
MEMBERSHIP_CHECK_S = 0.5  # how often nodes added or removed are picked up


@dataclass
class NodeCache:
    """The block hashes one node's prefix cache holds, as of batch `seq` of `epoch`."""

    epoch: str | None = None
    seq: int = 0
    block_size: int = 0
    hashes: set[int] = field(default_factory=set)
    synced: bool = False
    resyncs: int = 0

    def load(self, snapshot: KVSnapshot) -> None:
        self.epoch, self.seq, self.block_size = snapshot.epoch, snapshot.seq, snapshot.block_size
        self.hashes = set(snapshot.hashes)
        self.synced = True

    def apply(self, page: KVEventPage) -> bool:
        """Apply the batches after `seq`; False (and stale) on another epoch or a gap."""
        if page.epoch != self.epoch or (page.batches and page.batches[0].seq != self.seq + 1) \
                or (not page.batches and page.seq != self.seq):
            self.stale()
            return False
        for batch in page.batches:
            self.hashes.difference_update(batch.removed)  # KVEventBatch's order
            self.hashes.update(batch.stored)
            self.seq = batch.seq
        return True

    def stale(self) -> None:
        if self.synced:
            self.resyncs += 1
        self.synced = False

    def cached_blocks(self, hashes: list[int]) -> int:
        """How many of a prompt's leading blocks this node holds (a prefix hit stops at the first miss)."""
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n


class PrefixIndex:
    """Follows every node of the membership; `caches[url]` is the copy of that node's cache."""

    def __init__(self, members: Membership, client: NodeClient) -> None:
        self.members, self.client = members, client
        self.caches: dict[str, NodeCache] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    def cache(self, node: Node) -> NodeCache | None:
        return self.caches.get(node.url)

    async def run(self) -> None:
        try:
            while True:
                urls = {node.url: node for node in self.members.nodes()}
                for url in set(self._tasks) - set(urls):
                    self._tasks.pop(url).cancel()
                    self.caches.pop(url, None)
                for url, node in urls.items():
                    if url not in self._tasks:
                        self.caches[url] = NodeCache()
                        self._tasks[url] = asyncio.create_task(self._follow(node, self.caches[url]))
                await asyncio.sleep(MEMBERSHIP_CHECK_S)
        finally:
            for task in self._tasks.values():
                task.cancel()

    async def _follow(self, node: Node, cache: NodeCache) -> None:
        while True:
            try:
                if not cache.synced:
                    cache.load(await self._get(node, "/kv/snapshot", KVSnapshot))
                    logger.info("prefix cache of %s node %s: %d blocks (epoch %s, batch %d)", node.role, node.url,
                                len(cache.hashes), cache.epoch[:8], cache.seq)
                page = await self._get(node, f"/kv/events?after={cache.seq}&timeout={POLL_WAIT_S}", KVEventPage)
                if not cache.apply(page):
                    logger.info("prefix cache of %s node %s is stale (restart or missed events): resync",
                                node.role, node.url)
            except (NodeError, msgspec.DecodeError) as exc:
                cache.stale()
                logger.debug("KV events of %s: %s", node.url, exc)
                await asyncio.sleep(RETRY_S)
            except Exception:  # never let the copy die silently: it would stay trusted and wrong
                cache.stale()
                logger.exception("following the KV events of %s failed; retrying", node.url)
                await asyncio.sleep(RETRY_S)

    async def _get(self, node: Node, path: str, kind: type):
        response = await self.client.get(node, path, POLL_WAIT_S + 5.0)
        if response.status_code != 200:
            raise NodeError(response.status_code, response.content, node.url)
        return msgspec.json.decode(response.content, type=kind)
