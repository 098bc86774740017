// elche's dashboard page: draws /state.json, kept live by the /events stream; or, in a
// run's report.html, draws the state inlined as window.ELCHE_STATE and connects to nothing.
// Charts are uPlot (vendored under /static, MIT); nothing is fetched from elsewhere.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
  "#7f7f7f", "#bcbd22", "#17becf"];
const charts = {};

function chart(id, labels) {
  const el = document.getElementById(id);
  const key = id + ":" + labels.join(",");
  if (charts[id] && charts[id].key === key) return charts[id].plot;
  if (charts[id]) charts[id].plot.destroy();
  const series = [{label: "t (s)"}].concat(labels.map((label, i) => (
    {label, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true})));
  const plot = new uPlot({width: el.clientWidth || 460, height: 200, series,
    scales: {x: {time: false}}, legend: {live: false}}, [[]].concat(labels.map(() => [])), el);
  charts[id] = {key, plot};
  return plot;
}

// [[t, v], ...] per series -> uPlot's aligned columns, null where a series has no point.
function align(seriesList) {
  const times = [...new Set(seriesList.flatMap(s => s.map(p => p[0])))].sort((a, b) => a - b);
  const index = new Map(times.map((t, i) => [t, i]));
  const columns = seriesList.map(s => {
    const col = new Array(times.length).fill(null);
    for (const [t, v] of s) col[index.get(t)] = v;
    return col;
  });
  return [times].concat(columns);
}

function fmt(value, digits) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

function cell(row, text, cls) {
  const td = row.insertCell();
  td.textContent = text;
  if (cls) td.className = cls;
}

function drawRanks(ranks) {
  const body = document.querySelector("#ranks tbody");
  body.replaceChildren();
  for (const r of ranks) {
    const row = body.insertRow();
    row.className = r.state;
    row.dataset.rank = r.rank;
    cell(row, r.rank);
    cell(row, r.host || "–", "text");
    cell(row, r.device || "–", "text");
    cell(row, r.state + (r.reason ? ": " + r.reason : ""), "text");
    cell(row, fmt(r.samples_per_s, 0));
    cell(row, fmt(r.share, 3));
    cell(row, r.samples);
    cell(row, fmt(r.idle_pct, 1));
    cell(row, fmt(r.compute_ms_per_batch, 2));
    cell(row, fmt(r.loss, 4));
    cell(row, r.roles.join(", ") || "–", "text");
  }
}

function drawAlerts(alerts) {
  const list = document.getElementById("alerts");
  list.replaceChildren();
  if (!alerts.length) {
    list.innerHTML = '<li class="none">none</li>';
    return;
  }
  for (const a of alerts.slice().reverse()) {
    const li = document.createElement("li");
    li.className = a.severity;
    li.textContent = `${fmt(a.t, 1)} s  [${a.severity}] ${a.name} ${a.path} — ${a.detail} (x${a.count})`;
    list.appendChild(li);
  }
}

function draw(state) {
  const run = state.run;
  document.getElementById("run").textContent =
    `${run.mode || "?"} · ${run.world_size} ranks · ${run.phase}` +
    ` · epochs ${run.epochs_completed} · rounds ${run.rounds}` +
    ` · loss ${fmt(run.loss, 4)} · anchor ${run.anchor ?? "–"}` +
    (run.outcome ? ` · ${run.outcome}` : "") + ` · ${fmt(run.t, 1)} s`;
  const rankIds = state.ranks.map(r => String(r.rank));
  const names = rankIds.map(r => "rank " + r);
  chart("chart-loss", ["loss"]).setData(align([state.series.loss]));
  chart("chart-speed", names).setData(align(rankIds.map(r => state.series.samples_per_s[r])));
  chart("chart-share", names).setData(align(rankIds.map(r => state.series.share[r])));
  chart("chart-rounds", ["round ms"]).setData(align([state.series.round_ms]));
  chart("chart-anchor", ["anchor"]).setData(align([state.series.anchor]));
  drawRanks(state.ranks);
  drawAlerts(state.alerts);
  document.body.dataset.records = String(state.records ?? "");
}

function connect() {
  fetch("/state.json").then(r => r.json()).then(draw).catch(() => {});
  const events = new EventSource("/events");
  events.onmessage = (message) => draw(JSON.parse(message.data));
  events.addEventListener("complete", () => events.close());
}

if (window.ELCHE_STATE) draw(window.ELCHE_STATE);
else connect();
