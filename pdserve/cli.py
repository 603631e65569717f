"""`pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pdserve import tracing
from pdserve.kv.transport import AUTO, TRANSPORTS
from pdserve.models.locate import DEFAULT_MODEL, PACKAGED_MODELS
from pdserve.proxy.flows import FLOWS
from pdserve.proxy.placement import PLACEMENT_RULES
from pdserve.proxy.policies import POLICIES
from pdserve.registry import load_plugins

MODEL_HELP = (f"HF model directory, .gguf file, or a packaged model's name: {', '.join(PACKAGED_MODELS)} "
              f"(default: {DEFAULT_MODEL}, embedded)")


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="auto: bfloat16 where the CPU runs bf16 GEMMs natively (and on CUDA), else float32; "
                             "PDSERVE_KERNELS=portable forces the portable kernels (and float32 for auto)")


def add_quantization_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                        help="weight-only quantization for decode (CPU): auto follows the GGUF (Q4_x: int4, "
                             "Q8_0: int8; float weights: none); the output head is int8 whenever quantized")


def add_kv_cache_dtype_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the KV cache's dtype: auto keeps the model's (--dtype); bfloat16 halves a float32 "
                             "model's KV memory, transfers and decode reads. P and D nodes must agree")


def add_batch_invariant_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-invariant", action="store_true",
                        help="compute every token independently of what it is batched with and of how its prompt "
                             "is chunked: P + D equal a colocated node token for token on any dtype and "
                             "quantization, and an answer does not depend on the load (costs speed: see "
                             "docs/benchmarks.md)")


PREFILL_CAP_HELP = ("while streams decode, a step computes at most N prompt tokens (default: the whole budget): "
                    "bounds the gap a long prompt adds between their tokens (an ITL SLO); 0: none, a prompt waits "
                    "until the node's streams have finished (prefill and decode take turns); needs chunked prefill")


def add_role_args(parser: argparse.ArgumentParser) -> None:
    """Settings that P and D nodes take apart (`pdserve up`, and `pdserve simulate` to price them)."""
    parser.add_argument("--prefill-max-num-batched-tokens", type=int, default=None, metavar="N",
                        help="P nodes' token budget per step (default: --max-num-batched-tokens)")
    parser.add_argument("--decode-max-num-seqs", type=int, default=None, metavar="N",
                        help="D nodes' most requests in a step (default: pdserve serve's --max-num-seqs, 64): "
                             "fewer streams make a shorter decode step")
    parser.add_argument("--prefill-threads", type=int, default=None, metavar="N",
                        help="threads (cores) of each P node (default 1; pdserve simulate: needs a --thread-profile "
                             "measured at N)")
    parser.add_argument("--decode-threads", type=int, default=None, metavar="N", help="threads (cores) of each D node")


def add_thread_profile_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--thread-profile", nargs="+", default=None, metavar="JSON",
                        help="profiles of this model measured at more threads (`pdserve profile --threads N`): they "
                             "price P or D nodes of N threads (plan tries them, a node of N threads counting N cores)")


def role_settings(args: argparse.Namespace) -> dict[str, int | None]:
    """flag -> value of the per-role settings given (add_role_args)."""
    from pdserve.plan.sim.setup import ROLE_SETTINGS

    return {flag: getattr(args, flag.removeprefix("--").replace("-", "_")) for flag in ROLE_SETTINGS.values()}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    add_dtype_arg(parser)
    add_quantization_arg(parser)
    add_kv_cache_dtype_arg(parser)
    add_batch_invariant_arg(parser)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice; with TP, each rank's share of the cores)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                        help="ranks (processes) that split the model's heads and MLP and the KV pool")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, metavar="GiB", help="KV pool size in GiB")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-chunked-prefill", action="store_true", help="prefill whole prompts in one step")
    parser.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None, metavar="N",
                        help=PREFILL_CAP_HELP)
    parser.add_argument("--no-prefix-caching", action="store_true")


def engine_config_from_args(args: argparse.Namespace):
    from pdserve.config import EngineConfig, KVTransferConfig
    from pdserve.kv.transport import check_available

    check_available(getattr(args, "kv_transport", AUTO))

    kv = KVTransferConfig(
        role=getattr(args, "role", "both"),
        host=getattr(args, "kv_host", "127.0.0.1"),
        port=getattr(args, "kv_port", 0),
        transport=getattr(args, "kv_transport", "auto"),
        lease_s=getattr(args, "kv_lease", 10.0),
        wait_timeout_s=getattr(args, "kv_wait_timeout", 30.0),
        load_failure_policy=getattr(args, "kv_load_failure_policy", "recompute"),
        verify_digest=getattr(args, "kv_verify_digest", "on") == "on",
        secret=getattr(args, "kv_secret", None),
    )
    return EngineConfig(
        kv_transfer=kv,
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        batch_invariant=args.batch_invariant,
        threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        kv_cache_memory_gib=args.kv_cache_memory,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding,
        enable_prefix_caching=not args.no_prefix_caching,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    prompt = args.prompt
    if not args.raw:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    start = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    elapsed = time.perf_counter() - start
    print(out.text)
    n = len(out.token_ids)
    print(
        f"\n[{n} tokens, finish_reason={out.finish_reason}, TTFT {out.metrics.ttft * 1e3:.0f} ms, "
        f"{n / elapsed:.1f} tok/s overall]",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from pdserve.api.guards import resolve_api_key
    from pdserve.api.http import serve_app
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.threaded_client import ThreadedEngineClient
    from pdserve.models.locate import default_model_name
    from pdserve.node.metrics import NodeMetrics
    from pdserve.node.server import NodeServer

    tracing.setup(f"pdserve-{args.role}", args.otlp_endpoint)
    start = time.perf_counter()
    # The composition root: the engine on a thread of this process, behind its client.
    client = ThreadedEngineClient(LLMEngine(engine_config_from_args(args)))
    metrics = NodeMetrics(client.info, client.stats)
    client.on_step = metrics.observe_step  # request histograms, fed on the engine thread
    server = NodeServer(client, metrics, args.served_model_name or default_model_name(args.model),
                        resolve_api_key(args.api_key), args.max_waiting, args.max_body_bytes)
    logging.getLogger("pdserve").info(
        "node (role %s) loaded in %.1f s; serving %s on http://%s:%d",
        args.role, time.perf_counter() - start, server.model_name, args.host, args.port,
    )
    # On SIGINT/SIGTERM uvicorn stops accepting, lets in-flight requests finish for up to
    # --graceful-timeout seconds, then the lifespan hook aborts what is left and stops the engine.
    serve_app(server.app, args.host, args.port, args.log_level, args.graceful_timeout)
    return 0


def cmd_proxy(args: argparse.Namespace) -> int:
    from pdserve.api.guards import resolve_api_key
    from pdserve.api.http import serve_app
    from pdserve.proxy.app import Proxy, ProxyConfig
    from pdserve.workload import parse_goodput

    tracing.setup("pdserve-proxy", args.otlp_endpoint)
    meta_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    meta_url = args.meta_url or f"http://{meta_host}:{args.port}/v1/kv/meta"
    model_dir = None
    if args.mode == "auto":  # it tokenizes as the nodes do
        from pdserve.models.locate import resolve_model_dir

        model_dir = str(resolve_model_dir(args.model))
    proxy = Proxy(ProxyConfig(args.prefill or [], args.decode or [], args.policy, args.mode, meta_url=meta_url,
                              node_urls=args.node or [], kv_both_urls=args.kv_both or [],
                              api_key=resolve_api_key(args.api_key),
                              max_waiting=args.max_waiting, nodes_file=args.nodes_file, profile=args.profile,
                              model_dir=model_dir, stall_weight=args.stall_weight, placement=args.placement,
                              remote_prefill_threshold=args.remote_prefill_threshold,
                              slos=parse_goodput(args.slo) if args.slo else None,
                              dashboard=not args.no_dashboard))
    logging.getLogger("pdserve").info(
        "proxy (%s, %s) on http://%s:%d: prefill %s, decode %s",
        args.mode, args.policy, args.host, args.port, args.prefill, args.decode,
    )
    serve_app(proxy.app, args.host, args.port, args.log_level)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from pdserve.kv.transport import check_available
    from pdserve.launcher import run_up

    check_available(args.kv_transport)

    if args.colocated < 0 or (not args.colocated and (args.prefill < 1 or args.decode < 1)):
        raise ValueError("--prefill and --decode must be >= 1 (or use --colocated N >= 1)")
    if args.nodes is not None:
        if args.mode != "auto":
            raise ValueError("--nodes N is for --mode auto (colocated nodes: --colocated N)")
        if args.nodes < 1:
            raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
    if args.slo:
        from pdserve.workload import parse_goodput

        parse_goodput(args.slo)  # a bad --slo stops here, not in the proxy after the nodes started
    if args.prefill_tp != 1 or args.decode_tp != 1:
        if args.colocated or args.nodes:
            raise ValueError("--prefill-tp / --decode-tp size P and D nodes (not --colocated or --nodes)")
        from pdserve.launcher import check_node_tp

        check_node_tp(args)  # a TP size that cannot split the model stops here, before any node starts
    args.placement, args.ray_placement = split_placement(args.placement or [], args.ray_placement,
                                                         args.ray is not None)
    from pdserve.launcher import node_engine_config

    nodes = node_engine_config(args)  # a bad engine setting stops here, before any node starts
    if args.mode == "auto" and not args.colocated and not args.profile:
        from pdserve.plan.profile_cache import profile_for

        args.profile = str(profile_for(nodes)[0])  # cached, or measured now (it says which)
    shape_picked = args.mode == "auto" and args.nodes and args.slo and args.shape == "plan"
    if shape_picked:
        choose_auto_shape(args)
    elif args.rate or args.workload:
        raise ValueError("--rate / --workload describe the load auto's shape is chosen for: they need "
                         "--mode auto --nodes N --slo ... (and --shape plan, the default)")
    from pdserve.plan.sim.setup import check_role_settings

    check_role_settings(role_settings(args), not args.colocated and not args.nodes,
                        f"--colocated {args.colocated}" if args.colocated else f"--nodes {args.nodes} (kv_both nodes)")
    check_role_threads(args)
    if args.mode == "auto" and args.slo and not shape_picked and args.max_prefill_tokens_while_decoding is None:
        itl_prefill_cap(args)  # a picked shape brought its own (choose_auto_shape)
    if args.ray is not None:
        if args.ray_cpus <= 0:
            raise ValueError(f"--ray-cpus must be > 0, got {args.ray_cpus}")
        from pdserve.raycluster.up import run_up_ray

        return run_up_ray(args)
    return run_up(args)


def check_role_threads(args: argparse.Namespace) -> None:
    """--prefill-threads / --decode-threads: a one-process node's threads, each on a core of its own."""
    for flag, threads, tp in (("--prefill-threads", args.prefill_threads, args.prefill_tp),
                              ("--decode-threads", args.decode_threads, args.decode_tp)):
        if threads is None:
            continue
        if tp > 1:
            raise ValueError(f"{flag} sets a one-process node's threads; a TP node's ranks share the cores "
                             f"({flag.replace('threads', 'tp')} {tp})")
        if args.mode == "auto":
            raise ValueError(f"{flag}: auto mode prices every node with one profile of one thread; "
                             "use it with --mode pull or push")


