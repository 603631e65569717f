"""Auto mode's placement: the proxy's cost model against the planner's, each rule of the choice on
known costs, and a real P + D behind `pdserve proxy --mode auto`."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from servers import metric, start_pdserve
from test_pd_pull import MODEL, NODE
from test_plan_simulator import known_profile

from pdserve.kv.events import KVSnapshot
from pdserve.kv.prefix_hash import block_hashes
from pdserve.kv.transport import PeerAddress, choose_transport
from pdserve.plan.profile import Profile
from pdserve.proxy.costs import CostModel
from pdserve.proxy.flows.auto import AutoFlow
from pdserve.proxy.membership import Membership
from pdserve.proxy.placement import Placer, PromptView, next_turn, pair_transport, turn_ends
from pdserve.proxy.policies import Node, NoHealthyNode, Stream
from pdserve.proxy.prefix_index import NodeCache, PrefixIndex
from pdserve.proxy.speed import DecodeWindow, NodeSpeed, shared_steps
from pdserve.proxy.timing import RequestTiming

PROFILE = Path(__file__).parents[1] / "docs" / "results" / "profile.json"


def test_the_proxys_costs_are_the_planners():
    profile, costs = Profile.load(PROFILE), CostModel.load(PROFILE)
    budget = profile.meta["node"]["max_num_batched_tokens"]
    for tokens, cached in ((16, 0), (300, 0), (3000, 0), (3000, 2048), (5000, 1000)):
        assert costs.prefill_s(tokens, cached) == pytest.approx(profile.prefill_time(tokens, budget, cached))
    assert costs.step_s(8, 4000) == pytest.approx(profile.decode_step_time(8, 4000))
    nbytes = 1000 * profile.meta["node"]["kv_bytes_per_token"]
    # A pull's wait: the bytes' transfer and the served handoff around it.
    pull_s = profile.transfer_time("tcp", nbytes) + profile.serving["pull_handoff_s"]
    assert costs.transfer_s(1000, "tcp") == pytest.approx(pull_s)
    with_handoff = CostModel.of({**json.loads(PROFILE.read_text()), "serving": {"pull_handoff_s": 0.007}})
    assert with_handoff.transfer_s(1000, "tcp") == pytest.approx(profile.transfer_time("tcp", nbytes) + 0.007)


def test_a_bad_profile_is_named(tmp_path):
    with pytest.raises(ValueError, match="--profile /nonexistent.json: No such file"):
        CostModel.load("/nonexistent.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prefill_chunk": {"features": ["one", "tokens"], "coefficients": [0, 1]}}))
    with pytest.raises(ValueError, match="not a pdserve profile"):
        CostModel.load(bad)


def placer(tmp_path, nodes: list[Node], held: dict[str, list[int]] | None = None, stale: tuple[str, ...] = (),
           rule: str = "cost", slos: dict[str, float] | None = None) -> Placer:
    """Known costs (prefill chunk 10 ms + 1 ms/token, budget 512; transfer 2 ms + 1 ms/MB); each
    node's prefix cache holding `held[url]` hashes."""
    path = tmp_path / "profile.json"
    known_profile().save(path)
    index = PrefixIndex(Membership("auto", AutoFlow.roles), client=None)
    for node in nodes:
        index.caches[node.url] = cache = NodeCache()
        cache.load(KVSnapshot("e", 0, 16, (held or {}).get(node.url, [])))
        cache.synced = node.url not in stale
    return Placer(CostModel.load(path), index, rule, threshold_tokens=256, slos=slos)


def test_a_short_prompt_on_idle_nodes_is_prefilled_where_it_decodes(tmp_path):
    p, d = Node("http://p:1", "prefill"), Node("http://d:1", "decode")
    choice = placer(tmp_path, [p, d]).place(list(range(100)), [p], [d])
    assert (choice.decoder, choice.prefiller, choice.choice) == (d, None, "local")
    assert choice.ttft_s == pytest.approx(0.010 + 0.100)  # no queue, no hop in this profile


