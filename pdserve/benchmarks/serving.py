"""`pdserve bench`: an online serving benchmark for any OpenAI-compatible server (vLLM's names).

Sends a seeded workload with Poisson (gamma, `--burstiness`) arrivals, streams every answer, and
reports per request TTFT, TPOT = (latency - TTFT) / (output tokens - 1), ITL and E2EL, then mean /
median / p90 / p99, throughput, and goodput under the SLOs given with `--goodput`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}


@dataclass
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (completions only)
    input_len: int
    output_len: int


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

    @property
    def tpot_ms(self) -> float:
        return (self.e2el_ms - self.ttft_ms) / (self.output_len - 1) if self.output_len > 1 else 0.0


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


# -- sending ------------------------------------------------------------------------------------


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between arrivals: gamma with mean 1/rate (burstiness 1 = Poisson); 0 for rate=inf."""
    if rate == float("inf"):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return list(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n))


async def send_one(client: httpx.AsyncClient, url: str, endpoint: str, model: str | None, req: BenchRequest,
                   t0: float) -> RequestResult:
    body: dict = {"max_tokens": req.output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = req.prompt
        path = "/v1/completions"
    result = RequestResult(ok=False, input_len=req.input_len)
    start = time.perf_counter()
    result.start = start - t0
    last = start
    chunks = 0
    first_choice: float | None = None
    try:
        async with client.stream("POST", url + path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            result.stages_ms = stage_headers(response.headers)
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                data = json.loads(line[5:])
                if "error" in data:
                    result.error = str(data["error"])
                    return result
                if data.get("usage"):
                    result.output_len = data["usage"]["completion_tokens"]
                for choice in data.get("choices") or []:
                    if first_choice is None:
                        first_choice = time.perf_counter()
                    text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft_ms = (now - start) * 1e3
                    else:
                        result.itls_ms.append((now - last) * 1e3)
                    last = now
                    chunks += 1
        result.e2el_ms = (time.perf_counter() - start) * 1e3
        if chunks == 0 and result.output_len and first_choice is not None:
            # Tokens were generated but none had visible text yet (e.g. pieces of one UTF-8
            # character): a success, timed from the first chunk that carried a choice.
            result.ttft_ms = (first_choice - start) * 1e3
        result.output_len = result.output_len or chunks
        result.ok = chunks > 0 or (result.output_len > 0 and first_choice is not None)
        if not result.ok:
            result.error = "no tokens streamed"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def stage_headers(headers: httpx.Headers) -> dict[str, float]:
    """`x-pdserve-queue-ms: 12.5` -> {"queue": 12.5}: where a pdserve request's time went."""
    out = {}
    for key, value in headers.items():
        if key.startswith("x-pdserve-") and key.endswith("-ms"):
            try:
                out[key[len("x-pdserve-"):-len("-ms")]] = float(value)
            except ValueError:
                pass
    return out


async def run_benchmark(url: str, requests: list[BenchRequest], endpoint: str, model: str | None, rate: float,
                        burstiness: float, max_concurrency: int | None, seed: int,
                        show_progress: bool = True) -> tuple[list[RequestResult], float]:
    gaps = arrival_gaps(len(requests), rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None)) as client:
        bar = tqdm(total=len(requests), disable=not show_progress, desc="requests")

        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                res = await send_one(client, url, endpoint, model, req, t0)
            else:
                async with limit:
                    res = await send_one(client, url, endpoint, model, req, t0)
            bar.update(1)
            return res

        t0 = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    return results, duration


# -- metrics ------------------------------------------------------------------------------------


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:3000` -> {"ttft_ms": 500, ...}; ValueError naming a bad item."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"--goodput {item!r}: the metric must be one of {sorted(SLO_KEYS)}")
        try:
            slos[SLO_KEYS[key]] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[SLO_KEYS[key]] <= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
    return slos


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    return result.ok and all(getattr(result, key) <= limit for key, limit in slos.items())


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
    out["errors"] = [r.error for r in results]
    return out


def report(summary: dict) -> str:
    lines = [
        f"{'Successful requests:':<40}{summary['completed']:>12}",
        f"{'Failed requests:':<40}{summary['failed']:>12}",
        f"{'Benchmark duration (s):':<40}{summary['duration']:>12.2f}",
        f"{'Total input tokens:':<40}{summary['total_input_tokens']:>12}",
        f"{'Total generated tokens:':<40}{summary['total_output_tokens']:>12}",
        f"{'Request throughput (req/s):':<40}{summary['request_throughput']:>12.2f}",
        f"{'Output token throughput (tok/s):':<40}{summary['output_throughput']:>12.2f}",
        f"{'Total token throughput (tok/s):':<40}{summary['total_token_throughput']:>12.2f}",
    ]
    for engine in summary.get("engines", []):
        label = f"Engine ({engine.get('role', 'node')}):"
        lines.append(f"{label:<40}{engine.get('dtype', '?')}, {engine.get('kernels', '?')} kernels, {engine.get('isa', '?')}")
    if "request_goodput" in summary:
        lines.append(f"{'Request goodput (req/s):':<40}{summary['request_goodput']:>12.2f}")
        lines.append(f"{'SLO attainment:':<40}{summary['slo_attainment'] * 100:>11.1f}%")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append(f"{'-' * 15}{title}{'-' * 15}")
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(f"{f'{stat.capitalize()} {name.upper()} (ms):':<40}{summary[f'{stat}_{name}_ms']:>12.2f}")
    return "\n".join(lines)


def plot(summary: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from exc
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    ttfts = sorted(t * 1e3 for t, e in zip(summary["ttfts"], summary["errors"]) if not e)
    tpots = []
    for itls in summary["itls"]:
        if itls:
            tpots.append(sum(itls) * 1e3 / len(itls))
    for ax, values, title in ((axes[0], ttfts, "TTFT"), (axes[1], sorted(tpots), "TPOT")):
        if values:
            ax.plot(values, np.arange(1, len(values) + 1) / len(values), drawstyle="steps-post")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def server_engines(url: str) -> list[dict]:
    """What the measured server runs on (device, ISA, dtype, kernels per node): a pdserve proxy's
    /v1/nodes, or a pdserve node's /metrics; [] for other servers."""
    from pdserve.proxy.health import engine_info

    try:
        nodes = httpx.get(url + "/v1/nodes", timeout=5)
        if nodes.status_code == 200:
            return [{"url": n["url"], "role": n["role"], **n.get("engine", {})} for n in nodes.json()["nodes"]]
        info = engine_info(httpx.get(url + "/metrics", timeout=5).text)
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return [{"url": url, **info}] if info else []


def main(args) -> int:
    """Entry point of `pdserve bench` (arguments parsed by pdserve.cli)."""
    slos, rate, requests = workload_from_args(args)
    results, duration = asyncio.run(run_benchmark(args.base_url.rstrip("/"), requests, args.endpoint, args.model,
                                                  rate, args.burstiness, args.max_concurrency, args.seed))
    summary = summarize(results, duration, slos)
    summary["engines"] = server_engines(args.base_url.rstrip("/"))
    summary.update({"base_url": args.base_url, "endpoint": args.endpoint, "max_concurrency": args.max_concurrency})
    publish_run(summary, args)
    if args.plot:
        plot(summary, args.plot)
    return 0 if summary["failed"] == 0 else 1


def publish_run(summary: dict, args) -> None:
    """Add the workload flags and the date to a run's summary, print it, write it to --out."""
    summary.update({"dataset": args.dataset, "num_prompts": args.num_prompts, "request_rate": args.request_rate,
                    "burstiness": args.burstiness, "seed": args.seed, "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    print(report(summary))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=2))


def workload_from_args(args) -> tuple[dict[str, float], float, list[BenchRequest]]:
    """(SLOs, request rate, the requests) from the workload flags (cli.add_workload_args);
    ValueError names a bad flag."""
    slos = parse_goodput(args.goodput)
    rate = float("inf") if str(args.request_rate) == "inf" else float(args.request_rate)
    if rate <= 0:
        raise ValueError("--request-rate must be > 0 or inf")
    if args.burstiness <= 0:
        raise ValueError("--burstiness must be > 0")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    tokenizer = None
    chat = getattr(args, "endpoint", "completions") == "chat"  # `pdserve simulate` has no endpoint
    if args.dataset not in ("random", "mixed") or chat:
        from pdserve.models.loader import resolve_model_dir
        from pdserve.models.tokenizer import Tokenizer

        tokenizer = Tokenizer(resolve_model_dir(args.tokenizer))
    if args.dataset == "random":
        requests = random_dataset(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed)
    elif args.dataset == "mixed":
        requests = mixed_dataset(args.num_prompts, args.seed, args.long_fraction,
                                 (args.short_input_len, args.short_output_len), (args.long_input_len, args.long_output_len))
    else:
        if not Path(args.dataset).is_file():
            raise ValueError(f"--dataset {args.dataset!r} is neither random, mixed nor a ShareGPT JSON file")
        requests = sharegpt_dataset(args.dataset, args.num_prompts, args.seed, tokenizer)
    if chat:
        requests = as_text(requests, tokenizer)
    return slos, rate, requests