def choose_auto_shape(args: argparse.Namespace) -> None:
    """Auto mode at --nodes N under SLOs: the shape of N nodes the simulator finds best for the
    workload (plan/shape.py): N kv_both nodes, or P and D nodes that auto places each request over."""
    from pdserve.plan.profile import Profile
    from pdserve.plan.shape import shape_for
    from pdserve.workload import DATASETS, parse_goodput

    workload = args.workload or "chat"
    if workload not in DATASETS[1:]:
        raise ValueError(f"--workload {workload!r}: choose from {', '.join(DATASETS[1:])}")
    pick = shape_for(Profile.load(args.profile), workload, parse_goodput(args.slo), args.nodes, args.rate)
    logging.getLogger("pdserve").warning("auto mode, %d nodes, workload %s: runs as %s (--shape kv_both keeps %d "
                                         "kv_both nodes)", args.nodes, workload, pick.describe(), args.nodes)
    if pick.disaggregated:
        args.prefill, args.decode = pick.units * pick.family.prefill, pick.units * pick.family.decode
        args.nodes = None
        # The shape's per-role settings, where the command line gives none.
        args.prefill_max_num_batched_tokens = args.prefill_max_num_batched_tokens or pick.family.prefill_budget
        args.decode_max_num_seqs = args.decode_max_num_seqs or pick.family.decode_max_seqs
    else:  # kv_both nodes with the shape's batching, where the command line gives none
        args.no_chunked_prefill = args.no_chunked_prefill or not pick.family.chunked
        if args.max_prefill_tokens_while_decoding is None and not args.no_chunked_prefill:
            args.max_prefill_tokens_while_decoding = pick.family.prefill_cap


