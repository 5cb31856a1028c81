// mm-serve dashboard: polls /internal/dashboard every second (built from the /metrics counters) and draws
// SLO attainment per tier, TTFT/TPOT percentiles, request rate and refusals (plotly.js, served by this
// server), the workers' states, the caches, and where each recent request's time went.
"use strict";

const POLL_MS = 1000;
const WATERFALL_ROWS = 20;
const $ = (id) => document.getElementById(id);
const PHASE_COLOURS = {"front end": "#9aa5b8", "queue": "#f2b134", "queue + prefill": "#7a9fe6", "encode": "#8e6ad8", "prefill": "#2f6fde",
                       "hand-off": "#e0598b", "decode queue": "#f5d58a", "decode": "#1f9d55"};
const TIER_COLOURS = {interactive: "#c2410c", standard: "#2f6fde", batch: "#6b7385"};
let timer = null;

const pct = (v) => (v === null || v === undefined ? "-" : (100 * v).toFixed(1) + " %");
const secs = (v) => (v === null || v === undefined ? "-" : v < 1 ? Math.round(v * 1000) + " ms" : v.toFixed(2) + " s");

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  row.append(td);
  return td;
}

function tile(id, label, value) {
  let div = $(id);
  if (!div) {
    div = document.createElement("div");
    div.className = "tile";
    div.innerHTML = '<div class="muted"></div><div class="value"></div>';
    div.id = id;
    $("tiles").append(div);
  }
  div.firstChild.textContent = label;
  div.lastChild.textContent = value;
}

function drawTiles(data) {
  const last = data.series.length ? data.series[data.series.length - 1] : null;
  for (const tier of Object.keys(data.slo)) {
    const value = last ? last.attainment[tier] : null;
    tile("attainment-" + tier, tier + " SLO attainment", pct(value));
  }
  tile("rate", "requests / s", last ? last.rate.toFixed(2) : "-");
  tile("ttft-p90", "TTFT p90", last ? secs(last.ttft.p90) : "-");
  tile("tpot-p90", "TPOT p90", last ? secs(last.tpot.p90) : "-");
}

const layout = (yTitle, extra) => Object.assign({
  margin: {l: 48, r: 12, t: 8, b: 30}, yaxis: {title: yTitle, rangemode: "tozero"}, xaxis: {type: "date"},
  legend: {orientation: "h", y: -0.25}, showlegend: true}, extra || {});

function drawCharts(data) {
  const times = data.series.map((p) => new Date(p.t * 1000));
  const tiers = Object.keys(data.slo);
  Plotly.react("chart-attainment", tiers.map((tier) => ({
    x: times, y: data.series.map((p) => p.attainment[tier] ?? null), name: tier, mode: "lines",
    line: {color: TIER_COLOURS[tier]}, connectgaps: false})), layout("met / finished", {yaxis: {range: [0, 1.05]}}),
    {displayModeBar: false});
  for (const [chart, field] of [["chart-ttft", "ttft"], ["chart-tpot", "tpot"]]) {
    Plotly.react(chart, ["p50", "p90", "p99"].map((q) => ({
      x: times, y: data.series.map((p) => p[field][q]), name: q, mode: "lines"})), layout("seconds"),
      {displayModeBar: false});
  }
  const reasons = [...new Set(data.series.flatMap((p) => Object.keys(p.refusals)))];
  Plotly.react("chart-rate", [
    {x: times, y: data.series.map((p) => p.rate), name: "finished / s", mode: "lines", line: {color: "#1d2330"}},
    ...reasons.map((reason) => ({x: times, y: data.series.map((p) => p.refusals[reason] || 0),
                                 name: "refused: " + reason, type: "bar"}))],
    layout("per second", {barmode: "stack"}), {displayModeBar: false});
}

function drawWorkers(data) {
  const body = $("workers");
  body.replaceChildren();
  for (const [name, w] of Object.entries(data.workers)) {
    const row = document.createElement("tr");
    row.dataset.worker = name;
    cell(row, name);
    cell(row, w.state, "state state-" + w.state);
    cell(row, w.running ?? "-");
    cell(row, w.waiting ?? "-");
    cell(row, w.kv_pages_used === null || w.kv_pages_used === undefined ? "-" : w.kv_pages_used + " / " + w.kv_pages_total);
    cell(row, w.ring_slots_used ?? "-");
    cell(row, w.fault || "");
    body.append(row);
  }
  const faults = $("faults");
  faults.replaceChildren();
  for (const [role, f] of Object.entries(data.faults)) {
    const row = document.createElement("tr");
    row.dataset.role = role;
    cell(row, role);
    cell(row, f.restarts ?? 0, "restarts");
    cell(row, f.migrations ?? 0, "migrations");
    cell(row, f.failed_by_fault ?? 0);
    faults.append(row);
  }
  $("caches").textContent = "Prefix-cache hit rate (prompt tokens): " + pct(data.caches.prefix_hit_rate)
    + " · encoder-cache hit rate (images): " + pct(data.caches.encoder_hit_rate);
}

function drawWaterfall(data) {
  const legend = $("legend");
  if (!legend.childElementCount) {
    for (const [name, colour] of Object.entries(PHASE_COLOURS)) {
      const span = document.createElement("span");
      span.style.setProperty("--swatch", colour);
      span.textContent = name;
      legend.append(span);
    }
  }
  const box = $("waterfall");
  box.replaceChildren();
  const shown = data.recent.slice(0, WATERFALL_ROWS);
  const longest = Math.max(1e-3, ...shown.map((r) => r.e2e_s));
  for (const request of shown) {
    const row = document.createElement("div");
    row.className = "row";
    row.dataset.request = request.id;
    const label = document.createElement("div");
    label.textContent = request.id + " · " + request.tier + " · TTFT " + secs(request.ttft_s);
    const bar = document.createElement("div");
    bar.className = "bar";
    for (const phase of request.phases) {
      const span = document.createElement("span");
      span.className = "phase";
      span.dataset.phase = phase.name;
      span.style.left = (100 * phase.start_s / longest) + "%";
      span.style.width = (100 * (phase.end_s - phase.start_s) / longest) + "%";
      span.style.background = PHASE_COLOURS[phase.name];
      span.title = phase.name + ": " + secs(phase.end_s - phase.start_s);
      bar.append(span);
    }
    row.append(label, bar);
    box.append(row);
  }
}

async function poll() {
  clearTimeout(timer);
  try {
    const r = await fetch("/internal/dashboard", {headers: ConsoleKey.headers()});
    if (r.status === 401) {
      ConsoleKey.ask($("app"), ConsoleKey.set ? "That key was not accepted." : "This server needs an API key.", poll);
      return;
    }
    const data = await r.json();
    ConsoleKey.accepted($("app"));
    $("app").classList.remove("stale");
    $("updated").classList.remove("stale");
    $("status").textContent = data.model + " · " + data.status;
    $("updated").textContent = "updated " + new Date(data.time * 1000).toLocaleTimeString();
    drawTiles(data);
    drawWorkers(data);
    drawWaterfall(data);
    drawCharts(data);
  } catch (err) {  // the server is away: what is shown is from before, and says so
    $("app").classList.add("stale");
    $("updated").classList.add("stale");
    $("updated").textContent = "server not reachable, showing " + $("updated").textContent.replace(/^server not reachable, showing /, "");
  }
  timer = setTimeout(poll, POLL_MS);
}

poll();
