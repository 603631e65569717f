"""Prefix-cache identity and KV events: block hashes, the event log, the block manager's events."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import make_request

from pdserve.engine.block_manager import BlockManager
from pdserve.kv.events import KVEventLog
from pdserve.kv.prefix_hash import block_hashes


def test_block_hashes_chain_and_are_the_same_in_every_process():
    tokens = list(range(1000, 1070))
    hashes = block_hashes(tokens, 16)
    assert len(hashes) == 4 and len(set(hashes)) == 4  # 70 tokens: 4 full blocks
    assert block_hashes(tokens[:40], 16) == hashes[:2]  # a prefix's blocks are the longer prompt's
    assert block_hashes(tokens[:16] + [7] + tokens[17:], 16)[1:] != hashes[1:]  # one token changes all after it
    assert block_hashes(tokens, 16, start=hashes[:3]) == hashes
    code = "import json, sys; from pdserve.kv.prefix_hash import block_hashes; print(json.dumps(block_hashes(list(range(1000, 1070)), 16)))"
    for seed in ("1", "2"):  # hash() of str/bytes changes with the seed; these must not
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert json.loads(out.stdout) == hashes


def test_the_log_numbers_batches_keeps_the_latest_and_shows_gaps():
    log = KVEventLog(block_size=16, max_batches=2)
    log.close_batch()  # nothing happened: no batch
    assert log.page(0).seq == 0 and log.page(0).batches == []
    for h in (11, 12, 13):
        log.stored(h)
        log.close_batch()
    log.removed(11)
    log.close_batch()
    page = log.page(0)
    assert page.seq == 4 and [b.seq for b in page.batches] == [3, 4]  # 1 and 2 dropped: a subscriber at 0 sees the gap
    assert page.batches[0].stored == [13] and page.batches[1].removed == [11]
    assert log.page(3).batches == page.batches[1:] and log.page(4).batches == []
    snapshot = log.snapshot()
    assert (snapshot.seq, snapshot.hashes, snapshot.block_size) == (4, [12, 13], 16)
    log.removed(12)  # evicted while a step scheduled, filed again once computed: still held
    log.stored(12)
    log.close_batch()
    assert log.snapshot().hashes == [12, 13]
    assert KVEventLog(16).epoch != log.epoch  # a restarted node is another epoch


def test_the_block_manager_reports_blocks_filed_and_evicted():
    log = KVEventLog(block_size=4)
    bm = BlockManager(num_blocks=3, block_size=4, events=log)
    a = make_request(list(range(10)), "a")
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    log.close_batch()
    assert log.snapshot().hashes == sorted(block_hashes(a.token_ids, 4))  # two full blocks; the partial one is not filed
    bm.free(a)
    b = make_request([7] * 12, "b")  # takes all three blocks: both cached ones are evicted
    assert bm.allocate(b, 12)
    log.close_batch()
    assert sorted(log.page(1).batches[0].removed) == sorted(block_hashes(a.token_ids, 4))
    assert log.snapshot().hashes == []
