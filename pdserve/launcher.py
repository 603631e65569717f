"""`pdserve up`: P nodes, D nodes and the proxy as child processes on loopback, one core each.

The children form one `ProcessGroup` (pdserve.procs): each dies with this process even if it is
killed outright, and on Ctrl-C / SIGTERM all are stopped (SIGTERM, then SIGKILL) before exit.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from pdserve.procs import Child, ProcessGroup, cluster_env
from pdserve.proxy.membership import ROLE_FLAGS


def plan_cores(threads: list[int], available: list[int] | None = None) -> list[tuple[int, ...] | None]:
    """Each node's own cores, one per thread, when the machine (`available`: the cores this process
    may use) has enough; else no pinning."""
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    if len(cores) < sum(threads):
        return [None] * len(threads)
    starts = [sum(threads[:i]) for i in range(len(threads))]
    return [tuple(cores[start:start + n]) for start, n in zip(starts, threads)]


class StopSignal:
    """Set by SIGINT / SIGTERM (Ctrl-C): `pdserve up` then stops everything it started."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGINT, self._set)
        signal.signal(signal.SIGTERM, self._set)

    def _set(self, signum, frame) -> None:
        self.requested = True


def node_roles(args) -> list[str]:
    """The nodes `pdserve up` starts, by role."""
    if getattr(args, "nodes", None):  # auto over nodes that can each prefill, decode, or both
        return ["kv_both"] * args.nodes
    if args.colocated:
        return ["both"] * args.colocated
    return ["prefill"] * args.prefill + ["decode"] * args.decode


def node_threads(args, role: str) -> int | None:
    """The threads a `role` node was given (--prefill-threads, --decode-threads); None: one when pinned."""
    return {"prefill": args.prefill_threads, "decode": args.decode_threads}.get(role)


def node_tp(args, role: str) -> int:
    """The TP size of a node of `role`: --prefill-tp, --decode-tp (colocated nodes: 1)."""
    return {"prefill": args.prefill_tp, "decode": args.decode_tp}.get(role, 1)


def check_node_tp(args) -> None:
    """ValueError naming the flag whose TP size cannot split the model (before any node starts)."""
    from pdserve.models.locate import resolve_model_dir
    from pdserve.models.parallel import TensorParallel
    from pdserve.models.registry import read_model_config

    config = read_model_config(resolve_model_dir(args.model))
    for flag, tp in (("--prefill-tp", args.prefill_tp), ("--decode-tp", args.decode_tp)):
        try:
            TensorParallel(0, tp).check(config.num_heads, config.num_kv_heads, config.intermediate_size)
        except ValueError as exc:
            raise ValueError(f"{flag} {tp}: {exc}") from None


def node_command(args, model: str | None, role: str) -> list[str]:
    """A `role` node's `pdserve serve` options from `pdserve up`'s (address and pinning apart): TP
    size and the per-role settings by role; model None: each node resolves the embedded one."""
    from pdserve.models.locate import default_model_name

    budget = (args.prefill_max_num_batched_tokens if role == "prefill" else None) or args.max_num_batched_tokens
    command = ["--model", model] if model else []
    command += ["--served-model-name", default_model_name(args.model), "--dtype", args.dtype,
               "--quantization", args.quantization, "--kv-cache-dtype", args.kv_cache_dtype,
               "--kv-cache-memory", str(args.kv_cache_memory),
               "--kv-transport", args.kv_transport, "--log-level", args.log_level,
               "--max-num-batched-tokens", str(budget)]
    if node_tp(args, role) > 1:
        command += ["--tensor-parallel-size", str(node_tp(args, role))]
    if role == "decode" and args.decode_max_num_seqs:
        command += ["--max-num-seqs", str(args.decode_max_num_seqs)]
    if node_threads(args, role):
        command += ["--threads", str(node_threads(args, role))]
    if args.max_model_len:
        command += ["--max-model-len", str(args.max_model_len)]
    if args.no_chunked_prefill:
        command.append("--no-chunked-prefill")
    if args.max_prefill_tokens_while_decoding is not None:
        command += ["--max-prefill-tokens-while-decoding", str(args.max_prefill_tokens_while_decoding)]
    if args.batch_invariant:
        command.append("--batch-invariant")
    return command