def test_a_prompt_that_would_stall_the_decoding_streams_goes_to_a_prefill_node(tmp_path):
    p, d = Node("http://p:1", "prefill"), Node("http://d:1", "decode")
    d.active_requests = 4  # streams decoding on D
    choice = placer(tmp_path, [p, d]).place(list(range(100)), [p], [d])
    assert choice.choice == "remote" and choice.prefiller is p
    transfer, last_token = 0.002 + 100 * 1000 * 1e-9, 0.010 + 0.001
    assert choice.ttft_s == pytest.approx(0.110 + transfer + last_token)
    assert choice.stall_s == pytest.approx(4 * last_token)
    p.prefill_backlog_until = time.monotonic() + 30.0  # P is 30 s behind: D's stall is the lesser harm
    assert placer(tmp_path, [p, d]).place(list(range(100)), [p], [d]).choice == "local"


def test_a_remote_prefill_is_priced_over_the_transport_the_pair_would_use(tmp_path):
    """The proxy reads each node's KV labels (its --kv-transport, KV host, the transports it
    serves) and prices P -> D over what D would choose: the rule agrees with the nodes' own
    choose_transport (which the proxy may not import) on every combination, and a pair on one
    host (shm, free here) prices the transfer 50 ms below one that must use tcp (50 ms here)."""
    for configured in ("auto", "tcp", "shm", "mooncake"):
        for d_host, p_host in (("127.0.0.1", "127.0.0.1"), ("localhost", "127.0.0.2"), ("198.18.0.1", "198.18.0.2"),
                               ("198.18.0.1", "198.18.0.1"), ("127.0.0.1", "")):
            for served in (("shm", "tcp"), ("tcp",), ("shm", "tcp", "mooncake"), ()):
                d = Node("http://d:1", "decode", engine={"kv_transport": configured, "kv_host": d_host})
                p = Node("http://p:1", "prefill", engine={"kv_host": p_host, "kv_transports": ",".join(served)})
                assert pair_transport(d, p) == choose_transport(configured, PeerAddress(p_host, served), here=d_host)
    assert pair_transport(Node("http://d:1", "decode"), Node("http://p:1", "prefill")) == "tcp"  # no KV labels

    def remote_ttft(d_transport: str) -> float:
        p = Node("http://p:1", "prefill", engine={"kv_host": "127.0.0.1", "kv_transports": "shm,tcp"})
        d = Node("http://d:1", "decode", engine={"kv_transport": d_transport, "kv_host": "127.0.0.1"})
        d.active_requests = 4  # streams decoding on D: the prompt goes to P
        chooser = placer(tmp_path, [p, d])
        chooser.costs = replace(chooser.costs, transfer={"shm": (0.0, 0.0), "tcp": (0.05, 0.0)})
        choice = chooser.place(list(range(100)), [p], [d])
        assert choice.choice == "remote"
        return choice.ttft_s

    assert remote_ttft("tcp") - remote_ttft("auto") == pytest.approx(0.05)


def test_the_node_holding_the_prefix_wins_unless_its_copy_is_stale(tmp_path):
    a, b = Node("http://a:1", "both"), Node("http://b:1", "both")
    prompt = list(range(500))
    held = {b.url: block_hashes(prompt[:320], 16)}  # B holds the first 320 tokens
    choice = placer(tmp_path, [a, b], held).place(prompt, [], [a, b])
    assert choice.decoder is b and choice.cached_tokens == 320
    assert choice.ttft_s == pytest.approx(0.010 + 180 * 0.001)
    b.active_requests = 1  # stale: B counts as holding nothing, and A is less loaded
    choice = placer(tmp_path, [a, b], held, stale=(b.url,)).place(prompt, [], [a, b])
    assert choice.decoder is a and choice.cached_tokens == 0


def test_with_slos_a_request_waits_behind_a_long_prefill_rather_than_overfill_a_decode_batch(tmp_path):
    """A holds 3 streams (a step of 42.7 ms, within the 45 ms TPOT SLO); B is prefilling a long
    prompt for 5 s more. By seconds alone, A is cheaper (TTFT 0.11 s + 3 x 0.11 s of stall against
    5.11 s); but a 4th stream makes A's step 50 ms: 4 requests would miss the TPOT SLO, none does on
    B, whose 5.11 s TTFT is within its SLO."""
    a, b = Node("http://a:1", "both"), Node("http://b:1", "both")
    a.active_requests, a.active_tokens = 3, 768
    b.prefill_backlog_until = time.monotonic() + 5.0
    prompt = list(range(100))
    assert placer(tmp_path, [a, b]).place(prompt, [], [a, b], output_tokens=128).decoder is a
    slo_aware = placer(tmp_path, [a, b], slos={"ttft_ms": 10_000, "tpot_ms": 45})
    choice = slo_aware.place(prompt, [], [a, b], output_tokens=128)
    assert choice.decoder is b
    view = PromptView(prompt, slo_aware.costs, slo_aware.index, "shm", slo_aware.clock())
    assert slo_aware.misses(view.local(a), view, 128) == 4 and slo_aware.misses(view.local(b), view, 128) == 0


