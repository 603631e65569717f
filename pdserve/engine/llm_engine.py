"""The engine: requests in, one step at a time (schedule -> run the model -> update), outputs out."""

from __future__ import annotations

import itertools
import logging
import time

import msgspec
import torch

from pdserve.config import EngineConfig, prefill_cap_label
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.grammar import Grammars
from pdserve.engine.messages import CheckedRequest, DecodeSteps, EngineInfo, EngineStats, RequestOutput
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.rank import RankSpec, set_up_rank
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler, SchedulerOutput, is_decode
from pdserve.engine.tp_workers import TPWorkers, tp_threads
from pdserve.kv.connector import FinishedTransfers, KVConnectorScheduler, KVConnectorWorker, new_engine_id
from pdserve.kv.events import KVEventLog, KVEventPage, KVSnapshot
from pdserve.kv.holds import HeldBlocks
from pdserve.kv.params import KVTransferParams, wants_remote_prefill
from pdserve.kv.pool import KVPool
from pdserve.kv.stats import KVStats, KVStatsSnapshot
from pdserve.kv.transport import uses_shared_pool
from pdserve.models.attention import prefill_kernel_takes
from pdserve.models.loader import kv_cache_spec
from pdserve.models.locate import resolve_model_dir
from pdserve.models.parallel import TensorParallel
from pdserve.models.native import native_ops
from pdserve.models.quantization import resolve_quantization
from pdserve.models.registry import model_class, read_model_config
from pdserve.models.tokenizer import Tokenizer
from pdserve.platform import plan_kernels
from pdserve.sampling_params import InvalidParameter, SamplingParams

logger = logging.getLogger(__name__)

