// kvgate's live view: polls /dashboard/data once a second, keeps the last HISTORY_S seconds of
// snapshots in memory and redraws every chart as SVG paths. No dependencies, no build step.
"use strict";

const HISTORY_S = 300; // seconds of history kept in the page
const WINDOW_S = 10; // window of the rates and TTFT quantiles (seconds)
const POLL_MS = 1000;
const CLASSES = ["critical", "standard", "sheddable"];
const COLORS = ["#2f6fde", "#d9480f", "#2b8a3e", "#9c36b5", "#e8590c", "#0c8599", "#c2255c", "#5c940d", "#495057"];
const CLASS_COLORS = { critical: "#c2255c", standard: "#2f6fde", sheddable: "#868e96" };
const SVG_NS = "http://www.w3.org/2000/svg";
const W = 600, H = 120;
const UNLIMITED = 2 ** 40; // a backend without tokens_per_minute has a bucket this large

const history = []; // [{t: seconds, d: /dashboard/data document}]
const charts = new Map(); // chart id -> {box, svg, legend, top}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function fmt(v, digits) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (typeof v !== "number") return String(v);
  if (v >= UNLIMITED) return "unlimited";
  if (digits !== undefined) return v.toFixed(digits);
  if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(2) + " M";
  if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(1) + " k";
  return Number.isInteger(v) ? String(v) : v.toFixed(2);
}

function backendOf(d, name) {
  return d.backends.find((b) => b.name === name);
}

// the snapshot at least `seconds` older than history[i] (or the oldest one)
function before(i, seconds) {
  const t = history[i].t - seconds;
  for (let j = i - 1; j >= 0; j--) if (history[j].t <= t) return history[j];
  return i > 0 ? history[0] : null;
}

// quantile q of a cumulative histogram delta, interpolated inside its bucket (seconds)
function quantile(q, now, then) {
  const count = now.count - (then ? then.count : 0);
  if (!(count > 0)) return null;
  const old = new Map((then ? then.buckets : []).map(([le, c]) => [le, c]));
  const rank = q * count;
  let prevLe = 0, prevC = 0;
  for (const [le, c] of now.buckets) {
    const cum = c - (old.get(le) || 0);
    if (cum >= rank) {
      const inBucket = cum - prevC;
      return inBucket > 0 ? prevLe + ((le - prevLe) * (rank - prevC)) / inBucket : le;
    }
    prevLe = le;
    prevC = cum;
  }
  return prevLe; // above the last finite bound: report that bound
}

function rate(i, get) {
  const then = before(i, WINDOW_S);
  if (!then) return null;
  const dt = history[i].t - then.t;
  if (dt <= 0) return null;
  const a = get(history[i].d), b = get(then.d);
  if (a === null || a === undefined) return null;
  return Math.max(0, (a - (b || 0)) / dt);
}

// ---- charts ----------------------------------------------------------------------------
function chart(parent, id, title) {
  let c = charts.get(id);
  if (c) return c;
  const box = el("div", "chart-box");
  box.dataset.chart = id;
  box.append(el("h3", null, title));
  const top = el("div", "axis");
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const axis = el("div", "axis");
  const since = el("span", null, "");
  axis.append(since, el("span", null, "now"));
  const legend = el("div", "legend");
  box.append(top, svg, axis, legend);
  parent.append(box);
  c = { box, svg, legend, top, since };
  charts.set(id, c);
  return c;
}

