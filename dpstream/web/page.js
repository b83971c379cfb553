"use strict";
const SVG_NS = "http://www.w3.org/2000/svg";
const POLL_MS = __POLL__;
const UNITS = {pure: "ε", epsilon: "ε", eps: "ε", rho: "ρ", zcdp: "ρ"};
const C = {band: "#9ecae1", line: "#08519c", spent: "#e6550d", budget: "#d9d9d9",
           alert: "#cb181d", axis: "#737373", grid: "#ececec"};
let chosenKey = readHash();
let keySignature = null;
let timer = null;
let inFlight = false;
let updates = 0;

function readHash() {
  const m = location.hash.match(/^#key=(.*)$/);
  return m ? decodeURIComponent(m[1]) : "";
}
// The charts are drawn by hand in SVG, not with a chart library: uPlot 1.6 (MIT) was weighed
// and kept out, as its minified script alone (51 kB) is 2.6 times this whole page, it draws on
// a canvas (the tests read the band and line as SVG paths), and it has no horizontal bars.
function svg(tag, attrs, text) {
  const e = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}
function node(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  if (text !== undefined) e.textContent = text;
  return e;
}
function unit(u) { return UNITS[u] || u || ""; }
function fmt(x) {
  if (x === null || x === undefined) return "–";
  const a = Math.abs(x);
  if (Number.isInteger(x) && a < 1e7) return String(x);
  if (a >= 1000) return x.toFixed(0);
  if (a >= 10) return x.toFixed(1);
  if (a === 0) return "0";
  return x.toPrecision(3).replace(/\.?0+$/, "");
}
function clock(t) { return new Date(t * 1000).toISOString().slice(11, 19); }
function when(item) { return item.t === null ? "step " + item.step : clock(item.t); }
function clear(e, keep) {
  for (const child of Array.from(e.childNodes)) {
    if (!keep || !keep.includes(child.nodeName)) e.removeChild(child);
  }
}
function niceTicks(lo, hi, count, steps) {
  const span = hi - lo;
  let step = steps.find(s => span / s <= count);
  if (step === undefined) {
    const mag = Math.pow(10, Math.floor(Math.log10(span / count)));
    step = [1, 2, 5, 10].map(m => m * mag).find(s => span / s <= count);
  }
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(v);
  return out;
}
const TIME_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600];

function schedule(ms) { clearTimeout(timer); timer = setTimeout(poll, ms); }
async function poll() {
  if (inFlight) return;
  inFlight = true;
  try {
    const query = chosenKey ? "?key=" + encodeURIComponent(chosenKey) : "";
    const response = await fetch("state.json" + query, {cache: "no-store"});
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
    document.body.classList.remove("offline");
  } catch (err) {
    document.body.classList.add("offline");
    setText("status", "No connection to the live view (" + err.message + "); retrying.");
  } finally {
    inFlight = false;
    schedule(POLL_MS);
  }
}
function setText(id, text) { document.getElementById(id).textContent = text; }

function render(state) {
  updates += 1;
  document.body.dataset.updates = String(updates);
  const c = state.counts;
  let line = "Updated " + clock(state.generated) + " UTC · " + c.keys_tracked +
    " keys tracked (at most " + state.limits.keys + ", last " + state.limits.points_per_key +
    " releases each) · " + c.releases + " releases · " + c.alerts + " alerts · " +
    "budget-exhausted statuses: " + c.statuses;
  if (c.keys_evicted) line += " · " + c.keys_evicted + " keys no longer tracked";
  if (c.rejected) line += " · " + c.rejected + " malformed records ignored";
  setText("status", line);
  renderPicker(state);
  renderCount(state);
  renderBudget(state);
  renderAlerts(state);
  renderStatuses(state);
}