def test_requests_still_prefilling_on_p_count_in_their_decode_nodes_batch(tmp_path):
    """Two D nodes, both idle, and three requests placed on D1 that P is still prefilling: they are
    not D1's streams yet, but they will be, so the next request goes to D2 (blind to them, every
    request placed while P works chose D1: at 64 nodes in the simulator that cost auto 0.89 -> 0.29
    of requests within TTFT + TPOT)."""
    p, d1, d2 = Node("http://p:1", "prefill"), Node("http://d1:1", "decode"), Node("http://d2:1", "decode")
    d1.active_requests = d2.active_requests = 1  # a stream each: a long prompt goes to P
    prompt = list(range(400))
    slos = {"ttft_ms": 10_000, "tpot_ms": 45}
    first = placer(tmp_path, [p, d1, d2], slos=slos).place(prompt, [p], [d1, d2], output_tokens=128)
    assert (first.choice, first.decoder) == ("remote", d1)  # a tie: the first
    for _ in range(3):
        d1.reserve(528)
    assert d1.coming_requests == 4 and d1.active_requests == 1
    choice = placer(tmp_path, [p, d1, d2], slos=slos).place(prompt, [p], [d1, d2], output_tokens=128)
    assert choice.decoder is d2
    for _ in range(3):
        d1.unreserve(528)
    assert (d1.reserved_requests, d1.reserved_tokens) == (0, 0)


def test_an_itl_slo_sends_a_stalling_prefill_to_p_where_tpot_would_absorb_it(tmp_path):
    """D holds 2 streams (a step of 30.3 ms). Prefilling 1000 tokens there stalls each for about a
    second (chunks of 512: 0.522 + 0.498 s): within a TPOT SLO of 60 ms, spread over 128 tokens, but
    a gap far over an ITL SLO of 200 ms, so both streams would miss it; on P, D only computes the
    last token (11 ms a stream) and nobody misses."""
    p, d = Node("http://p:1", "prefill"), Node("http://d:1", "decode")
    d.active_requests, d.active_tokens = 2, 256
    prompt = list(range(1000))
    tpot = placer(tmp_path, [p, d], slos={"tpot_ms": 60})
    itl = placer(tmp_path, [p, d], slos={"max_itl_ms": 200})
    view = PromptView(prompt, itl.costs, itl.index, "shm", itl.clock())
    assert tpot.misses(view.local(d), view, 128) == 0
    assert itl.misses(view.local(d), view, 128) == 2 and itl.misses(view.remote(d, p), view, 128) == 0
    assert itl.place(prompt, [p], [d], output_tokens=128).choice == "remote"


def test_where_no_option_saves_a_miss_the_static_route_is_kept(tmp_path):
    """Two kv_both nodes of 3 streams each (42.7 ms steps); any 100-token prefill (110 ms) beside
    them is a gap past a 100 ms ITL SLO for 3 streams, wherever it runs. By seconds alone the first
    node wins each time; under the SLO, which cannot tell them apart, the proxy's round robin does."""
    a, b = Node("http://a:1", "kv_both"), Node("http://b:1", "kv_both")
    for n in (a, b):
        n.active_requests, n.active_tokens = 3, 768
    prompt = list(range(100))
    by_seconds = placer(tmp_path, [a, b])
    assert [by_seconds.place(prompt, [a, b], [a, b]).decoder for _ in range(3)] == [a, a, a]
    itl = placer(tmp_path, [a, b], slos={"max_itl_ms": 100})
    view = PromptView(prompt, itl.costs, itl.index, itl.transport, itl.clock())
    assert min(itl.misses(o, view, 128) for o in itl.options(view, [a, b], [a, b])) == 3
    choices = [itl.place(prompt, [a, b], [a, b]) for _ in range(3)]
    assert [(c.decoder, c.choice) for c in choices] == [(a, "local"), (b, "local"), (a, "local")]


