// pdserve's live cluster page: draws what /dashboard/events pushes (the proxy aggregates).
"use strict";

const STAGE_COLORS = {
  queue: "#b0b7c3", prefill: "#e0892b", decode_queue: "#c9a227", transfer: "#7b4fd6", decode: "#2f7fd8",
};
const SVG = "http://www.w3.org/2000/svg";
const state = { updates: 0, last: null, selected: null };
window.__pdserve = state; // what the browser test reads

function el(tag, attrs = {}, text = "") {
  const node = tag === "svg" || ["rect", "line", "polyline", "text", "title", "g"].includes(tag)
    ? document.createElementNS(SVG, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
}

const fmt = (v, digits = 1) => (v === null || v === undefined || Number.isNaN(v) ? "–" : Number(v).toFixed(digits));
const short = (url) => (url ? url.replace(/^https?:\/\//, "") : "–");

function drawNodes(nodes) {
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren(...nodes.map((n) => {
    const l = n.load || {}, e = n.engine || {};
    const engine = [e.dtype, e.quantization, e.kernels, e.tensor_parallel_size && `TP${e.tensor_parallel_size}`,
      e.kv_transport].filter(Boolean).join(" · ");
    const cells = [
      short(n.url), n.role, n.healthy ? "up" : "down", engine, fmt(l.waiting, 0), fmt(l.running, 0),
      `${fmt(l.kv_blocks_used, 0)} / ${fmt(l.kv_blocks_total, 0)}`, fmt(l.kv_blocks_held, 0),
      fmt(l.prefill_tokens_per_s, 0), fmt(l.decode_tokens_per_s, 0),
      `${fmt((l.kv_received_bytes_per_s || 0) / 1e6, 2)} / ${fmt((l.kv_sent_bytes_per_s || 0) / 1e6, 2)}`,
      l.utilisation === undefined ? "–" : `${fmt(100 * l.utilisation, 0)} %`,
    ];
    const row = el("tr", { class: "node", "data-url": n.url, "data-role": n.role });
    cells.forEach((c, i) => row.appendChild(el("td", i === 3 ? { class: "left" } : {}, String(c))));
    row.children[2].className = n.healthy ? "ok" : "error";
    return row;
  }));
}

function drawSummary(w) {
  document.querySelector("#window").textContent = `(over ${fmt(w.window_s / 60, 0)} min)`;
  const slos = Object.entries(w.slos_ms || {}).map(([k, v]) => `${k.replace("_ms", "")} ≤ ${v} ms`).join(", ");
  const pct = (p) => (p ? `${fmt(p.p50, 0)} / ${fmt(p.p90, 0)} / ${fmt(p.p99, 0)}` : "–");
  const cards = [
    ["requests", w.requests], ["throughput req/s", fmt(w.throughput_rps, 2)],
    [`goodput req/s${slos ? " (" + slos + ")" : " (no --slo: every answer)"}`, fmt(w.goodput_rps, 2)],
    ["TTFT p50 / p90 / p99 ms", pct(w.ttft_ms)], ["TPOT p50 / p90 / p99 ms", pct(w.tpot_ms)],
    ["ITL p50 / p90 / p99 ms", pct(w.itl_ms)],
    ["max gap p50 / p90 / p99 ms", pct(w.max_itl_ms)], ["e2e p50 / p90 / p99 ms", pct(w.e2e_ms)],
  ];
  document.querySelector("#summary").replaceChildren(...cards.map(([name, value]) => {
    const card = el("div", { class: "card" });
    card.append(el("span", { class: "muted" }, name), el("b", {}, String(value)));
    return card;
  }));
}

function lineChart(title, history, series) {
  const W = 300, H = 110, pad = 22;
  const svg = el("svg", { width: W, height: H, class: "chart" });
  svg.appendChild(el("text", { x: 4, y: 11 }, title));
  const t0 = history.length ? history[0].t : 0, t1 = history.length ? history[history.length - 1].t : 1;
  const values = series.flatMap((s) => history.map(s.value)).filter((v) => v !== null && v !== undefined);
  const top = Math.max(1e-9, ...values);
  svg.appendChild(el("text", { x: 4, y: 24 }, fmt(top, top < 10 ? 2 : 0)));
  series.forEach((s, i) => {
    const points = history.map((p) => [p.t, s.value(p)]).filter(([, v]) => v !== null && v !== undefined)
      .map(([t, v]) => `${pad + ((t - t0) / Math.max(t1 - t0, 1)) * (W - pad - 4)},${H - 14 - (v / top) * (H - 40)}`);
    if (!points.length) return;
    svg.appendChild(el("polyline", { points: points.join(" "), fill: "none", stroke: s.color, "stroke-width": 1.5 }));
    svg.appendChild(el("text", { x: pad + i * 90, y: H - 2, fill: s.color }, s.name));
  });
  return svg;
}

function drawCharts(history) {
  const q = (name, p) => (h) => (h[name] ? h[name][p] : null);
  document.querySelector("#charts").replaceChildren(
    lineChart("TTFT ms", history, [{ name: "p50", value: q("ttft_ms", "p50"), color: "#2f7fd8" },
      { name: "p90", value: q("ttft_ms", "p90"), color: "#e0892b" }]),
    lineChart("TPOT p50 / ITL p99 / max gap p50 ms", history, [
      { name: "TPOT", value: q("tpot_ms", "p50"), color: "#2f7fd8" },
      { name: "ITL p99", value: q("itl_ms", "p99"), color: "#e0892b" },
      { name: "max gap", value: q("max_itl_ms", "p50"), color: "#c62828" }]),
    lineChart("req/s", history, [{ name: "throughput", value: (h) => h.throughput_rps, color: "#7a8494" },
      { name: "goodput", value: (h) => h.goodput_rps, color: "#1a7f37" }]),
    lineChart("busy (fraction of time stepping)", history, [
      { name: "P", value: (h) => h.utilisation_prefill ?? null, color: "#e0892b" },
      { name: "D", value: (h) => h.utilisation_decode ?? null, color: "#2f7fd8" },
      { name: "colocated", value: (h) => h.utilisation_both ?? h.utilisation_kv_both ?? null, color: "#7b4fd6" }]),
  );
}

function timeline(record, scaleMs) {
  const W = 360, H = 14, svg = el("svg", { width: W, height: H, class: "timeline" });
  for (const s of record.segments) {
    const x = (s.start_ms / scaleMs) * W, w = Math.max(((s.end_ms - s.start_ms) / scaleMs) * W, 1);
    const rect = el("rect", { x, y: 1, width: w, height: H - 2, fill: STAGE_COLORS[s.stage] || "#999",
      "data-stage": s.stage, "data-ms": (s.end_ms - s.start_ms).toFixed(3) });
    rect.appendChild(el("title", {}, `${s.stage} ${fmt(s.end_ms - s.start_ms)} ms on ${short(s.node)}`));
    svg.appendChild(rect);
  }
  return svg;
}

function drawRequests(records) {
  const scale = Math.max(1, ...records.map((r) => r.e2e_ms ?? Math.max(0, ...r.segments.map((s) => s.end_ms))));
  const body = document.querySelector("#requests tbody");
  body.replaceChildren(...records.map((r) => {
    const row = el("tr", { class: "request", "data-request-id": r.id, "data-e2e-ms": r.e2e_ms ?? "" });
    const kv = r.transfer ? `${fmt(r.transfer.bytes / 1e6, 2)} MB · ${r.transfer.blocks} blocks · ${fmt(r.transfer.ms)} ms · `
      + `${r.transfer.transport || "?"}` : "–";
    const placed = r.placement ? `${r.placement.choice} (pred. TTFT ${fmt(r.placement.predicted_ttft_ms, 0)} ms)` : "–";
    const route = r.prefill_node ? `${short(r.prefill_node)} → ${short(r.decode_node)}` : short(r.decode_node);
    const cells = [r.id.slice(0, 8), r.status, null, fmt(r.ttft_ms), fmt(r.tpot_ms), fmt(r.max_itl_ms),
      fmt(r.e2e_ms, 0), route, kv, placed];
    cells.forEach((c, i) => {
      const td = el("td", i === 2 || i >= 7 ? { class: "left" } : {});
      if (i === 2) td.appendChild(timeline(r, scale)); else td.textContent = c;
      row.appendChild(td);
    });
    row.children[1].className = r.status;
    row.addEventListener("click", () => showRecord(r.id));
    return row;
  }));
}

async function showRecord(id) {
  const box = document.querySelector("#record");
  const response = await fetch(`/v1/requests/${id}`);
  box.textContent = JSON.stringify(await response.json(), null, 2);
  box.hidden = false;
  state.selected = id;
}

function legend() {
  document.querySelector("#legend").replaceChildren(...Object.entries(STAGE_COLORS).map(([stage, color]) => {
    const item = el("span");
    item.append(el("i", { style: `background:${color}` }), stage.replace("_", " "));
    return item;
  }));
}

function connect() {
  const source = new EventSource("/dashboard/events");
  source.addEventListener("snapshot", (event) => {
    const snap = JSON.parse(event.data);
    state.last = snap;
    state.updates += 1;
    document.querySelector("#mode").textContent = `${snap.mode} mode · ${snap.nodes.length} nodes`;
    document.querySelector("#status").textContent = `updated ${new Date(snap.t * 1000).toLocaleTimeString()}`;
    drawNodes(snap.nodes);
    drawSummary(snap.window);
    drawCharts(snap.history);
    drawRequests(snap.requests);
  });
  source.onerror = () => { document.querySelector("#status").textContent = "disconnected, retrying…"; };
}

legend();
connect();