def node_engine_config(args):
    """The engine settings every node of `pdserve up` runs (as node_command passes them), one
    thread like each pinned node: what auto mode's profile must price."""
    from pdserve.config import EngineConfig

    tp = args.prefill_tp > 1 or args.decode_tp > 1  # TP nodes are not pinned (run_up)
    return EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                        kv_cache_dtype=args.kv_cache_dtype, batch_invariant=args.batch_invariant,
                        threads=None if tp else 1, kv_cache_memory_gib=args.kv_cache_memory,
                        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_chunked_prefill=not args.no_chunked_prefill,
                        max_prefill_tokens_while_decoding=args.max_prefill_tokens_while_decoding)


def proxy_command(args, model_dir: str, host: str) -> list[str]:
    """The proxy's `pdserve proxy` options from `pdserve up`'s, its nodes apart."""
    command = ["proxy", "--host", host, "--port", str(args.port), "--policy", args.policy, "--log-level", args.log_level]
    if args.max_waiting is not None:
        command += ["--max-waiting", str(args.max_waiting)]
    if args.slo:  # auto's placements keep to them; in every mode the dashboard's goodput counts by them
        command += ["--slo", *args.slo]
    if args.no_dashboard:
        command.append("--no-dashboard")
    if args.colocated:
        return command + ["--mode", "colocated"]
    if args.mode == "auto":
        return command + ["--mode", "auto", "--profile", args.profile, "--model", model_dir,
                          "--stall-weight", str(args.stall_weight), "--placement", args.placement,
                          "--remote-prefill-threshold", str(args.remote_prefill_threshold)]
    return command + ["--mode", args.mode]


def node_flags(nodes: list[tuple[str, str]]) -> list[str]:
    """The proxy's --prefill / --decode / --node / --kv-both lists for (role, url) pairs."""
    flags = []
    for role, flag in ROLE_FLAGS.items():
        urls = [url for r, url in nodes if r == role]
        flags += [flag, *urls] if urls else []
    return flags


def one_thread(args, role: str, pinned: tuple[int, ...] | None) -> list[str]:
    """A node of no --prefill-threads / --decode-threads runs one thread when pinned to its core, or
    when the other role's nodes were given theirs (node_command passes those)."""
    by_role = args.prefill_threads or args.decode_threads
    return ["--threads", "1"] if (pinned or by_role) and not node_threads(args, role) else []


def run_up(args) -> int:
    from pdserve.models.locate import resolve_model_dir
    from pdserve.platform import plan_kernels

    # Convert the model once here, so that the nodes do not race to fill the cache.
    model_dir = str(resolve_model_dir(args.model))
    plan = plan_kernels(args.dtype)  # what each node will choose on this machine (a bad setting stops us here)
    roles = node_roles(args)
    # A TP node's ranks share the cores it may use: with TP, no node is pinned (each rank takes its
    # share of the machine's cores).
    tp = any(node_tp(args, role) > 1 for role in roles)
    cores = [None] * len(roles) if tp else plan_cores([node_threads(args, role) or 1 for role in roles])
    nodes = [
        Child.on_free_port(f"{role}-{i}", ["serve", "--role", role, *one_thread(args, role, pinned),
                                           *node_command(args, model_dir, role)], pinned, role)
        for i, (role, pinned) in enumerate(zip(roles, cores))
    ]
    cluster = ProcessGroup(cluster_env(args.api_key, args.otlp_endpoint))  # with an API key every node and the proxy require it
    stop = StopSignal()
    try:
        shape = ({"both": f"{len(roles)} colocated", "kv_both": f"{len(roles)} kv_both"}.get(roles[0])
                 or f"{args.prefill} prefill (TP {args.prefill_tp}) + {args.decode} decode (TP {args.decode_tp})")
        pinning = [list(c) if c else None for c in cores]
        print(f"pdserve up: starting {shape} node(s) (cores: {pinning}) on {plan.describe()}", flush=True)
        cluster.launch(nodes, args.startup_timeout)
        proxy_args = proxy_command(args, model_dir, args.host) + node_flags([(n.role, n.url) for n in nodes])
        proxy = Child("proxy", proxy_args, f"http://{args.host}:{args.port}", None)
        cluster.launch([proxy], 60)
        print_ready(proxy.url, "colocated" if args.colocated else args.mode)
        while not stop.requested:
            dead = cluster.dead_child()
            if dead is not None:
                print(f"pdserve up: {dead.name} exited with status {dead.proc.returncode}; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        print("pdserve up: stopping", flush=True)
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()


def print_ready(url: str, mode: str) -> None:
    print(
        f"\npdserve is ready ({mode} mode): {url}\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}], "
        f"\"max_tokens\": 64, \"temperature\": 0}}'\n\n"
        "Ctrl-C stops every process.\n",
        flush=True,
    )