def test_streams_already_past_the_itl_slo_are_not_counted_again(tmp_path):
    """A holds 3 streams whose gaps already passed a 100 ms ITL SLO, B 1 stream within it: a
    prefill on A stalls no one who can still meet it, so the prompt goes to A, the busier node;
    with A's streams still within it, it goes to B (1 miss against 3)."""
    a, b = Node("http://a:1", "kv_both"), Node("http://b:1", "kv_both")
    a.active_requests, a.active_tokens, b.active_requests, b.active_tokens = 3, 768, 1, 256
    prompt = list(range(100))
    itl = placer(tmp_path, [a, b], slos={"max_itl_ms": 100})
    view = PromptView(prompt, itl.costs, itl.index, itl.transport, itl.clock())
    assert (itl.misses(view.local(a), view, 128), itl.misses(view.local(b), view, 128)) == (3, 1)
    assert itl.place(prompt, [a, b], [a, b]).decoder is b
    a.streams_past_itl = 3
    assert (itl.misses(view.local(a), view, 128), itl.misses(view.local(b), view, 128)) == (0, 1)
    assert itl.place(prompt, [a, b], [a, b]).decoder is a
    tpot = placer(tmp_path, [a, b], slos={"tpot_ms": 43})  # past the ITL SLO is no excuse under TPOT
    assert tpot.misses(view.local(a), view, 128) == 1 + 3  # this one (a 50 ms step) and all three


def streaming(node: Node, count: int, ends_in: float, now: float, prompt: int = 128, output: int = 128) -> list[Stream]:
    """`count` streams on `node`, under way since the time that puts their end `ends_in` s from `now`
    at the step of their batch (known costs: 20 ms + 5 ms/seq + 0.01 ms/KV token)."""
    step = 0.020 + 0.005 * count + 1e-5 * count * (prompt + output)
    streams = [Stream(prompt, output, now + ends_in - output * step) for _ in range(count)]
    node.streams += streams
    node.active_requests += count
    node.active_tokens += count * (prompt + output)
    return streams


def taking_turns(*urls: str) -> list[Node]:
    nodes = [Node(url, "kv_both") for url in urls]
    for n in nodes:
        n.engine = {"max_prefill_tokens_while_decoding": "0"}
    return nodes


def test_a_node_taking_turns_is_priced_by_when_its_streams_end_not_by_a_stall(tmp_path):
    """Two kv_both nodes whose prefill and decode take turns (--max-prefill-tokens-while-decoding 0).
    A holds 3 streams that end in 4 s, B 1 stream ending in 1 s (from their first tokens, their
    tokens and the step of their batch): a prompt computed on either stalls no stream, it waits for
    the streams instead, so the prompt goes where it starts first (B), and its TTFT counts that
    wait. Were B's stream to end later than A's, A. A node that does not take turns is priced as
    before: by the stall."""
    a, b = taking_turns("http://a:1", "http://b:1")
    itl = placer(tmp_path, [a, b], slos={"max_itl_ms": 100})
    now = itl.clock()
    streaming(a, 3, 4.0, now)
    (b_stream,) = streaming(b, 1, 1.0, now)
    prompt = list(range(100))
    view = PromptView(prompt, itl.costs, itl.index, itl.transport, now)
    local_a, local_b = view.local(a), view.local(b)
    assert local_a.stall_s == local_b.stall_s == 0.0
    assert local_b.ttft_s == pytest.approx(1.0 + 0.110, abs=1e-3) and local_a.ttft_s == pytest.approx(4.110, abs=1e-3)
    assert itl.misses(local_a, view, 128) == itl.misses(local_b, view, 128) == 0  # the stall costs no gap
    choice = itl.place(prompt, [a, b], [a, b], output_tokens=128)
    assert (choice.decoder, choice.choice, choice.output_tokens, choice.prompt_tokens) == (b, "local", 128, 100)
    # Dispatched there, B's prefill queues behind its stream, and the request waits for B's next turn
    stream = itl.dispatched(choice)
    assert b.streams == [b_stream, stream] and (stream.prompt_tokens, stream.output_tokens) == (100, 128)
    assert b.prefill_backlog_until == pytest.approx(now + 1.0 + choice.prefill_s, abs=1e-3)
    assert next_turn(b) == [stream] and next_turn(a) == []
    assert turn_ends(b, now, itl.costs) == pytest.approx(now + 1.0, abs=1e-6)  # the stream under way still
    # A load from another node is admitted while B's stream decodes, unless prompts queued before it wait
    given = PromptView(prompt, itl.costs, itl.index, itl.transport, now, first_token_given=True)
    assert given.load_wait(a) == 0.0 and given.load_wait(b) == pytest.approx(1.0, abs=1e-3)
    b_stream.first_token_at += 8.0  # B's stream now ends in 9 s
    assert itl.place(prompt, [a, b], [a, b], output_tokens=128).decoder is a
    plain = Node("http://c:1", "kv_both", active_requests=3, active_tokens=768)
    streaming(plain, 3, 4.0, now)
    assert not plain.takes_turns
    assert view.local(plain).stall_s == pytest.approx(6 * 0.110) and view.local(plain).ttft_s == pytest.approx(0.110)
    b.end(256, stream=b_stream)
    b.end(228, stream=stream)  # idle: nothing predicted is pending
    assert b.streams == [] and b.prefill_backlog_until == 0.0 and turn_ends(b, now, itl.costs) == now


