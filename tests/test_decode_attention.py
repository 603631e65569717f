"""pdserve's C++ decode attention (blocks read in place) against the portable SDPA-over-gather path,
and the engine's choice between them."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.model_runner import ModelRunner
from pdserve.models.attention import AttentionMetadata, DecodeGroup, paged_attention


def sdpa_reference(q, kv_cache, tables, lens, scale):
    """The portable path: one decode group with a padding mask, as ModelRunner builds it."""
    block_size = kv_cache.shape[2]
    visible = torch.arange(tables.shape[1] * block_size) < lens.unsqueeze(1)
    mask = torch.zeros(visible.shape, dtype=kv_cache.dtype).masked_fill_(~visible, float("-inf"))
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long),
                             decode_groups=[DecodeGroup(0, len(lens), tables, mask[:, None, None, :])])
    empty = torch.empty(0, *kv_cache.shape[3:], dtype=kv_cache.dtype)
    return paged_attention(q, empty, empty, kv_cache, meta, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",  # GQA groups 3, 1, 8 (the generic path), 2
                         [(9, 3, 64, 16), (4, 4, 32, 8), (16, 2, 128, 32), (6, 3, 64, 16)])
@pytest.mark.parametrize("partition_blocks", [1, 3, 1000])
def test_kernel_equals_sdpa_over_gathered_blocks(ops, dtype, heads, kv_heads, head_dim, block_size, partition_blocks):
    torch.manual_seed(heads * block_size + partition_blocks)
    num_blocks = 300
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(dtype)
    # One token, a full block, one past it, a long context; tables scattered over the pool.
    lens = torch.tensor([1, block_size, block_size + 1, 37 * block_size - 5])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    ops.paged_decode_attention(q, kv_cache, tables, lens, out, scale, partition_blocks)
    expected = sdpa_reference(q, kv_cache, tables, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: SDPA rounds its output, the kernel once at the end
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefetch_distance_changes_no_bit(ops, block_size):
    """Prefetches only ask for lines early: at any distance (none, less than a block, the default
    32 tokens, several blocks) the output is the same bit for bit. A negative distance is refused."""
    torch.manual_seed(block_size)
    kv_cache = torch.randn(2, 200, block_size, 3, 64).bfloat16()
    lens = torch.tensor([5, 40 * block_size // 16, 1500 // (block_size // 16)])
    tables = torch.stack([torch.randperm(200)[:-(-int(lens.max()) // block_size)] for _ in lens])
    q = torch.randn(len(lens), 9, 64).bfloat16()
    outs = []
    previous = ops.set_prefetch_tokens(32)
    try:
        for tokens in (32, 0, 8, 64, 512):
            assert ops.set_prefetch_tokens(tokens) in (32, 0, 8, 64, 512)
            out = torch.empty_like(q)
            ops.paged_decode_attention(q, kv_cache, tables, lens, out, 64**-0.5, 8)
            outs.append(out)
        with pytest.raises(RuntimeError, match="prefetch tokens must be >= 0"):
            ops.set_prefetch_tokens(-1)
    finally:
        ops.set_prefetch_tokens(previous)
    assert previous == 32  # the default: 2 blocks of 16 ahead
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    torch.testing.assert_close(outs[0].float(), sdpa_reference(q, kv_cache, tables, lens, 64**-0.5).float(),
                               atol=1e-2, rtol=1e-2)


def test_kernel_refuses_bad_input_with_a_message(ops):
    kv_cache = torch.zeros(2, 4, 16, 2, 32)
    q, lens, tables = torch.zeros(1, 4, 32), torch.tensor([3]), torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="int64"):
        ops.paged_decode_attention(q, kv_cache, tables.int(), lens, torch.empty_like(q), 1.0, 8)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        ops.paged_decode_attention(torch.zeros(1, 3, 32), kv_cache, tables, lens, torch.zeros(1, 3, 32), 1.0, 8)


def test_partitions_feed_every_thread_at_batch_one(ops):
    runner = ModelRunner.__new__(ModelRunner)  # only the group builder: no model needed
    runner.device, runner.kv_cache = torch.device("cpu"), torch.zeros(1, 2, 1, 16, 3, 64)
    group = runner._kernel_group([list(range(128))], [2048])  # 128 blocks, 3 KV heads
    units = -(-128 // group.partition_blocks)  # a unit: a partition of the sequence, all its KV heads
    assert units >= 4 * torch.get_num_threads() or group.partition_blocks == 8
    assert group.context_lens.tolist() == [2048] and group.block_tables.shape == (1, 128)


def test_engine_decodes_on_the_kernel_and_equals_the_portable_path(ops, smollm_dir, monkeypatch):
    """Same greedy tokens over a long context (float32, unquantized) on the C++ kernels (decode
    attention and the fused elementwise ops) and on the portable torch path."""
    prompt = list(range(1000, 1000 + 700))  # several partitions of 8 blocks
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    native = LLM(str(smollm_dir), dtype="float32", quantization="none", kv_cache_memory_gib=0.05)
    assert native.engine.labels()["attention"] == "native"
    assert native.engine.labels()["prefill_attention"] == "sdpa"  # float32: the prefill kernel is bf16's
    expected = native.generate([prompt, prompt[:90]], params)
    monkeypatch.setenv("PDSERVE_KERNELS", "portable")
    portable = LLM(str(smollm_dir), dtype="float32", quantization="none", kv_cache_memory_gib=0.05)
    assert portable.engine.labels()["attention"] == "sdpa"
    got = portable.generate([prompt, prompt[:90]], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def windowed_reference(q, kv_cache, tables, lens, scale, window):
    """float64: each row attends to the last `window` positions of its context, from its table."""
    out = []
    for i, n in enumerate(lens.tolist()):
        kv = kv_cache[:, tables[i]].flatten(1, 2).double()  # [2, L, KVH, D]
        keys, values = kv[0, max(0, n - window) : n], kv[1, max(0, n - window) : n]
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [W, H, D]
        probs = (torch.einsum("hd,whd->hw", q[i].double(), keys) * scale).softmax(-1)
        out.append(torch.einsum("hw,whd->hd", probs, values))
    return torch.stack(out)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpp", "sdpa"])
@pytest.mark.parametrize("window", [1, 16, 40])
def test_a_sliding_window_reads_only_its_last_positions(ops, kernel, window):
    """Kernel and portable path alike: the last `window` positions of each context and nothing
    before them; blocks wholly before the window are never read (they hold NaN here)."""
    torch.manual_seed(window)
    heads, kv_heads, head_dim, block_size, num_blocks = 8, 2, 64, 16, 64
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    kv_cache[:, 0] = float("nan")  # block 0: what a dropped block's table entry points at
    lens = torch.tensor([1, window, window + 1, 5 * block_size + 3])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks - 1)[:width] + 1 for _ in lens])
    for i, n in enumerate(lens.tolist()):
        tables[i, : max(0, n - window) // block_size] = 0  # wholly before the window
    q = torch.randn(len(lens), heads, head_dim)
    scale = head_dim**-0.5
    expected = windowed_reference(q, kv_cache, tables, lens, scale, window)
    if kernel:
        out = torch.full_like(q, float("nan"))
        ops.paged_decode_attention(q, kv_cache, tables, lens, out, scale, 2, window)
    else:
        visible = torch.arange(width * block_size) < lens.unsqueeze(1)
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        group = DecodeGroup(0, len(lens), tables, mask[:, None, None, :], lens)
        meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), decode_groups=[group])
        empty = torch.empty(0, kv_heads, head_dim)
        out = paged_attention(q, empty, empty, kv_cache.nan_to_num(0.0), meta, scale, window)  # SDPA reads it all
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_a_kernel_build_lock_left_by_a_killed_build_is_removed(tmp_path):
    """torch waits for ever on its build lock: one older than any build is a killed build's, and
    goes; a fresh one (a build running in another process now) stays."""
    import os
    import time

    from pdserve.models.native import STALE_BUILD_LOCK_S, remove_stale_lock

    stale, fresh = tmp_path / "stale" / "lock", tmp_path / "fresh" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - STALE_BUILD_LOCK_S - 60
    os.utime(stale, (old, old))
    remove_stale_lock(stale)
    remove_stale_lock(fresh)
    remove_stale_lock(tmp_path / "none" / "lock")  # no lock: nothing to do
    assert not stale.exists() and fresh.exists()


def test_two_checkouts_build_their_kernels_apart(monkeypatch, tmp_path):
    """The same sources at another path (a CI clone beside a work tree) get a build directory of
    their own: torch rebuilds one whose recorded source paths differ, so sharing it rebuilt mid-run."""
    from pdserve.models import native

    here = native.build_dir()
    assert native.build_dir() == here  # stable
    monkeypatch.setattr(native, "CSRC", tmp_path / "csrc")
    assert native.build_dir() != here and native.build_dir().parent == here.parent


@pytest.mark.parametrize("window", [8, 40, 300])
@pytest.mark.parametrize("cached", [0, 37, 200], ids=["fresh", "cached37", "cached200"])
def test_a_sliding_prefill_in_tiles_equals_one_masked_attention(window, cached, monkeypatch):
    """A sliding layer's prefill chunk attends in query tiles, each over the keys its window reaches
    (gathered from the block of the first query's window on): equal to one attention over the
    whole context with the band mask, for chunks after `cached` tokens already in the pool (their
    blocks before the window are the null block, NaN here: never read)."""
    import pdserve.models.attention as attention

    monkeypatch.setattr(attention, "PREFILL_TILE", 16)  # many tiles, each shorter than some windows
    torch.manual_seed(window + cached)
    heads, kv_heads, head_dim, block_size, n = 4, 2, 32, 16, 150
    ctx = cached + n
    width = -(-ctx // block_size)
    kv_cache = torch.zeros(2, width + 1, block_size, kv_heads, head_dim)
    table = torch.arange(1, width + 1)  # block 0 stays the null block
    k, v = torch.randn(ctx, kv_heads, head_dim), torch.randn(ctx, kv_heads, head_dim)
    slots = table[torch.arange(ctx) // block_size] * block_size + torch.arange(ctx) % block_size
    kv_cache[0].view(-1, kv_heads, head_dim)[slots] = k
    kv_cache[1].view(-1, kv_heads, head_dim)[slots] = v
    first_read = max(0, cached - window + 1) // block_size
    table[:first_read] = 0
    kv_cache[:, 0] = float("nan")
    q = torch.randn(n, heads, head_dim)
    scale = head_dim**-0.5
    chunk = attention.PrefillChunk(0, n, ctx, table if cached else None)
    meta = AttentionMetadata(slot_mapping=slots[cached:], prefills=[chunk])
    out = paged_attention(q, k[cached:], v[cached:], kv_cache, meta, scale, window)
    # Reference: float64, every query over the whole context with the band mask.
    keys, values = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    offset = torch.arange(ctx).unsqueeze(0) - torch.arange(cached, ctx).unsqueeze(1)
    scores = scores.masked_fill(~((offset <= 0) & (offset > -window)), float("-inf"))
    expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
