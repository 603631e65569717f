"""The simulation's clock and event queue, and the profile's costs as plain numbers."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import asdict, dataclass
from typing import Callable

from pdserve.plan.idle import excess
from pdserve.plan.profile import Profile
from pdserve.proxy.costs import decode_hinges


@dataclass(frozen=True)
class Costs:
    """The profile's prefill-chunk and decode-step fits as plain numbers: the simulator's hot path
    (Profile.prefill_chunk_time and decode_step_time, without the feature dicts)."""

    chunk_fixed: float
    chunk_token: float
    chunk_pair: float  # per attention pair: tokens * (context_before + tokens / 2)
    step_fixed: float
    step_seq: float
    step_kv: float
    step_hinges: tuple[tuple[int, float], ...]  # (k, d): + d * max(0, seqs - k), the measured batch sizes
    step_serving: float  # what the server adds to every step (profile.serving)
    request_hop: float  # what one HTTP hop adds before a node starts a request
    stream_delay: float  # how much later than the engine the client sees a streamed token (the proxy's hop with it)
    gap_excess: tuple[float, ...] = ()  # a streamed gap beyond its stream's median, sorted (serving's gap_excess_s)
    idle: tuple[float, float, float] = (1.0, 0.0, 0.0)  # (tau_s, prefill_s, decode_s): plan/idle.py

    @classmethod
    def of(cls, profile: Profile) -> Costs:
        p = dict(zip(profile.prefill_chunk.features, profile.prefill_chunk.coefficients))
        (a, b, c), hinges = decode_hinges(asdict(profile.decode_step))
        serving = profile.serving
        return cls(p["one"], p["tokens"], p["attention_pairs"], a, b, c, hinges, serving["step_s"], serving["request_s"],
                   serving["stream_s"] + serving.get("proxy_s", 0.0),
                   tuple(serving.get("gap_excess_s", ())),
                   (profile.idle["tau_s"], profile.idle["prefill_s"], profile.idle["decode_s"]))

    def chunk(self, tokens: int, context_before: int) -> float:
        return self.chunk_fixed + tokens * (self.chunk_token + self.chunk_pair * (context_before + tokens / 2))

    def after_idle(self, gap: float, prefill: bool) -> float:
        """What a step pays beyond its price after its node idled `gap` s (plan/idle.py's penalty)."""
        tau, prefill_s, decode_s = self.idle
        return excess(prefill_s if prefill else decode_s, tau, gap)

    def step(self, seqs: int, kv_tokens: int) -> float:
        """A decode step, with what serving adds to each step."""
        return (self.step_fixed + self.step_serving + self.step_seq * seqs + self.step_kv * kv_tokens
                + sum(d * (seqs - k) for k, d in self.step_hinges if seqs > k))


class Simulation:
    def __init__(self, profile: Profile, one_host: bool = False,
                 thread_profiles: dict[int, Profile] | None = None) -> None:
        self.profile = profile
        self.costs = Costs.of(profile)
        # Nodes of more threads than the profile's (Setup.prefill_threads, decode_threads) step at
        # the costs of a profile measured at that many: `pdserve profile --threads N`.
        self.costs_by_threads = {threads: Costs.of(p) for threads, p in (thread_profiles or {}).items()}
        self.costs_by_threads[profile.meta.get("threads", 1)] = self.costs
        # Every node on one core of one host (as `pdserve up` starts them): a step runs the
        # profile's co-run factors slower while another node computes (plan/corun.py).
        self.corun = (profile.corun["prefill"], profile.corun["decode"]) if one_host else None
        # ... and the profile's relay factors while other nodes stream (SimNode._corun): the proxy
        # relaying their tokens is woken on this node's core.
        self.relay = profile.corun.get("relay", 1.0) if one_host else 1.0
        self.relay_decode = profile.corun.get("relay_decode", 1.0) if one_host else 1.0
        self.nodes: list = []  # the SimNodes, which tell each other when they start and stop computing
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def costs_for(self, threads: int | None, flag: str) -> Costs:
        """The step costs of a node of `threads` threads (None: the profile's own); ValueError
        naming `flag` where no profile was measured at that many."""
        if threads is None:
            return self.costs
        if threads not in self.costs_by_threads:
            raise ValueError(f"{flag} {threads}: no profile measured at {threads} thread(s) was given "
                             f"(have {sorted(self.costs_by_threads)}); measure one with `pdserve profile "
                             f"--threads {threads} --out P.json` and pass --thread-profile P.json")
        return self.costs_by_threads[threads]

    def at(self, time: float, action: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time, next(self._order), action))

    def run(self) -> None:
        while self._events:
            self.now, _, action = heapq.heappop(self._events)
            action()