def test_a_node_taking_turns_is_priced_by_what_the_proxy_sees_not_by_what_was_placed_before(tmp_path):
    """The turn is read from the requests in flight, not chained from earlier placements: B was
    sent 6 requests, of which one streams with 5 tokens left, so a prompt starts there in about 5
    steps. Once its first token is relayed a waiting request holds the node's turn. A prompt joins
    the next turn's batch (the requests waiting), not the streams under way: under a TPOT SLO that
    a batch of 4 misses, B with 3 streams under way takes it without a miss, and a node that does
    not take turns would make all four miss."""
    a, b = taking_turns("http://a:1", "http://b:1")
    tpot = placer(tmp_path, [a, b], slos={"tpot_ms": 40})
    now = tpot.clock()
    streaming(a, 1, 2.0, now)
    (nearly_out,) = streaming(b, 1, 5 * 0.02756, now)  # 5 steps of one stream of 256 tokens
    assert turn_ends(b, now, tpot.costs) == pytest.approx(now + 5 * 0.02756)
    prompt = list(range(100))
    view = PromptView(prompt, tpot.costs, tpot.index, tpot.transport, now)
    assert view.local(b).ttft_s == pytest.approx(5 * 0.02756 + 0.110, abs=1e-3)
    assert tpot.place(prompt, [a, b], [a, b], output_tokens=128).decoder is b
    waiting = Stream(100, 128)
    b.streams.append(waiting)
    b.drop(nearly_out)
    waiting.first_token_at = now  # its turn began: 128 steps of one stream of 228 tokens
    assert turn_ends(b, now, tpot.costs) == pytest.approx(now + 128 * (0.025 + 228e-5))
    c = taking_turns("http://c:1")[0]
    streaming(c, 3, 1.0, now, prompt=32)  # 3 streams of 160 tokens step in 39.8 ms, 4 with it in 48.7
    option = view.local(c)
    assert tpot.costs.step_s(4, 3 * 160 + 228) > 0.040 >= tpot.costs.step_s(3, 3 * 160)
    assert 0.040 > tpot.costs.step_s(1, 228)
    assert tpot.misses(option, view, 128) == 0
    c.engine = {}  # its prefill would stall them: all four in one batch
    assert tpot.misses(view.local(c), view, 128) == 1 + 3


