"""The live cluster page and its API (issue 40): request records, node load, the SSE feed, and the
page itself in a real headless Chromium against real P, D and proxy processes."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from servers import MODEL, NODE, Procs, start_pdserve

from pdserve.proxy.cluster import MetricsPage, NodeLoad
from pdserve.proxy.records import RecentRequests, record_of
from pdserve.proxy.slo import meets
from pdserve.proxy.timing import RequestTiming
from pdserve.workload import RequestResult

# -- the pieces --------------------------------------------------------------------------------------


def pull_timing() -> RequestTiming:
    """P queued 10 ms and prefilled until 110 ms; D, asked at 112 ms, queued 3 ms, waited 20 ms for
    the KV, and streamed 11 chunks from 140 ms to 340 ms."""
    t = RequestTiming(arrival=100.0, prefill_node="http://p", decode_node="http://d", node_queue_s=0.010,
                      prefill_done=100.110, decode_sent=100.112, decode_queue_s=0.003, transfer_s=0.020,
                      first_byte=100.140, last_byte=100.340, done=100.341, output_chunks=11, longest_gap=0.05,
                      kv_tokens=64, kv_bytes=1 << 20, kv_transport="tcp", prompt_tokens=65)
    t.prefill_s = t.prefill_done - t.arrival - t.node_queue_s
    return t


def test_a_pull_record_places_each_stage_where_the_proxy_saw_it_and_sizes_it_as_the_node_measured():
    r = record_of("id1", "/v1/completions", "pull", True, pull_timing(), "ok", 200)
    stages = [(s.stage, s.node, round(s.start_ms, 3), round(s.end_ms, 3)) for s in r.segments]
    assert stages == [("queue", "http://p", 0.0, 10.0), ("prefill", "http://p", 10.0, 110.0),
                      ("decode_queue", "http://d", 112.0, 115.0), ("transfer", "http://d", 115.0, 135.0),
                      ("decode", "http://d", 135.0, 340.0)]
    assert r.ttft_ms == pytest.approx(140) and r.tpot_ms == pytest.approx(20) and r.max_itl_ms == pytest.approx(50)
    assert r.e2e_ms == pytest.approx(341) and r.transfer.bytes == 1 << 20 and r.transfer.transport == "tcp"
    assert sum(s.end_ms - s.start_ms for s in r.segments) == pytest.approx(338)  # the 2 ms hop to D and 1 ms after


def test_a_push_record_shows_only_the_transfer_past_ps_prefill_and_a_colocated_one_no_transfer():
    push = pull_timing()
    push.decode_sent, push.transfer_s = 100.001, 0.004  # D asked first; 4 ms exposed after P's prefill
    r = record_of("id2", "/v1/completions", "push", True, push, "ok", 200)
    assert [s.stage for s in r.segments] == ["queue", "prefill", "transfer", "decode"]
    assert (r.segments[2].start_ms, r.segments[2].end_ms) == pytest.approx((110.0, 114.0))
    colocated = RequestTiming(arrival=5.0, decode_node="http://c", node_queue_s=0.002, prefill_done=5.050,
                              done=5.5, decode_sent=5.0)
    r = record_of("id3", "/v1/completions", "colocated", False, colocated, "ok", 200)
    assert [(s.stage, s.node) for s in r.segments] == [("queue", "http://c"), ("prefill", "http://c"),
                                                       ("decode", "http://c")]
    assert r.ttft_ms is None and r.transfer is None and r.segments[-1].end_ms == pytest.approx(500)


def test_the_proxy_judges_a_record_against_the_slos_as_bench_judges_its_result():
    """One rule (proxy/slo.py) for the dashboard's goodput and bench's: the same measured values meet
    or miss each SLO the same way in a RequestRecord and a RequestResult; an error meets none."""
    t = pull_timing()
    t.first_byte, t.done = 100.25, 101.0  # TTFT 250 ms, e2e 1000 ms
    record = record_of("r", "/v1/completions", "pull", True, t, "ok", 200)
    record.tpot_ms = record.max_itl_ms = 50.0
    result = RequestResult(True, 10, 2, ttft_ms=250.0, e2el_ms=1000.0, itls_ms=[750.0])  # 2 tokens: TPOT 750 ms
    result_same = RequestResult(True, 10, 16, ttft_ms=250.0, e2el_ms=1000.0, itls_ms=[50.0] * 15)
    assert (record.ttft_ms, record.e2el_ms, result_same.tpot_ms, result_same.max_itl_ms) == (250.0, 1000.0, 50.0, 50.0)
    for slos in ({"ttft_ms": 251}, {"ttft_ms": 249}, {"tpot_ms": 50}, {"max_itl_ms": 49}, {"e2el_ms": 1000},
                 {"e2el_ms": 999, "ttft_ms": 400}, {}):
        assert meets(record, slos) == meets(result_same, slos) == RecentRequests(slos).meets(record), slos
    assert meets(result, {"tpot_ms": 100}) is False and meets(record, {"tpot_ms": 100}) is True
    failed = record_of("e", "/v1/completions", "pull", True, t, "error", 502)
    assert not meets(failed, {}) and not meets(RequestResult(False, 10, 0), {})


def test_recent_requests_keep_a_bounded_ring_and_window_percentiles_and_goodput_against_the_slos():
    recent = RecentRequests({"ttft_ms": 150.0}, keep=3, window_s=10.0)
    recent.started -= 10.0  # as if running for the whole window
    for i in range(5):
        t = pull_timing()
        t.first_byte = 100.0 + 0.1 * (i + 1)  # TTFT 100, 200, ... 500 ms
        record = record_of(f"r{i}", "/v1/completions", "pull", True, t, "ok", 200)
        recent.start(record.id, lambda: record)
        assert recent.get(f"r{i}") is record and len(recent.running) == 1
        recent.finish(record)
    assert [r.id for r in recent.recent(10)] == ["r4", "r3", "r2"] and recent.get("r0") is None
    window = recent.window()
    assert window["requests"] == 5 and window["met_slos"] == 1  # only TTFT 100 ms is within 150
    assert window["ttft_ms"]["p50"] == pytest.approx(300) and window["goodput_rps"] == pytest.approx(0.1)
    assert window["itl_ms"] is None  # no gaps given
    assert recent.window(now=recent.started + 1e6)["requests"] == 0  # the window slid past them all


def test_every_gap_counts_in_the_windows_itl_percentiles_within_a_bucket():
    recent = RecentRequests(None, window_s=10.0)
    t = pull_timing()
    gaps = [0.010] * 89 + [0.050] * 10 + [1.0]  # ms: p50 10, p90 50 (the 90th), p99 50, p100 1000
    recent.finish(record_of("g", "/v1/completions", "pull", True, t, "ok", 200), now=100.0, gaps=gaps)
    itl = recent.window(now=101.0)["itl_ms"]
    assert [itl[p] / ms for p, ms in (("p50", 10), ("p90", 50), ("p99", 50))] == [pytest.approx(1.1, abs=0.1)] * 3
    assert recent.window(now=200.0)["itl_ms"] is None  # slid out


def test_node_load_turns_counters_into_rates_between_two_polls():
    page = ("# TYPE pdserve:generation_tokens counter\npdserve:generation_tokens_total {gen}\n"
            "# TYPE pdserve:engine_busy_seconds counter\npdserve:engine_busy_seconds_total {busy}\n"
            "# TYPE pdserve:kv_blocks_used gauge\npdserve:kv_blocks_used 7.0\n"
            "# TYPE pdserve:kv_transfer_bytes counter\n"
            'pdserve:kv_transfer_bytes_total{{direction="sent",transport="tcp"}} {sent}\n'
            'pdserve:kv_transfer_bytes_total{{direction="sent",transport="shm"}} 100.0\n')
    first = NodeLoad.read(MetricsPage.parse(page.format(gen=10, busy=1.0, sent=0)), None, now=50.0)
    second = NodeLoad.read(MetricsPage.parse(page.format(gen=110, busy=2.5, sent=4e6)), first, now=52.0)
    assert first.rates == {} and second.describe() == {"kv_blocks_used": 7.0, "decode_tokens_per_s": 50.0,
                                                       "utilisation": 0.75, "kv_sent_bytes_per_s": 2e6}


# -- a real cluster ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with Procs(tmp_path_factory.mktemp("dash")) as procs:
        p = procs.start(["serve", "--role", "prefill", *NODE], "p")
        d = procs.start(["serve", "--role", "decode", "--kv-transport", "tcp", *NODE], "d")
        procs.start(["proxy", "--prefill", p.url, "--decode", d.url, "--slo", "ttft:60000", "tpot:5000"], "proxy")
        procs.start(["proxy", "--prefill", p.url, "--decode", d.url, "--no-dashboard"], "bare_proxy")
        yield procs


def stream(url: str, prompt: str, max_tokens: int, headers: dict | None = None) -> tuple[str, int]:
    """A streamed completion through the proxy: its record id and the token events it carried
    (`headers`, if given, gets the answer's headers)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
        if headers is not None:
            headers.update(r.headers)
        return r.headers["x-pdserve-request-id"], len(events) - 1  # [DONE]


def test_each_request_has_a_record_with_its_nodes_transfer_and_stages(cluster):
    proxy, p, d = cluster["proxy"].url, cluster["p"].url, cluster["d"].url
    headers: dict = {}
    rid, chunks = stream(proxy, "The history of the Roman Empire " * 20, 16, headers)
    record = httpx.get(f"{proxy}/v1/requests/{rid}").json()
    assert record["status"] == "ok" and record["mode"] == "pull" and record["output_chunks"] == chunks == 16
    assert record["prefill_node"] == p and record["decode_node"] == d
    assert [s["stage"] for s in record["segments"]] == ["queue", "prefill", "decode_queue", "transfer", "decode"]
    assert [s["node"] for s in record["segments"]] == [p, p, d, d, d]
    assert record["prompt_tokens"] > 100 and record["transfer"]["tokens"] == record["prompt_tokens"]
    assert record["transfer"]["bytes"] > 0 and record["transfer"]["transport"] == "tcp"
    assert record["transfer"]["blocks"] == -(-record["prompt_tokens"] // 16)  # the engine's 16-token blocks
    # The answer's stage headers (bench records them) split P's answer to D's first token as the record does
    stage = {s["stage"]: s for s in record["segments"]}
    handoff = stage["decode_queue"]["start_ms"] - stage["prefill"]["end_ms"]
    assert float(headers["x-pdserve-handoff-ms"]) == pytest.approx(handoff, abs=0.01) and handoff >= 0
    queued = stage["decode_queue"]["end_ms"] - stage["decode_queue"]["start_ms"]
    assert float(headers["x-pdserve-decode-queue-ms"]) == pytest.approx(queued, abs=0.01)
    prefill = stage["prefill"]["end_ms"] - stage["prefill"]["start_ms"]
    assert 0 < float(headers["x-pdserve-prefill-engine-ms"]) <= prefill  # P's engine, within P's answer
    transfer = stage["transfer"]["end_ms"] - stage["transfer"]["start_ms"]
    assert float(headers["x-pdserve-decode-ttft-ms"]) >= queued + transfer - 0.01  # D's engine waited through both
    spent = sum(s["end_ms"] - s["start_ms"] for s in record["segments"])
    assert spent == pytest.approx(record["e2e_ms"], rel=0.05)  # the hops between stages are small
    assert 0 < record["ttft_ms"] < record["e2e_ms"] and record["max_itl_ms"] >= record["tpot_ms"] > 0
    recent = httpx.get(f"{proxy}/v1/requests/recent", params={"limit": 5}).json()["requests"]
    assert recent[0]["id"] == rid
    missing = httpx.get(f"{proxy}/v1/requests/nope")
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]
    bad = httpx.get(f"{proxy}/v1/requests/recent", params={"limit": 0})
    assert bad.status_code == 400 and "limit" in bad.text


def test_a_request_in_flight_shows_its_stages_so_far(cluster):
    proxy = cluster["proxy"].url
    body = {"model": MODEL, "prompt": "Count to a hundred:", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proxy + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for _ in range(3):  # a few tokens in: decoding on D
            next(lines)
        running = httpx.get(f"{proxy}/v1/requests/{r.headers['x-pdserve-request-id']}").json()
        assert running["status"] == "running" and running["e2e_ms"] is None
        assert [s["stage"] for s in running["segments"]][:4] == ["queue", "prefill", "decode_queue", "transfer"]
        listed = httpx.get(f"{proxy}/v1/requests/recent", params={"limit": 1}).json()["requests"]
        assert listed[0]["id"] == running["id"] and listed[0]["status"] == "running"
        r.close()  # the client leaves mid-stream
    deadline = time.monotonic() + 10
    while httpx.get(f"{proxy}/v1/requests/{running['id']}").json()["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert httpx.get(f"{proxy}/v1/requests/{running['id']}").json()["status"] == "aborted"


def test_a_failed_request_is_recorded_with_the_nodes_error(cluster):
    proxy = cluster["proxy"].url
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 10**6}  # past the model's context
    r = httpx.post(proxy + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400
    failed = httpx.get(f"{proxy}/v1/requests/recent", params={"limit": 1}).json()["requests"][0]
    assert failed["status"] == "error" and failed["http_status"] == 400 and "context" in failed["error"]


def test_bench_trace_out_saves_the_proxys_records_beside_the_clients_timings(cluster, tmp_path):
    trace = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "--base-url", cluster["proxy"].url, "--dataset", "random",
         "--input-len", "40", "--output-len", "6", "--num-prompts", "3", "--request-rate", "inf",
         "--trace-out", str(trace)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"3 of 3 request records written to {trace}" in proc.stdout
    saved = json.loads(trace.read_text())["requests"]
    assert len({t["request_id"] for t in saved}) == 3
    for t in saved:
        record, client = t["record"], t["client"]
        assert record["id"] == t["request_id"] and record["status"] == "ok" and client["ok"]
        assert record["prompt_tokens"] == 40 and record["transfer"]["tokens"] == 40
        assert record["ttft_ms"] <= client["ttft_ms"] and record["e2e_ms"] <= client["e2el_ms"]  # inside its view


def test_the_feed_pushes_a_snapshot_a_second_with_the_nodes_load(cluster):
    proxy = cluster["proxy"].url
    stream(proxy, "Once upon a time", 8)
    snapshots = []
    with httpx.stream("GET", proxy + "/dashboard/events", timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                snapshots.append(json.loads(line[len("data: "):]))
                if len(snapshots) == 3:
                    break
    assert snapshots[2]["t"] - snapshots[1]["t"] == pytest.approx(1.0, abs=0.5)
    last = snapshots[-1]
    roles = {n["role"]: n for n in last["nodes"]}
    assert set(roles) == {"prefill", "decode"} and all(n["healthy"] for n in last["nodes"])
    assert roles["decode"]["load"]["kv_blocks_total"] > 0 and roles["decode"]["engine"]["dtype"] == "float32"
    assert last["window"]["requests"] >= 1 and last["window"]["slos_ms"] == {"ttft_ms": 60000.0, "tpot_ms": 5000.0}
    assert last["requests"][0]["status"] == "ok" and len(last["history"]) >= 3
    assert last["window"]["itl_ms"]["p50"] > 0
    assert last["history"][-1]["itl_ms"] == pytest.approx(last["window"]["itl_ms"], abs=1e-3)  # (rounded there)


def test_the_page_and_its_files_are_served_without_a_cdn(cluster):
    proxy = cluster["proxy"].url
    page = httpx.get(proxy + "/dashboard")
    assert page.status_code == 200 and "/dashboard/static/dashboard.js" in page.text and "http" not in page.text
    js = httpx.get(proxy + "/dashboard/static/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "EventSource" in js.text
    assert httpx.get(proxy + "/dashboard/static/secret.py").status_code == 404


def test_the_grafana_dashboard_queries_only_metrics_the_cluster_exports(cluster):
    """docs/grafana/pdserve.json over Prometheus: every series it names is on the real proxy's or a
    node's /metrics page, and the proxy lists itself and its nodes, by role, for Prometheus' http_sd."""
    proxy, p, d = cluster["proxy"].url, cluster["p"].url, cluster["d"].url
    stream(proxy, "Photosynthesis converts light energy", 6)
    dashboard = json.loads((Path(__file__).resolve().parent.parent / "docs" / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    promql = pytest.importorskip("promql_parser")
    for expr in exprs:  # Prometheus' grammar, Grafana's variables given values
        promql.parse(expr.replace("$__rate_interval", "1m").replace("$role", ".*"))
    names = {name for expr in exprs for name in re.findall(r"pdserve(?:_proxy)?:[a-z_]+", expr)}
    assert len(names) >= 15
    exported = {line.split("{")[0].split(" ")[0] for url in (proxy, p, d)
                for line in httpx.get(url + "/metrics").text.splitlines() if line and not line.startswith("#")}
    assert names - exported == set()
    targets = httpx.get(proxy + "/v1/prometheus/targets").json()
    assert {(t["targets"][0], t["labels"]["pdserve_role"]) for t in targets} == {
        (proxy.removeprefix("http://"), "proxy"), (p.removeprefix("http://"), "prefill"),
        (d.removeprefix("http://"), "decode")}


def test_no_dashboard_keeps_no_records_and_serves_no_page(cluster):
    bare = cluster["bare_proxy"].url
    rid, chunks = stream(bare, "The three primary colors are", 5)
    assert chunks == 5 and rid
    assert httpx.get(f"{bare}/v1/requests/{rid}").status_code == 404
    assert httpx.get(bare + "/dashboard").status_code == 404
    assert "pdserve_proxy:requests_within_slo_total 0.0" in httpx.get(bare + "/metrics").text


def test_an_open_page_does_not_hold_the_proxys_stop(cluster, tmp_path):
    """SIGTERM with a feed open: the feed ends and the proxy exits 0 well before the 5 s grace."""
    proxy = start_pdserve(["proxy", "--prefill", cluster["p"].url, "--decode", cluster["d"].url], tmp_path, "stop")
    try:
        with httpx.stream("GET", proxy.url + "/dashboard/events", timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("event: snapshot")
            started = time.monotonic()
            proxy.proc.send_signal(signal.SIGTERM)
            assert proxy.proc.wait(timeout=10) == 0
            assert time.monotonic() - started < 3.0
    finally:
        proxy.stop()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (make install-test installs Debian's as root)")
def test_the_page_in_a_real_browser_shows_nodes_and_requests_and_updates(cluster, tmp_path):
    """Headless Chromium loads /dashboard while requests flow; the rows come, a request's segments
    add up to its end-to-end time within 5 %, the page updates. The screenshot goes to
    $PDSERVE_DASHBOARD_SCREENSHOT (docs/dashboard.png is made so), else to a temp dir."""
    sync_api = pytest.importorskip("playwright.sync_api")
    import concurrent.futures

    proxy = cluster["proxy"].url
    with sync_api.sync_playwright() as pw, concurrent.futures.ThreadPoolExecutor(2) as pool:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(proxy + "/dashboard")
            page.wait_for_function("window.__pdserve.updates >= 1", timeout=15000)
            flowing = [pool.submit(stream, proxy, f"Request number {i} tells a story about", 24) for i in range(4)]
            for future in flowing:
                future.result()
            page.wait_for_function("window.__pdserve.last.requests.filter(r => r.status === 'ok').length >= 4",
                                   timeout=15000)
            seen = page.evaluate("window.__pdserve.updates")
            page.wait_for_function(f"window.__pdserve.updates > {seen}", timeout=5000)
            assert page.locator("#nodes tr.node").count() == 2
            rows = page.locator("#requests tr.request")
            assert rows.count() >= 4
            first = rows.first
            e2e = float(first.get_attribute("data-e2e-ms"))
            stages = [float(ms) for ms in first.locator("rect").evaluate_all("rs => rs.map(r => r.dataset.ms)")]
            assert len(stages) == 5 and sum(stages) == pytest.approx(e2e, rel=0.05)
            first.click()
            page.wait_for_function("!document.querySelector('#record').hidden", timeout=5000)
            assert json.loads(page.locator("#record").text_content())["id"] == first.get_attribute("data-request-id")
            shot = Path(os.environ.get("PDSERVE_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
        finally:
            browser.close()
