"""KV transfer benchmark: each backend's GB/s against memcpy, and the transfer's share of TTFT.

    python -m pdserve.benchmarks.transfer [--mib 64] [--repeats 5] [--prompt-lens 512 2048]
                                          [--sweep-tokens 16 128 1024 4096] [--hosts]

Part 1 moves a SmolLM2-shaped set of blocks between two processes with the real connector code,
over every transport that runs here (tcp, shared memory, Mooncake and NIXL where they are
installed), contiguous and scattered, against memcpy of the same segments
(pdserve.plan.measure.bench_backends, which profiles use too). Part 2 starts real P and D nodes
(one core each) and measures, for 512- and 2048-token prompts, TTFT = P's prefill request + D's time to its first streamed token,
and how much of it was the KV transfer (D's x-pdserve-kv-load-ms). With --hosts (root), part 1
again between two network-namespace hosts (P's process in one, D's in the other), against the
link's raw TCP throughput between them (iperf-style: one stream into a sink on the other host).
Writes docs/results/transfer.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import struct
import subprocess
import sys
import time

import httpx
import torch

from pdserve.benchmarks.report import publish
from pdserve.kv.transport import PeerAddress, available, transport_class
from pdserve.plan.measure import BLOCK, bench_backends, pin_to
from pdserve.platform import CpuInfo, plan_kernels
from pdserve.testing.netns import NETWORK_ONLY, Host, Hosts, why_not


def bench_ttft(prompt_lens: list[int], repeats: int, dtype: str) -> dict:
    from pdserve.procs import Child, ProcessGroup, cluster_env

    common = ["--dtype", dtype, "--threads", "1", "--log-level", "warning"]
    nodes = {"p": Child.on_free_port("p", ["serve", "--role", "prefill", *common], (0,))}
    for transport in available():  # a D node pulling over each (mooncake where its engine is installed)
        nodes[transport] = Child.on_free_port(f"d-{transport}", ["serve", "--role", "decode", "--kv-transport",
                                                                  transport, *common], (1,))
    # The verified handoff's digests cost (issue 39): tcp again without them.
    nodes[UNCHECKED] = Child.on_free_port("d-unchecked", ["serve", "--role", "decode", "--kv-transport", "tcp",
                                                          "--kv-verify-digest", "off", *common], (1,))
    cluster = ProcessGroup(cluster_env())
    out: dict = {}
    try:
        cluster.launch(list(nodes.values()), 300)
        g = torch.Generator().manual_seed(0)
        with httpx.Client(timeout=600) as client:
            for length in prompt_lens:
                for transport in (*available(), UNCHECKED):
                    rows = []
                    for _ in range(repeats + 1):  # the first run warms up this shape
                        prompt = torch.randint(1000, 40000, (length,), generator=g).tolist()
                        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                "kv_transfer_params": {"do_remote_decode": True}}
                        start = time.perf_counter()
                        p = client.post(nodes["p"].url + "/v1/completions", json=body)
                        prefill_s = time.perf_counter() - start
                        kv = p.json()["kv_transfer_params"]
                        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "kv_transfer_params": kv}
                        with client.stream("POST", nodes[transport].url + "/v1/completions", json=body) as d:
                            load_s = float(d.headers["x-pdserve-kv-load-ms"]) / 1e3
                            lines = d.iter_lines()
                            next(line for line in lines if line.startswith("data:"))
                            ttft = time.perf_counter() - start
                            for _ in lines:
                                pass
                        rows.append({"ttft_s": ttft, "prefill_s": prefill_s, "transfer_s": load_s})
                    rows = rows[1:]
                    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
                    med["transfer_share"] = med["transfer_s"] / med["ttft_s"]
                    out[f"{transport}_{length}"] = med
    finally:
        cluster.stop()
    return out


UNCHECKED = "tcp, digest off"


def digest_ms(tokens: int, repeats: int) -> float:
    """One end's cost of the verified handoff's digests for a request of `tokens` (SmolLM2's KV
    shape, bf16, scattered blocks): gather + xxh3 of every block, best of `repeats`, ms."""
    from pdserve.kv.pool import KVPool
    from pdserve.kv.tp_plan import Piece
    from pdserve.kv.transport import NodeTransports
    from pdserve.plan.measure import DTYPE, KV_HEADS, pool_shape

    n = max(1, tokens // BLOCK)
    pool = KVPool(pool_shape(4 * n), DTYPE, "cpu")
    pool.tensor.normal_()
    ids = random.Random(0).sample(range(4 * n), n)
    plan = [Piece(0, range(KV_HEADS), 0, range(KV_HEADS))]
    runs = pool.group_runs(0, 0, n)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        NodeTransports([pool]).digests(plan, runs, [ids])
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def sweep(tokens: list[int], repeats: int, **where) -> dict:
    """Per request size (its prompt tokens, whole blocks of 16): ms per request and GB/s of each
    transport, contiguous and scattered blocks (`where`: bench_backends' names / host / prefix)."""
    out = {}
    for n in tokens:
        res = bench_backends(0, repeats, blocks=max(1, n // BLOCK), **where)
        out[str(n)] = {"bytes": res["bytes"], **{k: v for k, v in res.items() if k.endswith("_gbps")}}
    return out


def sink(host: str) -> None:
    """The far end of link_gbps: reads each length-prefixed message whole, answers one byte."""
    pin_to(0)
    buf = memoryview(bytearray(1 << 20))
    with socket.create_server((host, 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        with conn:
            while header := conn.recv(8, socket.MSG_WAITALL):
                left = struct.unpack("!Q", header)[0]
                while left:
                    got = conn.recv_into(buf[:min(left, len(buf))])
                    if not got:
                        return
                    left -= got
                conn.sendall(b"\1")


def link_gbps(host: str, server_prefix: tuple[str, ...], nbytes: int, repeats: int) -> float:
    """The link's raw throughput, iperf-style: one TCP stream sending `nbytes` into a sink process
    behind `server_prefix` (on the other host) until it has read them all; best of `repeats`."""
    proc = subprocess.Popen([*server_prefix, sys.executable, "-m", "pdserve.benchmarks.transfer", "--sink", host],
                            stdout=subprocess.PIPE, text=True)
    payload = memoryview(bytearray(nbytes))
    times = []
    try:
        with socket.create_connection((host, int(proc.stdout.readline()))) as conn:
            for _ in range(repeats):
                start = time.perf_counter()
                conn.sendall(struct.pack("!Q", nbytes))
                conn.sendall(payload)
                if conn.recv(1) != b"\1":
                    raise RuntimeError("the link sink closed early")
                times.append(time.perf_counter() - start)
    finally:
        proc.wait(30)
    return nbytes / min(times) / 1e9


def measure_from(ns: str, address: str, here: str, mib: int, repeats: int, tokens: list[int],
                 names: tuple[str, ...] | None) -> dict:
    """In one namespace host (D's side, KV host `here`), P's side in namespace `ns` at `address`:
    each transport that reaches it (shm does not cross hosts), memcpy, and the raw link, at `mib`
    MiB and at each request size of `tokens`."""
    pin_to(1)
    os.environ.update(NETWORK_ONLY)  # (measured without it: NIXL above the raw link's speed)
    prefix = ("ip", "netns", "exec", ns)
    peer = PeerAddress(address, available())
    names = names or tuple(n for n in available() if transport_class(n).reaches(peer))
    where = {"names": names, "host": address, "server_prefix": prefix, "here": here}
    out = {"backends": bench_backends(mib, repeats, **where), "sweep": sweep(tokens, repeats, **where)}
    out["backends"]["link_gbps"] = link_gbps(address, prefix, out["backends"]["bytes"], repeats)
    for row in out["sweep"].values():
        row["link_gbps"] = link_gbps(address, prefix, row["bytes"], repeats)
    return out


def between_hosts(hosts: list[Host], mib: int, repeats: int, tokens: list[int],
                  names: tuple[str, ...] | None = None) -> dict:
    """measure_from run in the first namespace host against the second: read its JSON back."""
    argv = [sys.executable, "-m", "pdserve.benchmarks.transfer", "--measure-from", hosts[1].ns, hosts[1].address,
            hosts[0].address, "--mib", str(mib), "--repeats", str(repeats), "--sweep-tokens", *map(str, tokens)]
    if names:
        argv += ["--transports", *names]
    done = hosts[0].run(argv, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the transfer benchmark between hosts failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def backends_table(b: dict, names: tuple[str, ...]) -> list[str]:
    lines = ["| backend | contiguous blocks GB/s | scattered blocks GB/s |", "|---|---|---|"]
    return lines + [f"| {n} | {b[f'{n}_contiguous_gbps']:.2f} | {b[f'{n}_scattered_gbps']:.2f} |" for n in names]


def sweep_table(sweep: dict, names: tuple[str, ...], link: bool = False) -> list[str]:
    """ms per request by its size, contiguous / scattered (and the raw link's ms for the same bytes)."""
    cols = (*names, "link") if link else names
    lines = ["| tokens | MiB | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for tokens, row in sweep.items():
        ms = [f"{row['bytes'] / row[f'{n}_contiguous_gbps'] / 1e6:.2f} / "
              f"{row['bytes'] / row[f'{n}_scattered_gbps'] / 1e6:.2f}" for n in names]
        if link:
            ms.append(f"{row['bytes'] / row['link_gbps'] / 1e6:.2f}")
        lines.append(f"| {tokens} | {row['bytes'] / 2**20:.2f} | " + " | ".join(ms) + " |")
    return lines


def transports_in(b: dict) -> tuple[str, ...]:
    return tuple(k.removesuffix("_contiguous_gbps") for k in b if k.endswith("_contiguous_gbps"))


def hosts_summary(h: dict) -> list[str]:
    """The issue's targets at the largest swept request: the best transport's share of the link,
    each transfer engine against pdserve's tcp."""
    tokens = max(h["sweep"], key=int)
    row = h["sweep"][tokens]
    names = [n for n in transports_in(row) if n != "memcpy"]
    best = max(names, key=lambda n: row[f"{n}_contiguous_gbps"])
    lines = [f"- {tokens}-token request ({row['bytes'] / 2**20:.1f} MiB), contiguous blocks: the best transport, "
             f"{best}, {row[f'{best}_contiguous_gbps']:.2f} GB/s = **{row[f'{best}_contiguous_gbps'] / row['link_gbps']:.0%}"
             f"** of the raw link's {row['link_gbps']:.2f} GB/s (target >= 80 %)."]
    for n in names:
        if n != "tcp" and "tcp" in names:
            lines.append(f"- {n} against pdserve's tcp at {tokens} tokens: "
                         f"{row[f'{n}_contiguous_gbps'] / row['tcp_contiguous_gbps']:.2f}x contiguous, "
                         f"{row[f'{n}_scattered_gbps'] / row['tcp_scattered_gbps']:.2f}x scattered (target >= 0.8x).")
    return lines


def markdown(res: dict, args) -> str:
    b = res["backends"]
    lines = [
        f"Command: `python -m pdserve.benchmarks.transfer --mib {args.mib} --repeats {args.repeats}"
        f"{' --hosts' if res.get('hosts') else ''}` "
        f"({res['date']}; {res.get('cpu', 'CPU not recorded')}; P and D pinned to different cores).",
        "",
        f"Moving {b['bytes'] / 2**20:.0f} MiB ({b['blocks']} blocks x 30 layers x K/V, bf16) from P to D, one host:",
        "",
        *backends_table(b, transports_in(b)),
    ]
    if res.get("sweep"):
        lines += ["", "Time per request by its size (prompt tokens, whole 16-token blocks), ms, contiguous / "
                  "scattered blocks (GB/s in docs/results/transfer.json):", "",
                  *sweep_table(res["sweep"], transports_in(next(iter(res["sweep"].values()))))]
    if res.get("hosts"):
        h = res["hosts"]
        hb = h["backends"]
        lines += ["", f"Between two hosts: network namespaces on one machine joined by veth pairs and a bridge "
                  f"(pdserve.testing.netns), P's process in one and D's in the other; shm does not cross hosts, "
                  f"and NIXL's UCX is held to tcp (UCX_TLS=tcp: it would otherwise reach the other namespace "
                  f"through shared memory, as separate hosts cannot). "
                  f"The raw link: one TCP stream into a sink process on the other host (iperf-style), "
                  f"{hb['link_gbps']:.2f} GB/s for {hb['bytes'] / 2**20:.0f} MiB.", "",
                  *backends_table(hb, transports_in(hb)), ""]
        if h.get("sweep"):
            lines += ["Time per request between the hosts, ms, contiguous / scattered (link: the same bytes "
                      "over the raw link):", "",
                      *sweep_table(h["sweep"], transports_in(next(iter(h["sweep"].values()))), link=True), "",
                      *hosts_summary(h)]
    lines += ["", "Transfer time inside TTFT (real P and D nodes, median of the runs):", "",
              "| prompt tokens | transport | TTFT (ms) | P prefill request (ms) | KV transfer (ms) | transfer share |",
              "|---|---|---|---|---|---|"]
    for key, row in res["ttft"].items():
        transport, length = key.rsplit("_", 1)
        lines.append(f"| {length} | {transport} | {row['ttft_s'] * 1e3:.0f} | {row['prefill_s'] * 1e3:.0f} | "
                     f"{row['transfer_s'] * 1e3:.1f} | {row['transfer_share'] * 100:.1f} % |")
    if res.get("digest_ms"):
        d = res["digest_ms"]
        lines += ["", "The verified handoff's digests (issue 39; D's `--kv-verify-digest`, on by default): xxh3 of "
                  "every block moved, computed on each end (P while D computes its own), one end's cost for "
                  "scattered blocks: " + ", ".join(f"{n} tokens {ms:.1f} ms" for n, ms in d.items()) + "."]
        for length in (n for n in ("2048", "512") if f"tcp_{n}" in res["ttft"] and f"{UNCHECKED}_{n}" in res["ttft"]):
            on, off = res["ttft"][f"tcp_{length}"], res["ttft"][f"{UNCHECKED}_{length}"]
            # D's part (TTFT after P answered): P's prefill varies more run to run than the digest costs.
            d_on, d_off = (row["ttft_s"] - row["prefill_s"] for row in (on, off))
            lines.append(f"- {length} tokens over tcp: TTFT {on['ttft_s'] * 1e3:.0f} ms with the digest, "
                         f"{off['ttft_s'] * 1e3:.0f} ms without, of which after P answered {d_on * 1e3:.1f} / "
                         f"{d_off * 1e3:.1f} ms (the prefill requests: {on['prefill_s'] * 1e3:.0f} / "
                         f"{off['prefill_s'] * 1e3:.0f} ms); one end's digest is "
                         f"{d.get(length, float('nan')) / (on['ttft_s'] * 1e3):.1%} of TTFT (target <= 2 %).")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--sweep-tokens", type=int, nargs="*", default=[16, 128, 1024, 4096],
                        help="request sizes (prompt tokens) to time each transport at (none: skip)")
    parser.add_argument("--dtype", default="auto", help="auto: what this CPU runs fastest (see pdserve.platform)")
    parser.add_argument("--hosts", action="store_true",
                        help="also between two network-namespace hosts on this machine (needs root)")
    parser.add_argument("--out", default="docs/results/transfer.json")
    parser.add_argument("--measure-from", nargs=3, metavar=("NS", "ADDRESS", "HERE"), help=argparse.SUPPRESS)
    parser.add_argument("--transports", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--sink", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sink:  # the raw link's far end
        return sink(args.sink)
    if args.measure_from:  # inside the first namespace host: P's side runs in the other one
        ns, address, here = args.measure_from
        transports = tuple(args.transports) if args.transports else None
        print(json.dumps(measure_from(ns, address, here, args.mib, args.repeats, args.sweep_tokens, transports)))
        return
    if args.hosts and (reason := why_not()):
        sys.exit(f"transfer --hosts: {reason}")
    args.dtype = plan_kernels(args.dtype).dtype  # named in the report, passed to every node
    cpu = CpuInfo.detect()
    res = {"date": time.strftime("%Y-%m-%d"), "cpu": f"{cpu.model}, {cpu.isa}",
           "backends": bench_backends(args.mib, args.repeats), "sweep": sweep(args.sweep_tokens, args.repeats)}
    if args.hosts:
        with Hosts(2) as hosts:
            res["hosts"] = between_hosts(hosts, args.mib, args.repeats, args.sweep_tokens)
    res["digest_ms"] = {str(n): digest_ms(n, args.repeats) for n in (512, 2048, 4096)}
    res["ttft"] = bench_ttft(args.prompt_lens, max(args.repeats // 2, 2), args.dtype)
    publish(res, args.out, "transfer", "KV transfer: backends and share of TTFT", markdown(res, args))


if __name__ == "__main__":
    main()
