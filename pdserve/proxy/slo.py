"""Service-level objectives: the metrics a request is judged on, and the one rule that judges it.
The proxy's goodput counter and dashboard, `pdserve bench`, `simulate` and `plan` all count with it."""

from __future__ import annotations

from typing import Mapping, Protocol

# --slo / --goodput name -> the measured value it bounds (milliseconds). itl: a request's longest gap
# between two tokens after the first (a TPOT SLO is a mean over the answer and absorbs a stall of
# seconds; this one sees it).
SLO_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "max_itl_ms", "e2el": "e2el_ms"}


class Measured(Protocol):
    """What a request's outcome offers: a client's RequestResult, the proxy's RequestRecord."""

    @property
    def ok(self) -> bool: ...
    @property
    def ttft_ms(self) -> float | None: ...
    @property
    def tpot_ms(self) -> float | None: ...
    @property
    def max_itl_ms(self) -> float | None: ...
    @property
    def e2el_ms(self) -> float | None: ...


def meets(result: Measured, slos: Mapping[str, float]) -> bool:
    """Answered, and within every SLO (`slos`: SLO_METRICS' values -> bound in ms; none: every answered
    request meets them). A value not measured (None: the proxy saw no first token of an answer it did
    not stream) meets its bound."""
    return result.ok and all((value := getattr(result, key)) is None or value <= limit for key, limit in slos.items())
