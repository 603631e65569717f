"""The health poller: checks every node's /health, takes failing nodes out of rotation and back,
and keeps each node's KV usage (for `least_loaded`) and engine description fresh from /metrics."""

from __future__ import annotations

import asyncio
import logging

from prometheus_client.parser import text_string_to_metric_families

from pdserve.proxy.client import NodeClient, NodeError
from pdserve.proxy.cluster import NodeLoad
from pdserve.proxy.membership import Membership, NodesFile
from pdserve.proxy.policies import Node
from pdserve.proxy.speed import DecodeWindow

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0


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
        used, total = sample(text, "pdserve:kv_blocks_used"), sample(text, "pdserve:kv_blocks_total")
        if total:
            node.kv_usage = used / total
        if text:  # a node restarted at the same URL may run another dtype
            node.engine = engine_info(text)
            node.load = NodeLoad.read(text, node.load)
            node.speed.count_decode_steps(DecodeWindow(
                int(sample(text, "pdserve:decode_steps_total")), sample(text, "pdserve:decode_step_seconds_total"),
                int(sample(text, "pdserve:decode_step_seqs_total")),
                int(sample(text, "pdserve:decode_step_kv_tokens_total"))))


def sample(metrics_text: str, name: str) -> float:
    """One unlabelled sample from a Prometheus text page (0 when absent)."""
    for line in metrics_text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def engine_info(metrics_text: str) -> dict[str, str]:
    """What a node runs on (device, ISA, dtype, kernels, quantization): the labels of its pdserve:engine_info."""
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == "pdserve:engine_info":
                return dict(s.labels)
    return {}