function renderPicker(state) {
  const picker = document.getElementById("key-picker");
  const names = state.keys.map(k => k.key).sort();
  const signature = JSON.stringify([names, state.default_key]);
  if (signature === keySignature) return;
  keySignature = signature;
  clear(picker);
  const auto = state.default_key ? " — " + state.default_key : "";
  picker.appendChild(node("option", {value: ""}, "Most releases" + auto));
  for (const name of names) picker.appendChild(node("option", {value: name}, name));
  if (chosenKey && !names.includes(chosenKey)) {
    picker.appendChild(node("option", {value: chosenKey}, chosenKey + " (not tracked)"));
  }
  picker.value = chosenKey;
}

function chooseKey(name) {
  chosenKey = name;
  history.replaceState(null, "", name ? "#key=" + encodeURIComponent(name) : "#");
  document.getElementById("key-picker").value = name;
  schedule(0);
}

function renderCount(state) {
  const chart = document.getElementById("count-chart");
  clear(chart, ["title", "desc"]);
  const W = 760, H = 330, L = 72, R = 34, T = 14, B = 48;
  const pts = state.series;
  const name = state.key;
  document.getElementById("count-heading").textContent =
    "Private count of " + (name === null ? "a key" : "key " + name) + " over time";
  if (!pts.length) {
    const why = name === null ? "Waiting for the first release…" :
      "No releases of this key are kept (it is not tracked).";
    chart.appendChild(svg("text", {x: W / 2, y: H / 2, "text-anchor": "middle",
                                   id: "count-empty"}, why));
    setText("count-chart-title", why);
    setText("latest", "");
    clear(document.querySelector("#series-table tbody"));
    return;
  }
  const z = state.band.z;
  const byTime = pts.every(p => p.t !== null);
  const xs = pts.map(p => byTime ? p.t : p.step);
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  let y0 = Math.min(...pts.map(p => p.value - z * p.std));
  let y1 = Math.max(...pts.map(p => p.value + z * p.std));
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const pad = (y1 - y0) * 0.06;
  y0 -= pad; y1 += pad;
  const X = v => L + (v - x0) / (x1 - x0) * (W - L - R);
  const Y = v => T + (y1 - v) / (y1 - y0) * (H - T - B);
  const axes = svg("g", {class: "axes", "aria-hidden": "true"});
  for (const v of niceTicks(y0, y1, 6, [])) {
    axes.appendChild(svg("line", {x1: L, x2: W - R, y1: Y(v), y2: Y(v), stroke: C.grid}));
    const label = Math.abs(v) < 1e-9 * (y1 - y0) ? "0" : fmt(Number(v.toPrecision(12)));
    axes.appendChild(svg("text", {x: L - 6, y: Y(v) + 4, "text-anchor": "end"}, label));
  }
  for (const v of niceTicks(x0, x1, 7, byTime ? TIME_STEPS : [])) {
    axes.appendChild(svg("line", {x1: X(v), x2: X(v), y1: H - B, y2: H - B + 5,
                                  stroke: C.axis}));
    axes.appendChild(svg("text", {x: X(v), y: H - B + 18, "text-anchor": "middle"},
                         byTime ? clock(v) : String(Math.round(v))));
  }
  axes.appendChild(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, stroke: C.axis}));
  axes.appendChild(svg("line", {x1: L, x2: L, y1: T, y2: H - B, stroke: C.axis}));
  axes.appendChild(svg("text", {x: (L + W - R) / 2, y: H - 8, "text-anchor": "middle"},
                       byTime ? "end of the step's window (UTC)" : "step"));
  const mid = (T + H - B) / 2;
  axes.appendChild(svg("text", {x: 14, y: mid, "text-anchor": "middle",
                                transform: "rotate(-90 14 " + mid + ")"}, "private count"));
  chart.appendChild(axes);
  const at = (i, v) => X(xs[i]).toFixed(1) + " " + Y(v).toFixed(1);
  const upper = pts.map((p, i) => at(i, p.value + z * p.std));
  const lower = pts.map((p, i) => at(i, p.value - z * p.std)).reverse();
  chart.appendChild(svg("path", {id: "count-band", class: "band", fill: C.band, stroke: C.band,
                                 "stroke-width": 1,
                                 d: "M" + upper.join(" L") + " L" + lower.join(" L") + " Z"}));
  chart.appendChild(svg("path", {id: "count-line", class: "line", fill: "none", stroke: C.line,
                                 "stroke-width": 2.5, "stroke-linejoin": "round",
                                 d: "M" + pts.map((p, i) => at(i, p.value)).join(" L")}));
  for (const a of state.alerts.filter(a => a.key === name)) {
    const ax = byTime && a.t !== null ? a.t : (byTime ? null : a.step);
    if (ax === null || ax < x0 || ax > x1) continue;
    const marker = svg("line", {class: "alert-marker", x1: X(ax), x2: X(ax), y1: T, y2: H - B,
                                stroke: C.alert, "stroke-width": 1.5, "stroke-dasharray": "5 4"});
    marker.appendChild(svg("title", {}, "alert at step " + a.step));
    chart.appendChild(marker);
  }
  const widest = Math.max(...pts.map(p => 2 * z * p.std));
  if (widest < 0.03 * (y1 - y0)) {
    chart.appendChild(svg("text", {id: "count-thin-band", x: L + 8, y: T + 14},
                          "The band is thin here: the noise is small next to counts this large."));
  }
  const last = pts[pts.length - 1];
  chart.appendChild(svg("circle", {id: "count-latest", cx: X(xs[xs.length - 1]),
                                   cy: Y(last.value), r: 4, fill: C.line}));
  const lastText = "latest (" + when(last) + ", step " + last.step + "): " + fmt(last.value) +
    " ± " + fmt(z * last.std) + " (noise std " + fmt(last.std) + ")";
  setText("latest", lastText);
  setText("count-chart-title", "Private count of key " + name + ": " + pts.length +
          " releases from step " + pts[0].step + " to " + last.step + "; " + lastText);
  const body = document.querySelector("#series-table tbody");
  clear(body);
  for (const p of pts.slice(-20).reverse()) {
    const row = node("tr");
    for (const cell of [String(p.step), when(p), fmt(p.value), fmt(p.std),
                        fmt(p.value - z * p.std) + " … " + fmt(p.value + z * p.std)]) {
      row.appendChild(node("td", {}, cell));
    }
    body.appendChild(row);
  }
}

