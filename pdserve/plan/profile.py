"""`pdserve profile`: measure this machine's engine and fit a cost model to each cost.

    pdserve profile [--model M] [--quick] [--threads 1] --out profile.json

- prefill: the time of each chunk a prompt is prefilled in, against its tokens and the tokens
  before it, for several prompt lengths and chunk sizes (the scheduler's token budget). Model:
  chunk = a + b * tokens + c * tokens * (context before + tokens / 2), the last term the pairs that
  causal attention scores;
- decode: the time of one decode step against the batch size and the context it reads. Model:
  step = a + b * seqs + c * kv_tokens (the KV the step reads, summed over its sequences) + a hinge
  d_k * max(0, seqs - k) at each batch size k measured between the smallest and the largest: the
  step's cost follows the measured batch sizes piecewise-linearly (one straight line in seqs
  missed the 4-16-sequence steps by 13-20 % here, bent by the cheaper 32-sequence ones);
- KV transfer: the time to pull a request's blocks from another process, per transport, against
  bytes. Model: transfer = latency + bytes / bandwidth;
- start-up: a node process from start to its first 200 on /health;
- idle (full profiles): what a step pays beyond those prices after the node idled (plan/idle.py).

Each fit reports its mean and worst relative error on the samples it was fitted on. `--quick`
measures fewer points (under a minute here).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import torch

from pdserve.config import EngineConfig, KVTransferConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv.transport import TRANSPORTS, available
from pdserve.plan.corun import pinned, relay_factors, relay_samples, twin_busy
from pdserve.plan.fit import LinearFit, fit_linear
from pdserve.plan.idle import NO_IDLE, fit_idle, measure_idle, penalty
from pdserve.plan.measure import (PROBE_PROMPT, PROBE_TOKENS, bench_backends, node_args, one_start, pull_handoffs,
                                  timed_step)
from pdserve.platform import CpuInfo
from pdserve.proxy.costs import DECODE_BASE, decode_hinges
from pdserve.sampling_params import SamplingParams
from pdserve.workload import random_prompts

logger = logging.getLogger(__name__)

PREFILL_FEATURES = ["one", "tokens", "attention_pairs"]
TRANSFER_FEATURES = ["one", "bytes"]
NO_SERVING = {"request_s": 0.0, "stream_s": 0.0, "step_s": 0.0, "proxy_s": 0.0, "pull_handoff_s": 0.0,
              "gap_excess_s": []}  # profiles from before them
# one core, or a profile from before it was measured
NO_CORUN = {"prefill": 1.0, "decode": 1.0, "relay": 1.0, "relay_decode": 1.0}


@dataclass
class ProfilePoints:
    """What to measure: the full profile, or --quick. A short prompt in each pins the per-chunk
    constant, which longer chunks alone leave to trade off against the per-token term."""

    prompt_lens: list[int]
    chunk_sizes: list[int]
    decode_batches: list[int]
    decode_contexts: list[int]
    decode_steps: int
    max_decode_kv_tokens: int  # skip (batch, context) points whose prefill would cost more
    transfer_mib: list[int]
    startup_runs: int
    # The co-run factors (plan/corun.py): a twin engine loaded on another core and timed beside.
    # Only `simulate --one-host` and simcheck read them, not auto mode, which measures --quick at start.
    corun: bool = True

    @classmethod
    def full(cls) -> ProfilePoints:
        return cls([16, 64, 256, 512, 1024, 2048, 4096], [256, 512, 2048], [1, 2, 4, 8, 16, 32], [128, 512, 2048, 4096],
                   16, 32768, [4, 16, 64], 3)

    @classmethod
    def quick(cls) -> ProfilePoints:
        return cls([16, 128, 512, 1024], [256, 1024], [1, 4, 8], [128, 1024], 6, 8192, [4, 16], 1, corun=False)


@dataclass
class Profile:
    meta: dict
    prefill_chunk: LinearFit
    decode_step: LinearFit
    transfer: dict[str, LinearFit]  # transport -> fit
    startup_s: float
    samples: dict = field(default_factory=dict)  # the raw measurements each fit was made on
    # A few seconds of fixed work timed right after the fits (speed_index): running it again later
    # says how much faster or slower the machine runs now (speed_factors).
    speed: dict = field(default_factory=dict)
    # What serving over HTTP adds to the engine's costs, from probes of one idle node: request_s
    # per request hop (a request in and a one-token answer out, as the proxy asks P), stream_s
    # for streaming the tokens to the client (the first arrives that much later), step_s per step;
    # proxy_s: what a proxy in front adds to a request (full profiles: plan/corun.py's relay_samples);
    # pull_handoff_s: what a served pull adds to its bytes' transfer (full profiles: measure.pull_handoffs);
    # gap_excess_s: each streamed gap minus its probe's median gap, sorted (a stream's longest gap is
    # the tail of these: the simulator's GapJitter).
    serving: dict = field(default_factory=lambda: dict(NO_SERVING))
    # How much slower (speed_index) prefill and decode run while a twin engine computes on another
    # core of this host (plan/corun.py): nodes that share a host, as `pdserve up` starts them;
    # relay, relay_decode: how much slower a served node prefills and decodes while the host's proxy
    # relays another node's streams.
    corun: dict = field(default_factory=lambda: dict(NO_CORUN))
    # What a node's first step after it idled pays beyond the fits' (warm) prices (plan/idle.py).
    idle: dict = field(default_factory=lambda: dict(NO_IDLE))

    @property
    def corun_measured(self) -> bool:
        """False for a --quick profile, whose `corun` is NO_CORUN by default (older profiles measured it)."""
        return self.meta.get("corun_measured", True)

    def prefill_time(self, prompt_tokens: int, chunk_size: int, cached_tokens: int = 0) -> float:
        """Predicted seconds to prefill a prompt in chunks of `chunk_size` after `cached_tokens`."""
        total, done = 0.0, cached_tokens
        while done < prompt_tokens:
            n = min(chunk_size, prompt_tokens - done)
            total += self.prefill_chunk_time(n, done)
            done += n
        return total

    def prefill_chunk_time(self, tokens: int, context_before: int) -> float:
        return self.prefill_chunk.predict(chunk_features(tokens, context_before))

    def decode_step_time(self, seqs: int, kv_tokens: int) -> float:
        return self.decode_step.predict({"seqs": seqs, "kv_tokens": kv_tokens})

    def transfer_time(self, transport: str, nbytes: int) -> float:
        return self.transfer[transport].predict({"bytes": nbytes})

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path | str, model: str | None = None, flag: str = "--profile") -> Profile:
        """The profile at `path`; ValueError in one line, naming `flag`, when it is missing, not a
        profile, made with other cost models than this pdserve fits, or (with `model`) of another model."""
        where = f"{flag} {path}"
        if not Path(path).is_file():
            raise ValueError(f"{where}: no such file (make one with `pdserve profile --out ...`)")
        try:
            data = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: not JSON ({e})") from None
        missing = [k for k in ("meta", "prefill_chunk", "decode_step", "transfer", "startup_s")
                   if not isinstance(data, dict) or k not in data]
        if missing:
            raise ValueError(f"{where}: not a pdserve profile (no {', '.join(missing)})")
        try:
            decode_hinges(data["decode_step"])
            if data["prefill_chunk"].get("features") != PREFILL_FEATURES:
                raise ValueError(f"its prefill_chunk model has features {data['prefill_chunk'].get('features')}, "
                                 f"this pdserve reads {PREFILL_FEATURES}")
        except (KeyError, ValueError) as e:
            raise ValueError(f"{where}: {e}: measure it again with `pdserve profile`") from None
        if model is not None and model not in str(data["meta"].get("model", "")):
            raise ValueError(f"{where}: a profile of {data['meta'].get('model', 'an unnamed model')!r}, "
                             f"not of {model!r}")
        return cls(data["meta"], LinearFit.from_dict(data["prefill_chunk"]), LinearFit.from_dict(data["decode_step"]),
                   {t: LinearFit.from_dict(f) for t, f in data["transfer"].items()}, data["startup_s"],
                   data.get("samples", {}), data.get("speed", {}), {**NO_SERVING, **data.get("serving", {})},
                   {**NO_CORUN, **data.get("corun", {})}, {**NO_IDLE, **data.get("idle", {})})

    def speed_factors(self, now: dict) -> dict[str, float]:
        """How much slower (> 1) prefill and decode run `now` (speed_index) than when this profile
        was measured: shared hosts drift by tens of percent within an hour. 1.0 without a record."""
        if not self.speed:
            return {"prefill": 1.0, "decode": 1.0}
        return {k: now[f"{k}_s"] / self.speed[f"{k}_s"] for k in ("prefill", "decode")}

    def scaled(self, factors: dict[str, float]) -> Profile:
        """This profile with its prefill-chunk and decode-step costs multiplied by `factors`."""
        def times(fit: LinearFit, factor: float) -> LinearFit:
            return replace(fit, coefficients=[c * factor for c in fit.coefficients])

        return replace(self, prefill_chunk=times(self.prefill_chunk, factors["prefill"]),
                       decode_step=times(self.decode_step, factors["decode"]))


def thread_profiles(paths: list[str] | None, profile: Profile) -> dict[int, Profile]:
    """threads -> profile for `--thread-profile` paths: profiles of the same model measured at
    other thread counts than `profile` (`pdserve profile --threads N`), which price P or D nodes of
    that many threads. ValueError naming the path where one is not such a profile."""
    out: dict[int, Profile] = {}
    own = profile.meta.get("threads", 1)
    for path in paths or []:
        other = Profile.load(path, model=profile.meta.get("model"), flag="--thread-profile")
        threads = other.meta.get("threads", 1)
        if threads == own or threads in out:
            raise ValueError(f"--thread-profile {path}: measured at {threads} thread(s), as "
                             f"{'--profile' if threads == own else 'another --thread-profile'} was")
        out[threads] = other
    return out


def chunk_features(tokens: int, context_before: int) -> dict[str, float]:
    return {"tokens": tokens, "attention_pairs": tokens * (context_before + tokens / 2)}


def _run_timed(engine: LLMEngine) -> list[tuple[float, list]]:
    """Step the engine until idle; (seconds, what was scheduled) per step that ran the model. A step
    is timed whole, as the engine loop runs it: schedule, forward and sample, update and detokenize."""
    steps = []
    while engine.has_unfinished_requests():
        elapsed, scheduled = timed_step(engine)
        if scheduled.scheduled:
            steps.append((elapsed, [(s.num_new_tokens, s.request.num_computed_tokens - s.num_new_tokens)
                                    for s in scheduled.scheduled]))
    return steps


def measure_prefill(engine: LLMEngine, points: ProfilePoints, seed: int) -> list[dict]:
    samples = []
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for chunk in points.chunk_sizes:
        engine.scheduler.max_num_batched_tokens = chunk
        for length in points.prompt_lens:
            if length >= engine.max_model_len:
                continue
            seed += 1
            engine.add_request(random_prompts(1, length, seed)[0], params)
            for elapsed, batch in _run_timed(engine):
                (tokens, before), = batch
                samples.append({"tokens": tokens, "context_before": before, "chunk_size": chunk,
                                "prompt_tokens": length, "seconds": elapsed})
    return samples


def speed_index(engine: LLMEngine, seed: int = 7) -> dict:
    """Seconds of fixed work, best of three after a warm-up: one 512-token prefill chunk, and a
    decode step of 4 sequences at 256 tokens (median of its steps). Each call needs its own
    `seed`: prompts seen before would be prefix-cache hits."""
    few = ProfilePoints([512], [512], [4], [256], 4, 8192, [], 0)
    capacity = engine.block_manager.num_blocks * engine.config.block_size
    measure_prefill(engine, few, seed + 50)  # warm-up
    prefill = min(measure_prefill(engine, few, seed + i)[0]["seconds"] for i in range(3))
    decode = min(statistics.median(s["seconds"] for s in measure_decode(engine, few, seed + 10 + 10 * i, capacity))
                 for i in range(3))
    return {"prefill_s": prefill, "decode_s": decode}


def node_limits(engine: LLMEngine) -> dict:
    """What the simulator needs of a node besides its costs: its KV and its batching limits (the
    token budget the scheduler runs with: without chunked prefill, at least max_model_len)."""
    config = engine.config
    return {"kv_bytes_per_token": engine.kv_spec.bytes_per_token, "num_layers": engine.kv_spec.num_layers,
            "kv_capacity_tokens": engine.block_manager.num_blocks * config.block_size,
            "max_num_batched_tokens": engine.max_num_batched_tokens, "max_num_seqs": config.max_num_seqs,
            "block_size": config.block_size, "max_model_len": engine.max_model_len}


def measure_decode(engine: LLMEngine, points: ProfilePoints, seed: int, capacity: int) -> list[dict]:
    """`capacity`: KV tokens the pool holds (a batch that does not fit it is skipped)."""
    samples = []
    for context in points.decode_contexts:
        for batch in points.decode_batches:
            tokens = batch * (context + points.decode_steps + engine.config.block_size)  # + a partial block each
            if batch * context > points.max_decode_kv_tokens or context + points.decode_steps >= engine.max_model_len:
                continue
            if tokens > capacity:  # the batch would not fit the KV pool together: say so, measure the rest
                logger.warning("decode point %d x %d skipped: needs %d KV tokens, the pool holds %d "
                               "(raise --kv-cache-memory)", batch, context, tokens, capacity)
                continue
            # All prompts in one prefill step, so that the batch then decodes together.
            engine.scheduler.max_num_batched_tokens = batch * context
            seed += 1
            params = SamplingParams(max_tokens=points.decode_steps + 1, temperature=0.0, ignore_eos=True)
            for prompt in random_prompts(batch, context, seed):
                engine.add_request(prompt, params)
            for elapsed, scheduled in _run_timed(engine):
                if len(scheduled) == batch and all(n == 1 for n, _ in scheduled):  # a step of only decodes
                    samples.append({"seqs": batch, "kv_tokens": sum(before + 1 for _, before in scheduled),
                                    "context": context, "seconds": elapsed})
    return samples


def measure_transfers(points: ProfilePoints) -> list[dict]:
    samples = []
    affinity = os.sched_getaffinity(0)
    try:
        for mib in points.transfer_mib:
            names = available()
            res = bench_backends(mib, repeats=3, names=names)
            for transport in names:
                gbps = res[f"{transport}_scattered_gbps"]
                samples.append({"transport": transport, "bytes": res["bytes"], "seconds": res["bytes"] / gbps / 1e9})
    finally:
        os.sched_setaffinity(0, affinity)  # the transfer benchmark pins this process to one core
    return samples


def two_cores(config: EngineConfig) -> tuple[int, int] | None:
    """The two cores the co-run measurements pin to; None where this process may use one core only,
    or for a profile of more threads (one core could not hold them: `pdserve up` gives such a node
    cores of its own)."""
    cores = sorted(os.sched_getaffinity(0))
    return None if len(cores) < 2 or (config.threads or 1) > 1 else (cores[0], cores[1])


def corun_factors(engine: LLMEngine, config: EngineConfig, seed: int) -> dict[str, float]:
    """speed_index on one core while a twin engine computes on another, over speed_index alone on
    it; 1.0 without two_cores. Alone is timed before and after the twin and the faster kept: one
    noisy stretch alone (a CI run once measured 0.78 on a small model) must not read as a speed-up."""
    cores = two_cores(config)
    if cores is None:
        return {"prefill": 1.0, "decode": 1.0}
    with pinned(cores[0]):
        before = speed_index(engine, seed)
        with twin_busy(replace(config, kv_transfer=KVTransferConfig()), cores[1]):
            beside = speed_index(engine, seed + 500)
        after = speed_index(engine, seed + 700)
    return {k: beside[f"{k}_s"] / min(before[f"{k}_s"], after[f"{k}_s"]) for k in ("prefill", "decode")}


def run_profile(config: EngineConfig, points: ProfilePoints, seed: int = 0) -> Profile:
    engine = LLMEngine(config)
    try:
        node = node_limits(engine)
        # Warm up first: the first forward passes pay one-off costs (allocations, kernel set-up)
        # that measured the first 16-token prefill at twice the next one.
        engine.add_request(random_prompts(1, 64, seed - 1)[0], SamplingParams(max_tokens=4, ignore_eos=True))
        _run_timed(engine)
        prefill = measure_prefill(engine, points, seed)
        decode = measure_decode(engine, points, seed + 1000, node["kv_capacity_tokens"])
        speed = speed_index(engine, seed + 2000)
        corun = corun_factors(engine, config, seed + 3000) if points.corun else None
        idle = measure_idle(engine, seed + 4000) if points.corun else None
        labels = engine.labels()
        model = engine.model_dir.name
    finally:
        engine.close()
    transfers = measure_transfers(points)
    starts = [one_start(config.dtype, config.model, probes=6 if i == 0 else 0) for i in range(points.startup_runs)]
    cores = two_cores(config)
    relay = relay_samples(node_args(config.dtype, config.model), cores) if points.corun and cores else None
    handoffs = pull_handoffs(node_args(config.dtype, config.model), cores) if points.corun and cores else None

    cpu = CpuInfo.detect()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": model, "cpu": cpu.model, "isa": cpu.isa,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "engine": labels,
            "node": node, "quick": points == ProfilePoints.quick(), "corun_measured": corun is not None}
    samples = {"prefill": prefill, "decode": decode, "transfer": transfers,
               "startup_s": [s["startup_s"] for s in starts], "serving_probes": starts[0]["probes"]}
    if relay:
        samples["relay"] = relay
    if handoffs:
        samples["pull_handoffs"] = handoffs
    if idle:
        samples["idle"] = idle
    profile = fitted(meta, samples, statistics.median(s["startup_s"] for s in starts))
    profile.speed = speed
    profile.corun = {**NO_CORUN, **(corun or {}), **(relay_factors(relay) if relay else {})}
    return profile


def fitted(meta: dict, samples: dict, startup_s: float) -> Profile:
    """A profile of these measurements: each cost model fitted to its samples."""
    prefill, decode, transfers = samples["prefill"], samples["decode"], samples["transfer"]
    prefill_fit = fit_linear([chunk_features(s["tokens"], s["context_before"]) for s in prefill],
                             [s["seconds"] for s in prefill], PREFILL_FEATURES)
    decode_fit = fit_linear(decode, [s["seconds"] for s in decode], decode_features([s["seqs"] for s in decode]))
    transfer_fits = {}
    for transport in (t for t in TRANSPORTS if any(s["transport"] == t for s in transfers)):  # those measured
        rows = [s for s in transfers if s["transport"] == transport]
        transfer_fits[transport] = fit_linear(rows, [s["seconds"] for s in rows], TRANSFER_FEATURES)
    meta = {**meta, "models": {"prefill_chunk": "a + b * tokens + c * tokens * (context_before + tokens / 2)",
                               "decode_step": "a + b * seqs + c * kv_tokens + sum_k d_k * max(0, seqs - k)",
                               "transfer": "latency + bytes / bandwidth"}}
    profile = Profile(meta, prefill_fit, decode_fit, transfer_fits, startup_s, samples)
    profile.serving = serving_overheads(profile, samples["serving_probes"], samples.get("relay"),
                                        samples.get("pull_handoffs"))
    if samples.get("idle"):
        profile.idle = fit_idle(samples["idle"])
    return profile


def refit(profile: Profile) -> Profile:
    """`pdserve profile --refit`: this pdserve's cost models fitted again to the samples an earlier
    profile recorded (its speed index and co-run factors kept), without measuring anything."""
    if not all(profile.samples.get(k) for k in ("prefill", "decode", "transfer", "serving_probes")):
        raise ValueError(f"--refit: the profile of {profile.meta.get('date', '?')} holds no samples to fit again "
                         f"(measure it again with `pdserve profile`)")
    again = fitted({**profile.meta, "refit": time.strftime("%Y-%m-%d %H:%M:%S")}, profile.samples, profile.startup_s)
    return replace(again, speed=profile.speed, corun=profile.corun)


def decode_features(batches: list[int]) -> list[str]:
    """The decode-step model's features: a hinge at each measured batch size between the smallest
    and the largest, so that the fit passes through every measured batch size."""
    return DECODE_BASE + [f"seqs>{b}" for b in sorted(set(batches))[1:-1]]


def serving_overheads(profile: Profile, probes: list[dict], relay: dict | None = None,
                      handoffs: list[dict] | None = None) -> dict:
    """Medians of what a client saw beyond the engine's costs: the one-token answer's latency minus
    the node's engine's own TTFT (probes before it was recorded: minus the fitted prefill step);
    streamed TTFT minus that latency; TPOT minus a one-sequence decode step at the probe's mean
    context; with `relay` (relay_samples), the hop through a proxy minus the hop to the node; with
    `handoffs` (measure.pull_handoffs), a served pull's KV wait minus its bytes' transfer fit."""
    mid_context = PROBE_PROMPT + PROBE_TOKENS // 2
    request = statistics.median(p["reply_s"] - p.get("engine_ttft_s", profile.prefill_chunk_time(p["prompt_tokens"], 0))
                                for p in probes)
    stream = statistics.median(p["ttft_s"] - p["reply_s"] for p in probes)
    step = statistics.median(p["tpot_s"] - profile.decode_step_time(1, mid_context) for p in probes)
    excess = sorted(round(gap - statistics.median(p["gaps_s"]), 6) for p in probes if p.get("gaps_s")
                    for gap in p["gaps_s"])
    proxy = (statistics.median(relay["proxy_hop_ms"]) - statistics.median(relay["direct_hop_ms"])) / 1e3 \
        if relay else 0.0
    handoff = statistics.median(h["kv_load_s"] - profile.transfer_time(h["transport"], h["kv_bytes"])
                                for h in handoffs) if handoffs else 0.0
    return {"request_s": max(request, 0.0), "stream_s": max(stream, 0.0), "step_s": max(step, 0.0),
            "proxy_s": max(proxy, 0.0), "pull_handoff_s": max(handoff, 0.0), "gap_excess_s": excess}


def sorted_quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile of sorted `xs` by rank, not interpolated (a draw of the gap excess is one of them)."""
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def describe(profile: Profile) -> str:
    """What a person reads after `pdserve profile`: each fit and its error."""
    p, d = profile.prefill_chunk, profile.decode_step
    lines = [f"profile of {profile.meta['model']} on {profile.meta['cpu']} ({profile.meta['isa']}, "
             f"{profile.meta['threads']} thread(s), {profile.meta['engine'].get('dtype')}, "
             f"quantization {profile.meta['engine'].get('quantization')})"]
    lines.append(f"  prefill chunk = {p.coefficients[0] * 1e3:.2f} ms + {p.coefficients[1] * 1e6:.1f} us/token + "
                 f"{p.coefficients[2] * 1e9:.3f} ns/attention pair   (error mean {p.mean_rel_error:.1%}, "
                 f"max {p.max_rel_error:.1%}, {p.samples} chunks)")
    batches = sorted({s["seqs"] for s in profile.samples.get("decode", [])}) or [1, 8]
    bases = " / ".join(f"{profile.decode_step_time(b, 0) * 1e3:.1f}" for b in batches)
    lines.append(f"  decode step   = {bases} ms at {' / '.join(map(str, batches))} seqs (in between: interpolated) + "
                 f"{d.coefficients[2] * 1e6:.2f} us/KV token   (error mean {d.mean_rel_error:.1%}, "
                 f"max {d.max_rel_error:.1%}, {d.samples} steps)")
    for transport, f in profile.transfer.items():
        bandwidth = 1 / f.coefficients[1] / 1e9 if f.coefficients[1] > 0 else float("inf")
        lines.append(f"  transfer {transport:4s} = {f.coefficients[0] * 1e3:.2f} ms + bytes / {bandwidth:.2f} GB/s   "
                     f"(error mean {f.mean_rel_error:.1%}, max {f.max_rel_error:.1%})")
    lines.append(f"  node start-up = {profile.startup_s:.1f} s")
    lines.append(f"  serving over HTTP adds {profile.serving['request_s'] * 1e3:.1f} ms per request hop, "
                 f"{profile.serving['stream_s'] * 1e3:.1f} ms to a streamed first token and "
                 f"{profile.serving['step_s'] * 1e3:.2f} ms per step"
                 + (f"; a proxy in front adds {profile.serving['proxy_s'] * 1e3:.1f} ms a request"
                    if profile.samples.get("relay") else "")
                 + (f"; a served pull's handoff {profile.serving['pull_handoff_s'] * 1e3:.1f} ms beyond its bytes' "
                    f"transfer" if profile.samples.get("pull_handoffs") else ""))
    excess = profile.serving.get("gap_excess_s")
    if excess:
        at = [sorted_quantile(excess, q) * 1e3 for q in (0.5, 0.9, 0.99)]
        lines.append(f"  a streamed gap exceeds its stream's median by {at[0]:.1f} / {at[1]:.1f} / {at[2]:.1f} / "
                     f"{excess[-1] * 1e3:.1f} ms at p50 / p90 / p99 / max ({len(excess)} gaps)")
    if profile.corun_measured:
        lines.append(f"  beside another busy core of this host: prefill x{profile.corun['prefill']:.2f}, "
                     f"decode x{profile.corun['decode']:.2f}"
                     + (f"; a served node prefills x{profile.corun['relay']:.2f} and decodes "
                        f"x{profile.corun['relay_decode']:.2f} while the host's proxy relays streams"
                        if profile.samples.get("relay") else ""))
    else:
        lines.append("  beside another busy core of this host: not measured (--quick; `simulate --one-host` "
                     "takes x1.00)")
    if profile.samples.get("idle"):
        def at(prefill: bool) -> str:
            return " / ".join(f"{penalty(profile.idle, g, prefill) * 1e3:.0f}" for g in (0.3, 1, 3))
        lines.append(f"  a node's first step after it idled 0.3 / 1 / 3 s pays {at(True)} ms more (prefill), "
                     f"{at(False)} ms (decode): tau {profile.idle['tau_s']:.1f} s")
    lines.append(f"  e.g. prefill 2048 tokens in 2048-token chunks: {profile.prefill_time(2048, 2048) * 1e3:.0f} ms; "
                 f"decode step of 8 x 1024: {profile.decode_step_time(8, 8 * 1024) * 1e3:.1f} ms")
    return "\n".join(lines)