// series: [{key, label, color, values: [number|null per history entry]}]; yMax: fixed top or null
function draw(c, series, yMax, unit) {
  const now = history.length ? history[history.length - 1].t : 0;
  // the time axis grows with the history, up to HISTORY_S
  const span = Math.min(HISTORY_S, Math.max(30, history.length ? now - history[0].t : 0));
  c.since.textContent = span >= 120 ? `−${(span / 60).toFixed(1)} min` : `−${Math.round(span)} s`;
  let top = yMax;
  if (top === null) {
    top = 0;
    for (const s of series) for (const v of s.values) if (v !== null && v > top) top = v;
    top = top > 0 ? top : 1;
  }
  const label = top;
  top *= 1.08; // headroom: a line at the top stays visible
  c.top.replaceChildren(el("span", null, `max ${fmt(label)}${unit || ""}`), el("span", null, ""));
  const nodes = [];
  for (const y of [0.25, 0.5, 0.75]) {
    const line = document.createElementNS(SVG_NS, "line");
    line.setAttribute("class", "grid");
    line.setAttribute("x1", "0");
    line.setAttribute("x2", String(W));
    line.setAttribute("y1", String(H * y));
    line.setAttribute("y2", String(H * y));
    nodes.push(line);
  }
  c.legend.replaceChildren();
  for (const s of series) {
    let d = "", points = 0, max = null, last = null, pen = "M";
    s.values.forEach((v, i) => {
      if (v === null || v === undefined || Number.isNaN(v)) {
        pen = "M";
        return;
      }
      const x = W - ((now - history[i].t) / span) * W;
      const y = H - (Math.min(v, top) / top) * H;
      d += `${pen}${x.toFixed(1)},${y.toFixed(1)} `;
      pen = "L";
      points += 1;
      max = max === null ? v : Math.max(max, v);
      last = v;
    });
    const path = document.createElementNS(SVG_NS, "path");
    path.setAttribute("d", d.trim() || "M0,0");
    path.setAttribute("stroke", s.color);
    path.dataset.series = s.key;
    path.dataset.points = String(points);
    path.dataset.max = max === null ? "" : String(max);
    path.dataset.last = last === null ? "" : String(last);
    nodes.push(path);
    const item = el("span", null, `${s.label} ${fmt(last)}${unit || ""}`);
    item.style.setProperty("--c", s.color);
    c.legend.append(item);
  }
  c.svg.replaceChildren(...nodes);
}

function values(get) {
  return history.map((h, i) => {
    const v = get(h.d, i);
    return v === undefined ? null : v;
  });
}

// ---- one backend's panel -----------------------------------------------------------------
const panels = new Map();

function panel(name) {
  let p = panels.get(name);
  if (p) return p;
  const section = el("section", "panel backend");
  section.dataset.backend = name;
  const head = el("h2", null, `backend ${name} `);
  const badge = el("span", "badge");
  head.append(badge);
  const tiles = el("div", "tiles");
  const grid = el("div", "charts");
  const slo = el("table", "slo");
  section.append(head, tiles, grid, slo);
  document.getElementById("backends").append(section);
  p = { section, badge, tiles, grid, slo };
  panels.set(name, p);
  return p;
}

function tile(p, field, label, value, text) {
  let t = p.tiles.querySelector(`[data-field="${field}"]`);
  if (!t) {
    t = el("div", "tile");
    t.dataset.field = field;
    t.append(el("div", "label", label), el("div", "value"));
    p.tiles.append(t);
  }
  t.dataset.value = value === null || value === undefined ? "" : String(value);
  t.querySelector(".value").textContent = text !== undefined ? text : fmt(value);
}