MAX_DEFAULT_MODEL_LEN = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # dtype and kernels from what the device supports; a slower path asked for is said once here.
        self.plan = plan_kernels(config.dtype, config.device, config.kernels)
        logger.info("kernels: %s", self.plan.describe())
        if self.plan.warning:
            logger.warning(self.plan.warning)
        self.model_dir = resolve_model_dir(config.model)
        self.model_config = mc = read_model_config(self.model_dir)
        self.tokenizer = Tokenizer(self.model_dir)
        self.eos_token_ids = mc.eos_token_ids or (
            (self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ()
        )
        self.grammars = Grammars(self.tokenizer.to_json(), mc.vocab_size, self.eos_token_ids)  # structured output
        # Tensor parallelism: this process is rank 0 (it schedules); ranks 1.. are started below.
        self.tp = TensorParallel(0, config.tensor_parallel_size)
        self.tp.check(mc.num_heads, mc.num_kv_heads, mc.intermediate_size)
        self.kv_dtype = self._kv_dtype(config.kv_cache_dtype, model_class(mc))
        self.kv_spec = kv_cache_spec(mc, self.kv_dtype, self.tp)  # what the model keeps per token (this rank's heads)
        num_blocks = config.num_kv_blocks or int(config.kv_cache_memory_gib * 2**30 // self._bytes_per_block)
        chunk = config.max_num_batched_tokens if config.enable_chunked_prefill else None
        self.max_model_len = self._max_model_len(self.kv_spec.capacity_tokens(num_blocks, config.block_size, chunk))
        # Without chunking a whole prompt must fit one step's budget.
        self.max_num_batched_tokens = (config.max_num_batched_tokens if config.enable_chunked_prefill
                                       else max(config.max_num_batched_tokens, self.max_model_len))
        # Weight-only quantization for decode: `auto` serves a Q4 GGUF as int4 (models/quantization.py).
        self.quantization = resolve_quantization(config.quantization, mc.gguf_weight_type, config.device)
        self.pools = self._make_pools(num_blocks)
        self.pool = self.pools[0]
        # TP ranks share the machine's cores: each takes its share unless told (oversubscribed, every
        # all-reduce waits for the slowest rank).
        self.threads = config.threads or (tp_threads(self.tp.size) if self.tp.size > 1 else None)
        rank_spec = RankSpec(str(self.model_dir), self.plan.torch_dtype, config.device, self.max_model_len,
                             self.plan.prepack, self.quantization, self.plan.compiled, num_blocks, config.block_size,
                             self.threads, config.batch_invariant,
                             tuple(pool.shm_name for pool in self.pools) if len(self.pools) > 1 else (),
                             kv_dtype=self.kv_dtype)
        self.tp_workers: TPWorkers | None = None
        self.connector_worker: KVConnectorWorker | None = None
        try:
            if self.tp.size > 1:
                self.tp_workers = TPWorkers(rank_spec, self.tp.size)
            model, kernel, prefill_kernel = set_up_rank(rank_spec, self.tp)
        except BaseException:
            self.close()
            raise
        self.engine_id = new_engine_id()
        self.kv_stats = KVStats()
        self.connector, self.connector_worker = self._kv_connector()
        self.kv_events = KVEventLog(config.block_size)
        self.decode_steps = DecodeSteps()
        self.busy_seconds = 0.0  # in steps that computed something: a node's utilisation (the dashboard's)
        # This thread's CPU time in those steps: below busy_seconds by the time other work held its core.
        self.busy_cpu_seconds = 0.0
        self._computed = False  # this step's batch was not empty
        self._decode_batch: tuple[int, int] | None = None  # the step now running: (seqs, KV tokens) if it only decodes
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, self.kv_events,
                                          self.kv_spec.group_windows)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, self.max_num_batched_tokens, config.enable_chunked_prefill,
            self.connector, self.kv_stats, config.kv_transfer.load_failure_policy,
            prefill_cap=config.max_prefill_tokens_while_decoding,
        )
        paged = model.decode_attention == "paged"  # the K/V paged attention (models/attention.py), else the model's own
        self.attention = "native" if kernel is not None else "sdpa" if paged else model.decode_attention
        windows = self.kv_spec.layer_windows or (0,)
        self.prefill_attention = "native" if prefill_kernel is not None and any(
            prefill_kernel_takes(self.plan.torch_dtype, self.kv_spec.head_dim, w) for w in windows) else "sdpa"
        self.model_runner = ModelRunner(model, self.pool, config.device, kernel, self.tp_workers, config.batch_invariant,
                                        prefill_kernel)
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._ids = itertools.count()
        logger.info(
            "engine ready: %s, %s, quantization %s, %s decode attention, %d KV blocks x %d tokens (%.0f MiB), max_model_len %d",
            self.model_dir.name, self.plan.dtype, self.quantization, self.attention, num_blocks, config.block_size,
            num_blocks * self._bytes_per_block / 2**20, self.max_model_len,
        )

    # -- set-up ---------------------------------------------------------------------------------

    @property
    def _bytes_per_block(self) -> int:
        return self.config.block_size * self.kv_spec.bytes_per_block_token

    def _max_model_len(self, capacity: int) -> int:
        """The asked max_model_len, checked against the model and the KV pool's `capacity` tokens;
        unasked, the most both allow (at most MAX_DEFAULT_MODEL_LEN)."""
        asked, model_len = self.config.max_model_len, self.model_config.max_position_embeddings
        if asked is None:
            return min(model_len, MAX_DEFAULT_MODEL_LEN, capacity)
        if asked > model_len:
            raise ValueError(f"max_model_len {asked} exceeds the model's context length {model_len}")
        if asked > capacity:
            raise ValueError(f"max_model_len {asked} does not fit the KV pool ({capacity} tokens); "
                             "raise the KV cache memory or lower max_model_len")
        return asked

    def _make_pools(self, num_blocks: int) -> list[KVPool]:
        """P and D keep their pools in shared memory when a transport may need it (shm: a peer on
        this host copies blocks with one memcpy, D out of P's pool, P into D's). With TP they
        always do, one pool per rank made here: this rank's connector moves every rank's share."""
        kv, config = self.config.kv_transfer, self.config
        ranks_share_pools = kv.role != "both" and self.tp.size > 1
        shared = kv.role != "both" and (uses_shared_pool(kv.transport) or ranks_share_pools)
        return [KVPool.for_model(self.kv_spec, num_blocks, config.block_size, config.device, shared=shared)
                for _ in range(self.tp.size if ranks_share_pools else 1)]

    def _kv_connector(self) -> tuple[KVConnectorScheduler | None, KVConnectorWorker | None]:
        """P and D: the connector's scheduler side and its worker side, which registers the pools."""
        kv = self.config.kv_transfer
        if kv.role == "both":
            return None, None
        held = HeldBlocks(kv.lease_s)
        connector = KVConnectorScheduler(kv, self.config.block_size, held, self.engine_id, self.kv_spec.group_windows)
        worker = KVConnectorWorker(kv, held, self.kv_stats, self.engine_id)
        connector.advertised = worker.register_kv_caches(self.pools)
        return connector, worker

    def release_kv_hold(self, request_id: str) -> bool:
        """P: no D will pull request_id's KV; its blocks are freed at the next step (once no pull reads them)."""
        if self.connector is None or not self.config.kv_transfer.is_producer:
            raise InvalidParameter("request_id", "only a prefill (or kv_both) node holds KV for decode nodes")
        return self.connector.held.release(request_id)

    # -- requests -------------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt given as text or ids; InvalidParameter names what is wrong."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidParameter("prompt", "prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise InvalidParameter("prompt", f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidParameter(
                "prompt",
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} "
                "(one more position is needed for the first output token)"
            )
        return ids

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      kv_transfer_params: KVTransferParams | None = None) -> CheckedRequest:
        """The one check of a request (prompt ids from tokenize_prompt): InvalidParameter for what
        only this model can say (logit_bias outside its vocabulary, a structured output constraint
        that does not compile: compiled here once, then cached) and for kv_transfer_params this
        node cannot act on. Any thread may call it: it reads only what is fixed at start."""
        params.check_vocab(self.model_config.vocab_size)
        if params.structured is not None:
            self.grammars.compile(params.structured)
        if kv_transfer_params is not None:
            if self.connector is None:
                raise InvalidParameter("kv_transfer_params", "this node is colocated (--role both): no KV transfer "
                                       "(--role kv_both serves whole requests and moves KV)")
            self.connector.validate(kv_transfer_params, len(prompt_token_ids))
            first = kv_transfer_params.first_token_id
            if wants_remote_prefill(kv_transfer_params) and kv_transfer_params.is_push:
                # Push: D asks P for the whole prompt and its first token where P's draw may stand for D's.
                kv_transfer_params = msgspec.structs.replace(
                    kv_transfer_params, send_first_token=True if params.decodes_from_given_token else None)
            elif first is not None and not params.decodes_from_given_token:  # D samples the first token itself
                kv_transfer_params = msgspec.structs.replace(kv_transfer_params, first_token_id=None)
            elif first is not None and first >= self.model_config.vocab_size:
                raise InvalidParameter("kv_transfer_params", f"kv_transfer_params.first_token_id {first} is outside "
                                       f"the vocabulary [0, {self.model_config.vocab_size})")
        return CheckedRequest(prompt_token_ids, params, kv_transfer_params)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    kv_transfer_params: KVTransferParams | None = None) -> Request:
        """Check a request and add it (the offline path: LLM, profiles, tests)."""
        return self.add(self.check_request(self.tokenize_prompt(prompt), params, kv_transfer_params), request_id)

    def add(self, request: CheckedRequest, request_id: str | None = None,
            arrival_time: float | None = None) -> Request:
        """Queue a checked request; ValueError if its id is taken. Returns its first sequence."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        params = request.params
        # n > 1: n requests; the first keeps the client's id (a KV transfer names it), the others
        # get "<id>.<i>", and a seed s seeds sequence i with s + i (as vLLM does).
        ids = [request_id] + [f"{request_id}.{i}" for i in range(1, params.n)]
        for rid in ids:
            if rid in self.scheduler.requests or rid in self.scheduler.families:
                raise ValueError(f"request id {rid!r} is already in use")
        sequences = [
            Request(rid, request.prompt_token_ids, params, IncrementalDetokenizer(self.tokenizer), self.eos_token_ids,
                    self.max_model_len, self._generator(params, i), request.kv_transfer_params if i == 0 else None,
                    arrival_time, client_id=request_id, index=i,
                    grammar=self.grammars.matcher(params.structured) if params.structured else None)
            for i, rid in enumerate(ids)
        ]
        self.scheduler.add(sequences[0], sequences[1:])
        return sequences[0]

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.greedy:
            return None
        seed = params.seed + index if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seeds))
        return torch.Generator(device=self.config.device).manual_seed(seed)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a request (all n of its sequences); their final outputs, none if it is unknown."""
        return self.scheduler.abort(request_id)

    def abort_all(self) -> None:
        for request_id in list(self.scheduler.requests):
            self.abort_request(request_id)

    def ranks_alive(self) -> bool:
        """Whether every TP rank's process is running (a node whose rank died is unhealthy at once)."""
        return self.tp_workers is None or self.tp_workers.alive()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_runnable_requests(self) -> bool:
        return self.scheduler.has_runnable()

    # -- for the engine client: what is fixed at start, and what any thread may read -------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool,
                            tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, tools)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text (special tokens included), as logprobs name tokens."""
        return [self.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    def kv_event_page(self, after: int) -> KVEventPage:
        return self.kv_events.page(after)  # the event log takes a lock

    def kv_snapshot(self) -> KVSnapshot:
        return self.kv_events.snapshot()

    def transfer_stats(self) -> KVStatsSnapshot:
        """The KV transfer counters now (side-channel threads move them between steps)."""
        return self.kv_stats.snapshot()

    def info(self) -> EngineInfo:
        return EngineInfo(self.max_model_len, self.block_manager.num_blocks, self.labels(), self.model_config.vocab_size,
                          self.tokenizer.template_knows_tools)

    def _kv_dtype(self, requested: str, cls: type) -> torch.dtype:
        """The KV cache's dtype: `auto` is the model's compute dtype."""
        if requested == "auto" or getattr(torch, requested) == self.plan.torch_dtype:
            return self.plan.torch_dtype
        if cls.decode_attention != "paged":
            raise ValueError(f"--kv-cache-dtype {requested}: {cls.__name__} keeps its own attention's cache in "
                             f"the model's dtype ({self.plan.dtype}); use --kv-cache-dtype auto")
        return getattr(torch, requested)

    def labels(self) -> dict[str, str]:
        """How this engine computes: the kernel plan, the weights' quantization, the decode and prefill
        attention (native: pdserve's C++ kernels), whether pdserve's kernels (int4 projections, int8
        head) run on AMX tiles, whether decode steps run fused (models/decode_stack.py)."""
        fused = self.model_runner.model.decode_stack is not None
        ops = native_ops() if self.plan.compiled else None
        return {**self.plan.labels(), "quantization": self.quantization, "attention": self.attention,
                "prefill_attention": self.prefill_attention,
                "amx_tiles": str(ops is not None and ops.amx()).lower(),
                "decode_step": "fused" if fused else "python", "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                "tensor_parallel_size": str(self.tp.size),
                "batch_invariant": str(self.config.batch_invariant).lower(),
                "max_prefill_tokens_while_decoding": prefill_cap_label(self.config.max_prefill_tokens_while_decoding),
                "max_num_seqs": str(self.config.max_num_seqs), "threads": str(torch.get_num_threads()),
                "max_num_batched_tokens": str(self.scheduler.max_num_batched_tokens), **self.kv_labels()}

    def kv_labels(self) -> dict[str, str]:
        """A node with a KV role: the transport it drives transfers over, its side channel's host and
        the transports it serves (the proxy prices a P -> D pair's transfer by them)."""
        if self.connector is None:
            return {}
        advertised = self.connector.advertised
        return {"kv_transport": self.config.kv_transfer.transport, "kv_host": str(advertised.get("remote_host", "")),
                "kv_transports": ",".join(advertised.get("remote_transports", ()))}

    def stats(self) -> EngineStats:
        """This step's snapshot (engine thread): what the server's metrics and admission read."""
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), num_loading=len(s.loading),
            kv_blocks_used=self.block_manager.num_used_blocks,
            kv_blocks_held=sum(self.block_manager.num_held(req) for req in s.held.values()),
            kv=self.kv_stats.snapshot(), decode=self.decode_steps, busy_seconds=self.busy_seconds,
            busy_cpu_seconds=self.busy_cpu_seconds,
        )

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        started, cpu_started = time.perf_counter(), time.thread_time()
        outputs = self._step()
        elapsed = time.perf_counter() - started
        if self._computed:
            self.busy_seconds += elapsed
            self.busy_cpu_seconds += time.thread_time() - cpu_started
        if self._decode_batch is not None:  # a step of decodes only: timed for the proxy's placement
            seqs, kv_tokens = self._decode_batch
            d = self.decode_steps
            self.decode_steps = DecodeSteps(d.steps + 1, d.seconds + elapsed, d.seqs + seqs, d.kv_tokens + kv_tokens)
        self.kv_events.close_batch()  # what this step filed in and dropped from the prefix cache
        return outputs

    def _schedule(self) -> SchedulerOutput:
        scheduled = self.scheduler.schedule()
        batch = scheduled.scheduled
        self._computed = bool(batch)
        self._decode_batch = ((len(batch), sum(s.request.num_tokens for s in batch))
                              if batch and all(is_decode(s) for s in batch) else None)
        return scheduled

    def _step(self) -> list[RequestOutput]:
        worker = self.connector_worker
        if worker is None:
            scheduled = self._schedule()
            return self.scheduler.update_from_output(scheduled, self.model_runner.run(scheduled))
        outputs = self.take_kv_transfers()
        scheduled = self._schedule()
        meta = self.connector.build_connector_meta(scheduled.scheduled)
        worker.start_load_kv(meta, self.connector.advertised)
        # Push: each layer goes to D as soon as it is computed; the step ends once all are sent.
        sampled = self.model_runner.run(scheduled, after_layer=worker.save_kv_layer if meta.saves else None)
        if meta.saves:
            worker.wait_for_save(sampled)  # a finished prompt's push ends with its first token
        return outputs + self.scheduler.update_from_output(scheduled, sampled)

    def take_kv_transfers(self) -> list[RequestOutput]:
        """Apply the KV transfers that finished since the last step (P: free what D pulled; D: make
        loaded requests runnable). Outputs: P's first tokens of prompts whose KV arrived, ready now.
        step() does this first; a serving loop calls it before step() too, so those tokens stream
        before the step's model run rather than after it (one step sooner: TTFT)."""
        worker = self.connector_worker
        return [] if worker is None else self.scheduler.update_kv_transfers(self._checked(worker.get_finished()))

    def _checked(self, finished: FinishedTransfers) -> FinishedTransfers:
        """A pushed first token outside this model's vocabulary is dropped: D computes its own."""
        for result in finished.received:
            if result.first_token_id is not None and not 0 <= result.first_token_id < self.model_config.vocab_size:
                logger.warning("request %s: the prefill node's first token %d is outside the vocabulary; computing it "
                               "here", result.request_id, result.first_token_id)
                result.first_token_id = None
        return finished

    def close(self) -> None:
        """Release the side channel, the shared-memory pools and the other TP ranks (also what a
        failed start had made)."""
        if self.connector_worker is not None:
            self.connector_worker.close()
        if self.tp_workers is not None:
            self.tp_workers.close()
        for pool in self.pools:
            pool.close()
