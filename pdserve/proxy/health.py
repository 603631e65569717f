"""The health poller: checks every node's /health, takes failing nodes out of rotation and back,
and keeps each node's KV usage (for `least_loaded`) and engine description fresh from /metrics."""

from __future__ import annotations

import asyncio
import logging

from pdserve.proxy.client import NodeClient, NodeError
from pdserve.proxy.cluster import MetricsPage, NodeLoad
from pdserve.proxy.membership import Membership, NodesFile
from pdserve.proxy.policies import Node
from pdserve.proxy.speed import DecodeWindow

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
ENGINE_INFO = "pdserve:engine_info"


class HealthPoller:
    def __init__(self, members: Membership, client: NodeClient, nodes_file: NodesFile | None, interval_s: float,
                 max_failures: int) -> None:
        self.members, self.client, self.nodes_file = members, client, nodes_file
        self.interval_s, self.max_failures = interval_s, max_failures

    async def run(self) -> None:
        while True:
            if self.nodes_file:
                self.nodes_file.poll(self.members)
            for node in self.members.nodes():
                await self.check(node)
            await asyncio.sleep(self.interval_s)

    async def check(self, node: Node) -> None:
        was_healthy = node.healthy
        try:
            ok = (await self.client.get(node, "/health", HEALTH_TIMEOUT_S)).status_code == 200
            text = (await self.client.get(node, "/metrics", HEALTH_TIMEOUT_S)).text if ok else ""
        except NodeError:
            ok, text = False, ""
        node.record_check(ok, self.max_failures)
        if node.healthy != was_healthy:
            logger.warning("%s node %s %s", node.role, node.url, "is back" if node.healthy else "left rotation")
        if not text:
            return
        page = MetricsPage.parse(text)  # once: every reading below comes from it
        node.load = NodeLoad.read(page, node.load)
        if total := node.load.values.get("kv_blocks_total"):
            node.kv_usage = node.load.values.get("kv_blocks_used", 0.0) / total
        node.engine = page.labels(ENGINE_INFO)  # a node restarted at the same URL may run another dtype
        node.speed.count_decode_steps(DecodeWindow(
            int(page.value("pdserve:decode_steps_total")), page.value("pdserve:decode_step_seconds_total"),
            int(page.value("pdserve:decode_step_seqs_total")), int(page.value("pdserve:decode_step_kv_tokens_total"))))


def engine_info(metrics_text: str) -> dict[str, str]:
    """What a node runs on (device, ISA, dtype, kernels, quantization): the labels of its pdserve:engine_info."""
    return MetricsPage.parse(metrics_text).labels(ENGINE_INFO)
