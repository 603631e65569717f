"""Where a decode rank reads its KV heads from when P and D run different TP sizes (the rule of
vLLM's NixlConnector). Which heads each rank holds is the model's layout (models/parallel.py:
`kv_heads`).

`read_plan(K, tp_p, tp_d)` is a pure function of the three numbers (property-tested in
tests/test_tp_plan.py). Each D rank reads each of its heads from the P rank "in proportion",
p = d tp_p // tp_d, when that rank holds it, else from a copy chosen by d; so:
- same TP: rank i reads all of rank i;
- D's TP larger: D rank r reads its slice from P rank r // (tp_d / tp_p);
- D's TP smaller: D rank r reads from the several P ranks whose heads it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.models.parallel import kv_heads


@dataclass(frozen=True)
class HeadRead:
    """D rank `d_rank` copies P rank `p_rank`'s local heads `p_heads` into its local heads `d_heads`."""

    d_rank: int
    p_rank: int
    p_heads: range
    d_heads: range


def read_plan(num_kv_heads: int, tp_p: int, tp_d: int) -> list[HeadRead]:
    """Every D rank's reads, in D rank order, each a run of consecutive heads from one P rank."""
    plan: list[HeadRead] = []
    for d in range(tp_d):
        for local, head in enumerate(kv_heads(d, tp_d, num_kv_heads)):
            p = _source(head, d, num_kv_heads, tp_p, tp_d)
            p_local = head - kv_heads(p, tp_p, num_kv_heads).start
            last = plan[-1] if plan else None
            if last and last.d_rank == d and last.p_rank == p and last.p_heads.stop == p_local:
                plan[-1] = HeadRead(d, p, range(last.p_heads.start, p_local + 1),
                                    range(last.d_heads.start, local + 1))
            else:
                plan.append(HeadRead(d, p, range(p_local, p_local + 1), range(local, local + 1)))
    return plan


def _source(head: int, d: int, num_kv_heads: int, tp_p: int, tp_d: int) -> int:
    """The P rank D rank d reads `head` from: the proportional one if it holds it, else a copy by d."""
    proportional = d * tp_p // tp_d
    if head in kv_heads(proportional, tp_p, num_kv_heads):
        return proportional
    holders = [p for p in range(tp_p) if head in kv_heads(p, tp_p, num_kv_heads)]
    return holders[d % len(holders)]


@dataclass(frozen=True)
class Piece:
    """One read of the plan as one side sees it: a run of KV heads moved between this node's TP rank
    `rank` (its local heads `heads`) and the peer's rank `peer_rank` (`peer_heads`)."""

    rank: int
    heads: range
    peer_rank: int
    peer_heads: range


def pieces(num_kv_heads: int, tp_p: int, tp_d: int, producer: bool) -> list[Piece]:
    """The read plan from P's side (`producer`) or D's. Both sides list it in the same order, which
    is the order of the bytes on a tcp stream. ValueError if a TP size cannot split the heads."""
    for side, tp in (("prefill", tp_p), ("decode", tp_d)):
        if tp < 1 or (num_kv_heads % tp and tp % num_kv_heads):
            raise ValueError(f"the {side} node's TP size {tp} cannot split the model's {num_kv_heads} KV heads")
    return [Piece(r.p_rank, r.p_heads, r.d_rank, r.d_heads) if producer else
            Piece(r.d_rank, r.d_heads, r.p_rank, r.p_heads) for r in read_plan(num_kv_heads, tp_p, tp_d)]
