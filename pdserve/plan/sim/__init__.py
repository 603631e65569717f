"""A discrete-event model of pdserve serving a workload, driven by a measured profile.

    pdserve simulate --profile profile.json --setup colocated:2|pull:1P1D|push:1P3D|auto:8|auto:4P4D [bench's workload flags]

What it models, as pdserve does it:
- the proxy: its flows (pdserve/proxy/flows/) in the order they ask nodes, re-enacted on the
  simulation's clock (the async HTTP code itself does not run here): colocated (each request to one
  `--role both` node), pull (P prefills and samples one token and holds the KV; with P's answer D
  gets the request, its KV connector reserves blocks for what D's own cache lacks and pulls it,
  P frees its blocks once pulled, D computes the last prompt token and decodes), push (D gets the
  request first and reserves its blocks; once it has announced them, P gets the prompt and pushes
  each layer as it is computed, so only the last layer's transfer follows the prefill), auto (the
  proxy's own Placer, pdserve/proxy/placement.py, on the simulation's clock: per request, the
  decode node and whether it prefills locally or on a P that D then pulls from; auto:N over kv_both
  nodes, each of which may prefill for another); nodes chosen by
  the proxy's own policy objects over its Node records (round robin; least loaded: in-flight
  tokens and KV usage), each node loaded from when the proxy asks it to when it answers;
- each node: pdserve's own Scheduler, BlockManager and KV connector (scheduler side) on the
  simulation's clock, the model runner replaced by the profile's costs: running requests first,
  in the order they were admitted, then waiting ones within the token budget (chunked prefill)
  and max_num_seqs; KV blocks taken as tokens are computed; when a running request cannot get a
  block the newest one is preempted and later prefilled again with its output so far; a P node
  holds a pulled prompt's blocks until D has pulled them; a D node's blocks are reserved from
  when it admits a request until its KV has arrived, which it reads between steps (a KV that
  arrives mid-step waits for the step's end, as the engine's loop); steps that only decode a batch that does not
  change are one event (the scheduler's steady decode runs, cut at the step in progress when work
  or KV arrives); the prefix cache (hash-chained full blocks, shared while in use, evicted least
  recently freed first) when the workload has conversations, the setup is auto, or it is asked for;
- conversations (`--dataset multiturn`) as bench runs them: each turn sent after the previous
  answer and the user's think time, its prompt the history (earlier turns and seeded answers);
- the step's time: the profile's decode-step fit for the decodes plus its prefill-chunk fit for
  each chunk, plus what the server adds per step; each HTTP hop (the proxy to a node, and D's
  push announcement to the proxy) adds the profile's per-request serving cost, and streaming
  delays every token the client sees by its stream cost; transfers: the profile's fit for the
  transport, for the tokens D's connector asked for;
- the gaps a client sees beyond the steps (GapJitter): each listed gap, and each request's longest,
  gets a draw from the streamed gaps the profile's probes saw beyond their median, so that a long
  answer's longest gap is the tail of its many gaps, as on a real node (an ITL SLO judges it).
  The draws are not fed back into the steps: TTFT, TPOT and the end time stay the engine's.

Not modelled: the proxy's view of the caches lagging the nodes' events (the simulated index is
exact), nor its /metrics scrape interval (KV usage is read live); a bench client's retokenized
answers, which may split the last block of an answer differently; n > 1, prompt logprobs and
stop strings (the workloads have none); failures (hold timeouts, lost nodes).

It returns the fields `pdserve bench --out` writes (pdserve/workload.py: summarize), so a
simulated and a measured run compare key by key.
"""

from __future__ import annotations

from pdserve.plan.sim.driver import prompts_of, simulate
from pdserve.plan.sim.events import Costs, Simulation
from pdserve.plan.sim.node import DecodeRun, Job, SimNode
from pdserve.plan.sim.proxy import Prompt, SimIndex, SimProxy
from pdserve.plan.sim.setup import MODES, Batching, Setup
from pdserve.plan.sim.tracker import GapJitter, Tracker

__all__ = ["MODES", "Batching", "Costs", "DecodeRun", "GapJitter", "Job", "Prompt", "Setup", "SimIndex",
           "SimNode", "SimProxy", "Simulation", "Tracker", "prompts_of", "simulate"]