function renderBudget(state) {
  const chart = document.getElementById("budget-chart");
  clear(chart, ["title", "desc"]);
  const rows = state.budget.rows;
  const W = 380, BW = 250, ROW = 54;
  const H = Math.max(1, rows.length) * ROW + 8;
  chart.setAttribute("viewBox", "0 0 " + W + " " + H);
  const source = {metrics: "Source: the flow's metrics.",
                  releases: "Source: the releases' privacy fields (largest spend of any key)."};
  setText("budget-source", source[state.budget.source] || "No budget known yet.");
  if (!rows.length) {
    chart.appendChild(svg("text", {x: 8, y: 30}, "No budget known yet."));
    return;
  }
  rows.forEach((r, i) => {
    const y = 8 + i * ROW;
    const frac = r.fraction === null ? 0 : Math.max(0, Math.min(1, r.fraction));
    const pct = r.fraction === null ? "" : " (" + Math.round(r.fraction * 100) + " %)";
    const label = r.mechanism + ": " + fmt(r.spent) + " of " + fmt(r.budget) + " " + unit(r.unit) +
      " spent" + pct;
    const g = svg("g", {class: "budget-bar", role: "img", "aria-label": label,
                        "data-mechanism": r.mechanism, "data-fraction": frac.toFixed(4)});
    g.appendChild(svg("text", {x: 0, y: y + 12}, r.mechanism + " (" + unit(r.unit) + ")"));
    g.appendChild(svg("rect", {class: "budget-total", x: 0, y: y + 18, width: BW, height: 18,
                               fill: C.budget, stroke: C.axis}));
    g.appendChild(svg("rect", {class: "budget-spent", x: 0, y: y + 18,
                               width: (BW * frac).toFixed(1), height: 18, fill: C.spent}));
    g.appendChild(svg("text", {x: BW + 8, y: y + 32}, fmt(r.spent) + " / " + fmt(r.budget) + pct));
    chart.appendChild(g);
  });
}

