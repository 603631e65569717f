"""OpenTelemetry traces across proxy -> P -> D (issue 40): real P, D and proxy processes export
over OTLP/HTTP to a local receiver (a real HTTP server decoding OTLP protobuf), and one request's
spans from the three processes share one trace and nest as the request travelled."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from servers import MODEL, NODE, Procs

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pytest.importorskip("opentelemetry.sdk")

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


class Receiver:
    """An OTLP/HTTP collector on 127.0.0.1 that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["content-length"]))
                request = trace_service.ExportTraceServiceRequest.FromString(body)
                for resource in request.resource_spans:
                    service = next(a.value.string_value for a in resource.resource.attributes
                                   if a.key == "service.name")
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            receiver.spans.append({
                                "service": service, "name": span.name, "trace": span.trace_id.hex(),
                                "id": span.span_id.hex(), "parent": span.parent_span_id.hex(),
                                "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                                "attributes": {a.key: getattr(a.value, a.value.WhichOneof("value"))
                                               for a in span.attributes}})
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def traced_cluster(tmp_path_factory):
    receiver = Receiver()
    with pytest.MonkeyPatch.context() as env, Procs(tmp_path_factory.mktemp("traced")) as procs:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export every 100 ms (the children inherit it)
        otlp = ["--otlp-endpoint", receiver.url]
        p = procs.start(["serve", "--role", "prefill", *otlp, *NODE], "p")
        d = procs.start(["serve", "--role", "decode", "--kv-transport", "tcp", *otlp, *NODE], "d")
        procs.start(["proxy", "--prefill", p.url, "--decode", d.url, *otlp], "proxy")
        procs.start(["proxy", "--mode", "push", "--prefill", p.url, "--decode", d.url, *otlp], "push_proxy")
        yield procs, receiver
    receiver.close()


def spans_of(receiver: Receiver, request_id: str, want: int, timeout: float = 20.0) -> list[dict]:
    """The spans of the trace whose proxy root names `request_id`, once `want` of them arrived."""
    deadline = time.monotonic() + timeout
    while True:
        roots = [s for s in receiver.spans if s["attributes"].get("pdserve.request_id") == request_id
                 and s["name"] == "pdserve.request"]
        trace = [s for s in receiver.spans if roots and s["trace"] == roots[0]["trace"]]
        if len(trace) >= want or time.monotonic() > deadline:
            return trace
        time.sleep(0.1)


