"""The workload both `pdserve bench` and `pdserve simulate` replay, and the figures they report.

Seeded datasets (random token prompts, the named workloads below, ShareGPT), gamma arrivals, the
per-request result and its summary (vLLM's field names), so a measured run and a simulated one
compare key by key.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pdserve.proxy.slo import SLO_METRICS, meets


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (completions only)
    input_len: int
    output_len: int
    conversation: int | None = None  # multiturn: turns of one conversation go in order, one at a time
    think_s: float = 0.0  # multiturn: the user's pause after the previous turn's answer


@dataclass
class RequestResult:
    ok: bool
    input_len: int
    output_len: int = 0
    ttft_ms: float = 0.0
    e2el_ms: float = 0.0
    itls_ms: list[float] = field(default_factory=list)
    error: str = ""
    start: float = 0.0  # seconds since the run began
    stages_ms: dict[str, float] = field(default_factory=dict)  # pdserve's x-pdserve-*-ms headers, if any
    placement: str = ""  # pdserve's auto mode: where the prompt was prefilled (x-pdserve-placement)
    text: str = ""  # the answer (multiturn puts it into the conversation's next prompt)
    longest_gap_ms: float | None = None  # set where itls_ms is not kept (the simulator's planner runs)
    request_id: str = ""  # a pdserve proxy's record of it (x-pdserve-request-id)

    @property
    def tpot_ms(self) -> float:
        return (self.e2el_ms - self.ttft_ms) / (self.output_len - 1) if self.output_len > 1 else 0.0

    @property
    def max_itl_ms(self) -> float:
        """The longest gap between two tokens after the first (what `--goodput itl:MS` bounds)."""
        if self.longest_gap_ms is not None:
            return self.longest_gap_ms
        return max(self.itls_ms, default=0.0)


# -- datasets -----------------------------------------------------------------------------------


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio))))


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float, seed: int,
                   vocab: tuple[int, int] = (1000, 40000)) -> list[BenchRequest]:
    """Prompts of random token ids: exact lengths on any server with the same vocabulary."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = _lengths(rng, input_len, range_ratio)
        out.append(BenchRequest([rng.randrange(*vocab) for _ in range(length)], length,
                                _lengths(rng, output_len, range_ratio)))
    return out


def mixed_dataset(n: int, seed: int, long_fraction: float = 0.1, short: tuple[int, int] = (128, 128),
                  long: tuple[int, int] = (2048, 64)) -> list[BenchRequest]:
    """Many short chat turns and some long documents (seeded), e.g. 90 % 128->128, 10 % 2048->64."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        inp, outp = long if rng.random() < long_fraction else short
        out.extend(random_dataset(1, inp, outp, 0.0, seed * 100_003 + i))
    return out


def multiturn_dataset(n: int, seed: int, turns: int = 4, system_len: int = 512, user_len: int = 64,
                      answer_len: int = 64, think_s: float = 1.0) -> list[BenchRequest]:
    """`n` seeded conversations of `turns` turns, all opening with one shared system prompt. Each
    request holds what its turn adds: the system prompt and first user turn, then `user_len` new
    user tokens a turn; the sender puts the history before it (every earlier turn and the server's
    own answer to it, serving.run_benchmark), as a chat client does. Each turn asks for
    `answer_len` tokens; a user thinks for an exponential time of mean `think_s` between an answer
    and the next turn. Listed conversation by conversation, turns in order."""
    rng = random.Random(seed)
    system = random_prompts(1, system_len, seed * 7 + 1)[0] if system_len else []
    out = []
    for c in range(n):
        for k in range(turns):
            user = random_prompts(1, user_len, seed * 100_003 + c * 1_009 + k)[0]
            prompt = (system + user) if k == 0 else user
            out.append(BenchRequest(prompt, len(prompt), answer_len, conversation=c,
                                    think_s=rng.expovariate(1 / think_s) if think_s > 0 and k else 0.0))
    return out


def ranged_dataset(n: int, seed: int, input_range: tuple[int, int], output_range: tuple[int, int]) -> list[BenchRequest]:
    """`n` seeded requests whose prompt and answer lengths are uniform in the (inclusive) ranges."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        inp, outp = rng.randint(*input_range), rng.randint(*output_range)
        out.extend(random_dataset(1, inp, outp, 0.0, seed * 100_003 + i))
    return out


