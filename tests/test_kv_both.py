"""kv_both nodes (`pdserve serve --role kv_both`): colocated nodes that also move KV, so auto mode
over them has every choice colocated nodes have (a node prefills and decodes) and the remote one
(one prefills and holds the KV, another pulls it and decodes). Real processes, real HTTP."""

from __future__ import annotations

import httpx
import pytest
from servers import MODEL, NODE, Procs, wait_for_metric
from test_placement import placer
from test_plan_simulator import known_profile

from pdserve.proxy.flows.auto import AutoFlow
from pdserve.proxy.membership import Membership
from pdserve.proxy.placement import PromptView
from pdserve.proxy.policies import Node

PROMPTS = [
    "The history of the Roman Empire, from the founding of the city to the fall of Constantinople,",
    "Photosynthesis converts light energy into chemical energy. The process begins when",
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with Procs(tmp_path_factory.mktemp("kv_both")) as procs:
        a = procs.start(["serve", "--role", "kv_both", *NODE], "a")
        b = procs.start(["serve", "--role", "kv_both", *NODE], "b")
        yield procs, a, b


def complete(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_kv_both_node_prefills_for_the_other_and_decodes_what_the_other_prefilled(pair):
    """Both directions of one pull, by hand as the proxy does it: the same greedy tokens as either
    node answering alone, and no block left used or held on either."""
    _, a, b = pair
    for prompt, (p, d) in zip(PROMPTS, ((a, b), (b, a))):
        ask = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        alone = complete(d.url, ask)["choices"][0]["text"]
        prefilled = complete(p.url, {**ask, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        params = prefilled["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_block_ids"]
        assert complete(d.url, {**ask, "kv_transfer_params": params})["choices"][0]["text"] == alone
    for node in (a, b):
        assert wait_for_metric(node.url, "pdserve:kv_blocks_used", 0) == 0
        assert wait_for_metric(node.url, "pdserve:kv_blocks_held", 0) == 0


def test_a_kv_both_node_refuses_layer_wise_push_by_name(pair):
    _, a, _ = pair
    push = {"do_remote_prefill": True, "kv_mode": "push", "metaserver": "http://127.0.0.1:9/v1/kv/meta",
            "proxy_request_id": "x"}
    r = httpx.post(a.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "kv_transfer_params": push})
    assert r.status_code == 400 and "pull only" in r.json()["error"]["message"]


def test_auto_over_kv_both_nodes_prefills_remotely_with_the_same_output(pair, tmp_path):
    """`pdserve proxy --mode auto --kv-both A B` with Dynamo's threshold rule at 1 token: every prompt
    is prefilled on the other node than the one that decodes it, and answers as a lone node does."""
    procs, a, b = pair
    profile = tmp_path / "profile.json"
    known_profile(budget=2048).save(profile)
    proxy = procs.start(["proxy", "--mode", "auto", "--profile", str(profile), "--kv-both", a.url, b.url,
                         "--placement", "threshold", "--remote-prefill-threshold", "1"], "proxy")
    for prompt in PROMPTS:
        ask = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        r = httpx.post(proxy.url + "/v1/completions", json=ask, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-pdserve-placement"] == "remote"
        assert r.json()["choices"][0]["text"] == complete(a.url, ask)["choices"][0]["text"]
    nodes = httpx.get(proxy.url + "/v1/nodes", timeout=10).json()["nodes"]
    assert sorted((n["role"], n["url"]) for n in nodes) == sorted([("kv_both", a.url), ("kv_both", b.url)])
    for node in (a, b):
        assert wait_for_metric(node.url, "pdserve:kv_blocks_held", 0) == 0


def test_kv_both_nodes_are_prefillers_and_decoders_once(tmp_path):
    members = Membership("auto", AutoFlow.roles)
    a, b = members.add("http://127.0.0.1:1", "kv_both"), members.add("http://127.0.0.1:2", "kv_both")
    assert members.prefillers == members.decoders == [a, b] and members.nodes() == [a, b]
    members.remove(a.url)
    assert members.prefillers == members.decoders == members.nodes() == [b]
    AutoFlow.check_members(members)


def test_the_cost_rule_offers_every_kv_both_node_local_and_remote_from_another(tmp_path):
    a, b = Node("http://a:1", "kv_both"), Node("http://b:1", "kv_both")
    p = placer(tmp_path, [a, b])
    view = PromptView(list(range(600)), p.costs, p.index, p.transport, 0.0)
    options = p.options(view, [a, b], [a, b])
    assert {(o.decoder.url, o.prefiller.url if o.prefiller else None) for o in options} == {
        (a.url, None), (a.url, b.url), (b.url, None), (b.url, a.url)}
    colocated = [Node("http://c:1", "both"), Node("http://d:1", "both")]
    assert all(o.prefiller is None for o in p.options(view, [], colocated))


def test_a_remote_prefill_on_a_kv_both_node_counts_the_streams_it_stalls_there(tmp_path):
    """Two kv_both nodes, b decoding 4 streams, a idle. Prefilling 100 tokens (110 ms) on b for a
    stalls b's 4 streams (440 ms summed); on a for b, b's streams wait only for b's last-token
    recompute. The cost rule takes a's own prefill, which stalls no one."""
    a, b = Node("http://a:1", "kv_both"), Node("http://b:1", "kv_both")
    b.active_requests = 4
    p = placer(tmp_path, [a, b])
    view = PromptView(list(range(100)), p.costs, p.index, p.transport, 0.0)
    on_b, on_a = view.remote(a, b), view.remote(b, a)
    assert on_b.prefiller_stall_s == pytest.approx(4 * 0.110) and on_a.prefiller_stall_s == 0.0
    assert on_a.stall_s == pytest.approx(4 * (0.010 + 0.001))
    choice = p.place(list(range(100)), [a, b], [a, b])
    assert (choice.decoder, choice.prefiller) == (a, None)
    # Under a 100 ms ITL SLO, b's 4 streams would miss it if b prefilled: counted as 4 misses.
    strict = placer(tmp_path, [a, b], slos={"max_itl_ms": 100.0})
    assert strict.misses(on_b, view, 128) == 4 + strict.misses(view.local(a), view, 128)
