"""The scheduler always makes progress: a request preempted for want of blocks must not take them
back ahead of requests that already hold theirs (found by the simulator, which runs this scheduler:
an overloaded decode node spun forever, re-prefilling one prompt step after step)."""

from __future__ import annotations

import math

from helpers import make_request

from pdserve.config import KVTransferConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.kv.connector import FinishedTransfers, KVConnectorScheduler
from pdserve.kv.holds import HeldBlocks
from pdserve.kv.inbox import TransferResult
from pdserve.kv.params import KVTransferParams


def loaded_request(rid: str, prompt: int, max_tokens: int):
    """A decode node's request whose prompt KV a prefill node holds (pull)."""
    req = make_request(list(range(100, 100 + prompt)), rid, max_tokens)
    req.kv_transfer_params = KVTransferParams(do_remote_prefill=True, remote_request_id=rid,
                                              remote_block_ids=list(range(-(-prompt // 4))))
    return req


def test_a_preempted_request_queues_behind_the_waiting_requests_that_hold_their_blocks():
    """8 blocks of 4 tokens, a budget of 8. L1 and L2 reserve 3 blocks each for their loads; X
    (8 tokens) takes the last 2 and samples. Once L1's and L2's KV has arrived they wait, holding
    6 blocks, and X needs a third block: X is preempted. Queued ahead of them, X took its 2 blocks
    and the whole budget back at every step and was preempted again, forever; behind them, L1 and
    L2 run first and everything finishes."""
    connector = KVConnectorScheduler(KVTransferConfig(role="decode"), 4, HeldBlocks(math.inf), "D")
    scheduler = Scheduler(BlockManager(8, 4, enable_prefix_caching=False), 8, 8, True, connector=connector,
                          clock=lambda: 0.0)
    reqs = [loaded_request("L1", 12, 3), loaded_request("L2", 12, 3), make_request(list(range(8)), "X", 6)]
    for req in reqs:
        scheduler.add(req)
    for step in range(200):
        out = scheduler.schedule()
        connector.build_connector_meta()
        scheduler.update_from_output(out, {s.request.request_id: 1 for s in out.scheduled if s.samples})
        if step == 0:
            assert sorted(scheduler.loading) == ["L1", "L2"] and reqs[2].num_output_tokens == 1
            scheduler.update_kv_transfers(FinishedTransfers(received=[TransferResult(r, None, "pull")
                                                                      for r in ("L1", "L2")]))
        if not scheduler.has_unfinished():
            break
    assert [r.num_output_tokens for r in reqs] == [3, 3, 6], f"no progress after {step + 1} steps"
    assert all(r.status.finished for r in reqs)
    assert scheduler.block_manager.num_free_blocks == 8


def test_a_zero_prefill_cap_holds_prompts_until_the_streams_finish_but_admits_loads():
    """--max-prefill-tokens-while-decoding 0: while S decodes, the local prompt P computes nothing
    (the stream's gaps stay one decode step), while L, whose KV is loaded from elsewhere and which
    arrived first, is admitted at once (loading computes nothing here; the queue stays first come
    first served, so a load behind a held prompt waits with it and the streams drain). Once S has
    finished, P takes its whole prompt in one step: the node's prefill and decode take turns, and
    every request finishes."""
    connector = KVConnectorScheduler(KVTransferConfig(role="decode"), 4, HeldBlocks(math.inf), "D")
    scheduler = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), 8, 16, True, connector=connector,
                          clock=lambda: 0.0, prefill_cap=0)
    stream, prompt, loaded = make_request(list(range(4)), "S", 6), make_request(list(range(8)), "P", 2), \
        loaded_request("L", 8, 3)

    def step() -> list[str]:
        out = scheduler.schedule()
        connector.build_connector_meta()
        scheduler.update_from_output(out, {s.request.request_id: 1 for s in out.scheduled if s.samples})
        return [s.request.request_id for s in out.scheduled]

    scheduler.add(stream)
    assert step() == ["S"] and stream.num_output_tokens == 1  # nothing decoding yet: the prompt runs
    scheduler.add(loaded)
    scheduler.add(prompt)
    assert step() == ["S"] and "L" in scheduler.loading and prompt.num_computed_tokens == 0
    scheduler.update_kv_transfers(FinishedTransfers(received=[TransferResult("L", None, "pull")]))
    while not stream.status.finished:
        step()
        assert prompt.num_computed_tokens == 0
    while prompt.num_computed_tokens == 0:
        step()
    assert prompt.num_computed_tokens == 8  # the whole prompt in one step
    while scheduler.has_unfinished():
        step()
    assert [r.num_output_tokens for r in (stream, prompt, loaded)] == [6, 2, 3]
    assert scheduler.block_manager.num_free_blocks == 64


def test_each_prompt_counts_the_prompt_tokens_of_the_steps_that_prefilled_it():
    """RequestMetrics.prefill_step_tokens: a node taking turns prefills the prompts that waited for
    its stream together, so each one's TTFT covers both prompts' tokens; a prompt alone in its steps
    counts its own; chunks count every chunk of the steps they ran in; a decode step counts nothing."""
    scheduler = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), 8, 12, True, clock=lambda: 0.0,
                          prefill_cap=0)
    stream, a, b = make_request(list(range(4)), "S", 3), make_request(list(range(8)), "A", 1), \
        make_request(list(range(6)), "B", 1)

    def step() -> None:
        out = scheduler.schedule()
        scheduler.update_from_output(out, {s.request.request_id: 1 for s in out.scheduled if s.samples})

    scheduler.add(stream)
    step()  # S alone: its 4 prompt tokens
    scheduler.add(a)
    scheduler.add(b)
    while not stream.status.finished:
        step()  # S decodes; A and B wait for it (prefill and decode take turns)
    assert stream.metrics.prefill_step_tokens == 4 and a.metrics.prefill_step_tokens == 0
    step()  # A's 8 tokens and B's first 4 (a budget of 12)
    step()  # B's last 2
    assert a.metrics.prefill_step_tokens == 12 and b.metrics.prefill_step_tokens == 12 + 2