def test_a_nodes_measured_speed_scales_what_the_profile_predicts():
    """Decode: 10 decode-only steps of 2 sequences and 200 KV tokens in 0.6 s, against a model of
    10 ms + 10 ms/seq + 0.1 ms/KV token (50 ms a step): 1.2x, of which 30 % is taken in. A node
    whose counters go back restarted: its next window counts from zero. Prefill: short ones are
    left out, and a ratio is bounded."""
    speed = NodeSpeed()

    def predict(seqs: float, kv_tokens: float) -> float:
        return 0.010 + 0.010 * seqs + 0.0001 * kv_tokens

    speed.count_decode_steps(DecodeWindow(4, 0.24, 8, 800))
    speed.fold_decode(predict)
    assert speed.decode == 1.0 and speed.pending.steps == 4  # too few steps yet
    speed.count_decode_steps(DecodeWindow(10, 0.6, 20, 2000))
    speed.fold_decode(predict)
    assert speed.decode == pytest.approx(0.7 + 0.3 * 1.2) and speed.pending.steps == 0
    speed.count_decode_steps(DecodeWindow(9, 0.9, 18, 1800))  # restarted: 9 steps of 100 ms
    speed.fold_decode(predict)
    assert speed.decode == pytest.approx(0.7 * (0.7 + 0.3 * 1.2) + 0.3 * 2.0)
    speed.observe_prefill(0.1, 0.02)
    assert speed.prefill == 1.0
    speed.observe_prefill(10.0, 1.0)
    assert speed.prefill == pytest.approx(0.7 + 0.3 * 3.0)


def test_a_prompt_prefilled_with_others_is_priced_with_the_steps_it_shared():
    """A node that prefilled 3 waiting prompts of 128 tokens in one step answers each after it: 384
    tokens' time against one prompt's price would read as a node 3x slow (auto's prefill speeds sat
    at their limit past saturation). The price is scaled by the steps' tokens over the prompt's own
    (what its prefix cache held is not its own); a node that does not report them: 1."""
    timing = RequestTiming(arrival=0.0, prompt_tokens=128, cached_tokens=0, prefill_step_tokens=384)
    assert shared_steps(timing) == 3.0
    timing.cached_tokens = 64  # 64 computed, in steps of 384
    assert shared_steps(timing) == 6.0
    assert shared_steps(RequestTiming(arrival=0.0, prompt_tokens=128, cached_tokens=0, prefill_step_tokens=128)) == 1.0
    assert shared_steps(RequestTiming(arrival=0.0, prompt_tokens=128)) == 1.0  # not reported
    speed = NodeSpeed()
    speed.observe_prefill(0.3, 0.1 * shared_steps(RequestTiming(arrival=0.0, prompt_tokens=128, cached_tokens=0,
                                                                 prefill_step_tokens=384)))
    assert speed.prefill == pytest.approx(1.0)  # as fast as the profile: it did three prompts' work


def test_placement_prices_each_node_at_its_measured_speed(tmp_path):
    """B prefills twice as slowly as the profile says: A wins an idle tie. With a TPOT SLO of 45 ms,
    A's 3 streams fit (42.7 ms a step) until A decodes 1.2x slower than profiled."""
    a, b = Node("http://a:1", "both"), Node("http://b:1", "both")
    b.speed.prefill = 2.0
    choice = placer(tmp_path, [a, b]).place(list(range(100)), [], [b, a])
    assert choice.decoder is a
    view = PromptView(list(range(100)), placer(tmp_path, [a, b]).costs, placer(tmp_path, [a, b]).index, "shm", 0.0)
    assert view.local(b).ttft_s == pytest.approx(2 * 0.110) and view.local(b).prefill_profile_s == pytest.approx(0.110)
    slo_aware = placer(tmp_path, [a, b], slos={"ttft_ms": 10_000, "tpot_ms": 45})
    a.active_requests, a.active_tokens = 2, 512
    view = PromptView(list(range(100)), slo_aware.costs, slo_aware.index, "shm", 0.0)
    assert slo_aware.misses(view.local(a), view, 128) == 0
    a.speed.decode = 1.2
    assert slo_aware.misses(view.local(a), view, 128) == 3  # this request and A's 2 streams


