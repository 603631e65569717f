"""The live cluster page and the API behind it.

- `GET /dashboard`: the page (static files in proxy/static: plain SVG, no build step, no CDN);
- `GET /dashboard/events`: server-sent events, one snapshot a second (nodes, the last minutes'
  percentiles and goodput, their history, the recent requests);
- `GET /v1/requests/recent`, `GET /v1/requests/{id}`: the typed request records (proxy/records.py).

Everything is aggregated here, once a second, whoever watches: the page only draws.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from importlib.resources import files
from typing import TYPE_CHECKING, AsyncIterator

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from pydantic import BaseModel

from pdserve.api.errors import error_response
from pdserve.api.http import STOPPING
from pdserve.proxy.records import RecentRequests, RequestRecord

if TYPE_CHECKING:
    from pdserve.proxy.membership import Membership
    from pdserve.proxy.policies import Node

TICK_S = 1.0  # the page's update period
HISTORY_POINTS = 300  # one a tick: the last five minutes' curves
PAGE_ROWS = 60  # requests each update carries
STATIC = files("pdserve.proxy") / "static"
MEDIA_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}


class RecentList(BaseModel):
    requests: list[RequestRecord]


class Dashboard:
    """Keeps the last minutes' history (a point per tick) and serves the page and its feed."""

    def __init__(self, mode: str, members: Membership, recent: RecentRequests) -> None:
        self.mode, self.members, self.recent = mode, members, recent
        self.history: deque[dict] = deque(maxlen=HISTORY_POINTS)
        self.snapshot: dict = {}
        self.event = b""  # the snapshot as one SSE event, encoded once for every open page
        self.watching = 0  # open pages: with none, a tick keeps the history only
        self._dumped: dict[str, dict] = {}  # finished records as JSON-ready dicts, each made once
        self._changed = asyncio.Event()

    async def run(self) -> None:
        """The proxy's background task: a history point a tick, and for open pages a snapshot."""
        while True:
            self.tick(snapshot=self.watching > 0)
            self._changed.set()
            self._changed = asyncio.Event()
            await asyncio.sleep(TICK_S)

    def tick(self, snapshot: bool = True) -> dict:
        window = self.recent.window()
        nodes = [describe_node(n) for n in self.members.nodes()]
        point = {"t": time.time(), "throughput_rps": window["throughput_rps"], "goodput_rps": window["goodput_rps"]}
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "max_itl_ms"):
            point[name] = {q: round(v, 3) for q, v in window[name].items()} if window[name] else None
        for role in ("prefill", "decode", "both", "kv_both"):
            loads = [n["load"].get("utilisation") for n in nodes if n["role"] == role and n["load"]]
            loads = [u for u in loads if u is not None]
            if loads:
                point[f"utilisation_{role}"] = round(sum(loads) / len(loads), 4)
        self.history.append(point)
        if snapshot:
            self.snapshot = {"t": point["t"], "mode": self.mode, "nodes": nodes, "window": window,
                             "history": list(self.history), "requests": self._rows()}
            self.event = f"event: snapshot\ndata: {json.dumps(self.snapshot)}\n\n".encode()
        return self.snapshot

    def _rows(self) -> list[dict]:
        """The newest records, JSON-ready; a finished one is dumped once, not once a tick."""
        rows, dumped = [], {}
        for record in self.recent.recent(PAGE_ROWS):
            if record.status == "running":
                rows.append(record.model_dump(mode="json"))
                continue
            row = dumped[record.id] = self._dumped.get(record.id) or record.model_dump(mode="json")
            rows.append(row)
        self._dumped = dumped  # (those that left the page are forgotten)
        return rows

    async def events(self) -> AsyncIterator[bytes]:
        """SSE: the current snapshot at once, then each new one, until the server stops."""
        self.watching += 1
        try:
            if not self.event:  # the first page since start, or since the last one closed
                self.tick()
            while not STOPPING.is_set():
                changed = self._changed
                yield self.event
                await changed.wait()
        finally:
            self.watching -= 1
            if not self.watching:
                self.event = b""  # stale from the next tick on

    def router(self) -> APIRouter:
        router = APIRouter()

        @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
        async def page():
            return HTMLResponse((STATIC / "dashboard.html").read_text())

        @router.get("/dashboard/static/{name}", include_in_schema=False)
        async def static(name: str):
            suffix = name[name.rfind("."):]
            asset = STATIC / name
            if "/" in name or suffix not in MEDIA_TYPES or not asset.is_file():
                return error_response(404, f"no dashboard file {name!r}", "name")
            return Response(asset.read_bytes(), media_type=MEDIA_TYPES[suffix])

        @router.get("/dashboard/events", include_in_schema=False)
        async def events():
            return StreamingResponse(self.events(), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})

        @router.get("/v1/requests/recent", response_model=RecentList)
        async def recent(limit: int = Query(100, ge=1, le=2000)):
            """The newest requests first: those in flight, then the finished ones (the last 2000 kept)."""
            return RecentList(requests=self.recent.recent(limit))

        @router.get("/v1/requests/{request_id}", response_model=RequestRecord)
        async def one(request_id: str):
            """One request's record, by the id in its answer's x-pdserve-request-id header."""
            record = self.recent.get(request_id)
            if record is None:
                return error_response(404, f"no recent request {request_id!r} (the last 2000 are kept)",
                                      "request_id")
            return record

        return router


def describe_node(node: Node) -> dict:
    return {"url": node.url, "role": node.role, "healthy": node.healthy, "active_requests": node.active_requests,
            "engine": dict(node.engine), "load": node.load.describe() if node.load is not None else {}}