def itl_prefill_cap(args: argparse.Namespace) -> None:
    """Auto mode under an ITL SLO (its shape given, not picked): each node also caps the prompt
    tokens a step takes while streams decode, at the largest chunk the profile says keeps such a
    step within the SLO; 0 where not even the smallest chunk does (prefill and decode take turns)."""
    from pdserve.plan.planner import prefill_cap_for
    from pdserve.plan.profile import Profile
    from pdserve.workload import parse_goodput

    itl_ms = parse_goodput(args.slo).get("max_itl_ms")
    if itl_ms is None or args.no_chunked_prefill:
        return
    log = logging.getLogger("pdserve")
    cap = args.max_prefill_tokens_while_decoding = prefill_cap_for(Profile.load(args.profile), itl_ms / 1e3)
    if cap == 0:
        log.info("auto mode, ITL SLO %g ms: every node's prefill and decode take turns (a prompt waits until the "
                 "node's streams have finished), as the profile says even a 16-token chunk beside a decode step "
                 "misses it (--max-prefill-tokens-while-decoding sets another cap)", itl_ms)
        return
    log.info("auto mode, ITL SLO %g ms: every node computes at most %d prompt tokens a step while streams decode "
             "(--max-prefill-tokens-while-decoding; give it to choose another)", itl_ms, cap)


