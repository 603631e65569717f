"""The scheduler's steady decode runs (Scheduler.steady_decode_steps / advance_decode_steps): k steps
of one batch taken at once give what k scheduled steps give, on workloads that preempt, hit the
prefix cache, stop on a token, reach max_tokens and max_model_len, and see requests arrive."""

from __future__ import annotations

import random
import zlib

import pytest
from helpers import make_request

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.sampling_params import SamplingParams

EOS = 7


def token_at(rid: str, position: int) -> int:
    """The token a request samples at a position: fixed by both, so both runs see the same answers;
    a twin ("r5 twin") samples what its first does."""
    rid = rid.removesuffix(" twin")
    return 10 + zlib.crc32(f"{rid}:{position}".encode()) % 90 if (position * 31 + len(rid)) % 23 else EOS


def workload(seed: int) -> list[tuple[int, str, list[int], SamplingParams, int]]:
    """(arrival step, id, prompt, params, max_model_len) of 14 requests and 3 twins (the same
    prompt, at the same step, the same answer: blocks of equal hashes filled side by side); some
    share a prompt prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 100) for _ in range(12)]
    found = []
    for i in range(14):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1, 100) for _ in range(rng.randrange(1, 30))]
        arrival = rng.randrange(0, 30)
        if i % 4 == 3:  # a next turn: the previous request's prompt and its first answers, and more
            before, last_arrival = found[-1][2], found[-1][0]
            prompt = before + [token_at(f"r{i - 1}", len(before) + j) for j in range(8)] + prompt[:5]
            arrival = last_arrival + 3  # while that one still decodes
        stops = i % 4 == 1  # this one stops at EOS; the others ignore it
        params = SamplingParams(max_tokens=rng.randrange(1, 40) if i % 4 != 2 else 30, ignore_eos=not stops)
        found.append((arrival, f"r{i}", prompt, params, 60 if i % 5 == 2 else 10_000))
    for i in (0, 5, 10):
        arrival, rid, prompt, params, max_len = found[i]
        found.append((arrival, f"{rid} twin", prompt, params, max_len))
    return found


def run(seed: int, blocks: int, prefix_caching: bool, steady: bool) -> tuple[dict, int, set, int]:
    step = 0
    scheduler = Scheduler(BlockManager(blocks, 4, enable_prefix_caching=prefix_caching), 6, 24, True,
                          clock=lambda: float(step))
    pending = sorted(workload(seed), key=lambda w: w[0])  # (stable: a twin after its first)
    requests, runs = {}, 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params, max_len = pending.pop(0)
            req = requests[rid] = make_request(prompt, rid, params=params, eos_token_ids=(EOS,))
            req.max_model_len = max_len
            scheduler.add(req)
        out = scheduler.schedule()
        most = (pending[0][0] - step if pending else 1000) if steady else 1  # a run ends where a request arrives
        for s in out.scheduled:  # ... and with a token that stops its request
            req = s.request
            ahead = [token_at(req.request_id, req.num_tokens + j) for j in range(most)]
            if not req.params.ignore_eos and EOS in ahead:
                most = min(most, ahead.index(EOS) + 1)
        k = scheduler.steady_decode_steps(out, most) if steady and most > 1 else 1
        if k > 1:
            runs += 1
            tokens = {s.request.request_id: [token_at(s.request.request_id, s.request.num_tokens + j) for j in range(k)]
                      for s in out.scheduled}
            scheduler.advance_decode_steps(out, tokens, [float(step + 1 + j) for j in range(k)])
            step += k
        else:
            step += 1
            scheduler.update_from_output(out, {s.request.request_id: token_at(s.request.request_id, s.request.num_tokens)
                                               for s in out.scheduled if s.samples})
    manager = scheduler.block_manager
    seen = {rid: (r.token_ids, r.metrics.token_times, r.finish_reason, r.metrics.num_preemptions)
            for rid, r in requests.items()}
    # The pool as it ends, block by block: which block caches which hash, the free list's order.
    return seen, list(manager.free_blocks), dict(manager.cached_blocks), runs


# (4, 24) and (10, 28): next turns wait for blocks while their history decodes and fills cached blocks.
@pytest.mark.parametrize("seed, blocks, prefix_caching", [(0, 200, True), (1, 200, False), (2, 40, True),
                                                          (3, 28, False), (4, 60, True), (4, 24, True),
                                                          (10, 28, True)])
def test_runs_of_steady_steps_equal_the_steps_one_by_one(seed, blocks, prefix_caching):
    by_step, free, cached, _ = run(seed, blocks, prefix_caching, steady=False)
    by_run, free_after_runs, cached_after_runs, runs = run(seed, blocks, prefix_caching, steady=True)
    assert runs > 0  # the fast path was taken
    assert by_run == by_step
    assert (free_after_runs, cached_after_runs) == (free, cached)  # block for block
    assert {reason for _, _, reason, _ in by_step.values()} >= {"stop", "length"}
    if blocks <= 40:  # the small pools preempt
        assert any(preempted for _, _, _, preempted in by_step.values())


def test_a_run_is_refused_where_the_batch_would_change():
    scheduler = Scheduler(BlockManager(64, 4), 8, 16, True, clock=lambda: 0.0)
    a, b = make_request([1, 2, 3], "a", max_tokens=10), make_request([4, 5], "b", max_tokens=3)
    stopping = make_request([6], "c", params=SamplingParams(max_tokens=10), eos_token_ids=(EOS,))
    for req in (a, b, stopping):
        scheduler.add(req)
    out = scheduler.schedule()  # the prompts: not a decode step
    assert scheduler.steady_decode_steps(out, 50) == 1
    with pytest.raises(ValueError, match="not a steady decode batch"):
        scheduler.advance_decode_steps(out, {"a": [1], "b": [1], "c": [1]}, [1.0])
    scheduler.update_from_output(out, {"a": 11, "b": 12, "c": 13})
    out = scheduler.schedule()
    assert scheduler.steady_decode_steps(out, 50) == 2  # b ends with its 3rd token
    with pytest.raises(ValueError, match="request b ends before step 3"):
        scheduler.advance_decode_steps(out, {"a": [1, 2, 3], "b": [1, 2, 3], "c": [1, 2, 3]}, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="request c may stop before step 2"):
        scheduler.advance_decode_steps(out, {"a": [1, 2], "b": [1, 2], "c": [EOS, 2]}, [1.0, 2.0])
    outputs = scheduler.advance_decode_steps(out, {"a": [1, 2], "b": [1, 2], "c": [1, EOS]}, [1.0, 2.0])
    assert [(o.new_token_ids, o.finished) for o in outputs] == [([1, 2], False), ([1, 2], True), ([1, EOS], True)]
    assert scheduler.running == [a] and a.metrics.token_times == [0.0, 1.0, 2.0]


def test_no_run_where_a_sliding_window_gives_blocks_back():
    """A sliding group frees the blocks its window leaves, so a waiting request may fit mid-run."""
    scheduler = Scheduler(BlockManager(64, 4, group_windows=(0, 8)), 8, 16, True, clock=lambda: 0.0)
    scheduler.add(make_request([1, 2, 3], "a", max_tokens=10))
    scheduler.update_from_output(scheduler.schedule(), {"a": 11})
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [1] and scheduler.steady_decode_steps(out, 50) == 1
