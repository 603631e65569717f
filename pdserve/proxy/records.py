"""Where each request's time went, kept for the dashboard and `/v1/requests`: a typed record per
request (its stages as timeline segments, the nodes, the KV moved, auto mode's choice), a bounded
ring of the recent ones and a sliding window of the last minutes' latencies, aggregated here so
that the page stays cheap at 50 req/s.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Callable

import numpy as np
from pydantic import BaseModel

from pdserve.proxy.slo import meets

if TYPE_CHECKING:
    from pdserve.proxy.timing import RequestTiming

RECENT_REQUESTS = 2000  # finished records kept for /v1/requests/{id}
WINDOW_S = 300.0  # "the last minutes": percentiles, goodput and utilisation over this window


class Segment(BaseModel):
    """One stage of a request, in ms since the proxy received it."""

    stage: str  # queue | prefill | decode_queue | transfer | decode
    node: str | None  # the node's URL
    start_ms: float
    end_ms: float


class Transfer(BaseModel):
    """The KV that came from a prefill node, as the decode node reported it."""

    bytes: int
    tokens: int  # prompt tokens whose KV moved
    blocks: int  # the blocks they filled on D
    ms: float  # pull: D's wait for the KV; push: the part not hidden behind P's prefill
    transport: str | None


class Placement(BaseModel):
    """Auto mode's choice for this request."""

    choice: str  # local | remote
    choose_ms: float
    predicted_ttft_ms: float | None


class RequestRecord(BaseModel):
    id: str
    path: str
    mode: str
    status: str  # running | ok | error | aborted
    http_status: int | None = None
    arrival_unix: float  # wall clock, for the page's time axis
    stream: bool
    prompt_tokens: int | None = None  # as the node that computed the prompt counted them
    cached_tokens: int | None = None
    output_chunks: int = 0  # streamed: SSE events relayed (a token each at n = 1, unless a stop string held some back)
    prefill_node: str | None = None
    decode_node: str | None = None
    ttft_ms: float | None = None  # streamed answers only
    tpot_ms: float | None = None  # per chunk after the first
    max_itl_ms: float | None = None  # the longest gap between two chunks after the first
    e2e_ms: float | None = None
    segments: list[Segment] = []
    transfer: Transfer | None = None
    placement: Placement | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def e2el_ms(self) -> float | None:  # the name SLOs and bench use
        return self.e2e_ms


def record_of(request_id: str, path: str, mode: str, stream: bool, t: RequestTiming, status: str,
              http_status: int | None = None, error: str | None = None) -> RequestRecord:
    """The record of a request from its timing (finished or still running)."""
    ms = lambda at: (at - t.arrival) * 1e3  # noqa: E731
    end = t.last_byte if t.last_byte is not None else t.done
    record = RequestRecord(
        id=request_id, path=path, mode=mode, status=status, http_status=http_status, error=error,
        arrival_unix=t.arrival_unix, stream=stream, prompt_tokens=t.prompt_tokens, cached_tokens=t.cached_tokens,
        output_chunks=t.output_chunks, prefill_node=t.prefill_node, decode_node=t.decode_node,
        e2e_ms=ms(t.done) if t.done is not None else None, segments=segments(t, end))
    if t.first_byte is not None:
        record.ttft_ms = ms(t.first_byte)
        if t.output_chunks > 1 and t.last_byte is not None:
            record.tpot_ms = (t.last_byte - t.first_byte) * 1e3 / (t.output_chunks - 1)
            record.max_itl_ms = t.longest_gap * 1e3
    if t.kv_tokens:
        record.transfer = Transfer(bytes=t.kv_bytes, tokens=t.kv_tokens, blocks=t.kv_blocks, ms=t.transfer_s * 1e3,
                                   transport=t.kv_transport)
    if t.placement is not None:
        record.placement = Placement(choice=t.placement, choose_ms=t.placement_s * 1e3,
                                     predicted_ttft_ms=None if t.predicted_ttft_s is None else t.predicted_ttft_s * 1e3)
    return record


def segments(t: RequestTiming, end: float | None) -> list[Segment]:
    """The stages on a time line, each placed where the proxy saw it begin, sized as the node that ran
    it measured it (the hops between them are left as gaps)."""
    out: list[Segment] = []

    def add(stage: str, node: str | None, start: float, seconds: float) -> float:
        out.append(Segment(stage=stage, node=node, start_ms=(start - t.arrival) * 1e3,
                           end_ms=(start + seconds - t.arrival) * 1e3))
        return start + seconds

    first = t.prefill_node or t.decode_node
    at = add("queue", first, t.arrival, t.node_queue_s)
    if t.prefill_done is None:
        return out
    at = add("prefill", first, at, max(t.prefill_done - at, 0.0))
    if t.prefill_node is None or t.decode_sent is None:  # one node did it all
        pass
    elif t.decode_sent >= t.prefill_done:  # pull: D asked after P's answer
        at = add("decode_queue", t.decode_node, t.decode_sent, t.decode_queue_s)
        at = add("transfer", t.decode_node, at, t.transfer_s)
    else:  # push: D waited from the start; only the transfer past P's prefill shows
        at = add("transfer", t.decode_node, at, t.transfer_s)
    if end is not None and end > at:
        add("decode", t.decode_node, at, end - at)
    return out