function renderBackend(b) {
  const p = panel(b.name);
  const name = b.name;
  const get = (f) => (d) => {
    const x = backendOf(d, name);
    return x ? f(x) : null;
  };
  p.badge.textContent = !b.healthy ? "unhealthy" : b.stale ? "metrics stale" : b.shedding ? "shedding" : "healthy";
  p.badge.className = "badge" + (!b.healthy || b.stale || b.shedding ? " bad" : "");

  tile(p, "kv_usage", "engine KV usage", b.kv_usage, b.kv_usage === null ? "–" : (b.kv_usage * 100).toFixed(1) + " %");
  tile(p, "scale", "scale", b.scale, fmt(b.scale, 3));
  tile(p, "in_use", "slots in use", b.in_use);
  tile(p, "effective_concurrency", "slots effective", b.effective.concurrency);
  tile(p, "base_concurrency", "slots base", b.base.concurrency);
  tile(p, "inflight_tokens", "in-flight tokens", b.inflight_tokens);
  tile(p, "effective_inflight_tokens", "in-flight effective", b.effective.inflight_tokens);
  tile(p, "base_inflight_tokens", "in-flight base", b.base.inflight_tokens);
  tile(p, "effective_tpm", "TPM effective", b.effective.tokens_per_minute);
  tile(p, "base_tpm", "TPM base", b.base.tokens_per_minute);
  tile(p, "waiting", "engine waiting", b.waiting);
  const refused = Object.values(b.refusals).reduce((a, n) => a + n, 0);
  tile(p, "refusals", "refusals (total)", refused);
  if (b.prefill) {
    tile(p, "prefill_budget", "prefill budget", b.prefill.budget);
    tile(p, "prefill_in_prefill", "in prefill (other / critical)", b.prefill.in_prefill,
      `${fmt(b.prefill.in_prefill)} / ${fmt(b.prefill.critical_in_prefill)}`);
  }

  draw(chart(p.grid, `${name}/kv`, "engine KV-cache usage"), [
    { key: "kv_usage", label: "KV usage", color: COLORS[0], values: values(get((x) => x.kv_usage)) },
    { key: "scale", label: "scale", color: COLORS[1], values: values(get((x) => x.scale)) },
  ], 1, "");
  draw(chart(p.grid, `${name}/slots`, "slots: in use, effective, base"), [
    { key: "in_use", label: "in use", color: COLORS[0], values: values(get((x) => x.in_use)) },
    { key: "effective_concurrency", label: "effective", color: COLORS[1], values: values(get((x) => x.effective.concurrency)) },
    { key: "base_concurrency", label: "base", color: COLORS[8], values: values(get((x) => x.base.concurrency)) },
  ], null);
  draw(chart(p.grid, `${name}/inflight`, "in-flight tokens: held, effective, base limit"), [
    { key: "inflight_tokens", label: "held", color: COLORS[0], values: values(get((x) => x.inflight_tokens)) },
    { key: "effective_inflight_tokens", label: "effective", color: COLORS[1], values: values(get((x) => x.effective.inflight_tokens)) },
    { key: "base_inflight_tokens", label: "base", color: COLORS[8], values: values(get((x) => x.base.inflight_tokens)) },
  ], null);
  draw(chart(p.grid, `${name}/queue`, "waiting in kvgate, by class"), CLASSES.map((cls) => ({
    key: `queue_${cls}`, label: cls, color: CLASS_COLORS[cls], values: values(get((x) => x.queue[cls])),
  })), null);
  const reasons = new Set();
  for (const h of history) {
    const x = backendOf(h.d, name);
    if (x) Object.keys(x.refusals).forEach((r) => reasons.add(r));
  }
  draw(chart(p.grid, `${name}/refusals`, `refusals per second by reason (${WINDOW_S} s)`),
    [...reasons].sort().map((r, k) => ({
      key: `refusals_${r}`, label: r, color: COLORS[k % COLORS.length],
      values: history.map((_, i) => rate(i, get((x) => x.refusals[r] || 0))),
    })), null, "/s");
  draw(chart(p.grid, `${name}/ttft`, `time to first token p99 by class (${WINDOW_S} s window)`),
    CLASSES.map((cls) => ({
      key: `ttft_p99_${cls}`, label: cls, color: CLASS_COLORS[cls],
      values: history.map((h, i) => {
        const x = backendOf(h.d, name);
        const now = x && x.ttft[cls];
        if (!now) return null;
        const old = before(i, WINDOW_S);
        const y = old && backendOf(old.d, name);
        return quantile(0.99, now, y ? y.ttft[cls] : null);
      }),
    })), null, " s");
  if (b.prefill) {
    draw(chart(p.grid, `${name}/prefill`, "prefill budget: prompt tokens before their first bytes"), [
      { key: "prefill_other", label: "in prefill", color: COLORS[0], values: values(get((x) => x.prefill && x.prefill.in_prefill)) },
      { key: "prefill_critical", label: "critical lane", color: CLASS_COLORS.critical, values: values(get((x) => x.prefill && x.prefill.critical_in_prefill)) },
      { key: "prefill_budget", label: "budget", color: COLORS[8], values: values(get((x) => x.prefill && x.prefill.budget)) },
    ], null);
  }
  renderSlo(p, b.slo);
}

