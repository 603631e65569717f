"""Owns the model and its KV pool; turns a scheduled batch into one forward pass and samples."""

from __future__ import annotations

import torch

from pdserve.engine.logits import apply_logit_controls
from pdserve.engine.sampler import sample, token_logprobs
from pdserve.engine.scheduler import ScheduledRequest, SchedulerOutput, is_decode
from pdserve.engine.tp_workers import TPWorkers
from pdserve.kv.pool import KVPool
from pdserve.models.attention import (AttentionMetadata, DecodeGroup, DecodeKernel, PrefillChunk, PrefillKernel,
                                      RowsAlone)
from pdserve.models.batch_invariant import INVARIANT_PARTITION_BLOCKS
from pdserve.models.contract import LayerHook


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool, device: str, decode_kernel: DecodeKernel | None = None,
                 tp_workers: TPWorkers | None = None, batch_invariant: bool = False,
                 prefill_kernel: PrefillKernel | None = None):
        self.model = model
        self.batch_invariant = batch_invariant  # every row attends alone (models/batch_invariant.py)
        self.tp_workers = tp_workers  # TP: the other ranks run each step's forward pass with this one
        self.decode_kernel = decode_kernel  # None: SDPA over gathered blocks
        self.prefill_kernel = prefill_kernel  # None: SDPA
        self.pool = pool
        self.block_size = pool.block_size
        self.device = torch.device(device)
        self.kv_cache = pool.tensor
        self.kv_caches = pool.layer_caches()
        # The queries' dtype (the KV cache may keep another: --kv-cache-dtype), which SDPA's masks take.
        self.compute_dtype = getattr(model, "compute_dtype", pool.tensor.dtype)
        # Each KV group's attention window; every layer reads its group's metadata (pool.layer_groups).
        self.group_windows = [group.window for group in pool.groups]

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, after_layer: LayerHook | None = None) -> dict[str, int]:
        """Compute the scheduled tokens; return the sampled next token of each request that samples."""
        if not out.scheduled:
            return {}
        # Decodes first, shortest context first: they share batched SDPAs by groups of similar length.
        batch = sorted(out.scheduled, key=lambda s: (not is_decode(s), s.request.num_computed_tokens))
        input_ids, positions, metas = self._prepare(batch)
        if self.tp_workers is not None:
            self.tp_workers.step(input_ids, positions, metas)
        meta = metas[0]
        layer_metas = [metas[g] for g in self.pool.layer_groups] if len(metas) > 1 else meta
        hidden = self.model(input_ids, positions, self.kv_caches, layer_metas, after_layer)
        self._prompt_logprobs(batch, hidden)
        samplers, last_index, offset = [], [], 0
        for s in batch:
            offset += s.num_new_tokens
            # A request for no tokens (echo's scoring call: max_tokens 0) computes its prompt, samples nothing.
            if s.samples and s.request.params.max_tokens > 0:
                samplers.append(s)
                last_index.append(offset - 1)
        if not samplers:
            return {}
        # Decodes always sample, so they are the first rows of the logits too.
        logits = self.model.compute_logits(hidden[torch.tensor(last_index, device=self.device)], meta.num_decodes)
        reporting = [i for i, s in enumerate(samplers) if s.request.params.logprobs is not None]
        raw = logits[reporting] if reporting else None  # a copy, taken before the controls change the rows in place
        logits = apply_logit_controls(logits, [s.request for s in samplers])
        tokens = sample(logits, [s.request.params for s in samplers], [s.request.generator for s in samplers])
        if reporting:
            reports = token_logprobs(raw, [tokens[i] for i in reporting],
                                     [samplers[i].request.params.logprobs for i in reporting])
            for i, report in zip(reporting, reports):
                samplers[i].request.logprobs.append(report)  # the scheduler appends its token next
        return {s.request.request_id: t for s, t in zip(samplers, tokens)}

    def _prompt_logprobs(self, batch: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """For requests that ask (params.prompt_logprobs): the logprob of each prompt token this
        step's chunk predicts (row j of a chunk starting at position p predicts the token at p+j+1;
        the first prompt token has none). A preempted request computing its prompt again starts over."""
        offset = 0
        for s in batch:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            k = req.params.prompt_logprobs
            last = min(start + n, req.num_prompt_tokens - 1)  # the last prompt position this chunk predicts
            if k is not None and start < req.num_prompt_tokens:
                if start == 0:
                    req.prompt_logprobs = [None]
                if last > start:
                    rows = torch.arange(offset, offset + last - start, device=self.device)
                    logits = self.model.compute_logits(hidden[rows])
                    req.prompt_logprobs.extend(token_logprobs(logits, req.token_ids[start + 1 : last + 1],
                                                              [k] * (last - start)))
            offset += n

    def _prepare(self, batch: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata]]:
        """The step's token ids and positions, and each KV group's attention metadata."""
        ids: list[int] = []
        pos: list[torch.Tensor] = []
        for s in batch:
            start, n = s.request.num_computed_tokens, s.num_new_tokens
            ids.extend(s.request.token_ids[start : start + n])
            pos.append(torch.arange(start, start + n))
        metas = [self._group_meta(batch, g) for g in range(len(self.group_windows))]
        return torch.tensor(ids, device=self.device), torch.cat(pos).to(self.device), metas

    def _group_meta(self, batch: list[ScheduledRequest], group: int) -> AttentionMetadata:
        """Where the step's new tokens go and what they read, in the block tables of one KV group."""
        bs, dev = self.block_size, self.device
        slots: list[int] = []  # plain ints: one tensor per group and step (there are several groups)
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        first = 0
        for s in batch:
            req, start, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            block_ids = req.block_tables[group]
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, start + n))
            if is_decode(s):
                decode_tables.append(block_ids)
                decode_lens.append(start + 1)
            else:
                cached = torch.tensor(block_ids, device=dev) if start > 0 else None
                prefills.append(PrefillChunk(first, first + n, start + n, cached))
            first += n
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, device=dev), prefills=prefills,
                                 num_decodes=len(decode_lens), decode_kernel=self.decode_kernel,
                                 prefill_kernel=self.prefill_kernel)
        window = self.group_windows[group]
        if self.batch_invariant:  # every row attends alone, in place of the chunks and groups
            meta.prefills, meta.rows_alone = [], self._rows_alone(batch, group)
        elif self.decode_kernel is not None and decode_lens:  # one group: the kernel pads nothing
            meta.decode_groups.append(self._kernel_group(decode_tables, decode_lens))
        else:
            for start, end in decode_groups(decode_lens):
                meta.decode_groups.append(self._decode_group(start, end, decode_tables[start:end],
                                                             decode_lens[start:end], window))
        return meta

    def _rows_alone(self, batch: list[ScheduledRequest], group: int) -> RowsAlone:
        tables, lens, sequences = [], [], []
        for s in batch:
            start, n = s.request.num_computed_tokens, s.num_new_tokens
            sequences.append((len(lens), len(lens) + n))
            tables += [s.request.block_tables[group]] * n
            lens += range(start + 1, start + n + 1)
        return RowsAlone(self._padded(tables), torch.tensor(lens, device=self.device), INVARIANT_PARTITION_BLOCKS,
                         sequences)

    def _padded(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables as one [n, longest] int64 tensor, zero-padded (padding is never read)."""
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=self.device)

    def _kernel_group(self, tables: list[list[int]], lens: list[int]) -> DecodeGroup:
        padded = self._padded(tables)
        width = padded.shape[1]
        # Split long contexts so that every thread has work even at batch 1 (4 units per thread),
        # in partitions of at least MIN_PARTITION_BLOCKS (merging partitions costs too). A unit is a
        # sequence's partition (all its KV heads: the kernel's AVX-512 path reads a block's heads together).
        units = len(lens)
        wanted = -(-4 * torch.get_num_threads() // units)
        partition = max(MIN_PARTITION_BLOCKS, -(-width // wanted))
        return DecodeGroup(0, len(lens), padded, context_lens=torch.tensor(lens, device=self.device),
                           partition_blocks=partition)

    def _decode_group(self, start: int, end: int, tables: list[list[int]], lens: list[int], window: int) -> DecodeGroup:
        bs, dev = self.block_size, self.device
        padded = self._padded(tables)
        width = padded.shape[1]
        # Additive mask (0 / -inf) over the padded context, built once for all layers of the group:
        # past each context's end hidden, and for a sliding group what lies before its window too.
        context = torch.tensor(lens, device=dev).unsqueeze(1)
        positions = torch.arange(width * bs, device=dev)
        visible = (positions < context) & (positions >= context - window) if window else positions < context
        mask = torch.zeros(visible.shape, dtype=self.compute_dtype, device=dev).masked_fill_(~visible, float("-inf"))
        return DecodeGroup(start, end, padded, mask[:, None, None, :], torch.tensor(lens, device=dev), window=window)


MIN_PARTITION_BLOCKS = 8  # C++ decode attention: the fewest context blocks one work unit reads
MIN_GROUP_CONTEXT = 512  # below this, one more SDPA costs more than the padding it saves


def decode_groups(lens: list[int]) -> list[tuple[int, int]]:
    """Split decodes sorted by context length into [start, end) runs whose longest context is at
    most twice the shortest (or under MIN_GROUP_CONTEXT): padding costs at most 2x per run."""
    groups, start = [], 0
    for i in range(1, len(lens) + 1):
        if i == len(lens) or (lens[i] > 2 * lens[start] and lens[i] > MIN_GROUP_CONTEXT):
            groups.append((start, i))
            start = i
    return groups