def test_one_pull_requests_spans_from_three_processes_share_a_trace_and_nest(traced_cluster):
    procs, receiver = traced_cluster
    body = {"model": MODEL, "prompt": "The history of the Roman Empire " * 10, "max_tokens": 8, "temperature": 0,
            "stream": True}
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"}  # the client's own trace goes on
    with httpx.stream("POST", procs["proxy"].url + "/v1/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        request_id = r.headers["x-pdserve-request-id"]
        assert sum(line.startswith("data: ") for line in r.iter_lines()) == 9
    expected = {("pdserve-proxy", "pdserve.request"), ("pdserve-proxy", "proxy.prefill"),
                ("pdserve-proxy", "proxy.decode"), ("pdserve-prefill", "node.request"), ("pdserve-prefill", "queue"),
                ("pdserve-prefill", "prefill"), ("pdserve-prefill", "kv.serve_pull"), ("pdserve-prefill", "kv.lease"),
                ("pdserve-decode", "node.request"), ("pdserve-decode", "queue"), ("pdserve-decode", "kv.pull"),
                ("pdserve-decode", "kv.load"), ("pdserve-decode", "decode")}
    trace = spans_of(receiver, request_id, len(expected))
    by_name = {(s["service"], s["name"]): s for s in trace}
    assert set(by_name) == expected and len(trace) == len(expected)
    assert {s["trace"] for s in trace} == {CLIENT_TRACE}
    parent = {key: next((k for k, s in by_name.items() if s["id"] == span["parent"]), span["parent"])
              for key, span in by_name.items()}
    assert parent == {
        ("pdserve-proxy", "pdserve.request"): CLIENT_PARENT,
        ("pdserve-proxy", "proxy.prefill"): ("pdserve-proxy", "pdserve.request"),
        ("pdserve-proxy", "proxy.decode"): ("pdserve-proxy", "pdserve.request"),
        ("pdserve-prefill", "node.request"): ("pdserve-proxy", "proxy.prefill"),
        ("pdserve-prefill", "queue"): ("pdserve-prefill", "node.request"),
        ("pdserve-prefill", "prefill"): ("pdserve-prefill", "node.request"),
        ("pdserve-prefill", "kv.lease"): ("pdserve-prefill", "node.request"),  # outlives it: until D pulled
        ("pdserve-decode", "node.request"): ("pdserve-proxy", "proxy.decode"),
        ("pdserve-decode", "queue"): ("pdserve-decode", "node.request"),
        ("pdserve-decode", "kv.pull"): ("pdserve-decode", "node.request"),
        ("pdserve-prefill", "kv.serve_pull"): ("pdserve-decode", "kv.pull"),  # through the side channel
        ("pdserve-decode", "kv.load"): ("pdserve-decode", "node.request"),
        ("pdserve-decode", "decode"): ("pdserve-decode", "node.request"),
    }
    # Each child lies within its parent's time (one machine, one clock), the transfer's on both ends.
    for key, span in by_name.items():
        above = by_name.get(parent[key])
        if above is not None and key[1] not in ("kv.serve_pull", "kv.lease"):
            assert above["start"] <= span["start"] + 2_000_000 and span["end"] <= above["end"] + 2_000_000, key
    pull, served = by_name[("pdserve-decode", "kv.pull")], by_name[("pdserve-prefill", "kv.serve_pull")]
    assert pull["attributes"]["pdserve.kv.bytes"] == served["attributes"]["pdserve.kv.bytes"] > 0
    assert pull["attributes"]["pdserve.kv.transport"] == "tcp" and pull["attributes"]["pdserve.kv.blocks"] > 0
    lease = by_name[("pdserve-prefill", "kv.lease")]
    assert lease["attributes"]["pdserve.kv.expired"] is False and lease["end"] >= served["end"]
    # Each span names the request as its process knows it; the nodes' request spans the proxy's id too
    assert all(span["attributes"]["pdserve.request_id"] for span in trace)
    assert {by_name[(node, "node.request")]["attributes"]["pdserve.proxy_request_id"]
            for node in ("pdserve-prefill", "pdserve-decode")} == {request_id}
    assert by_name[("pdserve-decode", "kv.pull")]["attributes"]["pdserve.request_id"] == \
        by_name[("pdserve-decode", "node.request")]["attributes"]["pdserve.request_id"]
    assert by_name[("pdserve-prefill", "kv.serve_pull")]["attributes"]["pdserve.request_id"] == \
        by_name[("pdserve-prefill", "node.request")]["attributes"]["pdserve.request_id"]
    root = by_name[("pdserve-proxy", "pdserve.request")]["attributes"]
    assert root["pdserve.status"] == "ok" and root["pdserve.decode_node"] == procs["d"].url


def test_every_request_starts_its_own_trace_without_a_client_traceparent(traced_cluster):
    procs, receiver = traced_cluster
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    ids = [httpx.post(procs["proxy"].url + "/v1/completions", json=body, timeout=120).headers["x-pdserve-request-id"]
           for _ in range(2)]
    traces = [spans_of(receiver, rid, 13) for rid in ids]
    per_trace = [defaultdict(int) for _ in traces]
    for counts, trace in zip(per_trace, traces):
        for span in trace:
            counts[span["service"]] += 1
    assert traces[0][0]["trace"] != traces[1][0]["trace"]
    assert all(set(counts) == {"pdserve-proxy", "pdserve-prefill", "pdserve-decode"} for counts in per_trace)


def test_a_push_is_traced_from_ps_span_to_ds_through_the_side_channel(traced_cluster):
    procs, receiver = traced_cluster
    body = {"model": MODEL, "prompt": "The three primary colors are " * 8, "max_tokens": 4, "temperature": 0}
    r = httpx.post(procs["push_proxy"].url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200
    trace = spans_of(receiver, r.headers["x-pdserve-request-id"], 11)
    by_name = {(s["service"], s["name"]): s for s in trace}
    push, received = by_name[("pdserve-prefill", "kv.push")], by_name[("pdserve-decode", "kv.receive_push")]
    assert push["parent"] == by_name[("pdserve-prefill", "node.request")]["id"]
    assert received["parent"] == push["id"]  # through PushBegin
    assert push["attributes"]["pdserve.kv.bytes"] == received["attributes"]["pdserve.kv.bytes"] > 0
    # D was asked first (it reserves the blocks), then P: both under the proxy's request
    root = by_name[("pdserve-proxy", "pdserve.request")]
    assert {by_name[("pdserve-proxy", name)]["parent"] for name in ("proxy.prefill", "proxy.decode")} == {root["id"]}
    assert by_name[("pdserve-decode", "node.request")]["parent"] == by_name[("pdserve-proxy", "proxy.decode")]["id"]
