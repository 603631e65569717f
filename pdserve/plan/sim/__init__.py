"""A discrete-event model of pdserve serving a workload, driven by a measured profile.

    pdserve simulate --profile profile.json --setup colocated:2|pull:1P1D|push:1P3D|auto:8|auto:4P4D [bench's workload flags]

What it models, as pdserve does it:
- the proxy: colocated (each request to one `--role both` node), pull (P prefills and samples one
  token, D pulls the KV its own cache lacks, recomputes the last prompt token and decodes), push
  (D reserves its blocks first, P pushes each layer as it is computed, so only the last layer's
  transfer follows the prefill), auto (the proxy's own Placer, pdserve/proxy/placement.py, run on
  the simulation's clock: per request, the decode node and whether it prefills locally or on a P
  that D then pulls from); nodes picked by round robin or least loaded (outstanding requests);
- each node: pdserve's own Scheduler and BlockManager (pdserve/engine/) on the simulation's clock,
  the model runner replaced by the profile's costs: running requests first, in the order they were
  admitted, then waiting ones within the token budget (chunked prefill) and max_num_seqs; KV
  blocks taken as tokens are computed; when a running request cannot get a block the newest one is
  preempted and later prefilled again with its output so far; a P node holds a prompt's blocks
  until its KV has left (pulled by D, or its last layer pushed); steps that only decode a batch
  that does not change are one event (the scheduler's steady decode runs, cut at the step in
  progress when work arrives); the prefix cache (hash-chained full blocks, shared while in use,
  evicted least recently freed first) when the workload has conversations, the setup is auto, or
  it is asked for;
- conversations (`--dataset multiturn`) as bench runs them: each turn sent after the previous
  answer and the user's think time, its prompt the history (earlier turns and seeded answers);
- the step's time: the profile's decode-step fit for the decodes plus its prefill-chunk fit for
  each chunk, plus what the server adds per step; each HTTP hop to a node (one colocated, P's and
  D's in pull, P's in push, where D had the request during the prefill) adds the profile's
  per-request serving cost, and streaming delays every token the client sees by its stream cost;
  transfers: the profile's fit for the transport.

Not modelled: D's blocks while a pull is in flight (the transfer is charged before D queues the
request, its prompt counted computed, so D shares no cached prefix blocks with it); the proxy's view of the caches lagging the nodes' events (the simulated index is exact);
a bench client's retokenized answers, which may split the last block of an answer differently.

It returns the fields `pdserve bench --out` writes (pdserve/workload.py: summarize), so a
simulated and a measured run compare key by key.
"""

from __future__ import annotations

from pdserve.plan.sim.driver import prompts_of, simulate
from pdserve.plan.sim.events import Costs, Simulation
from pdserve.plan.sim.node import DecodeRun, Job, SimNode
from pdserve.plan.sim.proxy import Prompt, SimIndex, SimProxy
from pdserve.plan.sim.setup import MODES, Batching, Setup
from pdserve.plan.sim.tracker import Tracker

__all__ = ["MODES", "Batching", "Costs", "DecodeRun", "Job", "Prompt", "Setup", "SimIndex",
           "SimNode", "SimProxy", "Simulation", "Tracker", "prompts_of", "simulate"]