def test_the_baseline_rules_choose_as_their_systems_do(tmp_path):
    p, d1, d2 = Node("http://p:1", "prefill"), Node("http://d1:1", "decode"), Node("http://d2:1", "decode")
    short, long = list(range(100)), list(range(1000))
    rr = placer(tmp_path, [p, d1, d2], rule="round_robin")
    picks = [rr.place(short, [p], [d1, d2]) for _ in range(3)]
    assert [c.decoder for c in picks] == [d1, d2, d1] and all(c.prefiller is p for c in picks)  # always disaggregated

    held = {d2.url: block_hashes(long[:800], 16)}
    threshold = placer(tmp_path, [p, d1, d2], held, rule="threshold")  # Dynamo: 256 uncached tokens
    assert threshold.place(short, [p], [d1, d2]).choice == "local"
    choice = threshold.place(long, [p], [d1, d2])
    assert (choice.decoder, choice.choice) == (d2, "local")  # D2 holds 800 of 1000: 200 uncached
    d2.active_tokens = 5000  # D2 busy: D1, which holds nothing, and a P prefill
    assert threshold.place(long, [p], [d1, d2]).prefiller is p
    p.active_requests = 2  # P's queue is long: stay local
    assert threshold.place(long, [p], [d1, d2]).choice == "local"

    p.active_requests, d2.active_tokens = 0, 0
    scorers = placer(tmp_path, [p, d1, d2], held, rule="scorers")  # llm-d: prefix x3, queue x2, KV x2
    assert scorers.place(long, [p], [d1, d2]).decoder is d2
    d2.active_requests, d2.kv_usage = 4, 0.9  # 3 x 0.8 + 0 + 0.2 < 0 + 2 + 2
    choice = scorers.place(long, [p], [d1, d2])
    assert choice.decoder is d1 and choice.prefiller is p
    with pytest.raises(ValueError, match="--placement must be one of"):
        placer(tmp_path, [p], rule="fastest")


def test_no_node_that_decodes_is_an_error(tmp_path):
    p, d = Node("http://p:1", "prefill"), Node("http://d:1", "decode", healthy=False)
    with pytest.raises(NoHealthyNode, match="no healthy decode or colocated node"):
        placer(tmp_path, [p, d]).place([1, 2, 3], [p], [d])


def test_auto_mode_places_each_request_and_keeps_the_output(tmp_path):
    """A real P and D: a prompt with D idle is prefilled on D; another while D streams a long answer
    goes to P and is pulled; asked again once D is idle (and holds it), it is prefilled on D, with
    the same greedy tokens."""
    profile = tmp_path / "profile.json"
    known_profile(budget=2048).save(profile)
    prefill = start_pdserve(["serve", "--role", "prefill", *NODE], tmp_path, "prefill")
    decode = start_pdserve(["serve", "--role", "decode", *NODE], tmp_path, "decode")
    proxy = start_pdserve(["proxy", "--mode", "auto", "--profile", str(profile), "--prefill", prefill.url,
                           "--decode", decode.url], tmp_path, "proxy")
    try:
        prompt = "The history of the Roman Empire, from the founding of the city to the fall of Constantinople,"
        ask = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        local = httpx.post(proxy.url + "/v1/completions", json=ask, timeout=120)
        assert local.status_code == 200, local.text
        assert local.headers["x-pdserve-placement"] == "local"
        assert float(local.headers["x-pdserve-placement-ms"]) < 50
        empty = httpx.post(proxy.url + "/v1/completions", json={**ask, "prompt": ""}, timeout=60)
        assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]

        busy = threading.Thread(target=lambda: httpx.post(
            proxy.url + "/v1/completions", timeout=300,
            json={"model": MODEL, "prompt": "Count to a hundred:", "max_tokens": 400, "temperature": 0,
                  "ignore_eos": True}))
        busy.start()
        deadline = time.monotonic() + 30
        while metric(decode.url, "pdserve:num_requests_running") < 1:
            assert time.monotonic() < deadline, "the long answer never started on D"
            time.sleep(0.05)
        other = {**ask, "prompt": "Once upon a time, in a small village by the sea, there lived an old fisherman"}
        remote = httpx.post(proxy.url + "/v1/completions", json=other, timeout=120)
        busy.join()
        assert remote.status_code == 200, remote.text
        assert remote.headers["x-pdserve-placement"] == "remote"
        # Its record (the dashboard's): the choice and its predicted TTFT, P prefilled, D pulled
        record = httpx.get(f"{proxy.url}/v1/requests/{remote.headers['x-pdserve-request-id']}").json()
        assert record["placement"]["choice"] == "remote" and record["placement"]["predicted_ttft_ms"] > 0
        assert (record["prefill_node"], record["decode_node"]) == (prefill.url, decode.url)
        assert record["transfer"]["tokens"] > 0 and "transfer" in [s["stage"] for s in record["segments"]]
        again = httpx.post(proxy.url + "/v1/completions", json=other, timeout=120)
        assert again.headers["x-pdserve-placement"] == "local"
        record = httpx.get(f"{proxy.url}/v1/requests/{again.headers['x-pdserve-request-id']}").json()
        assert record["placement"]["choice"] == "local" and record["prefill_node"] is None
        assert again.json()["choices"][0]["text"] == remote.json()["choices"][0]["text"]
        assert metric(proxy.url, "pdserve_proxy:placement_total", 'choice="local"') == 3
        assert metric(proxy.url, "pdserve_proxy:placement_total", 'choice="remote"') == 1
        assert metric(proxy.url, "pdserve_proxy:placement_seconds_count") == 4
        assert metric(prefill.url, "pdserve:kv_blocks_held") == 0  # D pulled P's KV and P freed it
        # D's decode-only steps, which the proxy read and priced against the profile: D's speed now
        steps = metric(decode.url, "pdserve:decode_steps_total")
        assert steps >= 390 and metric(decode.url, "pdserve:decode_step_seqs_total") >= steps
        assert metric(decode.url, "pdserve:decode_step_kv_tokens_total") > 100 * steps  # ~200 a step on average
        speeds = {n["role"]: n["speed"] for n in httpx.get(proxy.url + "/v1/nodes", timeout=10).json()["nodes"]}
        assert speeds["decode"]["decode"] != 1.0 and 1 / 3 <= speeds["decode"]["decode"] <= 3
        cold = httpx.post(proxy.url + "/v1/completions", json={**ask, "temperature": -1}, timeout=60)
        assert cold.status_code == 400 and cold.json()["error"]["param"] == "temperature"  # the node's 400, relayed
        for node in httpx.get(proxy.url + "/v1/nodes", timeout=10).json()["nodes"]:  # none left holding a turn
            assert node["streams"] == {"streaming": 0, "waiting": 0}, node
    finally:
        proxy.stop()
        decode.stop()
        prefill.stop()