# The named workloads (`--dataset NAME`), shapes fixed so that a name means one load everywhere:
#   chat       `mixed` as its flags default: 90 % 128 -> 128 turns, 10 % 2048 -> 64 documents
#   summarize  prefill-heavy: 1024-4096 tokens in, 32-128 out (uniform)
#   generate   decode-heavy: 32-256 tokens in, 256-1024 out (uniform)
#   multiturn  conversations (its flags: 4 turns on a 512-token system prompt, 64-token turns)
#   agentic    long histories: 8 turns on a 1536-token system prompt (tools), each turn adds a
#              256-token tool result and asks for a 64-token call, 0.2 s between turns
SUMMARIZE = ((1024, 4096), (32, 128))
GENERATE = ((32, 256), (256, 1024))
AGENTIC = {"turns": 8, "system_len": 1536, "user_len": 256, "answer_len": 64, "think_s": 0.2}
DATASETS = ("random", "mixed", "chat", "summarize", "generate", "multiturn", "agentic")


def named_dataset(name: str, n: int, seed: int) -> list[BenchRequest]:
    """A named workload at its stated shape (the comment above); `n` requests, or conversations."""
    if name in ("chat", "mixed"):
        return mixed_dataset(n, seed)
    if name == "summarize":
        return ranged_dataset(n, seed, *SUMMARIZE)
    if name == "generate":
        return ranged_dataset(n, seed, *GENERATE)
    if name == "multiturn":
        return multiturn_dataset(n, seed)
    if name == "agentic":
        return multiturn_dataset(n, seed, **AGENTIC)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(DATASETS[1:])}")


def conversations(requests: list[BenchRequest]) -> list[list[BenchRequest]]:
    """Requests grouped into the sequences that must go in order: one per conversation, in the order
    conversations first appear; a request of no conversation is a sequence of its own."""
    sessions: list[list[BenchRequest]] = []
    by_id: dict[int, list[BenchRequest]] = {}
    for req in requests:
        if req.conversation is None:
            sessions.append([req])
        elif req.conversation in by_id:
            by_id[req.conversation].append(req)
        else:
            by_id[req.conversation] = [req]
            sessions.append(by_id[req.conversation])
    return sessions


def sharegpt_dataset(path: str, n: int, seed: int, tokenizer) -> list[BenchRequest]:
    """First human turn as the prompt, the first reply's length as the output length."""
    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    rng.shuffle(data)
    out = []
    for item in data:
        turns = item.get("conversations") or []
        if len(turns) < 2:
            continue
        prompt, reply = str(turns[0].get("value", "")), str(turns[1].get("value", ""))
        input_len, output_len = len(tokenizer.encode(prompt)), len(tokenizer.encode(reply))
        if input_len < 4 or output_len < 4:
            continue
        out.append(BenchRequest(prompt, input_len, output_len))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"{path}: no usable ShareGPT conversations")
    return out


def as_text(requests: list[BenchRequest], tokenizer) -> list[BenchRequest]:
    """Token-id prompts decoded to text (the chat endpoint takes text only)."""
    return [BenchRequest(tokenizer.decode(r.prompt) if isinstance(r.prompt, list) else r.prompt, r.input_len,
                         r.output_len) for r in requests]


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch  # here: torch's generator keeps the prompts every recorded run used; the proxy does without it

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 40000, (n, length), generator=g).tolist()