def split_placement(values: list[str], ray_placement: str | None, ray: bool) -> tuple[str, str]:
    """(auto mode's rule, --ray's actor placement) from `pdserve up --placement` and
    `--ray-placement`; defaults cost and spread. `--placement spread|pack` is the older spelling of
    `--ray-placement` (issue 17's), still taken."""
    rules = [v for v in values if v not in RAY_PLACEMENTS]
    spread = [v for v in values if v in RAY_PLACEMENTS] + ([ray_placement] if ray_placement else [])
    if spread and not ray:
        raise ValueError(f"--ray-placement {spread[0]} places Ray actors: it needs --ray")
    if len(rules) > 1:
        raise ValueError(f"--placement takes one rule, got {rules}")
    if len(set(spread)) > 1:
        raise ValueError(f"--ray-placement takes one of spread / pack, got {spread}")
    return (rules or ["cost"])[0], (spread or ["spread"])[0]


def cmd_profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.plan.profile import Profile, ProfilePoints, describe, refit, run_profile

    out = Path(args.out)
    if not out.parent.is_dir():
        raise ValueError(f"--out {args.out}: directory {out.parent} does not exist")
    if args.refit:
        profile = refit(Profile.load(args.refit, flag="--refit"))
    else:
        config = engine_config_from_args(args)
        profile = run_profile(config, ProfilePoints.quick() if args.quick else ProfilePoints.full(), args.seed)
    profile.save(out)
    print(describe(profile))
    print(f"wrote {out}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from pdserve.plan.planner import Planner, report
    from pdserve.plan.profile import Profile, thread_profiles
    from pdserve.workload import parse_goodput, requests_from_args

    profile = Profile.load(args.profile, model=args.model)
    slos = parse_goodput(args.goodput)
    if args.nodes is not None:
        if args.thread_profile:
            raise ValueError("--thread-profile: --nodes N weighs shapes of N one-thread nodes; plan without --nodes")
        return plan_shape(args, profile, slos)
    planner = Planner(profile, requests_from_args(args), args.rate, slos, args.attainment, args.max_nodes, args.seed,
                      thread_profiles(args.thread_profile, profile), args.size_every_family)
    result = planner.plan()
    result.update({"profile": args.profile, "dataset": args.dataset, "date": time.strftime("%Y-%m-%d %H:%M:%S")})
    print(report(result, args.profile))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["pick"] else 1


def plan_shape(args: argparse.Namespace, profile, slos: dict[str, float]) -> int:
    """`pdserve plan --nodes N`: each shape of N nodes simulated at --rate with auto placing over it,
    and the one auto runs as."""
    import json
    from pathlib import Path

    from pdserve.plan.shape import MARGIN, pick_shape
    from pdserve.workload import requests_from_args

    pick = pick_shape(profile, requests_from_args(args), slos, args.nodes, [args.rate])
    print(f"{args.nodes} nodes at {args.rate:g} req/s, {' '.join(args.goodput)} (profile {args.profile}), "
          "auto placing each request over each shape:")
    for setup, (goodput,) in sorted(pick.goodput.items(), key=lambda kv: -kv[1][0]):
        print(f"  {setup:34s} goodput {goodput:.3f} req/s ({goodput / args.rate * 100:.1f} % meet the SLOs)")
    print(f"run as {pick.setup} ({pick.family.name}): " + ("disaggregate" if pick.disaggregated else
          f"do not disaggregate (PD must beat the best colocated shape by {MARGIN:.0%})"))
    if args.out:
        Path(args.out).write_text(json.dumps({"nodes": args.nodes, "rate": args.rate, "slos_ms": slos,
                                              "pick": pick.setup, "disaggregated": pick.disaggregated,
                                              "goodput": {k: v[0] for k, v in pick.goodput.items()}}, indent=1))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from pdserve.bench_serving import publish_run
    from pdserve.plan.profile import Profile, thread_profiles
    from pdserve.plan.sim import Setup, simulate
    from pdserve.workload import workload_from_args

    setup = replace(Setup.parse(args.setup), prefill_budget=args.prefill_max_num_batched_tokens,
                    decode_max_seqs=args.decode_max_num_seqs, prefill_threads=args.prefill_threads,
                    decode_threads=args.decode_threads)
    profile = Profile.load(args.profile)
    if args.one_host and not profile.corun_measured:
        logging.getLogger("pdserve").warning("--one-host: %s did not measure the co-run factors (a --quick "
                                             "profile): no node is slowed by the others", args.profile)
    slos, rate, requests = workload_from_args(args)
    summary = simulate(profile, setup, requests, rate, args.burstiness, args.seed, slos,
                       args.policy, args.kv_transport, args.max_num_batched_tokens, not args.no_chunked_prefill,
                       prefix_caching=False if args.no_prefix_caching else None, placement=args.placement,
                       prefill_cap=args.max_prefill_tokens_while_decoding, one_host=args.one_host,
                       thread_profiles=thread_profiles(args.thread_profile, profile))
    summary["profile"] = args.profile
    publish_run(summary, args)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.bench_serving import main as bench_main

    return bench_main(args)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload of `pdserve bench` (and of `pdserve simulate`, which replays the same requests)."""
    add_dataset_args(parser)
    parser.add_argument("--request-rate", default="inf", help="requests per second, or inf (all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson arrivals")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs, e.g. ttft:500 tpot:50 itl:200 (itl: each request's longest gap between tokens)")


def add_dataset_args(parser: argparse.ArgumentParser, num_prompts: int = 100) -> None:
    """Which requests: `pdserve bench`, `simulate` and `plan` read the same dataset flags."""
    parser.add_argument("--dataset", default="random",
                        help="random | mixed (its flags below) | a named workload: chat (mixed as it defaults), "
                             "summarize (1-4k tokens in, 32-128 out), generate (32-256 in, 256-1k out), "
                             "multiturn (its flags below), agentic (8 turns on a 1536-token system prompt, "
                             "256-token tool results, 64-token calls, 0.2 s apart) | a ShareGPT JSON file")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths vary by +- this fraction")
    parser.add_argument("--long-fraction", type=float, default=0.1, help="mixed: share of long documents")
    parser.add_argument("--short-input-len", type=int, default=128)
    parser.add_argument("--short-output-len", type=int, default=128)
    parser.add_argument("--long-input-len", type=int, default=2048)
    parser.add_argument("--long-output-len", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4, help="multiturn: turns per conversation")
    parser.add_argument("--system-prompt-len", type=int, default=512, help="multiturn: tokens of the shared system prompt")
    parser.add_argument("--turn-input-len", type=int, default=64, help="multiturn: tokens of each user turn")
    parser.add_argument("--turn-output-len", type=int, default=64, help="multiturn: tokens of each answer")
    parser.add_argument("--think-time", type=float, default=1.0, metavar="S",
                        help="multiturn: mean pause between an answer and the next turn (exponential)")
    parser.add_argument("--num-prompts", type=int, default=num_prompts,
                        help="requests (multiturn, agentic: conversations of --turns, or 8, requests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="model dir / GGUF for ShareGPT lengths and chat text")


PLACEMENT_HELP = ("auto: pdserve's cost-based choice, or a baseline rule: round_robin / least_loaded (always P "
                  "when the decode node is a D), threshold (Dynamo's), scorers (llm-d's)")
RAY_PLACEMENTS = ("spread", "pack")


def add_placement_args(parser: argparse.ArgumentParser, ray: bool = False) -> None:
    if ray:  # `pdserve up`: the rule, and with --ray where the node actors go
        parser.add_argument("--placement", action="append", choices=[*PLACEMENT_RULES.names(), *RAY_PLACEMENTS],
                            help=PLACEMENT_HELP + " (spread / pack: the older spelling of --ray-placement)")
        parser.add_argument("--ray-placement", choices=RAY_PLACEMENTS, default=None,
                            help="with --ray: spread the node actors across Ray nodes (the default) or pack them "
                                 "onto as few as fit")
    else:
        parser.add_argument("--placement", default="cost", choices=PLACEMENT_RULES.names(), help=PLACEMENT_HELP)
    parser.add_argument("--remote-prefill-threshold", type=int, default=512, metavar="TOKENS",
                        help="auto, threshold / scorers: uncached prompt tokens past which a P node prefills")
    parser.add_argument("--slo", nargs="+", default=None, metavar="KEY:MS",
                        help="ttft:MS tpot:MS itl:MS: auto's cost rule places requests so that the fewest miss them; "
                             "in every mode the dashboard's goodput counts by them")
    parser.add_argument("--no-dashboard", action="store_true",
                        help="keep no request records: no /dashboard, no /v1/requests, no goodput counter")


def add_guard_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", default=None,
                        help="require Authorization: Bearer <key> on the API (default: $PDSERVE_API_KEY)")
    parser.add_argument("--max-waiting", type=int, default=None, metavar="N",
                        help="answer 429 (Retry-After) once N requests are waiting")
    parser.add_argument("--otlp-endpoint", default=None, metavar="URL",
                        help="export OpenTelemetry traces to this OTLP/HTTP collector (default: "
                             "$OTEL_EXPORTER_OTLP_ENDPOINT; neither: tracing off). Needs pdserve[otel]")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with prefill/decode disaggregation")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="one-shot generation with the offline engine")
    add_engine_args(gen)
    gen.add_argument("--prompt", default="What is the capital of France?")
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="run a node: an OpenAI-compatible server over one engine")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--role", default="both", choices=["both", "prefill", "decode", "kv_both"],
                       help="both = colocated; prefill = kv_producer (P); decode = kv_consumer (D); kv_both = "
                            "colocated that also prefills for or decodes from other kv_both nodes (auto mode, pull)")
    serve.add_argument("--kv-host", default="127.0.0.1", help="address of the KV side channel (P)")
    serve.add_argument("--kv-port", type=int, default=0, help="port of the KV side channel (P); 0 = free port")
    serve.add_argument("--kv-transport", default="auto", choices=[AUTO, *TRANSPORTS],
                       help="how KV bytes move; auto = shm when the peer is on this host, else tcp")
    serve.add_argument("--kv-lease", "--kv-hold-timeout", dest="kv_lease", type=float, default=10.0, metavar="S",
                       help="P holds a prefill's KV for this lease, which the D that admitted the request renews "
                            "until it pulls; KV nobody pulls is freed this long after (D renews every third)")
    serve.add_argument("--kv-wait-timeout", type=float, default=30.0, metavar="S",
                       help="D gives up on a KV transfer after this many seconds")
    serve.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"],
                       help="D on a failed transfer: prefill locally, or answer an error")
    serve.add_argument("--kv-verify-digest", default="on", choices=["on", "off"],
                       help="D checks a digest (xxh3) of every transfer's bytes against P's (a mismatch fails the load)")
    add_guard_args(serve)
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    serve.add_argument("--kv-secret", default=None,
                       help="shared secret of the KV side channel (default: $PDSERVE_KV_SECRET)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--graceful-timeout", type=float, default=5.0, metavar="S")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(func=cmd_serve)

    proxy = sub.add_parser("proxy", help="run the PD proxy in front of prefill and decode nodes")
    urls = dict(nargs="+", action="extend", metavar="URL")  # `--node A B` and `--node A --node B` alike
    proxy.add_argument("--prefill", **urls, help="prefill node URLs (pull / push)")
    proxy.add_argument("--decode", **urls, help="decode node URLs (pull / push)")
    proxy.add_argument("--node", **urls, help="colocated (--role both) node URLs (colocated, auto)")
    proxy.add_argument("--kv-both", **urls, help="auto: --role kv_both node URLs (each serves whole requests, and "
                       "prefills for or decodes from the others)")
    proxy.add_argument("--policy", default="round_robin", choices=POLICIES.names())
    proxy.add_argument("--mode", default="pull", choices=FLOWS.names(),
                       help="pull: D reads P's KV after prefill; push: P writes each layer into D as computed; "
                            "colocated: load-balance --role both nodes; auto: per request, where to prefill and "
                            "decode, priced from --profile")
    proxy.add_argument("--profile", default=None, metavar="JSON", help="auto: a `pdserve profile` of the nodes' machine")
    proxy.add_argument("--model", default=None,
                       help="auto: the nodes' model (HF dir or .gguf; default: the embedded SmolLM2), to tokenize as they do")
    proxy.add_argument("--stall-weight", type=float, default=1.0, metavar="W",
                       help="auto: what a second of delay to each stream already decoding counts for, "
                            "against a second of the request's TTFT")
    add_placement_args(proxy)
    proxy.add_argument("--nodes-file", default=None, metavar="JSON",
                       help='nodes to route to, re-read when it changes: {"prefill": [URL...], "decode": [URL...]} '
                            '(colocated: {"node": [URL...]}; auto also {"kv_both": [URL...]}); adds to the flags')
    proxy.add_argument("--meta-url", default=None,
                       help="push: the URL decode nodes use to announce blocks (default: this proxy's /v1/kv/meta)")
    proxy.add_argument("--host", default="127.0.0.1")
    proxy.add_argument("--port", type=int, default=8000)
    proxy.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_guard_args(proxy)
    proxy.set_defaults(func=cmd_proxy)

    up = sub.add_parser("up", help="start proxy + prefill + decode nodes on this machine")
    up.add_argument("--prefill", type=int, default=1, help="number of prefill nodes")
    up.add_argument("--decode", type=int, default=1, help="number of decode nodes")
    up.add_argument("--prefill-tp", type=int, default=1, metavar="N", help="tensor parallel size of each prefill node")
    up.add_argument("--decode-tp", type=int, default=1, metavar="N", help="tensor parallel size of each decode node")
    # The flows that route to P and D nodes (colocated nodes alone: --colocated N).
    pd_flows = [name for name, flow in FLOWS.classes().items() if "prefill" in flow.roles]
    up.add_argument("--mode", default="pull", choices=pd_flows,
                    help="auto: per request, prefill on a P node or on the node that decodes (priced by --profile)")
    up.add_argument("--nodes", type=int, default=None, metavar="N",
                    help="auto: N nodes. With --slo, in the shape of N nodes --shape picks (P and D nodes, or "
                         "kv_both ones); else N --role kv_both nodes: per request, a node prefills and decodes it, "
                         "or one prefills and another pulls the KV and decodes (a superset of colocated x N)")
    up.add_argument("--shape", default="plan", choices=["plan", "kv_both"],
                    help="auto --nodes N with --slo: plan (default): run as the shape of N nodes the simulator "
                         "finds best for --workload under the SLOs (N kv_both nodes, or P and D nodes, e.g. 1P1D "
                         "under an ITL SLO), then place each request within it; kv_both: always N kv_both nodes")
    up.add_argument("--workload", default=None, metavar="NAME",
                    help="auto --shape plan: the load to choose the shape for, one of bench's named datasets "
                         "(chat, the default; summarize, generate, multiturn, agentic)")
    up.add_argument("--rate", type=float, nargs="+", default=None, metavar="R",
                    help="auto --shape plan: the expected load(s), req/s (default: a quarter, half and all of "
                         "what the idle nodes serve one request at a time each)")
    up.add_argument("--profile", default=None, metavar="JSON",
                    help="auto: a `pdserve profile` of this machine (default: the one cached for this machine, model "
                         "and node settings, else a quick one measured at start, about 2 minutes, and cached)")
    up.add_argument("--stall-weight", type=float, default=1.0, metavar="W", help="auto: see `pdserve proxy --help`")
    add_placement_args(up, ray=True)
    up.add_argument("--colocated", type=int, default=0, metavar="N",
                    help="instead of P/D: N colocated (--role both) nodes behind the proxy")
    up.add_argument("--max-num-batched-tokens", type=int, default=2048)
    add_role_args(up)
    up.add_argument("--no-chunked-prefill", action="store_true")
    up.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None, metavar="N",
                    help=PREFILL_CAP_HELP)
    up.add_argument("--policy", default="round_robin", choices=POLICIES.names())
    up.add_argument("--host", default="127.0.0.1", help="where the proxy listens")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--model", default=None, help=MODEL_HELP)
    add_dtype_arg(up)
    add_quantization_arg(up)
    add_kv_cache_dtype_arg(up)
    add_batch_invariant_arg(up)
    up.add_argument("--kv-cache-memory", type=float, default=0.5, metavar="GiB")
    up.add_argument("--kv-transport", default="auto", choices=[AUTO, *TRANSPORTS])
    up.add_argument("--max-model-len", type=int, default=None)
    up.add_argument("--startup-timeout", type=float, default=300.0, metavar="S")
    up.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    up.add_argument("--ray", nargs="?", const="auto", default=None, metavar="auto|ADDRESS",
                    help="run the nodes as Ray actors: auto (this machine's Ray cluster, or a new one) or a "
                         "cluster's HOST:PORT; needs pip install 'pdserve[ray]'")
    up.add_argument("--ray-cpus", type=float, default=1.0, metavar="N", help="--ray: CPUs each node reserves")
    up.add_argument("--ray-max-restarts", type=int, default=3, metavar="N",
                    help="--ray: how often Ray restarts a node actor that dies (-1: always)")
    add_guard_args(up)
    up.set_defaults(func=cmd_up)

    profile = sub.add_parser("profile", help="measure this machine's engine and fit a cost model (for planning)")
    add_engine_args(profile)
    profile.add_argument("--quick", action="store_true", help="fewer points: under a minute here")
    profile.add_argument("--refit", default=None, metavar="JSON",
                         help="measure nothing: fit this pdserve's cost models again to the samples that profile holds")
    profile.add_argument("--out", required=True, help="where to write the profile (JSON)")
    profile.add_argument("--seed", type=int, default=0, help="seed of the random token prompts")
    profile.set_defaults(func=cmd_profile)

    simulate = sub.add_parser("simulate", help="predict a bench run on a setup from a profile (no model runs)")
    simulate.add_argument("--profile", required=True, help="the JSON `pdserve profile` wrote")
    add_thread_profile_arg(simulate)
    simulate.add_argument("--setup", required=True,
                          help="colocated:N | pull:xPyD | push:xPyD | auto:N | auto:xPyD (auto: per-request placement; "
                               "auto:N over N kv_both nodes)")
    simulate.add_argument("--policy", default="round_robin", choices=POLICIES.names())
    simulate.add_argument("--kv-transport", default="shm", choices=list(TRANSPORTS))
    simulate.add_argument("--max-num-batched-tokens", type=int, default=None,
                          help="every node's token budget per step (default: the profiled node's)")
    add_role_args(simulate)
    simulate.add_argument("--no-chunked-prefill", action="store_true", help="a prompt is prefilled in one step")
    simulate.add_argument("--max-prefill-tokens-while-decoding", type=int, default=None, metavar="N",
                          help="every node's cap on prompt tokens per step while streams decode (pdserve serve's)")
    simulate.add_argument("--one-host", action="store_true",
                          help="every node on its own core of this one host, as `pdserve up` starts them: a step "
                               "runs slower while another node computes (the profile's co-run factors)")
    simulate.add_argument("--no-prefix-caching", action="store_true",
                          help="every prompt computed in full (default: cached prefixes reused when the workload "
                               "has conversations or the setup is auto)")
    simulate.add_argument("--placement", default="cost", choices=PLACEMENT_RULES.names(),
                          help="auto setups: how each request is placed (as `pdserve proxy --placement`); "
                               "the cost rule counts SLO misses first when --goodput names SLOs")
    add_workload_args(simulate)
    simulate.add_argument("--out", default=None, help="write the results as JSON here (pdserve bench's fields)")
    simulate.set_defaults(func=cmd_simulate)

    plan = sub.add_parser("plan", help="the fewest nodes (colocated or P:D) that meet SLOs at a rate, from a profile")
    plan.add_argument("--profile", required=True, help="the JSON `pdserve profile` wrote")
    add_thread_profile_arg(plan)
    plan.add_argument("--model", default=None, help="refuse a profile of another model (name or part of it)")
    plan.add_argument("--rate", type=float, required=True, help="requests per second to serve")
    plan.add_argument("--goodput", nargs="+", required=True, metavar="METRIC:MS",
                      help="SLOs, e.g. ttft:2000 tpot:60 (itl:MS too)")
    plan.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLOs")
    plan.add_argument("--max-nodes", type=int, default=64,
                      help="the largest cluster to consider (up to 1000), in cores: a node of N threads counts N")
    plan.add_argument("--nodes", type=int, default=None, metavar="N",
                      help="instead: the best shape of exactly N nodes at --rate (colocated or P:D, as "
                           "`pdserve up --mode auto --nodes N` picks it): should these N nodes disaggregate?")
    plan.add_argument("--size-every-family", action="store_true",
                      help="size each setup family exactly (default: one that cannot pass within the cheapest "
                           "found before it is reported as needing more, which answers faster)")
    add_dataset_args(plan, num_prompts=2000)
    plan.set_defaults(dataset="mixed")
    plan.add_argument("--out", default=None, help="write every setup's figures as JSON here")
    plan.set_defaults(func=cmd_plan)

    bench = sub.add_parser("bench", help="online serving benchmark against any OpenAI-compatible server")
    bench.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    bench.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    bench.add_argument("--model", default=None, help="model name to send (default: the server's choice)")
    add_workload_args(bench)
    bench.add_argument("--max-concurrency", type=int, default=None)
    bench.add_argument("--out", default=None, help="write the results as JSON here")
    bench.add_argument("--plot", default=None, help="write TTFT / TPOT CDFs as a PNG here (needs matplotlib)")
    bench.add_argument("--trace-out", default=None, metavar="FILE",
                       help="write each request's record as a pdserve proxy kept it (GET /v1/requests/{id}: stages, "
                            "nodes, KV moved) beside the client's timings, as JSON")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    load_plugins()  # $PDSERVE_PLUGINS: their flows, policies, rules and models are choices too
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