def test_a_stream_capped_decode_node_holds_ps_first_token_until_a_seat_waits_for_it():
    """max_num_seqs 1: L1's and L2's loads both start (a load takes no seat), and their KV arrives
    together. L1 is seated at the next step, so P's first token streams at once; L2 would wait for
    L1 to finish after its first token, a gap an ITL SLO counts: its first token is held and
    streams with the first token D computes for it, when the client's TTFT is stamped."""
    connector = KVConnectorScheduler(KVTransferConfig(role="decode"), 4, HeldBlocks(math.inf), "D")
    now = [0.0]
    scheduler = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), 1, 16, True, connector=connector,
                          clock=lambda: now[0])
    reqs = [loaded_request("L1", 8, 3), loaded_request("L2", 8, 3)]
    for req in reqs:
        req.kv_transfer_params.first_token_id = 7  # P's first token (pull)
        scheduler.add(req)
    outputs = []

    def step() -> None:
        out = scheduler.schedule()
        connector.build_connector_meta()
        now[0] += 1.0
        outputs.extend(scheduler.update_from_output(out, {s.request.request_id: 1 for s in out.scheduled
                                                          if s.samples}))

    step()
    assert sorted(scheduler.loading) == ["L1", "L2"] and not scheduler.running
    arrived = scheduler.update_kv_transfers(FinishedTransfers(received=[TransferResult(r, None, "pull")
                                                                        for r in ("L1", "L2")]))
    assert [(o.request_id, o.new_token_ids) for o in arrived] == [("L1", [7])]
    assert reqs[1].held_tokens == [7] and reqs[1].metrics.first_token_time == 1.0  # appended, not streamed
    for _ in range(10):
        step()
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("L1", [1]), ("L1", [1]), ("L2", [7, 1]),
                                                                  ("L2", [1])]
    assert reqs[1].metrics.first_token_time == 4.0 and reqs[1].metrics.token_times[:2] == [4.0, 4.0]
    assert all(r.status.finished and r.output_token_ids == [7, 1, 1] for r in reqs)
    assert scheduler.block_manager.num_free_blocks == 64
