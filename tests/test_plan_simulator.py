"""The discrete-event simulator on a profile with known costs: each modelled rule, checked by hand."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace

import pytest
from helpers import make_request

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.prefix_hash import block_hashes
from pdserve.plan.corun import RELAY_STREAMS
from pdserve.plan.fit import LinearFit
from pdserve.plan.profile import Profile
from pdserve.plan.sim import Batching, Job, Setup, SimNode, Simulation, Tracker, simulate
from pdserve.workload import BenchRequest, mixed_dataset

KV_BYTES = 1000  # per token


def known_profile(capacity: int = 100_000, budget: int = 512) -> Profile:
    """Prefill chunk: 10 ms + 1 ms/token; decode step: 20 ms + 5 ms/seq + 0.01 ms/KV token;
    transfer: 2 ms + 1 ms per MB (shm)."""
    def fit(features, coefficients):
        return LinearFit(features, coefficients, 0.0, 0.0, 10)

    node = {"kv_bytes_per_token": KV_BYTES, "num_layers": 10, "kv_capacity_tokens": capacity,
            "max_num_batched_tokens": budget, "max_num_seqs": 64, "block_size": 16}
    return Profile({"node": node}, fit(["one", "tokens", "attention_pairs"], [0.010, 0.001, 0.0]),
                   fit(["one", "seqs", "kv_tokens"], [0.020, 0.005, 1e-5]),
                   {"shm": fit(["one", "bytes"], [0.002, 1e-9])}, 5.0)


def run(setup: str, requests, rate=float("inf"), profile=None, **kwargs) -> dict:
    return simulate(profile or known_profile(), Setup.parse(setup), requests, rate, 1.0, 0, {"ttft_ms": 1000}, **kwargs)


def test_setups_parse_and_bad_ones_are_named():
    assert Setup.parse("colocated:2") == Setup("colocated", 0, 2)
    assert Setup.parse("pull:1P3D") == Setup("pull", 1, 3)
    assert Setup.parse("auto:8") == Setup("auto", 0, 8) and Setup.parse("auto:2P6D") == Setup("auto", 2, 6)
    for bad in ("colocated:0", "pull:1P", "push:0P1D", "mixed:1P1D", "pull", "auto:0", "colocated:1P1D"):
        with pytest.raises(ValueError, match="expected colocated:N, pull:xPyD, push:xPyD, auto:N or auto:xPyD"):
            Setup.parse(bad)


def test_one_request_colocated_costs_its_prefill_chunks_then_its_decode_steps():
    summary = run("colocated:1", [BenchRequest([0], 1000, 3)])
    # 1000 tokens in chunks of 512 and 488: (10 + 512) + (10 + 488) ms; then decode steps at 1001 and 1002 KV tokens.
    assert summary["ttfts"][0] == pytest.approx(1.020)
    assert summary["itls"][0] == pytest.approx([0.020 + 0.005 + 1001e-5, 0.020 + 0.005 + 1002e-5])
    assert summary["completed"] == 1 and summary["slo_attainment"] == 0.0  # TTFT 1020 ms > 1000 ms


def test_pull_adds_the_prompts_transfer_and_push_its_last_layer():
    """Pull: D loads the whole prompt's KV and starts from P's first token (kv_transfer_params'
    first_token_id), computing no prompt token. Push: only the last of 10 layers (of all 100
    prompt tokens) follows the prefill, and D starts from the first token P sent with the push's
    end (send_first_token), computing no prompt token either."""
    colocated = run("colocated:1", [BenchRequest([0], 100, 2)])
    pull = run("pull:1P1D", [BenchRequest([0], 100, 2)])
    transfer = 0.002 + 100 * KV_BYTES * 1e-9
    assert pull["ttfts"][0] == pytest.approx(colocated["ttfts"][0] + transfer)
    push = run("push:1P1D", [BenchRequest([0], 100, 2)])
    assert push["ttfts"][0] == pytest.approx(colocated["ttfts"][0] + 0.002 + 10 * KV_BYTES * 1e-9)


def test_serving_overheads_add_a_hop_per_request_and_a_cost_per_step():
    """Each HTTP hop to a node 50 ms, the proxy in front 4 ms a request, the stream 30 ms, each step 2 ms."""
    profile = known_profile()
    profile.serving = {"request_s": 0.050, "stream_s": 0.030, "step_s": 0.002, "proxy_s": 0.004}
    colocated = run("colocated:1", [BenchRequest([0], 100, 3)], profile=profile)
    assert colocated["ttfts"][0] == pytest.approx(0.050 + 0.010 + 0.100 + 0.002 + 0.030 + 0.004)
    assert colocated["itls"][0] == pytest.approx([0.020 + 0.002 + 0.005 + 101e-5, 0.020 + 0.002 + 0.005 + 102e-5])
    pull = run("pull:1P1D", [BenchRequest([0], 100, 2)], profile=profile)  # P's hop, then D's, then the pull
    transfer = 0.002 + 100 * KV_BYTES * 1e-9  # then P's first token leaves D: no step of D's before it
    assert pull["ttfts"][0] == pytest.approx(2 * 0.050 + (0.110 + 0.002) + transfer + 0.030 + 0.004)
    # A served pull's handoff (side channel, D's loader) 7 ms on top of the bytes' transfer; push has none.
    handed = run("pull:1P1D", [BenchRequest([0], 100, 2)], profile=replace(
        profile, serving={**profile.serving, "pull_handoff_s": 0.007}))
    assert handed["ttfts"][0] == pytest.approx(pull["ttfts"][0] + 0.007)
    # Push: D's hop; D reserves its blocks and announces them (a hop to the proxy); P's hop; P's
    # prefill, of which only the last layer's transfer follows; then P's first token leaves D.
    push = run("push:1P1D", [BenchRequest([0], 100, 2)], profile=profile)
    last_layer = 0.002 + 10 * KV_BYTES * 1e-9
    assert push["ttfts"][0] == pytest.approx(3 * 0.050 + (0.110 + 0.002) + last_layer + 0.030 + 0.004)


def test_simulated_requests_carry_the_stages_the_proxys_headers_split_ttft_into():
    """As proxy/timing.py's x-pdserve-*-ms headers: a node's queue and prefill (pull and push: P's
    answer as the proxy times it, from the client's arrival), D's queue, the KV wait that showed."""
    profile = known_profile()
    profile.serving = {"request_s": 0.050, "stream_s": 0.030, "step_s": 0.002}
    colocated = run("colocated:1", [BenchRequest([0], 100, 3)], profile=profile)
    assert colocated["stages_ms"][0] == pytest.approx({"queue": 0.0, "prefill": 112.0, "kv-load": 0.0})
    pull = run("pull:1P1D", [BenchRequest([0], 100, 2)], profile=profile)
    transfer_ms = 2 + 100 * KV_BYTES * 1e-6
    assert pull["stages_ms"][0] == pytest.approx({"queue": 0.0, "prefill": 50 + 112, "prefill-engine": 112.0,
                                                  "handoff": 0.0, "decode-queue": 0.0, "kv-load": transfer_ms,
                                                  "decode-ttft": transfer_ms})
    stages = pull["stages_ms"][0]  # with D's hop and the stream, they make up the TTFT
    parts = ("queue", "prefill", "handoff", "decode-queue", "kv-load")
    assert pull["ttfts"][0] * 1e3 == pytest.approx(sum(stages[k] for k in parts) + 50 + 30)
    push = run("push:1P1D", [BenchRequest([0], 100, 2)], profile=profile)
    # P answers after D's hop, D's announcement and P's hop; D's wait for the last layer ends
    # within P's answer (the proxy shows none of it)
    last_layer_ms = 2 + 10 * KV_BYTES * 1e-6
    assert push["stages_ms"][0] == pytest.approx({"queue": 0.0, "prefill": 3 * 50 + 112, "prefill-engine": 112.0,
                                                  "decode-queue": 0.0, "kv-load": 0.0,
                                                  "decode-ttft": 2 * 50 + 112 + last_layer_ms})
    busy = run("pull:1P1D", [BenchRequest([0], 100, 2), BenchRequest([0], 100, 2)], profile=profile)
    assert busy["stages_ms"][1]["queue"] == pytest.approx(112.0)  # behind the first prompt on P


def test_simulated_nodes_count_decode_only_steps_as_the_engine_does():
    """pdserve:decode_steps and its sums (benchmarks/host_load.py reads both): a step that also
    prefills is not counted; a steady run counts each of its steps, KV growing by one a sequence."""
    summary = run("colocated:1", [BenchRequest([0], 100, 4)])
    counters = summary["decode_counters"]["N0"]
    assert counters["decode_steps"] == 3 and counters["decode_step_seqs"] == 3
    assert counters["decode_step_kv_tokens"] == 101 + 102 + 103
    assert counters["decode_step_seconds"] == pytest.approx(sum(summary["itls"][0]))
    pull = run("pull:1P1D", [BenchRequest([0], 100, 4), BenchRequest([0], 100, 4)])
    assert pull["decode_counters"]["P0"]["decode_steps"] == 0  # P only prefills
    # D: 3 steps a request (the first token is P's); P's second prefill ends after D's first request did
    assert pull["decode_counters"]["D0"]["decode_steps"] == pull["decode_counters"]["D0"]["decode_step_seqs"] == 6
    # A step after the node idled is timed whole, its idle penalty (plan/idle.py) with it, as the engine times it.
    cold = run("pull:1P1D", [BenchRequest([0], 100, 4)], profile=replace(known_profile(), idle=IDLE))
    warm = run("pull:1P1D", [BenchRequest([0], 100, 4)])
    assert cold["decode_counters"]["D0"]["decode_step_seconds"] == pytest.approx(
        warm["decode_counters"]["D0"]["decode_step_seconds"] + IDLE["decode_s"])


def test_new_work_cuts_a_decode_run_at_the_step_in_progress():
    """A decodes alone (one event per run) when B arrives at 0.5 s: B's prefill joins the step
    after the one in progress, exactly as a step-by-step loop would schedule it."""
    sim = Simulation(known_profile())
    node = SimNode(sim, "N", Batching(budget=512, chunked=True, max_seqs=64, capacity=100_000))
    blocks = node.free_blocks
    a, b = Tracker(BenchRequest([0], 100, 50), 0.0), Tracker(BenchRequest([0], 100, 5), 0.5)
    sim.at(0.0, lambda: node.submit(Job(0, 100, 50, a, lambda t: None)))
    sim.at(0.5, lambda: node.submit(Job(1, 100, 5, b, lambda t: None)))
    sim.run()
    t, kv, expected = 0.110, 101, []  # step by step: A's prefill, then decode steps that start before 0.5
    while t < 0.5:
        step = 0.025 + kv * 1e-5
        t, kv = t + step, kv + 1
        expected.append(step)
    mixed = 0.110 + 0.025 + kv * 1e-5  # B's 100-token chunk and A's decode in one step
    expected.append(mixed)
    assert a.result().itls_ms[: len(expected)] == pytest.approx([x * 1e3 for x in expected])
    assert b.result().ttft_ms == pytest.approx((t + mixed - 0.5) * 1e3)
    assert a.result().output_len == 50 and b.result().output_len == 5 and node.free_blocks == blocks


IDLE = {"tau_s": 1.0, "prefill_s": 0.2, "decode_s": 0.1}  # plan/idle.py's fit: amplitude * (1 - exp(-gap / tau))


def test_a_nodes_first_step_after_it_idled_pays_the_profiles_idle_penalty():
    """A's prefill is the node's first step ever (idle since long before: the whole 0.2 s); its
    decode steps follow back to back (nothing); B arrives 2 s later, after the node idled since A's
    last token; pulled, D's first step (a decode step) pays the decode amplitude, 0.1 s."""
    sim = Simulation(replace(known_profile(), idle=IDLE))
    node = SimNode(sim, "N", Batching(budget=512, chunked=True, max_seqs=64, capacity=100_000))
    a, b = Tracker(BenchRequest([0], 100, 3), 0.0), Tracker(BenchRequest([0], 100, 3), 2.0)
    sim.at(0.0, lambda: node.submit(Job(0, 100, 3, a, lambda t: None)))
    sim.at(2.0, lambda: node.submit(Job(1, 100, 3, b, lambda t: None)))
    sim.run()
    steps = [0.025 + 101e-5, 0.025 + 102e-5]
    assert a.result().ttft_ms == pytest.approx((0.110 + 0.2) * 1e3)
    assert a.result().itls_ms == pytest.approx([x * 1e3 for x in steps])
    idled = 2.0 - (0.110 + 0.2 + sum(steps))
    assert b.result().ttft_ms == pytest.approx((0.110 + 0.2 * (1 - math.exp(-idled / 1.0))) * 1e3)
    assert b.result().itls_ms == pytest.approx([x * 1e3 for x in steps])
    warm = run("pull:1P1D", [BenchRequest([0], 100, 3)])
    cold = run("pull:1P1D", [BenchRequest([0], 100, 3)], profile=replace(known_profile(), idle=IDLE))
    assert cold["ttfts"][0] == pytest.approx(warm["ttfts"][0] + 0.2)
    assert cold["itls"][0] == pytest.approx([warm["itls"][0][0] + 0.1, warm["itls"][0][1]])


def a_then_b_on_two_nodes(profile: Profile, one_host: bool) -> tuple[Tracker, Tracker]:
    """A (100 -> 3 tokens) on one node from 0, B (100 -> 6) on the other from 0.12 s, in A's first
    decode step; simulated to the end."""
    sim = Simulation(profile, one_host=one_host)
    batching = Batching(budget=512, chunked=True, max_seqs=64, capacity=100_000)
    first, second = SimNode(sim, "N0", batching), SimNode(sim, "N1", batching)
    a, b = Tracker(BenchRequest([0], 100, 3), 0.0), Tracker(BenchRequest([0], 100, 6), 0.12)
    sim.at(0.0, lambda: first.submit(Job(0, 100, 3, a, lambda t: None)))
    sim.at(0.12, lambda: second.submit(Job(1, 100, 6, b, lambda t: None)))
    sim.run()
    return a, b


def test_on_one_host_a_node_steps_slower_while_another_computes():
    """Co-run factors x1.5 (prefill) and x2 (decode). A (100 -> 3) computes alone from 0; B (100 ->
    6) arrives on the other node at 0.12 s, in A's first decode step: B's prefill runs x1.5 and A's
    decode run is cut at that step, its next step x2. Once A is done B decodes alone again."""
    profile = known_profile()
    profile.corun = {"prefill": 1.5, "decode": 2.0}
    a, b = a_then_b_on_two_nodes(profile, one_host=True)
    step = [0.025 + kv * 1e-5 for kv in range(101, 106)]  # one sequence's decode step at 101.. KV tokens
    assert a.result().ttft_ms == pytest.approx(110.0)  # 10 + 100 ms, alone
    assert a.result().itls_ms == pytest.approx([step[0] * 1e3, 2 * step[1] * 1e3])
    assert b.result().ttft_ms == pytest.approx(1.5 * 110.0)
    assert b.result().itls_ms == pytest.approx([x * 1e3 for x in step])  # A finished at 0.188 s, B at 0.275
    # Not on one host (the planner's clusters): no factor.
    a, b = a_then_b_on_two_nodes(profile, one_host=False)
    assert a.result().itls_ms == pytest.approx([x * 1e3 for x in step[:2]]) and b.result().ttft_ms == pytest.approx(110.0)


def test_the_simulated_proxy_measures_each_nodes_decode_speed_as_the_health_poller_does():
    """Auto's proxy holds each node's decode-step counters, read every health interval, against its
    profile (proxy/speed.py). Apart, the simulated steps cost what the profile says: x1.0. On one
    host, where a step runs x2 while the other node computes, the proxy sees the nodes run slower
    and prices their steps so, as a real proxy does on `pdserve up`'s nodes."""
    profile = known_profile()
    profile.corun = {"prefill": 1.0, "decode": 2.0}
    load = mixed_dataset(120, seed=1, long_fraction=0.0, short=(64, 64))
    apart = simulate(profile, Setup.parse("auto:2"), load, 4.0, 1.0, 0, {"ttft_ms": 5000.0})
    together = simulate(profile, Setup.parse("auto:2"), load, 4.0, 1.0, 0, {"ttft_ms": 5000.0}, one_host=True)
    assert all(speed == pytest.approx(1.0) for speed in apart["decode_speeds"].values()), apart["decode_speeds"]
    assert all(1.2 < speed <= 2.0 for speed in together["decode_speeds"].values()), together["decode_speeds"]


def test_on_one_host_a_prefill_runs_slower_by_the_streams_other_nodes_have_under_way():
    """Relay factor x1.3 measured at RELAY_STREAMS (3) streams, no co-run slow-down. k requests
    (100 -> 5) arrive on N0 at 0 and stream; B (100 -> 2) arrives on N1 once all k do: its prefill
    runs 1 + 0.3 * min(k / 3, 1) slower. C arrives on N0 once all are done: alone again. Not on one
    host: never."""
    assert RELAY_STREAMS == 3
    profile = known_profile()
    profile.corun = {"prefill": 1.0, "decode": 1.0, "relay": 1.3}
    for one_host in (True, False):
        for k, b_arrives in ((1, 0.12), (3, 0.37), (4, 0.48)):
            sim = Simulation(profile, one_host=one_host)
            batching = Batching(budget=512, chunked=True, max_seqs=64, capacity=100_000)
            first, second = SimNode(sim, "N0", batching), SimNode(sim, "N1", batching)
            streams = [Tracker(BenchRequest([0], 100, 5), 0.0) for _ in range(k)]
            b, c = Tracker(BenchRequest([0], 100, 2), b_arrives), Tracker(BenchRequest([0], 100, 2), 2.0)
            for i, tracker in enumerate(streams):
                sim.at(0.0, lambda i=i, tracker=tracker: first.submit(Job(i, 100, 5, tracker, lambda t: None)))
            sim.at(b_arrives, lambda: second.submit(Job(10, 100, 2, b, lambda t: None)))
            sim.at(2.0, lambda: first.submit(Job(11, 100, 2, c, lambda t: None)))
            sim.run()
            for stream in streams:  # under way when B arrives
                result = stream.result()
                assert result.ttft_ms < b_arrives * 1e3 < result.ttft_ms + sum(result.itls_ms), (k, result)
            factor = 1 + 0.3 * min(k / 3, 1.0) if one_host else 1.0
            assert b.result().ttft_ms == pytest.approx(factor * 110.0), (one_host, k)
            assert c.result().ttft_ms == pytest.approx(110.0)


def test_on_one_host_a_decode_step_runs_slower_by_the_streams_of_another_node_that_computes():
    """Decode relay factor x2 measured at 3 streams, no other slow-down. A (100 -> 12) computes
    alone from 0; B (100 -> 3) arrives on the other node at 0.12 s. While B prefills it computes
    but has no stream: A's steps run x1. Once B streams (its first token at 0.23 s) each node's
    steps run x(1 + 1/3) while the other streams, until B is done. Not on one host: never."""
    profile = known_profile()
    profile.corun = {"prefill": 1.0, "decode": 1.0, "relay": 1.0, "relay_decode": 2.0}
    step = [(0.025 + kv * 1e-5) * 1e3 for kv in range(101, 112)]  # one sequence's decode step at 101.. KV tokens
    for one_host in (True, False):
        sim = Simulation(profile, one_host=one_host)
        batching = Batching(budget=512, chunked=True, max_seqs=64, capacity=100_000)
        first, second = SimNode(sim, "N0", batching), SimNode(sim, "N1", batching)
        a, b = Tracker(BenchRequest([0], 100, 12), 0.0), Tracker(BenchRequest([0], 100, 3), 0.12)
        sim.at(0.0, lambda: first.submit(Job(0, 100, 12, a, lambda t: None)))
        sim.at(0.12, lambda: second.submit(Job(1, 100, 3, b, lambda t: None)))
        sim.run()
        assert a.result().ttft_ms == pytest.approx(110.0) and b.result().ttft_ms == pytest.approx(110.0)
        factor = 4 / 3 if one_host else 1.0
        assert b.result().itls_ms == pytest.approx([factor * x for x in step[:2]])
        # A's steps 6 and 7 (from 0.240 s and 0.275 s) begin once B streams (0.230 s), before it is done (0.299 s).
        slowed = [factor if i in (5, 6) else 1.0 for i in range(11)]
        assert a.result().itls_ms == pytest.approx([f * x for f, x in zip(slowed, step)])


def test_when_blocks_run_out_the_newest_request_is_preempted_and_recomputed():
    """A pool of 4 blocks of 16 tokens; A and B (16-token prompts, 20 tokens out; B admitted with
    A's first decode, one token behind) fill it when A has 32 tokens. A's next block preempts B, the
    newest, as Scheduler.schedule does; B waits until A finishes, then prefills its prompt and its
    16 tokens again (32 tokens) and goes on."""
    sim = Simulation(known_profile())
    node = SimNode(sim, "N", Batching(budget=512, chunked=True, max_seqs=64, capacity=64, block_size=16))
    a, b = Tracker(BenchRequest([0], 16, 20), 0.0), Tracker(BenchRequest([0], 16, 20), 0.0)
    sim.at(0.0, lambda: node.submit(Job(0, 16, 20, a, lambda t: None)))
    sim.at(0.0, lambda: node.submit(Job(1, 16, 20, b, lambda t: None)))
    sim.run()
    assert node.preemptions == 1 and node.free_blocks == 4
    assert a.result().output_len == b.result().output_len == 20
    a_alone = [0.025 + kv * 1e-5 for kv in (33, 34, 35)]  # A's last three steps, by itself
    assert a.result().itls_ms[-3:] == pytest.approx([x * 1e3 for x in a_alone])
    recompute = 0.010 + 32 * 0.001
    assert b.result().itls_ms[15] == pytest.approx((sum(a_alone) + recompute) * 1e3)


def engine_token_steps(requests: list[tuple[int, int]], blocks: int, budget: int, chunked: bool,
                       max_seqs: int, prefix_caching: bool = False) -> tuple[list[list[int]], int]:
    """The engine's Scheduler on (prompt, output) requests, all waiting at step 1: the step each
    token is sampled at, per request, and the preemptions. Prompts are 0, 1, 2, ...: with prefix
    caching a request finds the blocks of every shorter prompt computed before it."""
    scheduler = Scheduler(BlockManager(blocks, 4, enable_prefix_caching=prefix_caching), max_seqs, budget, chunked)
    reqs = [make_request(list(range(prompt)), str(i), output) for i, (prompt, output) in enumerate(requests)]
    for req in reqs:
        scheduler.add(req)
    steps: list[list[int]] = [[] for _ in reqs]
    preempted, step = 0, 0
    while scheduler.has_unfinished():
        step += 1
        out = scheduler.schedule()
        preempted += len(out.preempted)
        sampled = {s.request.request_id: 1 for s in out.scheduled if s.samples}
        for rid in sampled:
            steps[int(rid)].append(step)
        scheduler.update_from_output(out, sampled)
    return steps, preempted


def test_the_engines_scheduler_stamps_its_requests_with_the_clock_it_is_given():
    """A virtual clock (the step number): each request's first scheduling, first token and token
    times are the steps they happened at, as engine_token_steps counts them (issue 36's first piece:
    the simulator drives this scheduler on modelled time)."""
    step = 0
    scheduler = Scheduler(BlockManager(64, 4), 8, 16, True, clock=lambda: float(step))
    reqs = [make_request(list(range(prompt)), str(i), output) for i, (prompt, output) in enumerate([(10, 3), (20, 2)])]
    for req in reqs:
        scheduler.add(req)
    while scheduler.has_unfinished():
        step += 1
        out = scheduler.schedule()
        scheduler.update_from_output(out, {s.request.request_id: 1 for s in out.scheduled if s.samples})
    a, b = (r.metrics for r in reqs)
    # A (10 tokens) and 6 of B's 20 fit step 1's 16-token budget; B's prompt ends at step 2 (A decodes
    # beside it), so both sample at 1 / 2 and on.
    assert (a.first_scheduled_time, b.first_scheduled_time) == (1.0, 1.0)
    assert a.token_times == [1.0, 2.0, 3.0] and b.token_times == [2.0, 3.0]
    assert a.first_token_time == 1.0 and b.first_token_time == 2.0


def simulated_token_steps(requests: list[tuple[int, int]], blocks: int, budget: int, chunked: bool,
                          max_seqs: int, prefix_caching: bool = False) -> tuple[list[list[int]], int]:
    """The same on a SimNode whose every step costs 1 s, so a token's time is its step."""
    profile = known_profile()
    profile.prefill_chunk = replace(profile.prefill_chunk, coefficients=[0.0, 0.0, 0.0])
    profile.decode_step = replace(profile.decode_step, coefficients=[0.0, 0.0, 0.0])
    profile.serving = {"request_s": 0.0, "stream_s": 0.0, "step_s": 1.0}
    sim = Simulation(profile)
    node = SimNode(sim, "N", Batching(budget, chunked, max_seqs, blocks * 4, block_size=4), prefix_caching=prefix_caching)
    trackers = [Tracker(BenchRequest([0], prompt, output), 0.0) for prompt, output in requests]
    node.busy = True  # all of them arrive before the first step, as in engine_token_steps
    for i, ((prompt, output), tracker) in enumerate(zip(requests, trackers)):
        hashes = block_hashes(list(range(prompt)) + [1] * output, 4)  # engine_token_steps samples token 1
        node.submit(Job(i, prompt, output, tracker, lambda t: None, hashes=hashes))
    node.busy = False
    node._maybe_step()
    sim.run()
    steps = []
    for tracker in trackers:
        result = tracker.result()
        times = [result.ttft_ms] + [result.ttft_ms + sum(result.itls_ms[: k + 1]) for k in range(len(result.itls_ms))]
        steps.append([round(t / 1e3) for t in times])
    return steps, node.preemptions


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("blocks,budget,chunked,max_seqs", [(64, 32, True, 8), (20, 16, True, 8), (12, 64, False, 4),
                                                           (30, 8, True, 3)])
def test_a_simulated_node_schedules_step_for_step_as_the_engines_scheduler(blocks, budget, chunked, max_seqs,
                                                                          prefix_caching):
    """Same requests, same settings: every token in the same step, the same preemptions; pools
    small enough to preempt, budgets small enough to chunk; with prefix caching, prompts that
    share their leading blocks (and preempted requests find their own again)."""
    rng = random.Random(blocks * budget)
    requests = [(rng.randint(3, 30), rng.randint(1, 20)) for _ in range(12)]
    requests = [(p, min(o, blocks * 4 - p)) for p, o in requests]
    engine, engine_preempted = engine_token_steps(requests, blocks, budget, chunked, max_seqs, prefix_caching)
    simulated, simulated_preempted = simulated_token_steps(requests, blocks, budget, chunked, max_seqs, prefix_caching)
    assert simulated == engine
    assert simulated_preempted == engine_preempted


def test_a_prefill_node_holds_the_kv_until_it_is_pulled():
    """P's pool holds one 100-token prompt (7 blocks): the second prompt waits for the first's KV
    to be pulled, not for its prefill to end."""
    profile = known_profile(capacity=112)
    summary = run("pull:1P1D", [BenchRequest([0], 100, 2), BenchRequest([0], 100, 2)], profile=profile)
    prefill, transfer = 0.110, 0.002 + 100 * KV_BYTES * 1e-9
    assert summary["ttfts"][0] == pytest.approx(prefill + transfer)
    assert summary["ttfts"][1] == pytest.approx(2 * (prefill + transfer))
    assert summary["preemptions"] == 0  # P's second prompt waited; nothing was evicted


def test_a_profile_scales_to_the_machines_speed_now():
    profile = known_profile()
    assert profile.speed_factors({"prefill_s": 2.0, "decode_s": 2.0}) == {"prefill": 1.0, "decode": 1.0}  # no record
    profile.speed = {"prefill_s": 0.5, "decode_s": 0.02}
    factors = profile.speed_factors({"prefill_s": 0.6, "decode_s": 0.018})
    assert factors == pytest.approx({"prefill": 1.2, "decode": 0.9})
    slower = profile.scaled(factors)
    assert slower.prefill_chunk_time(100, 0) == pytest.approx(1.2 * profile.prefill_chunk_time(100, 0))
    assert slower.decode_step_time(4, 400) == pytest.approx(0.9 * profile.decode_step_time(4, 400))
    assert slower.transfer == profile.transfer and slower.serving == profile.serving


def test_without_chunked_prefill_a_prompt_takes_one_step_and_the_budget_grows_to_max_model_len():
    profile = known_profile()
    profile.meta["node"]["max_model_len"] = 4096
    whole = run("colocated:1", [BenchRequest([0], 1000, 2)], profile=profile, chunked_prefill=False)
    assert whole["ttfts"][0] == pytest.approx(0.010 + 1.000)  # one chunk, not two
    assert whole["max_num_batched_tokens"] == 4096 and whole["chunked_prefill"] is False
    small = run("colocated:1", [BenchRequest([0], 1000, 2)], profile=profile, max_num_batched_tokens=100)
    assert small["ttfts"][0] == pytest.approx(10 * 0.010 + 1.000)  # ten 100-token chunks


def test_under_load_every_request_finishes_and_more_decoders_cut_tpot():
    requests = [BenchRequest([0], 200, 100) for _ in range(40)]
    one = run("pull:1P1D", requests, rate=20.0)
    three = run("pull:1P3D", requests, rate=20.0)
    assert one["completed"] == three["completed"] == 40 and one["failed"] == 0
    assert three["median_tpot_ms"] < one["median_tpot_ms"]
    both = run("colocated:2", requests, rate=20.0, policy="least_loaded")
    assert both["completed"] == 40


def test_a_request_larger_than_the_kv_pool_fails_instead_of_hanging():
    summary = run("colocated:1", [BenchRequest([0], 50, 10), BenchRequest([0], 500, 10)], profile=known_profile(capacity=200))
    assert summary["completed"] == 1 and summary["failed"] == 1
    assert summary["errors"][1] == "does not fit the KV pool of any node"


def test_simulate_cli_writes_benchs_fields(tmp_path):
    profile = known_profile()
    path = tmp_path / "profile.json"
    profile.save(path)
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "pdserve.cli", "simulate", "--profile", str(path), "--setup", "push:1P2D",
                           "--dataset", "mixed", "--num-prompts", "20", "--request-rate", "2", "--goodput", "tpot:80",
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Median TTFT (ms)" in proc.stdout
    data = json.loads(out.read_text())
    assert data["completed"] == 20 and data["setup"] == "push:1P2D" and data["simulated"] is True
    for key in ("median_ttft_ms", "p99_tpot_ms", "request_throughput", "slo_attainment"):
        assert key in data
    bad = subprocess.run([sys.executable, "-m", "pdserve.cli", "simulate", "--profile", str(path), "--setup", "pull:3"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--setup 'pull:3'" in bad.stderr


def conversation(turns: int, system_len: int = 32, user_len: int = 8, answer_len: int = 4, n: int = 1):
    from pdserve.workload import multiturn_dataset

    return multiturn_dataset(n, seed=0, turns=turns, system_len=system_len, user_len=user_len,
                             answer_len=answer_len, think_s=0.0)


def test_a_turn_prefills_only_what_its_nodes_cache_lacks():
    """Turn 1: 32 system + 8 user tokens, all computed (10 ms + 40 ms). Turn 2 (52 tokens: turn 1,
    its 4-token answer, 8 new) comes right after the answer; the node holds turn 1's first two
    16-token blocks (its 43 computed tokens), so it computes 20 tokens (10 ms + 20 ms). Without
    prefix caching it computes all 52."""
    cached = run("colocated:1", conversation(2), prefix_caching=True)
    uncached = run("colocated:1", conversation(2), prefix_caching=False)
    assert cached["prefix_caching"] and not uncached["prefix_caching"]
    assert cached["ttfts"] == pytest.approx([0.050, 0.030]) and uncached["ttfts"] == pytest.approx([0.050, 0.062])
    assert cached["completed"] == 2 and cached["total_input_tokens"] == 40 + 52


def test_auto_sends_each_turn_where_its_history_is_cached():
    """One conversation of 4 turns on two nodes: round robin alternates, so turns 2-4 find at most
    the turn before last; auto (the proxy's own Placer) keeps the conversation on one node."""
    rr = run("colocated:2", conversation(4))
    auto = run("auto:2", conversation(4))
    assert auto["placement_counts"] == {"local": 4, "remote": 0}
    # turn k+1 computes the new 8 tokens plus the answer's tail past the last full block
    new = [40, 52 - 32, 64 - 48, 76 - 64]
    assert auto["ttfts"] == pytest.approx([(10 + n) / 1e3 for n in new])
    assert all(r > a for r, a in zip(rr["ttfts"][1:], auto["ttfts"][1:]))


def test_a_tracker_says_once_when_its_longest_gap_passes_its_limit():
    """As the proxy's relay counts a stream whose gap passed auto's ITL SLO, once; a run of decode
    steps counts by its longest step."""
    calls = []
    tracker = Tracker(BenchRequest([0], 10, 8), 0.0, limit=0.050, on_past_limit=lambda: calls.append(1))
    tracker.token(0.100)  # the first token: no gap yet
    tracker.token(0.140)
    assert calls == [] and not tracker.past_limit
    tracker.steps(0.320, 0.030, 0.010, 4)  # 30, 40, 50, 60 ms
    assert calls == [1] and tracker.past_limit and tracker.longest == pytest.approx(0.060)
    tracker.token(0.500)
    assert calls == [1]


def test_auto_prefills_a_long_prompt_on_p_when_d_is_decoding():
    """auto:1P1D: D is decoding a long answer when a 2000-token prompt comes; prefilling it on D
    would stall that stream for two seconds, so the Placer sends it to P and D pulls the KV."""
    requests = [BenchRequest(list(range(1000, 1100)), 100, 400), BenchRequest(list(range(2000, 4000)), 2000, 4)]
    summary = run("auto:1P1D", requests, rate=2.0)
    assert summary["placement_counts"] == {"local": 1, "remote": 1} and summary["completed"] == 2


def slow_transfer_profile(capacity: int = 100_000) -> Profile:
    """known_profile with a transfer of 1 ms per token (2 ms + 1 us per byte): what moves shows."""
    profile = known_profile(capacity)
    profile.transfer = {"shm": replace(profile.transfer["shm"], coefficients=[0.002, 1e-6])}
    return profile


def test_a_decode_node_pulls_only_what_its_own_cache_lacks():
    """pull:1P1D, two turns (40 tokens, then 52). Turn 1: P computes 40 tokens (50 ms), D's connector
    loads all 40 (42 ms) and D starts from P's first token. Both nodes keep turn 1's two full blocks.
    Turn 2: P computes 20 tokens (30 ms); D matches those 32 tokens in its own cache and loads only
    20 (22 ms), as the engine's scheduler and connector do; without D's cache it would load 52."""
    summary = run("pull:1P1D", conversation(2), profile=slow_transfer_profile(), prefix_caching=True)
    assert summary["ttfts"] == pytest.approx([0.050 + 0.042, 0.030 + 0.022])


def test_push_reserves_decode_blocks_before_the_prefill_starts():
    """push:1P1D, D's pool holding one request (7 blocks): D reserves the first request's blocks,
    so the second is not even sent to P until the first has finished on D and freed them (pull
    would prefill it on P meanwhile). Each: P's prefill (110 ms), its last layer (2 ms + 10 us),
    then D starts from P's first token."""
    profile = known_profile()
    profile.meta["node"] = {**profile.meta["node"], "kv_capacity_tokens": 112}
    summary = run("push:1P1D", [BenchRequest([0], 100, 5), BenchRequest([0], 100, 5)], profile=profile)
    first = 0.110 + 0.002 + 10_000e-9
    assert summary["ttfts"][0] == pytest.approx(first)
    assert summary["ttfts"][1] == pytest.approx(summary["e2els"][0] + first)


def test_least_loaded_counts_in_flight_tokens_as_the_proxy_does():
    """The proxy's own LeastLoaded policy: a 1000-token prompt on N0, then two short ones. The
    third goes to N1 too (fewer in-flight tokens, though each node has one request), so it does not
    wait behind the long prefill; round robin sends it to N0."""
    requests = [BenchRequest([0], 1000, 4), BenchRequest([0], 10, 4), BenchRequest([0], 10, 4)]
    least = run("colocated:2", requests, policy="least_loaded")
    rr = run("colocated:2", requests)
    assert least["ttfts"][2] < 0.1 and rr["ttfts"][2] > 1.0


def test_the_simulator_predicts_each_requests_longest_gap_kept_or_not():
    """colocated:1: A decodes when B's 1000-token prompt arrives; the step that takes B's first
    chunk (512 tokens: 10 + 512 ms) beside A's decode is A's longest gap. The planner's runs keep
    no gaps (itls=False) but the same longest gap, so an ITL SLO is judged alike."""
    requests = [BenchRequest([0], 100, 20), BenchRequest([0], 1000, 2)]
    kept = run("colocated:1", requests, rate=10.0)
    bare = run("colocated:1", requests, rate=10.0, itls=False)
    longest = [max(gaps) for gaps in kept["itls"]]
    assert longest[0] > 0.522  # B's first chunk, beside A's decode
    for summary in (kept, bare):
        assert summary["mean_max_itl_ms"] == pytest.approx(1e3 * sum(longest) / 2)
    assert bare["itls"] == [[], []]


def test_a_prefill_cap_while_decoding_bounds_a_streams_longest_gap_to_one_small_chunk():
    """The same A and B with --max-prefill-tokens-while-decoding 64: beside A's decode, B's prompt
    advances 64 tokens a step (16 steps instead of 2), so A's longest gap is one 64-token chunk
    (10 + 64 ms) and its decode, not a 512-token chunk; B's TTFT pays the smaller chunks."""
    requests = [BenchRequest([0], 100, 40), BenchRequest([0], 1000, 2)]
    plain = run("colocated:1", requests, rate=10.0)
    capped = run("colocated:1", requests, rate=10.0, prefill_cap=64)
    assert max(plain["itls"][0]) > 0.522
    # A's decode step: 20 + 5 ms and 0.01 ms per KV token (100-140 of them here).
    assert 0.074 + 0.025 + 100e-5 < max(capped["itls"][0]) < 0.074 + 0.025 + 140e-5
    assert capped["ttfts"][1] > plain["ttfts"][1]
    assert capped["max_prefill_tokens_while_decoding"] == 64 and capped["completed"] == 2
    # A cap of 0: B's prompt waits for A's last token, so A's gaps are all decode steps and B's
    # first token comes after A's end (A arrives at 0 and B 0.1 s later, at rate 10 with no jitter).
    turns = run("colocated:1", requests, rate=10.0, prefill_cap=0)
    assert max(turns["itls"][0]) < 0.025 + 140e-5
    a_end = turns["start_times"][0] + turns["e2els"][0]
    assert turns["start_times"][1] + turns["ttfts"][1] > a_end + 0.020 + 0.512  # then B's first chunk
    with pytest.raises(ValueError, match="needs chunked prefill"):
        run("colocated:1", requests, prefill_cap=64, chunked_prefill=False)


def test_per_role_settings_set_p_nodes_budget_and_d_nodes_streams():
    """`--decode-max-num-seqs 1`: D decodes one stream at a time, every step the cost of one
    sequence (20 + 5 ms + KV), the second request waiting for the first's 19 steps; two streams
    share 30 ms steps. `--prefill-max-num-batched-tokens 256`: P prefills 1000 tokens in four chunks
    instead of two, two more chunk overheads of 10 ms."""
    two = [BenchRequest([0], 100, 20), BenchRequest([0], 100, 20)]

    def on(setup: Setup, requests) -> dict:
        return simulate(known_profile(), setup, requests, float("inf"), 1.0, 0, {"ttft_ms": 1000})

    shared, alone = on(Setup("pull", 1, 1), two), on(Setup("pull", 1, 1, decode_max_seqs=1), two)
    assert max(max(gaps) for gaps in alone["itls"]) < 0.027 < max(max(gaps) for gaps in shared["itls"])
    assert alone["ttfts"][1] >= alone["ttfts"][0] + 19 * 0.026 > shared["ttfts"][1]  # after the first's last step
    long = [BenchRequest([0], 1000, 2)]
    small = on(Setup("pull", 1, 1, prefill_budget=256), long)
    assert small["ttfts"][0] == pytest.approx(on(Setup("pull", 1, 1), long)["ttfts"][0] + 0.020)
    assert small["prefill_max_num_batched_tokens"] == 256 and alone["decode_max_num_seqs"] == 1
    assert Setup("pull", 1, 1, 256, 8).role_flags == "--prefill-max-num-batched-tokens 256 --decode-max-num-seqs 8"
    with pytest.raises(ValueError, match="--decode-max-num-seqs sets P and D nodes by role; colocated:2 has none"):
        Setup("colocated", 0, 2, decode_max_seqs=4)
    with pytest.raises(ValueError, match="--prefill-max-num-batched-tokens must be >= 1, got 0"):
        Setup("pull", 1, 1, prefill_budget=0)



def two_thread_profile(prefill: float = 0.5, decode: float = 0.8) -> Profile:
    """known_profile as measured at 2 threads: its prefill and decode costs times these factors."""
    faster = known_profile().scaled({"prefill": prefill, "decode": decode})
    return replace(faster, meta={**faster.meta, "threads": 2})


def test_nodes_of_more_threads_step_at_their_profiles_costs():
    """`--prefill-threads 2`: P prefills at the 2-thread profile's costs (half here), D decodes at
    the 1-thread one's; `--decode-threads 2` the other way round (0.8x the step). Without a profile
    measured at that many threads the setup is refused, naming the flag."""
    one = [BenchRequest([0], 1000, 4)]
    threads = {2: two_thread_profile()}

    def on(setup: Setup) -> dict:
        return simulate(known_profile(), setup, one, float("inf"), 1.0, 0, {"ttft_ms": 1000}, thread_profiles=threads)

    plain, fat_p, fat_d = on(Setup("pull", 1, 1)), on(Setup("pull", 1, 1, prefill_threads=2)), \
        on(Setup("pull", 1, 1, decode_threads=2))
    prefill = 0.010 + 0.512 + 0.010 + 0.488  # two chunks at the 1-thread costs
    assert fat_p["ttfts"][0] == pytest.approx(plain["ttfts"][0] - prefill / 2)
    assert fat_p["itls"][0] == pytest.approx(plain["itls"][0])
    assert fat_d["ttfts"][0] == pytest.approx(plain["ttfts"][0])
    assert fat_d["itls"][0] == pytest.approx([0.8 * gap for gap in plain["itls"][0]])
    assert fat_p["prefill_threads"] == 2 and fat_d["decode_threads"] == 2 and plain["prefill_threads"] is None
    assert Setup("pull", 2, 1, prefill_threads=2).role_flags == "--prefill-threads 2"
    with pytest.raises(ValueError, match="--decode-threads 4: no profile measured at 4 thread"):
        on(Setup("pull", 1, 1, decode_threads=4))
    with pytest.raises(ValueError, match="--prefill-threads sets P and D nodes by role; colocated:2 has none"):
        Setup("colocated", 0, 2, prefill_threads=2)


def test_thread_profiles_load_by_thread_count_and_refuse_a_repeat(tmp_path):
    from pdserve.plan.profile import thread_profiles

    main, two = known_profile(), two_thread_profile()
    main.meta["model"] = two.meta["model"] = "SmolLM2-135M-Instruct.Q4_1-abc"
    paths = {}
    for name, profile in (("one", main), ("two", two)):
        profile.save(tmp_path / f"{name}.json")
        paths[name] = str(tmp_path / f"{name}.json")
    loaded = thread_profiles([paths["two"]], main)
    assert list(loaded) == [2] and loaded[2].prefill_chunk.coefficients == two.prefill_chunk.coefficients
    assert thread_profiles(None, main) == {}
    with pytest.raises(ValueError, match="--thread-profile .*one.json: measured at 1 thread.*as --profile was"):
        thread_profiles([paths["one"]], replace(main, meta={**main.meta, "threads": 1}))
    with pytest.raises(ValueError, match="as another --thread-profile was"):
        thread_profiles([paths["two"], paths["two"]], main)
    other = replace(two, meta={**two.meta, "model": "Qwen2-0.5B"})
    other.save(tmp_path / "qwen.json")
    with pytest.raises(ValueError, match="--thread-profile .*qwen.json: a profile of 'Qwen2-0.5B'"):
        thread_profiles([str(tmp_path / "qwen.json")], main)


def test_a_streams_longest_gap_is_the_tail_of_the_probes_gaps():
    """One gap in a hundred ran 20 ms long in the profile's probes: a 600-token answer then almost
    surely meets one (1 - 0.99 ** 599 = 99.8 %), a 3-token one rarely (2 %); the engine's steps and
    so the TTFTs and end times are unchanged. Without probe gaps (older profiles) nothing is added."""
    profile = known_profile()
    profile.serving = {"request_s": 0.0, "stream_s": 0.0, "step_s": 0.0, "gap_excess_s": [0.0] * 990 + [0.020] * 10}

    def longest(summary: dict) -> list[float]:
        return [max(gaps) for gaps in summary["itls"]]

    long = [BenchRequest([0], 100, 600) for _ in range(20)]
    short = [BenchRequest([0], 100, 3) for _ in range(20)]
    for requests, met in ((long, 19), (short, 0)):
        plain = run("colocated:20", requests, rate=1.0)
        jittered = run("colocated:20", requests, rate=1.0, profile=profile)
        assert jittered["ttfts"] == plain["ttfts"] and jittered["e2els"] == plain["e2els"]
        extra = [j - p for j, p in zip(longest(jittered), longest(plain))]
        assert sum(e > 0.015 for e in extra) >= met and (met or sum(e > 0.015 for e in extra) <= 3)
    # Each listed gap has its own draw: about one in a hundred of the long answers' is 20 ms longer
    long_gaps = [g for request in run("colocated:20", long, rate=1.0, profile=profile)["itls"] for g in request]
    assert 0.005 < sum(g > 0.040 for g in long_gaps) / len(long_gaps) < 0.02
    # The planner's runs keep no gaps: the longest is drawn at once, as often, and seeded
    plain = run("colocated:20", long, rate=1.0, itls=False)
    planned = run("colocated:20", long, rate=1.0, profile=profile, itls=False)
    # its mean gap (29 ms: a step grows from 26 to 32 ms over the answer) + 20 ms, over the last step's 32 ms
    assert planned["median_max_itl_ms"] - plain["median_max_itl_ms"] == pytest.approx(17.0, abs=0.5)
    assert run("colocated:20", long, rate=1.0, profile=profile, itls=False) == planned


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_kv_that_arrives_during_a_step_is_read_at_its_end(mode):
    """The engine's loop reads finished transfers between steps: a prompt's KV that reaches a
    decoding D mid-step starts (with P's first token, which the client then gets) when that step
    ends. A (600 tokens) keeps D stepping; B's first token comes at one of A's token times, after
    its KV arrived."""
    a, b = BenchRequest([0], 100, 600), BenchRequest([0], 100, 20)
    out = run(f"{mode}:1P1D", [a, b], rate=2.0)  # B about half a second after A: A is decoding on D
    a_start, b_start = out["start_times"]
    a_times = [a_start + out["ttfts"][0]]
    for gap in out["itls"][0]:
        a_times.append(a_times[-1] + gap)
    b_first = b_start + out["ttfts"][1]
    kv_arrived = b_start + 0.010 + 0.100 + 0.002 + 100 * KV_BYTES * 1e-9 * (1 if mode == "pull" else 0.1)
    assert a_times[0] < b_first < a_times[-1] and b_first >= kv_arrived - 1e-9
    assert min(abs(b_first - t) for t in a_times) < 1e-9  # a step boundary of D's
