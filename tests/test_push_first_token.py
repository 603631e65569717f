"""Push, D's scheduler: D asked for P's first token (send_first_token), so it reserved blocks for
the whole prompt. With the token at the push's end D computes no prompt token; from a P that
sends none (an older P), D computes the last prompt token itself and nothing is lost."""

from __future__ import annotations

import math

from helpers import make_request

from pdserve.config import KVTransferConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler, is_decode
from pdserve.kv.connector import FinishedTransfers, KVConnectorScheduler
from pdserve.kv.holds import HeldBlocks
from pdserve.kv.inbox import TransferResult
from pdserve.kv.params import KVTransferParams

PROMPT = 10  # tokens; blocks of 4


def pushed_to(first_token_id: int | None) -> tuple[Scheduler, list[list[int]], list]:
    """D's scheduler after a push of a 10-token prompt ended: (scheduler, the next step's
    (request, new tokens, a decode) triples, the outputs the push's end gave)."""
    connector = KVConnectorScheduler(KVTransferConfig(role="decode"), 4, HeldBlocks(math.inf), "D")
    scheduler = Scheduler(BlockManager(16, 4, enable_prefix_caching=False), 8, 64, True, connector=connector,
                          clock=lambda: 0.0)
    req = make_request(list(range(100, 100 + PROMPT)), "R", max_tokens=3)
    req.kv_transfer_params = KVTransferParams(do_remote_prefill=True, kv_mode="push", metaserver="http://proxy/meta",
                                              proxy_request_id="x", send_first_token=True)
    scheduler.add(req)
    assert not scheduler.schedule().scheduled  # parked, waiting for the push
    [expect] = connector.build_connector_meta().expects
    assert expect.announcement({}).send_first_token and len(expect.block_ids[0]) == 3  # blocks for all 10 tokens
    assert req.kv_external_tokens == PROMPT
    outputs = scheduler.update_kv_transfers(FinishedTransfers(received=[
        TransferResult("R", None, "push", "shm", first_token_id=first_token_id)]))
    step = [(s.request.request_id, s.num_new_tokens, is_decode(s)) for s in scheduler.schedule().scheduled]
    return scheduler, step, outputs


def test_d_decodes_from_the_token_the_push_ended_with():
    _, step, outputs = pushed_to(first_token_id=42)
    assert [o.new_token_ids for o in outputs] == [[42]]  # the client's first token, as the KV lands
    assert step == [("R", 1, True)]  # a decode step: the token 42 fed, no prompt token computed


def test_without_ps_token_d_computes_the_last_prompt_token():
    scheduler, step, outputs = pushed_to(first_token_id=None)
    assert outputs == []
    assert step == [("R", 1, False)]  # the last prompt token, a prefill row
    [req] = scheduler.running
    assert req.num_computed_tokens == PROMPT - 1 and req.metrics.num_remote_tokens == PROMPT - 1
    assert req.num_output_tokens == 0