function renderAlerts(state) {
  const alerts = state.alerts;
  const line = document.getElementById("alert-timeline");
  clear(line, ["title", "desc"]);
  const W = 760, H = 46, L = 10, R = 10;
  line.appendChild(svg("line", {x1: L, x2: W - R, y1: 30, y2: 30, stroke: "#737373"}));
  if (alerts.length) {
    const byTime = alerts.every(a => a.t !== null);
    const xs = alerts.map(a => byTime ? a.t : a.step);
    let x0 = Math.min(...xs), x1 = Math.max(...xs);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    const X = v => L + (v - x0) / (x1 - x0) * (W - L - R);
    alerts.forEach((a, i) => {
      const tick = svg("line", {class: "alert-tick", x1: X(xs[i]), x2: X(xs[i]), y1: 8, y2: 30,
                                stroke: C.alert, "stroke-width": 3});
      tick.appendChild(svg("title", {}, "step " + a.step + ": " + a.key));
      line.appendChild(tick);
    });
    line.appendChild(svg("text", {x: L, y: 44}, byTime ? clock(x0) : "step " + x0));
    line.appendChild(svg("text", {x: W - R, y: 44, "text-anchor": "end"},
                         byTime ? clock(x1) : "step " + x1));
  }
  setText("alert-timeline-title", alerts.length + " alerts on a time line");
  const tracked = new Set(state.keys.map(k => k.key));
  const body = document.querySelector("#alerts-table tbody");
  clear(body);
  for (const a of alerts.slice().reverse()) {
    const row = node("tr", {class: "alert-row"});
    row.appendChild(node("td", {}, String(a.step)));
    row.appendChild(node("td", {}, when(a)));
    const cell = node("td");
    if (tracked.has(a.key)) {
      const b = node("button", {class: "key-link", type: "button",
                                title: "show this key's count"}, a.key);
      b.addEventListener("click", () => chooseKey(a.key));
      cell.appendChild(b);
    } else {
      cell.textContent = a.key;
    }
    row.appendChild(cell);
    row.appendChild(node("td", {}, fmt(a.threshold)));
    row.appendChild(node("td", {}, fmt(a.epsilon)));
    body.appendChild(row);
  }
  setText("alerts-summary", alerts.length ?
          "Newest first; the last " + state.limits.alerts + " are kept." : "No alerts yet.");
}

function renderStatuses(state) {
  const statuses = state.statuses;
  const summary = document.getElementById("status-summary");
  summary.textContent = statuses.length ? statuses.length + " budget-exhausted status" +
    (statuses.length === 1 ? "" : "es") + ": these keys stop releasing." :
    "None: no key has run out of budget.";
  summary.className = statuses.length ? "bad" : "";
  const body = document.querySelector("#status-table tbody");
  clear(body);
  for (const s of statuses.slice().reverse()) {
    const row = node("tr", {class: "status-row"});
    for (const cell of [String(s.step), s.key, s.refused,
                        fmt(s.spent) + " of " + fmt(s.budget) + " " + unit(s.unit), s.reason]) {
      row.appendChild(node("td", {}, cell));
    }
    body.appendChild(row);
  }
}

document.getElementById("key-picker").addEventListener("change", e => chooseKey(e.target.value));
window.addEventListener("hashchange", () => {
  if (readHash() !== chosenKey) chooseKey(readHash());
});
poll();
