"""`pdserve bench`: an online serving benchmark for any OpenAI-compatible server (vLLM's names).

Sends a seeded workload with Poisson (gamma, `--burstiness`) arrivals, streams every answer, and
reports per request TTFT, TPOT = (latency - TTFT) / (output tokens - 1), ITL and E2EL, then mean /
median / p90 / p99, throughput, and goodput under the SLOs given with `--goodput`.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.workload import BenchRequest, RequestResult, arrival_gaps, conversations, summarize, workload_from_args

# -- sending ------------------------------------------------------------------------------------


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
            result.placement = response.headers.get("x-pdserve-placement", "")
            result.request_id = response.headers.get("x-pdserve-request-id", "")
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
                    result.text += text
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


async def fetch_trace(client: httpx.AsyncClient, url: str, result: RequestResult) -> dict:
    """The proxy's record of a request (GET /v1/requests/{id}) beside what the client measured;
    None where the server keeps none (not a pdserve proxy)."""
    record = None
    if result.request_id:
        try:
            response = await client.get(f"{url}/v1/requests/{result.request_id}")
            record = response.json() if response.status_code == 200 else None
        except httpx.HTTPError:
            pass
    client_view = {"ok": result.ok, "error": result.error, "start_s": result.start, "ttft_ms": result.ttft_ms,
                   "e2el_ms": result.e2el_ms, "output_len": result.output_len, "max_itl_ms": result.max_itl_ms}
    return {"request_id": result.request_id or None, "client": client_view, "record": record}


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
                        burstiness: float, max_concurrency: int | None, seed: int, show_progress: bool = True,
                        answer_ids: Callable[[str], list[int]] | None = None,
                        traces: list[dict] | None = None) -> tuple[list[RequestResult], float]:
    """Send the requests at the rate; a conversation's turns (multiturn) go one after another, each
    after the previous answer and its think time, and the conversations arrive at the rate. A turn's
    prompt is the conversation so far (earlier turns and the answers, as `answer_ids` tokenizes
    them) followed by what the turn adds. `traces`: each answered request's record, fetched from a
    pdserve proxy as soon as it ends (its ring keeps the last 2000), appended with the client's view."""
    sessions = conversations(requests)
    gaps = arrival_gaps(len(sessions), rate, burstiness, seed)
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
            if traces is not None:
                traces.append(await fetch_trace(client, url, res))
            return res

        async def session(turns: list[BenchRequest]) -> list[RequestResult]:
            results: list[RequestResult] = []
            history: list[int] = []
            for req in turns:
                if results:
                    await asyncio.sleep(req.think_s)
                if req.conversation is not None:
                    prompt = history + list(req.prompt)
                    req = replace(req, prompt=prompt, input_len=len(prompt))
                results.append(await one(req))
                if req.conversation is not None:
                    history = prompt + (answer_ids(results[-1].text) if answer_ids and results[-1].text else [])
            return results

        t0 = time.perf_counter()
        tasks = []
        for turns, gap in zip(sessions, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(session(turns)))
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
        duration = time.perf_counter() - t0
        bar.close()
    return results, duration


# -- metrics ------------------------------------------------------------------------------------


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
                        ("itl", "Inter-token Latency"), ("max_itl", "Longest Gap per Request"),
                        ("e2el", "End-to-end Latency")):
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


def answer_tokenizer(model: str | None) -> Callable[[str], list[int]]:
    """Multiturn: how an answer's text becomes tokens of the next prompt (`model`'s tokenizer;
    None: the embedded model's, which pdserve's nodes serve)."""
    from pdserve.models.locate import resolve_model_dir
    from pdserve.models.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model_dir(model))
    return lambda text: tokenizer.encode(text, add_bos=False)


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
    traces: list[dict] | None = [] if args.trace_out else None
    results, duration = asyncio.run(run_benchmark(args.base_url.rstrip("/"), requests, args.endpoint, args.model,
                                                  rate, args.burstiness, args.max_concurrency, args.seed,
                                                  answer_ids=answer_tokenizer(args.tokenizer)
                                                  if any(r.conversation is not None for r in requests) else None,
                                                  traces=traces))
    if traces is not None:
        Path(args.trace_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.trace_out).write_text(json.dumps({"base_url": args.base_url, "requests": traces}, indent=1))
        kept = sum(t["record"] is not None for t in traces)
        print(f"{kept} of {len(traces)} request records written to {args.trace_out}"
              + ("" if kept else " (the server keeps none: a pdserve proxy does)"))
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


