"""How fast each node runs now against the profile auto mode prices placements with.

A profile is measured once; a shared host drifts by tens of percent within an hour, and nodes on
different machines differ. So the proxy keeps two ratios per node, measured over predicted,
smoothed over the recent past, and multiplies the profile's predictions by them:
- decode: the node's decode-only steps (its pdserve:decode_step_* counters, which the health
  poller reads every interval) against the profile's decode-step model for the same batches. The
  model is linear in sequences and KV tokens, so its prediction at a window's mean batch is its
  mean prediction over the window's steps;
- prefill: each prefill auto mode placed (the node's own queue / prefill split of its headers)
  against what it predicted. Short prefills are left out: the request hop dominates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from pdserve.proxy.timing import RequestTiming

SMOOTHING = 0.3  # weight of the newest ratio
LIMITS = (1 / 3, 3.0)  # a ratio outside is a hiccup (a node paused, a scrape late), not the node's speed
MIN_WINDOW_STEPS = 8
MIN_PREFILL_S = 0.05


@dataclass
class DecodeWindow:
    """Decode-only steps since the last fold: counts and sums."""

    steps: int = 0
    seconds: float = 0.0
    seqs: int = 0
    kv_tokens: int = 0


@dataclass
class NodeSpeed:
    prefill: float = 1.0  # measured over predicted prefill seconds (1.0: nothing measured yet)
    decode: float = 1.0  # measured over predicted decode-step seconds
    pending: DecodeWindow = field(default_factory=DecodeWindow)
    _totals: DecodeWindow = field(default_factory=DecodeWindow)  # the node's counters at the last read

    def count_decode_steps(self, totals: DecodeWindow) -> None:
        """The node's counters now (health poller). Counters that went back mean the node restarted."""
        last = self._totals
        if totals.steps < last.steps:
            last = DecodeWindow()
        p = self.pending
        self.pending = DecodeWindow(p.steps + totals.steps - last.steps, p.seconds + totals.seconds - last.seconds,
                                    p.seqs + totals.seqs - last.seqs, p.kv_tokens + totals.kv_tokens - last.kv_tokens)
        self._totals = totals

    def fold_decode(self, predict_step_s: Callable[[float, float], float]) -> None:
        """Take the steps counted since the last fold into `decode`, once there are enough of them."""
        w = self.pending
        if w.steps < MIN_WINDOW_STEPS:
            return
        predicted = predict_step_s(w.seqs / w.steps, w.kv_tokens / w.steps)
        if predicted > 0:
            self.decode = _smooth(self.decode, w.seconds / w.steps / predicted)
        self.pending = DecodeWindow()

    def observe_prefill(self, measured_s: float, predicted_s: float) -> None:
        if predicted_s >= MIN_PREFILL_S and measured_s > 0:
            self.prefill = _smooth(self.prefill, measured_s / predicted_s)


def shared_steps(timing: RequestTiming) -> float:
    """How many times its own prompt's tokens the steps that prefilled a request computed (1: it was
    prefilled alone). A node that prefills several waiting prompts at once (one taking turns, when
    its streams end) answers each after the whole step: its time is compared with the profile's
    price of all those tokens, not of its own (which drove the speed to its limit of 3 past
    saturation: docs/benchmarks.md)."""
    own = (timing.prompt_tokens or 0) - (timing.cached_tokens or 0)
    if not timing.prefill_step_tokens or own <= 0:
        return 1.0  # a node that does not report it, or a prompt it held whole
    return max(timing.prefill_step_tokens / own, 1.0)


def _smooth(old: float, ratio: float) -> float:
    return (1 - SMOOTHING) * old + SMOOTHING * min(max(ratio, LIMITS[0]), LIMITS[1])
