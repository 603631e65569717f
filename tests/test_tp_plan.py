"""The TP head layout and the P -> D read plan (pdserve/kv/tp_plan.py), property-tested over TP pairs
and KV head counts: every D head is filled exactly once, from a P rank that holds that very head."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kv.tp_plan import HeadRead, read_plan
from pdserve.models.parallel import check_tp, kv_heads


def valid_tps(num_kv_heads: int) -> list[int]:
    """TP sizes that split K KV heads evenly or replicate them evenly (up to 16 ranks)."""
    return [t for t in range(1, 17) if num_kv_heads % t == 0 or t % num_kv_heads == 0]


@st.composite
def layouts(draw) -> tuple[int, int, int]:
    k = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    return k, draw(st.sampled_from(valid_tps(k))), draw(st.sampled_from(valid_tps(k)))


@given(layouts())
def test_every_d_head_is_read_once_from_a_p_rank_holding_it(layout):
    k, tp_p, tp_d = layout
    plan = read_plan(k, tp_p, tp_d)
    for d in range(tp_d):
        mine = kv_heads(d, tp_d, k)
        filled = [i for r in plan if r.d_rank == d for i in r.d_heads]
        assert sorted(filled) == list(range(len(mine)))  # each local head once
        for r in (r for r in plan if r.d_rank == d):
            source = kv_heads(r.p_rank, tp_p, k)
            assert 0 <= r.p_rank < tp_p and len(r.p_heads) == len(r.d_heads) > 0
            assert [source[i] for i in r.p_heads] == [mine[i] for i in r.d_heads]  # the same global heads


@given(layouts())
def test_the_layout_covers_every_head_evenly(layout):
    k, tp, _ = layout
    held = [h for r in range(tp) for h in kv_heads(r, tp, k)]
    assert set(held) == set(range(k)) and len(held) == max(k, tp)
    assert all(held.count(h) == max(1, tp // k) for h in range(k))  # replicated tp/K times when tp > K


@given(layouts())
def test_the_rules_of_vllms_connector(layout):
    k, tp_p, tp_d = layout
    plan = read_plan(k, tp_p, tp_d)
    if tp_p == tp_d:  # rank i reads all of rank i
        assert plan == [HeadRead(i, i, range(len(kv_heads(i, tp_p, k))), range(len(kv_heads(i, tp_p, k))))
                        for i in range(tp_p)]
    elif tp_d > tp_p and tp_d % tp_p == 0:  # D rank r reads from P rank r // ratio
        assert all(r.p_rank == r.d_rank // (tp_d // tp_p) for r in plan)
    elif tp_d < tp_p and k % tp_p == 0 and tp_p % tp_d == 0:  # D rank r reads from the P ranks holding its heads
        ratio = tp_p // tp_d
        for d in range(tp_d):
            assert [r.p_rank for r in plan if r.d_rank == d] == list(range(d * ratio, (d + 1) * ratio))
    assert {r.d_rank for r in plan} == set(range(tp_d))  # every D rank reads from some P rank


def test_smollm2_and_the_random_config_pairs():
    # SmolLM2: 3 KV heads. P TP 3 -> D TP 1: D reads one head from each P rank; and back.
    assert read_plan(3, 3, 1) == [HeadRead(0, p, range(1), range(p, p + 1)) for p in range(3)]
    assert read_plan(3, 1, 3) == [HeadRead(d, 0, range(d, d + 1), range(1)) for d in range(3)]
    # 2 KV heads, P TP 2 -> D TP 4: D ranks 0, 1 hold head 0 (replicated), read from P rank 0.
    assert [(r.d_rank, r.p_rank) for r in read_plan(2, 2, 4)] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert {r.d_rank for r in read_plan(2, 2, 4) if r.p_rank == 0} == {0, 1}


@pytest.mark.parametrize("tp, heads, kv, message", [
    (2, 9, 3, "does not divide the model's 9 attention heads"),
    (3, 12, 2, "must divide the model's 2 KV heads or be a multiple"),
    (0, 8, 2, ">= 1"),
])
def test_a_tp_size_that_does_not_split_the_model_is_refused(tp, heads, kv, message):
    with pytest.raises(ValueError, match=message):
        check_tp(tp, heads, kv)
    check_tp(3, 9, 3), check_tp(4, 8, 2)  # these split
