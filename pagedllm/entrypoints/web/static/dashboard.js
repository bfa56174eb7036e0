// Dashboard: polls /dashboard/api/stats once a second (fetch, so the key goes in a header; EventSource
// could only put it in the URL) and draws the counters, the KV-block grid, token rates and histograms.
"use strict";

const POLL_MS = 1000;
const MAX_CELLS = 400;
const $ = (id) => document.getElementById(id);
let timer = null;
let inFlight = false;

function fmt(n) { return Number(n).toLocaleString("en-US"); }

/** One cell per block, or per `per` blocks when the pool is larger than MAX_CELLS: in use first, then the
 * free-but-cached blocks, then the free ones (the pool keeps no spatial order worth showing). */
function drawGrid(kv) {
  const grid = $("kv-grid");
  const per = Math.max(1, Math.ceil(kv.total / MAX_CELLS));
  const cells = Math.ceil(kv.total / per);
  const used = Math.ceil(kv.in_use / per);
  const cached = Math.min(cells - used, Math.round(kv.cached_free / per));
  while (grid.children.length < cells) {
    const c = document.createElement("div");
    c.className = "kv-cell free";
    grid.appendChild(c);
  }
  while (grid.children.length > cells) grid.lastChild.remove();
  for (let i = 0; i < cells; i++) {
    const cls = i < used ? "used" : i < used + cached ? "cached" : "free";
    const c = grid.children[i];
    if (c.className !== "kv-cell " + cls) c.className = "kv-cell " + cls;
  }
  grid.dataset.total = kv.total;
  grid.dataset.inUse = kv.in_use;
  grid.dataset.cachedFree = kv.cached_free;
  $("kv-legend-text").textContent =
    `${fmt(kv.in_use)} in use, ${fmt(kv.cached_free)} cached, ${fmt(kv.total - kv.in_use - kv.cached_free)} free` +
    ` of ${fmt(kv.total)}` + (per > 1 ? ` (one cell = ${per} blocks)` : "");
}

function axes(ctx, w, h, pad, yMax, yLabel) {
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = "#999";
  ctx.fillStyle = "#555";
  ctx.font = "11px sans-serif";
  ctx.beginPath();
  ctx.moveTo(pad, 5);
  ctx.lineTo(pad, h - pad);
  ctx.lineTo(w - 5, h - pad);
  ctx.stroke();
  ctx.fillText(yMax.toFixed(yMax < 10 ? 1 : 0), 2, 12);
  ctx.fillText(yLabel, 2, h - pad);
}

function drawRates(history) {
  const cv = $("rate-chart");
  const ctx = cv.getContext("2d");
  const w = cv.width, h = cv.height, pad = 30;
  const pts = [];
  for (let i = 1; i < history.length; i++) {
    const [t0, p0, g0] = history[i - 1];
    const [t1, p1, g1] = history[i];
    const dt = t1 - t0;
    if (dt > 0) pts.push([t1, (p1 - p0) / dt, (g1 - g0) / dt]);
  }
  const yMax = Math.max(1, ...pts.map((p) => Math.max(p[1], p[2])));
  axes(ctx, w, h, pad, yMax, "0");
  const now = history.length ? history[history.length - 1][0] : 0;
  const x = (t) => pad + ((t - (now - 300)) / 300) * (w - pad - 5);
  const y = (v) => h - pad - (v / yMax) * (h - pad - 10);
  for (const [idx, color, label, ly] of [[1, "#d9822b", "prompt", 14], [2, "#2b7bd9", "generation", 28]]) {
    ctx.strokeStyle = color;
    ctx.beginPath();
    pts.forEach((p, i) => (i ? ctx.lineTo(x(p[0]), y(p[idx])) : ctx.moveTo(x(p[0]), y(p[idx]))));
    ctx.stroke();
    ctx.fillStyle = color;
    const last = pts.length ? pts[pts.length - 1][idx] : 0;
    ctx.fillText(`${label}: ${last.toFixed(1)} tok/s`, w - 170, ly);
  }
  ctx.fillStyle = "#555";
  ctx.fillText("-5 min", pad + 2, h - pad + 14);
  ctx.fillText("now", w - 30, h - pad + 14);
}

function drawHistogram(id, hist) {
  const cv = $(id);
  const ctx = cv.getContext("2d");
  const w = cv.width, h = cv.height, pad = 30;
  const counts = hist.cumulative.map((c, i) => c - (i ? hist.cumulative[i - 1] : 0));
  const yMax = Math.max(1, ...counts);
  axes(ctx, w, h, pad, yMax, "0");
  const bw = (w - pad - 10) / counts.length;
  ctx.fillStyle = "#2b7bd9";
  counts.forEach((c, i) => {
    const bh = (c / yMax) * (h - pad - 10);
    ctx.fillRect(pad + i * bw + 1, h - pad - bh, bw - 2, bh);
  });
  ctx.fillStyle = "#555";
  hist.le.forEach((le, i) => {
    if (i % 3 === 0) ctx.fillText(le === null ? "inf" : String(le), pad + i * bw, h - pad + 12);
  });
  const mean = hist.count ? (hist.sum / hist.count) * 1000 : 0;
  ctx.fillText(`${fmt(hist.count)} samples, mean ${mean.toFixed(1)} ms (bucket upper bounds, s)`, pad + 5, h - 4);
}

function render(s) {
  $("model-name").textContent = s.model;
  $("running").textContent = fmt(s.running);
  $("waiting").textContent = fmt(s.waiting);
  $("preemptions").textContent = fmt(s.preemptions);
  $("kv-usage").textContent = (s.kv_cache_usage * 100).toFixed(1) + "%";
  $("hit-rate").textContent = s.prefix_cache_queries
    ? ((100 * s.prefix_cache_hits) / s.prefix_cache_queries).toFixed(1) + "%" : "-";
  $("hit-rate").dataset.hits = s.prefix_cache_hits;
  $("hit-rate").dataset.queries = s.prefix_cache_queries;
  $("prompt-tokens").textContent = fmt(s.prompt_tokens);
  $("generation-tokens").textContent = fmt(s.generation_tokens);
  $("requests-done").textContent = fmt(Object.values(s.requests).reduce((a, b) => a + b, 0));
  drawGrid(s.kv_blocks);
  drawRates(s.history);
  drawHistogram("ttft-chart", s.ttft);
  drawHistogram("itl-chart", s.itl);
  document.body.dataset.updated = String(s.time);
}

async function poll() {
  if (inFlight) return;
  inFlight = true;
  if (timer !== null) clearTimeout(timer);
  timer = null;
  try {
    const r = await Api.fetch("/dashboard/api/stats");
    const s = await r.json();
    if (!s.available) { $("status").textContent = "Metrics are not collected by this server."; return; }
    $("status").textContent = s.engine_alive ? "" : "Engine is dead";
    render(s);
  } catch (e) {
    if (e.status === 401) return; // the key prompt is shown; polling resumes once a key is entered
    $("status").textContent = "Server unreachable: " + e.message;
  } finally {
    inFlight = false;
  }
  timer = setTimeout(poll, POLL_MS);
}

KeyPrompt.init(poll);
poll();