class GapHistogram:
    """Every inter-chunk gap of the last `window_s` seconds, counted into log-spaced buckets per
    second (1 ms to 60 s, 19 % wide): percentiles without keeping 50 req/s x 100 gaps x 5 minutes."""

    EDGES = np.geomspace(1e-3, 60.0, 64)

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._seconds: deque[tuple[int, np.ndarray]] = deque()  # (second, counts per bucket)

    def add(self, gaps: list[float], now: float) -> None:
        if not gaps:
            return
        second = int(now)
        if not self._seconds or self._seconds[-1][0] != second:
            self._seconds.append((second, np.zeros(len(self.EDGES) + 1, dtype=np.int64)))
        np.add.at(self._seconds[-1][1], np.searchsorted(self.EDGES, gaps), 1)

    def percentiles(self, now: float) -> dict[str, float] | None:
        """p50 / p90 / p99 in ms (each its bucket's upper edge), None without gaps."""
        while self._seconds and self._seconds[0][0] < now - self.window_s:
            self._seconds.popleft()
        if not self._seconds:
            return None
        cumulative = np.cumsum(sum(counts for _, counts in self._seconds))
        edges_ms = np.append(self.EDGES, self.EDGES[-1]) * 1e3
        return {f"p{q}": float(edges_ms[np.searchsorted(cumulative, cumulative[-1] * q / 100)]) for q in (50, 90, 99)}


class RecentRequests:
    """The records of the requests in flight and the last `RECENT_REQUESTS` finished, plus what the
    last `WINDOW_S` seconds add up to."""

    def __init__(self, slos: dict[str, float] | None, keep: int = RECENT_REQUESTS, window_s: float = WINDOW_S) -> None:
        self.slos = slos or {}
        self.keep, self.window_s = keep, window_s
        self.started = time.monotonic()
        # those in flight: how to make their record as it stands (built when asked for, not kept up to date)
        self.running: dict[str, Callable[[], RequestRecord]] = {}
        self.finished: OrderedDict[str, RequestRecord] = OrderedDict()
        # (finished at, ttft, tpot, max itl, e2e [ms, nan where unknown], met the SLOs)
        self._window: deque[tuple[float, float, float, float, float, bool]] = deque()
        self.gaps = GapHistogram(window_s)

    def start(self, request_id: str, record: Callable[[], RequestRecord]) -> None:
        self.running[request_id] = record

    def finish(self, record: RequestRecord, now: float | None = None, gaps: list[float] = ()) -> None:
        """`gaps`: its inter-chunk gaps, for the window's ITL percentiles."""
        now = time.monotonic() if now is None else now
        self.gaps.add(gaps, now)
        self.running.pop(record.id, None)
        self.finished[record.id] = record
        while len(self.finished) > self.keep:
            self.finished.popitem(last=False)
        nan = float("nan")
        value = lambda ms: nan if ms is None else ms  # noqa: E731
        self._window.append((now, value(record.ttft_ms), value(record.tpot_ms),
                             value(record.max_itl_ms), value(record.e2e_ms), self.meets(record)))

    def meets(self, record: RequestRecord) -> bool:
        """Within every configured SLO (`--slo`), by the rule bench and the simulator count with."""
        return meets(record, self.slos)

    def get(self, request_id: str) -> RequestRecord | None:
        running = self.running.get(request_id)
        return running() if running is not None else self.finished.get(request_id)

    def recent(self, limit: int) -> list[RequestRecord]:
        """The newest first: those in flight, then the finished ones."""
        running = [record() for record in itertools.islice(reversed(self.running.values()), limit)]
        return running + list(itertools.islice(reversed(self.finished.values()), limit - len(running)))

    def window(self, now: float | None = None) -> dict:
        """The last minutes: requests, goodput, and p50 / p90 / p99 of TTFT, TPOT, max ITL and e2e (ms)."""
        now = time.monotonic() if now is None else now
        while self._window and self._window[0][0] < now - self.window_s:
            self._window.popleft()
        span = min(self.window_s, now - self.started)
        n = len(self._window)  # (fromiter over the flat rows: 5x a list of slices at 15,000 rows)
        rows = np.fromiter(itertools.chain.from_iterable(self._window), float, count=6 * n).reshape(n, 6)
        met = int(rows[:, 5].sum())
        out = {"window_s": self.window_s, "requests": len(self._window), "met_slos": met,
               "slos_ms": self.slos, "goodput_rps": met / span if span > 0 else 0.0,
               "throughput_rps": len(self._window) / span if span > 0 else 0.0}
        for i, name in enumerate(("ttft_ms", "tpot_ms", "max_itl_ms", "e2e_ms"), start=1):
            column = rows[:, i][~np.isnan(rows[:, i])]
            out[name] = ({f"p{q}": float(np.percentile(column, q)) for q in (50, 90, 99)} if column.size else None)
        out["itl_ms"] = self.gaps.percentiles(now)
        return out