def test_the_proxy_counts_a_stream_past_the_itl_slo_while_it_streams(tmp_path):
    """A real node behind `pdserve proxy --mode auto --slo itl:1`: a streamed answer's gaps pass
    1 ms, so the proxy counts it on its node (/v1/nodes: streams_past_itl; the cost rule leaves such
    streams out of the misses a stall would make) while it streams, and not once it has ended."""
    profile = tmp_path / "profile.json"
    known_profile(budget=2048).save(profile)
    node = start_pdserve(["serve", "--role", "both", *NODE], tmp_path, "node")
    proxy = start_pdserve(["proxy", "--mode", "auto", "--profile", str(profile), "--node", node.url,
                           "--slo", "itl:1"], tmp_path, "proxy")

    def view() -> dict:
        return httpx.get(proxy.url + "/v1/nodes", timeout=10).json()["nodes"][0]

    def past_itl() -> int:
        return view()["streams_past_itl"]

    try:
        ask = {"model": MODEL, "prompt": "Count to a hundred:", "max_tokens": 40, "temperature": 0,
               "ignore_eos": True, "stream": True}
        during, events = None, 0
        with httpx.stream("POST", proxy.url + "/v1/completions", json=ask, timeout=120) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                events += line.startswith("data: {")
                if events == 20 and during is None:
                    during = view()
        assert events > 20 and during["streams_past_itl"] == 1
        assert during["streams"] == {"streaming": 1, "waiting": 0}  # auto's view of the node's turn
        deadline = time.monotonic() + 10  # the relay's end runs as the stream closes, maybe after our last read
        while past_itl() != 0:
            assert time.monotonic() < deadline, "the stream still counts after it ended"
            time.sleep(0.05)
        # Idle, nothing auto predicted for the node is pending
        idle = view()
        assert idle["predicted_s"] == {"prefill_backlog": 0.0} and idle["streams"] == {"streaming": 0, "waiting": 0}
    finally:
        proxy.stop()
        node.stop()
