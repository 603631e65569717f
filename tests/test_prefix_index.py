"""The proxy's copy of each node's prefix cache: kept from the node's KV events, resynced when stale."""

from __future__ import annotations

import time

import httpx
from servers import start_pdserve, wait_ready
from test_pd_pull import MODEL, NODE

from pdserve.kv.events import KVEventBatch, KVEventPage, KVSnapshot
from pdserve.kv.prefix_hash import block_hashes
from pdserve.proxy.prefix_index import NodeCache


def page(epoch: str, seq: int, *batches: tuple[int, list[int], list[int]]) -> KVEventPage:
    return KVEventPage(epoch, seq, [KVEventBatch(epoch, s, stored, removed) for s, stored, removed in batches])


def test_a_copy_follows_batches_in_order_and_goes_stale_on_a_gap_or_a_restart():
    cache = NodeCache()
    cache.load(KVSnapshot("e1", 2, 16, [1, 2]))
    assert cache.apply(page("e1", 4, (3, [3, 4], []), (4, [], [1])))
    assert cache.hashes == {2, 3, 4} and cache.seq == 4 and cache.synced
    assert cache.apply(page("e1", 4))  # nothing new
    assert cache.apply(page("e1", 5, (5, [4], [4]))) and 4 in cache.hashes  # evicted and filed again in one step
    assert cache.cached_blocks([2, 3, 9, 4]) == 2  # a prefix hit stops at the first miss
    assert not cache.apply(page("e1", 7, (7, [5], [])))  # batch 6 was dropped by the node: a gap
    assert not cache.synced and cache.resyncs == 1
    cache.load(KVSnapshot("e1", 7, 16, [2, 5]))
    assert cache.apply(page("e1", 7)) and cache.synced  # caught up: nothing new, still good
    assert not cache.apply(page("e2", 1, (1, [8], [])))  # the node restarted
    assert cache.resyncs == 2 and not cache.synced


def proxy_view(proxy_url: str, node_url: str) -> dict:
    nodes = httpx.get(proxy_url + "/v1/nodes", timeout=5).json()["nodes"]
    return next(n for n in nodes if n["url"] == node_url)


def wait_for_copy(proxy_url: str, node_url: str, timeout: float = 20.0) -> tuple[dict, KVSnapshot]:
    """Until the proxy's copy is synced at the node's latest batch and the node is back in rotation
    (a restart costs it its health checks); the copy and the node's snapshot."""
    deadline = time.monotonic() + timeout
    while True:
        snapshot = KVSnapshot(**httpx.get(node_url + "/kv/snapshot", timeout=5).json())
        view = proxy_view(proxy_url, node_url)
        copy = view["prefix_cache"]
        if copy["synced"] and (copy["epoch"], copy["batch"]) == (snapshot.epoch, snapshot.seq) and view["healthy"]:
            return copy, snapshot
        assert time.monotonic() < deadline, f"proxy's copy {copy} never caught up with {snapshot.epoch} {snapshot.seq}"
        time.sleep(0.1)


def test_the_proxy_keeps_each_nodes_prefix_cache_across_a_restart(tmp_path):
    node = start_pdserve(["serve", "--role", "both", *NODE], tmp_path, "both")
    proxy = start_pdserve(["proxy", "--mode", "colocated", "--node", node.url], tmp_path, "proxy")
    try:
        prompt = list(range(1000, 1070))  # 70 token ids: 4 full blocks of 16
        answer = httpx.post(proxy.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3},
                            timeout=120)
        assert answer.status_code == 200, answer.text
        copy, snapshot = wait_for_copy(proxy.url, node.url)
        assert set(block_hashes(prompt, snapshot.block_size)) <= set(snapshot.hashes)  # the proxy's hashes are the node's
        assert copy["blocks"] == len(snapshot.hashes) >= 4

        bad = httpx.get(node.url + "/kv/events", params={"timeout": 60}, timeout=5)
        assert bad.status_code == 400 and "timeout" in bad.json()["error"]["message"]

        first_epoch = snapshot.epoch
        node.stop()
        node.start()  # same port, fresh engine: another epoch, an empty cache
        wait_ready(node)
        copy, snapshot = wait_for_copy(proxy.url, node.url)
        assert snapshot.epoch != first_epoch and copy["resyncs"] >= 1 and copy["blocks"] == 0
        answer = httpx.post(proxy.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3},
                            timeout=120)
        assert answer.status_code == 200, answer.text
        copy, snapshot = wait_for_copy(proxy.url, node.url)
        assert copy["blocks"] == len(snapshot.hashes) >= 4
    finally:
        proxy.stop()
        node.stop()