# -- arrivals and results -------------------------------------------------------------------


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between arrivals: gamma with mean 1/rate (burstiness 1 = Poisson); 0 for rate=inf."""
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return list(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:3000` -> {"ttft_ms": 500, ...}; ValueError naming a bad item."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_METRICS:
            raise ValueError(f"--goodput {item!r}: the metric must be one of {sorted(SLO_METRICS)}")
        try:
            slos[SLO_METRICS[key]] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[SLO_METRICS[key]] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
    return slos


def goodput_items(slos: dict[str, float]) -> list[str]:
    """parse_goodput's inverse: {"ttft_ms": 500, ...} -> ["ttft:500.0", ...] (for --slo / --goodput)."""
    names = {field: key for key, field in SLO_METRICS.items()}
    return [f"{names[field]}:{ms:.1f}" for field, ms in slos.items()]


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    done = [r for r in results if r.ok]
    out: dict = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": sum(r.input_len for r in done),
        "total_output_tokens": sum(r.output_len for r in done),
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": sum(r.output_len for r in done) / duration if duration else 0.0,
        "total_token_throughput": sum(r.input_len + r.output_len for r in done) / duration if duration else 0.0,
    }
    series = {
        "ttft": [r.ttft_ms for r in done],
        "tpot": [r.tpot_ms for r in done if r.output_len > 1],
        "itl": [x for r in done for x in r.itls_ms],
        "max_itl": [r.max_itl_ms for r in done if r.output_len > 1],  # per request: its longest gap
        "e2el": [r.e2el_ms for r in done],
    }
    for name, values in series.items():
        arr = np.array(values) if values else np.zeros(1)
        out[f"mean_{name}_ms"] = float(arr.mean())
        out[f"median_{name}_ms"] = float(np.median(arr))
        out[f"std_{name}_ms"] = float(arr.std())
        for p in (90, 99):
            out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    if slos:
        good = sum(meets(r, slos) for r in results)
        out["goodput_slos_ms"] = slos
        out["request_goodput"] = good / duration if duration else 0.0
        out["slo_attainment"] = good / len(results) if results else 0.0
    out["input_lens"] = [r.input_len for r in results]
    out["output_lens"] = [r.output_len for r in results]
    out["ttfts"] = [r.ttft_ms / 1e3 for r in results]
    out["itls"] = [[x / 1e3 for x in r.itls_ms] for r in results]
    out["start_times"] = [r.start for r in results]
    out["e2els"] = [r.e2el_ms / 1e3 for r in results]
    out["stages_ms"] = [r.stages_ms for r in results]
    out["placements"] = [r.placement for r in results]
    out["errors"] = [r.error for r in results]
    return out


def workload_from_args(args) -> tuple[dict[str, float], float, list[BenchRequest]]:
    """(SLOs, request rate, the requests) from the workload flags (cli.add_workload_args);
    ValueError names a bad flag."""
    slos = parse_goodput(args.goodput)
    rate = float("inf") if str(args.request_rate) == "inf" else float(args.request_rate)
    if rate <= 0:
        raise ValueError("--request-rate must be > 0 or inf")
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    return slos, rate, requests_from_args(args)


def requests_from_args(args) -> list[BenchRequest]:
    """The requests of the dataset flags (cli.add_dataset_args); ValueError names a bad flag."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    tokenizer = None
    chat = getattr(args, "endpoint", "completions") == "chat"  # only `pdserve bench` has an endpoint
    if args.dataset not in DATASETS or chat:  # ShareGPT's lengths; chat text
        from pdserve.models.locate import resolve_model_dir
        from pdserve.models.tokenizer import Tokenizer

        tokenizer = Tokenizer(resolve_model_dir(args.tokenizer))
    if args.dataset == "random":
        requests = random_dataset(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    elif args.dataset == "multiturn":
        for flag in ("turns", "system_prompt_len", "turn_input_len", "turn_output_len"):
            if getattr(args, flag) < (0 if flag == "system_prompt_len" else 1):
                raise ValueError(f"--{flag.replace('_', '-')} must be >= {0 if flag == 'system_prompt_len' else 1}")
        if args.think_time < 0:
            raise ValueError("--think-time must be >= 0")
        requests = multiturn_dataset(args.num_prompts, args.seed, args.turns, args.system_prompt_len,
                                     args.turn_input_len, args.turn_output_len, args.think_time)
    elif args.dataset == "mixed":
        requests = mixed_dataset(args.num_prompts, args.seed, args.long_fraction,
                                 (args.short_input_len, args.short_output_len), (args.long_input_len, args.long_output_len))
    elif args.dataset in DATASETS:
        requests = named_dataset(args.dataset, args.num_prompts, args.seed)
    else:
        if not Path(args.dataset).is_file():
            raise ValueError(f"--dataset {args.dataset!r} is neither one of {', '.join(DATASETS)} "
                             "nor a ShareGPT JSON file")
        requests = sharegpt_dataset(args.dataset, args.num_prompts, args.seed, tokenizer)
    if chat:
        requests = as_text(requests, tokenizer)
    return requests
