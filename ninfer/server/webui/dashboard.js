// The dashboard: polls /admin/live twice a second and draws the figures, the charts and the
// table of requests in flight (ids and counts only: the server never sends prompt or text).
"use strict";

const POLL_MS = 500;
const COLORS = { green: "#58d68d", blue: "#4fb3ff", orange: "#f5a623", red: "#ff6b6b", violet: "#b48cff" };

function setText(id, value) {
  const el = document.getElementById(id);
  if (el) el.textContent = value;
}

function render(live) {
  setText("model", live.model + " · " + live.backend);
  const health = document.getElementById("health");
  health.textContent = !live.healthy ? "unhealthy" : live.quiesced ? "quiesced" : "healthy";
  health.className = "status " + (!live.healthy ? "bad" : live.quiesced ? "held" : "ok");
  setText("updated", "updated " + new Date(live.time_unix_s * 1000).toLocaleTimeString());
  const r = live.requests, kv = live.kv_pages, host = live.host_tier, totals = live.totals;
  setText("fig-running", r.running);
  setText("fig-waiting", r.waiting);
  setText("fig-paused", r.paused);
  setText("fig-held", r.held);
  setText("fig-lanes", live.lanes);
  setText("fig-gen-tps", formatNumber(live.tokens_per_s.generated));
  setText("fig-prefill-tps", formatNumber(live.tokens_per_s.prefilled));
  setText("fig-generated-total", formatNumber(totals.generated_tokens, 0));
  setText("fig-prefill-total", formatNumber(totals.prefill_tokens, 0));
  setText("fig-ttft", formatNumber(live.latency_ms.ttft));
  setText("fig-itl", formatNumber(live.latency_ms.inter_token, 2));
  setText("fig-kv-used", kv.used);
  setText("fig-kv-capacity", kv.capacity);
  setText("fig-kv-active", kv.active);
  setText("fig-kv-cached", kv.cached);
  setText("fig-host-tier", formatBytes(host.prefix_bytes));
  setText("fig-host-pages", host.prefix_pages);
  setText("fig-host-snapshots", formatBytes(host.snapshot_bytes));
  setText("fig-preemptions", totals.preemptions);
  setText("fig-restores", totals.snapshot_restores + totals.replay_restores);
  setText("fig-snapshot-restores", totals.snapshot_restores);
  setText("fig-replay-restores", totals.replay_restores);
  setText("fig-steps", formatNumber(totals.steps, 0));
  setText("fig-memory-device", live.memory.device === "cpu" ? "host (cpu)" : "GPU");
  setText("fig-memory", formatBytes(live.memory.used_bytes));
  setText("fig-memory-total", formatBytes(live.memory.total_bytes));
  renderTable(live.in_flight);
  renderCharts(live.history);
}

function renderTable(rows) {
  const body = document.getElementById("requests");
  body.replaceChildren();
  if (!rows.length) {
    const tr = body.insertRow();
    const td = tr.insertCell();
    td.colSpan = 6;
    td.className = "empty";
    td.textContent = "no requests in flight";
    return;
  }
  rows.sort((a, b) => b.age_s - a.age_s);
  for (const row of rows) {
    const tr = body.insertRow();
    tr.className = "request-row";
    for (const value of [row.id, row.route, row.age_s.toFixed(1), row.tokens_in, row.tokens_out, row.phase]) {
      tr.insertCell().textContent = value;
    }
  }
}

function renderCharts(history) {
  drawLineChart(document.getElementById("chart-tps"), history,
    [{ key: "gen_tps", color: COLORS.green }, { key: "prefill_tps", color: COLORS.blue }]);
  drawLineChart(document.getElementById("chart-requests"), history,
    [{ key: "running", color: COLORS.green }, { key: "waiting", color: COLORS.orange }, { key: "paused", color: COLORS.red }]);
  drawLineChart(document.getElementById("chart-kv"), history,
    [{ key: "kv_used", color: COLORS.blue }, { key: "kv_active", color: COLORS.green }, { key: "kv_cached", color: COLORS.violet }]);
  drawLineChart(document.getElementById("chart-latency"), history,
    [{ key: "ttft_ms", color: COLORS.orange }, { key: "itl_ms", color: COLORS.violet }]);
}

async function poll() {
  try {
    const response = await apiFetch("/admin/live");
    if (!response.ok) throw new Error("GET /admin/live: " + response.status);
    render(await response.json());
    setText("error", "");
  } catch (error) {
    setText("error", String(error.message || error));
    const health = document.getElementById("health");
    health.textContent = "unreachable";
    health.className = "status bad";
  }
  setTimeout(poll, POLL_MS);
}

document.getElementById("forget-key").addEventListener("click", (event) => {
  event.preventDefault();
  forgetKey();
});
poll();
