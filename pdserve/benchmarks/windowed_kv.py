"""What a PD transfer of Gemma 3 270M moves: each sliding layer's window against every layer in full.

    python -m pdserve.benchmarks.windowed_kv [--prompt-lens 512 2048 8192] [--repeats 30]

Gemma 3 270M keeps K and V of one KV head (head dim 256) in 18 layers, 15 of them sliding (window
512). D needs the global layers' KV of the whole prompt but a sliding layer's only for its last
window. For each prompt length: the KV bytes per request both ways (the connector's own count,
`KVPool.group_runs`), and the time of a pull and of a push over tcp and shm through the connector's
real path (side channel, transports; both ends in this process on threads, without the model), the
windowed transfer against the full one. Median of `--repeats` (pools in bfloat16, as `auto` runs
here). And the KV a node holds for such a request (the block manager's own count, driven as the
scheduler drives it: a prefill in chunks of 2048 tokens, then a decode step): KV groups whose
sliding blocks go back to the pool as they leave the window, against every layer keeping every
block. Writes docs/results/windowed_kv.json and a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.benchmarks.report import publish
from pdserve.benchmarks.tp_transfer import time_pull, time_push
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request
from pdserve.kv.params import join_tables
from pdserve.kv.pool import KVPool
from pdserve.kv.transport import NodeTransports, available
from pdserve.models.locate import resolve_model_dir
from pdserve.models.registry import model_class, read_model_config
from pdserve.platform import CpuInfo
from pdserve.sampling_params import SamplingParams

BLOCK = 16
CHUNK = 2048  # the engine's default max_num_batched_tokens


def held_blocks(spec, prompt_len: int) -> tuple[int, int]:
    """(most blocks held while the prompt is computed in chunks, blocks held at its first decode
    step) of one request, by the block manager with the model's KV groups."""
    manager = BlockManager(1 << 20, BLOCK, group_windows=tuple(g.window for g in spec.groups))
    req = Request("r", list(range(prompt_len)), SamplingParams(max_tokens=1), None, (), prompt_len + 1, None)
    peak = 0
    while req.num_computed_tokens < prompt_len:
        n = min(CHUNK, prompt_len - req.num_computed_tokens)
        assert manager.allocate(req, n)
        peak = max(peak, manager.num_used_blocks)
        req.num_computed_tokens += n
    req.token_ids.append(0)
    assert manager.allocate(req, 1)
    return peak, manager.num_used_blocks


def measure(spec, prompt_len: int, repeats: int) -> dict:
    num_tokens = prompt_len - 1  # D computes the last prompt token itself
    num_blocks = -(-num_tokens // BLOCK)
    groups = len(spec.groups)  # each KV group's table of the prompt: its own num_blocks ids
    pools = [KVPool.for_model(spec, groups * num_blocks, BLOCK, "cpu", shared=True) for _ in range(2)]
    pools[0].tensor.normal_()
    p, d = NodeTransports([pools[0]]), NodeTransports([pools[1]])
    blocks = [list(range(g * num_blocks, (g + 1) * num_blocks)) for g in range(groups)]
    runs = pools[0].group_runs(num_tokens, 0, num_blocks)
    out = {"full_mib": pools[0].nbytes(join_tables(blocks)) / 2**20,
           "windowed_mib": sum(pools[0].nbytes(blocks[g][skip:], slots) for g, slots, skip in runs) / 2**20}
    block_mib = pools[0].nbytes([0]) / 2**20  # one block id: a layer slot of each of its group's layers
    peak, decoding = held_blocks(spec, prompt_len)
    out |= {"held_every_layer_mib": groups * -(-(prompt_len + 1) // BLOCK) * block_mib,
            "held_peak_mib": peak * block_mib, "held_decoding_mib": decoding * block_mib}
    try:
        for transport in available():
            for mode, run in (("pull", time_pull), ("push", time_push)):
                for kind, tokens in (("full", 0), ("windowed", num_tokens)):
                    seconds = run(p, d, transport, blocks, repeats, tokens)
                    out[f"{mode}_{transport}_{kind}_ms"] = 1e3 * statistics.median(seconds)
    finally:
        p.close()
        d.close()
        for pool in pools:
            pool.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", default="docs/results/windowed_kv.json")
    args = parser.parse_args()
    config = read_model_config(resolve_model_dir("gemma-3-270m"))
    spec = model_class(config).kv_cache_spec(config, torch.bfloat16)
    res = {"date": time.strftime("%Y-%m-%d"), "layer_windows": list(spec.layer_windows), "block_size": BLOCK,
           "lengths": {str(n): measure(spec, n, args.repeats) for n in args.prompt_lens}}
    sliding = sum(1 for w in spec.layer_windows if w)
    res["cpu"] = CpuInfo.detect().model
    lines = [f"Command: `python -m pdserve.benchmarks.windowed_kv` ({res['date']}, {res['cpu']}; Gemma 3 270M's KV layout: "
             f"{spec.num_layers} layers, {sliding} sliding with a window of {max(spec.layer_windows)}, one KV head of "
             f"{spec.head_dim}, bfloat16, blocks of {BLOCK}; median of {args.repeats}; both ends in this process). "
             "Windowed: the global layers' blocks and each sliding layer's last window; full: every layer's every "
             "block. Each transfer cell: full / windowed, milliseconds per request. Held on a node: the request's "
             f"KV at its first decode step with every layer keeping every block, and with KV groups (the block "
             f"manager's count: most while the prompt is computed in chunks of {CHUNK}, then at the first decode "
             "step).", "",
             "| prompt tokens | KV full (MiB) | KV windowed (MiB) | pull tcp | pull shm | push tcp | push shm "
             "| held, every layer (MiB) | held, KV groups: prefill peak / decoding (MiB) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, r in res["lengths"].items():
        cells = [f"{r[f'{m}_{t}_full_ms']:.1f} / {r[f'{m}_{t}_windowed_ms']:.1f}"
                 for m in ("pull", "push") for t in ("tcp", "shm")]
        lines.append(f"| {n} | {r['full_mib']:.1f} | {r['windowed_mib']:.1f} | " + " | ".join(cells) +
                     f" | {r['held_every_layer_mib']:.1f} | {r['held_peak_mib']:.1f} / {r['held_decoding_mib']:.1f} |")
    publish(res, args.out, "windowed_kv", "Gemma 3: moving each sliding layer's window (issue 34)", "\n".join(lines))


if __name__ == "__main__":
    main()
