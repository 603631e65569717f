"""Node selection policies on their own."""

from __future__ import annotations

import pytest

from pdserve.proxy.policies import LeastLoaded, Node, NoHealthyNode, RoundRobin, select_decoder, select_prefiller


def test_round_robin_cycles_over_healthy_nodes():
    nodes = [Node("a", "prefill"), Node("b", "prefill"), Node("c", "prefill", healthy=False)]
    policy = RoundRobin()
    assert [select_prefiller(nodes, policy, 10).url for _ in range(4)] == ["a", "b", "a", "b"]


def test_least_loaded_weighs_tokens_and_kv_usage():
    a, b = Node("a", "decode"), Node("b", "decode")
    policy = LeastLoaded(kv_weight_tokens=1000)
    a.begin(500)
    assert select_decoder([a, b], policy, 10) is b
    b.kv_usage = 0.9  # 900 token-equivalents of KV in use outweigh a's 500 in-flight tokens
    assert select_decoder([a, b], policy, 10) is a
    a.end(500)
    assert a.active_tokens == 0 and a.served == 1


def test_no_healthy_node_is_a_clear_error():
    with pytest.raises(NoHealthyNode, match="no healthy decode node"):
        select_decoder([Node("a", "decode", healthy=False)], RoundRobin(), 1)


def test_node_leaves_rotation_after_consecutive_failed_checks_and_comes_back():
    node = Node("a", "prefill")
    node.record_check(False, max_failures=3)
    node.record_check(False, max_failures=3)
    assert node.healthy  # two failures: still in rotation
    node.record_check(False, max_failures=3)
    assert not node.healthy
    node.record_check(True, max_failures=3)
    assert node.healthy and node.failures == 0