function renderSlo(p, slo) {
  if (!slo) {
    p.slo.replaceChildren();
    return;
  }
  const head = el("tr");
  for (const h of ["class", "latency-target cap", "bound by", "running", "p99 TTFT (s)", "target TTFT p99 (s)", "p99 TPOT (s)"]) head.append(el("th", null, h));
  const rows = [head];
  for (const cls of CLASSES) {
    const s = slo[cls];
    if (!s) continue;
    const tr = el("tr");
    tr.dataset.sloClass = cls;
    const target = s.target ? s.target.ttft_p99_s : null;
    for (const v of [cls, s.cap === null ? "none" : fmt(s.cap), s.bound_by || "–", fmt(s.running),
      fmt(s.ttft_p99_s, 3), target === null ? "–" : fmt(target, 3), fmt(s.tpot_p99_s, 3)]) tr.append(el("td", null, v));
    rows.push(tr);
  }
  p.slo.replaceChildren(...rows);
}

// ---- tenants ---------------------------------------------------------------------------------
function renderTenants(d) {
  const i = history.length - 1;
  const tokens = (name) => (x) => {
    const t = x.tenants.find((y) => y.name === name);
    return t ? t.tokens : null;
  };
  const rows = d.tenants.map((t) => {
    const tr = el("tr");
    tr.dataset.tenant = t.name;
    for (const v of [t.name, t.priority, fmt(t.tokens), fmt(rate(i, tokens(t.name))), fmt(t.in_use), fmt(t.queue_depth)]) tr.append(el("td", null, v));
    return tr;
  });
  document.querySelector("#tenants tbody").replaceChildren(...rows);
  draw(chart(document.getElementById("tenant-chart"), "tenants", `tokens per second, top tenants (${WINDOW_S} s)`),
    d.tenants.slice(0, 6).map((t, k) => ({
      key: `tenant_${t.name}`, label: t.name, color: COLORS[k % COLORS.length],
      values: history.map((_, j) => rate(j, tokens(t.name))),
    })), null, "/s");
}

// ---- polling -----------------------------------------------------------------------------
function setStatus(text, ok) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = "status " + (ok ? "ok" : "bad");
}

function render(d) {
  const st = d.store || {};
  let store = `store: ${st.mode || "local"}`;
  if (st.replica) store += ` · replica ${st.replica} · breaker ${st.breaker}` +
    Object.entries(st.scopes || {}).map(([m, n]) => ` · ${m} ${n}`).join("");
  const storeEl = document.getElementById("store");
  storeEl.textContent = store;
  storeEl.dataset.mode = st.mode || "local";
  d.backends.forEach(renderBackend);
  renderTenants(d);
}

async function poll() {
  try {
    const resp = await fetch("/dashboard/data", { credentials: "same-origin", cache: "no-store" });
    if (resp.status === 401) {
      setStatus("admin key required: open /dashboard?key=ADMIN_KEY", false);
      return;
    }
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const d = await resp.json();
    history.push({ t: d.time, d });
    while (history.length && history[0].t < d.time - HISTORY_S) history.shift();
    render(d);
    document.body.dataset.samples = String(history.length);
    setStatus(`live · ${new Date(d.time * 1000).toLocaleTimeString()}`, true);
  } catch (err) {
    setStatus(`no data: ${err.message}`, false);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
