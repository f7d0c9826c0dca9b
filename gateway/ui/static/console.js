// llmgw console: a single page polling the gateway's /ui/api every 2 s (docs/console.md); the playground
// and the keys page render on demand (they hold what the user typed) and never poll.
// Plain DOM, no framework, nothing fetched from elsewhere. Every value is put in the page as text
// (textContent), never as HTML: model names, reasons and log lines come from the fleet.
"use strict";

const REFRESH_MS = 2000;
const KEY_STORE = "llmgw.key";
const TABS = ["fleet", "models", "events", "catalog", "batches", "playground", "keys"];
const ON_DEMAND = new Set(["playground", "keys"]); // rendered when opened or acted on, not every 2 s

const state = {
  tab: "fleet",
  key: sessionStorage.getItem(KEY_STORE) || "",
  timer: null,
  events: { cursor: null, list: [], filters: { model: "", node: "", kind: "" }, kinds: [] },
  catalogVersion: null,
  catalogSeen: null,
};

class AuthError extends Error {}

// --- small helpers --------------------------------------------------------------------------------
// null, undefined and false among children mean "nothing here": left out, never put in the page as the
// text "null" (which is what append and replaceChildren make of them).
function present(children) {
  return children.flat().filter((c) => c !== null && c !== undefined && c !== false);
}

function show(parent, ...children) {
  parent.replaceChildren(...present(children));
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "style") node.setAttribute("style", v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of present(children)) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "-";
  const s = Math.max(0, seconds);
  if (s < 10) return s.toFixed(1) + "s";
  if (s < 120) return Math.round(s) + "s";
  if (s < 7200) return Math.round(s / 60) + "m";
  if (s < 172800) return Math.round(s / 3600) + "h";
  return Math.round(s / 86400) + "d";
}

function when(ts) {
  return ts ? new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 19) + "Z" : "-";
}

function secs(v) {
  if (v === null || v === undefined) return "-";
  return v < 1 ? Math.round(v * 1000) + " ms" : v.toFixed(v < 10 ? 2 : 1) + " s";
}

function colour(id) {
  // A stable colour per replica id: the same replica has the same colour on every page and refresh.
  let h = 0;
  for (const ch of id) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360} 65% 72%)`;
}

function stateBadge(s) {
  return el("span", { class: "state state-" + s }, s);
}

// --- the API ----------------------------------------------------------------------------------------
async function api(path, opts) {
  const o = opts || {};
  const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
  if (o.body !== undefined) headers["Content-Type"] = "application/json";
  const resp = await fetch(path, { method: o.method || "GET", headers, cache: "no-store",
    body: o.body === undefined ? undefined : JSON.stringify(o.body) });
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  const message = body && body.error ? body.error.message : `${resp.status} ${resp.statusText}`;
  if (resp.status === 401 || resp.status === 403) throw new AuthError(message);
  if (!resp.ok) throw new Error(message);
  return body;
}

function showAuth(message) {
  document.getElementById("auth").hidden = false;
  document.getElementById("auth-error").textContent = message;
  document.getElementById("view").replaceChildren();
}

function setStatus(text, bad) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = bad ? "error" : "muted";
}

// --- pages ----------------------------------------------------------------------------------------
async function renderFleet(view) {
  const r = await api("/ui/api/fleet");
  const states = Object.entries(r.replica_states).map(([k, v]) => `${v} ${k}`).join(", ") || "no replicas";
  const summary = el("div", { class: "summary" },
    `catalog version ${r.catalog.version}`, r.catalog.problem ? ` (${r.catalog.problem})` : "",
    ` · endpoint list v${r.endpoints.version}, ${r.endpoints.count} routable · ${states}`);
  const cards = el("div", { class: "cards" });
  for (const n of r.nodes) {
    const badges = [
      n.live ? el("span", { class: "badge good" }, "live") : el("span", { class: "badge bad" }, "LOST"),
      el("span", { class: "badge" }, "pool " + (n.pool || "?")),
      n.draining ? el("span", { class: "badge warn" }, "draining") : n.cordoned ? el("span", { class: "badge warn" }, "cordoned") : null,
    ];
    const labels = Object.entries(n.labels || {}).map(([k, v]) => el("span", { class: "chip" }, `${k}=${v}`));
    const gpus = el("div", { class: "gpus" }, (n.devices || []).map((d) => el("div", {
      class: "gpu" + (d.replica ? "" : " free") + (d.healthy === false ? " unhealthy" : ""),
      "data-gpu": `${n.name}:${d.index}`,
      "data-replica": d.replica,
      style: d.replica ? `background:${colour(d.replica)}` : null,
      title: (d.replica ? `${d.class} ${d.index}: ${d.replica} (${d.model})` : `${d.class} ${d.index}: free`)
        + (d.healthy === false ? ` · unhealthy: ${d.health}` : ""),
    }, d.index)));
    const cpu = r.replicas.filter((x) => x.nodes.includes(n.name) && !(x.gpus[n.name] || []).length && x.state !== "Stopped");
    const gpuHolders = [...new Set((n.devices || []).filter((d) => d.replica).map((d) => d.replica))];
    cards.append(el("div", { class: "card", "data-node": n.name, "data-live": String(n.live) },
      el("div", { class: "row" }, el("h3", {}, n.name), badges),
      el("div", { class: "row muted" }, n.live ? `heartbeat ${age(n.heartbeat_age)} ago` : "no heartbeat",
        n.address ? ` · ${n.address}` : "",
      weightsText(n.weights)),
      labels.length ? el("div", { class: "row" }, labels) : null,
      (n.devices || []).length ? el("div", { class: "row" }, el("span", { class: "muted" },
        Object.entries(n.gpus).map(([c, g]) => `${c} ${g.used}/${g.total} used`).join(", ")), gpus)
        : el("div", { class: "muted" }, "no GPUs"),
      gpuHolders.length ? el("div", { class: "row legend" }, gpuHolders.map((id) => {
        const rep = r.replicas.find((x) => x.id === id);
        return el("span", { "data-replica": id, "data-state": rep ? rep.state : "" },
          el("span", { class: "chip", style: `background:${colour(id)}` }, id), " ", rep ? stateBadge(rep.state) : "");
      })) : null,
      cpu.length ? el("div", {}, el("div", { class: "muted" }, "CPU replicas"),
        cpu.map((x) => el("div", { class: "row", "data-replica": x.id, "data-state": x.state },
          el("span", { class: "chip" }, x.id), stateBadge(x.state), downloadBar(x.download),
          el("span", { class: "muted" }, x.reason || ""))))
        : null));
  }
  const unplaced = r.replicas.filter((x) => !x.nodes.length && x.state !== "Stopped");
  show(view, summary, r.nodes.length ? cards : el("p", { class: "muted" }, "No node has sent a heartbeat."),
    unplaced.length ? el("div", { class: "card", style: "margin-top:.8rem" }, el("h3", {}, "Not placed"),
      unplaced.map((x) => el("div", { class: "row", "data-replica": x.id, "data-state": x.state },
        el("span", { class: "chip" }, x.id), stateBadge(x.state), el("span", { class: "muted" }, x.reason || ""))))
      : null);
}

// What a bar says of a figure it does not have: no fresh scrape of the engine (o.why says more).
const UNKNOWN_WHY = "not known: the engine's last scrape is older than 10 s, or failed";

function bar(label, value, max, opts) {
  const o = opts || {};
  const known = value !== null && value !== undefined;
  const pct = known && max ? Math.min(100, (100 * value) / max) : 0;
  const hot = known && o.limit !== undefined && value >= o.limit;
  return [
    el("span", { class: "muted" }, label),
    el("div", { class: "bar" }, el("span", { class: hot ? "hot" : "", style: `width:${pct}%` }),
      o.limit !== undefined && max ? el("i", { style: `left:${Math.min(100, (100 * o.limit) / max)}%` }) : null),
    known ? el("span", {}, o.text ? o.text(value) : String(value))
      : el("span", { class: "muted", title: o.why || UNKNOWN_WHY }, "n/a"),
  ];
}

function weightsText(w) {
  // A node's weights cache (remote sources downloaded there): what it holds and the disk left for it.
  if (!w) return "";
  const held = w.sources ? `${size(w.bytes)} of ${w.sources} model${w.sources === 1 ? "" : "s"}` : "empty";
  return ` · weights cache ${held}, ${size(w.free)} free`;
}

function size(n) {
  if (n === null || n === undefined) return "?";
  return n >= 1024 ** 3 ? (n / 1024 ** 3).toFixed(1) + " GiB" : (n / 1024 ** 2).toFixed(1) + " MiB";
}

function downloadBar(d) {
  // A replica's download of its weights: bytes done of the total, the rate and ETA beside it.
  if (!d || d.phase === "failed") return null;
  const text = (v) => `${d.total ? Math.floor((100 * v) / d.total) + "% " : ""}${size(v)} of ${size(d.total)}`
    + (d.rate ? `, ${size(d.rate)}/s` : "") + (d.eta !== null && d.eta !== undefined ? `, ETA ${age(d.eta)}` : "");
  return el("div", { class: "bars download", "data-download": d.source }, bar(d.phase, d.done, d.total || 1, { text }));
}

function loadBars(row, capacity, th) {
  const l = row.load || {};
  return el("div", { class: "bars" },
    bar("in flight", l.inflight, capacity || Math.max(1, l.inflight), { limit: capacity || undefined }),
    bar("running", l.running, capacity || Math.max(1, l.running || 0)),
    bar("waiting", l.waiting, Math.max(th.max_waiting * 1.5, l.waiting || 0), { limit: th.max_waiting }),
    bar("KV", l.kv, 1, { limit: th.max_kv, text: (v) => Math.round(v * 100) + "%",
      why: "not reported: llama.cpp reports no KV cache use (vLLM does), or the last scrape is older than 10 s" }),
    el("span", { class: "muted" }, "service"), el("span", {}), l.service_time === null || l.service_time === undefined
      ? el("span", { class: "muted", title: "not learned yet: this gateway process has had no answer from it" }, "n/a")
      : el("span", {}, secs(l.service_time)),
    // prefix cache: the share of prompt tokens the gateways expected cached, and the engine reused
    ...(l.prefix ? [el("span", { class: "muted" }, "prefix hit"), el("span", {}),
                    el("span", { "data-prefix": "", title: "share of the prompt tokens found in the engine's prefix cache: "
                      + "expected by the gateways' routing, reused as the engine reports it; "
                      + `indexed up to ${l.prefix.indexed} tokens (${l.prefix.indexed_by})` },
                       `expected ${ratio(l.prefix.expected)} · reused ${ratio(l.prefix.measured)}`)] : []));
}

function ratio(v) {
  return v === null || v === undefined ? "n/a" : Math.round(v * 100) + "%";
}

function chart(title, points, series) {
  // A small line chart of `series` ([key, colour, label]) over the points' times; gaps stay gaps.
  const W = 220, H = 52, P = 2;
  const vals = points.flatMap((p) => series.map(([k]) => p[k])).filter((v) => v !== null && v !== undefined);
  const max = Math.max(...vals, 0) || 1;
  const box = svg("svg", { width: W, height: H, viewBox: `0 0 ${W} ${H}` });
  box.append(svg("line", { x1: 0, y1: H - P, x2: W, y2: H - P, stroke: "#e5e7eb" }));
  const n = Math.max(1, points.length - 1);
  for (const [k, col] of series) {
    let path = "";
    points.forEach((p, i) => {
      const v = p[k];
      if (v === null || v === undefined) return;
      const x = (i / n) * W, y = H - P - (v / max) * (H - 2 * P);
      path += (path && points[i - 1] && points[i - 1][k] !== null ? " L" : " M") + x.toFixed(1) + " " + y.toFixed(1);
    });
    if (path) box.append(svg("path", { d: path.trim(), fill: "none", stroke: col, "stroke-width": 1.5 }));
    points.forEach((p, i) => {  // a point with no neighbour would draw nothing: a dot
      const alone = (j) => j < 0 || j >= points.length || points[j][k] === null || points[j][k] === undefined;
      if (p[k] !== null && p[k] !== undefined && alone(i - 1) && alone(i + 1)) {
        box.append(svg("circle", { cx: (i / n) * W, cy: H - P - (p[k] / max) * (H - 2 * P), r: 2, fill: col }));
      }
    });
  }
  const last = points.length ? points[points.length - 1] : {};
  const legend = series.map(([k, col, label, fmt]) => el("span", { style: `color:${col}` },
    `${label} ${last[k] === null || last[k] === undefined ? "-" : fmt(last[k])}`));
  return el("div", { class: "chart" }, el("div", {}, el("b", {}, title), " ", el("span", { class: "legend" }, legend)), box,
    el("div", { class: "muted" }, `max ${series[0][3](max)}`));
}

async function renderModels(view) {
  const r = await api("/ui/api/models");
  const th = r.thresholds;
  const rate = (v) => v.toFixed(v < 10 ? 2 : 0) + "/s";
  const out = [];
  for (const m of r.models) {
    const ok = m.ready >= m.wanted;
    const section = el("section", { class: "card model", "data-model": m.name },
      el("div", { class: "row" }, el("h2", {}, m.name),
        m.aliases.length ? el("span", { class: "muted" }, "aka " + m.aliases.join(", ")) : null,
        el("span", { class: "badge " + (ok ? "good" : "bad") }, `${m.ready}/${m.wanted} Ready`),
        m.in_catalog ? null : el("span", { class: "badge warn" }, "not in the catalog"),
        el("span", { class: "muted" }, `gateways: ${m.gateway.inflight} in flight, ${m.gateway.queued} queued`)),
      m.traffic.length ? el("div", { class: "charts" },
        chart("requests", m.traffic, [["rps", "#2563eb", "req", rate]]),
        chart("latency", m.traffic, [["p50", "#2563eb", "p50", secs], ["p99", "#dc2626", "p99", secs]]),
        chart("TTFT", m.traffic, [["ttft_p50", "#2563eb", "p50", secs], ["ttft_p99", "#dc2626", "p99", secs]]),
        chart("sheds & errors", m.traffic, [["sheds", "#c2410c", "shed", rate], ["errors", "#dc2626", "err", rate]]))
        : el("div", { class: "muted" }, "no traffic in the last minutes"));
    if ((m.adapters || []).length) section.append(adapterTable(m.adapters));
    if ((m.tenants || []).length) section.append(tenantTable(m.tenants));
    for (const p of m.profiles) {
      const rows = p.replicas.map((x) => el("tr", { "data-replica": x.id, "data-state": x.state },
        el("td", {}, x.id), el("td", {}, stateBadge(x.state)), el("td", {}, x.reason || ""), el("td", {}, x.restarts),
        el("td", {}, age(x.age)), el("td", {}, x.nodes.join(", ") || "-"),
        el("td", {}, Object.entries(x.gpus).map(([n, ix]) => `${n}:${ix.join(",")}`).join("; ") || "-"),
        el("td", {}, x.state === "Ready" || x.state === "Draining" ? loadBars(x, p.capacity, th) : downloadBar(x.download) || "")));
      const fit = p.replicas.map((x) => x.fit).find((f) => f);
      section.append(el("h4", {}, `profile ${p.name}`, p.engine ? ` (${p.engine})` : "", ` · ${p.ready}/${p.wanted} Ready`,
        fit ? el("span", { class: "muted", "data-fit": "" }, ` · fit estimate ${fit}`) : null),
        rows.length ? el("table", {}, el("tr", {}, ["replica", "state", "reason", "restarts", "age", "node", "GPUs", "load"]
          .map((h) => el("th", {}, h))), rows) : el("div", { class: "muted" }, "no replicas"));
    }
    out.push(section);
  }
  show(view, out.length ? out : el("p", { class: "muted" }, "No model in the catalog."));
}

function tenantTable(tenants) {
  // Fair queueing per API key: its weight, the service it received (tokens), its share of the model's
  // service over the last minutes, and the mean wait of its requests in the gateways' queues.
  const rows = tenants.map((t) => el("tr", { "data-tenant": t.key },
    el("td", {}, t.key), el("td", {}, String(t.weight)), el("td", {}, t.service_tokens.toLocaleString()),
    el("td", {}, t.share === null ? "-" : (100 * t.share).toFixed(1) + " %"),
    el("td", {}, String(t.requests)), el("td", {}, t.mean_wait === null ? "-" : secs(t.mean_wait))));
  return el("div", {}, el("h4", {}, "API keys (fair queueing)"),
    el("table", {}, el("tr", {}, ["key", "weight", "service (tokens)", "share (5 min)", "requests", "mean queue wait"]
      .map((h) => el("th", {}, h))), rows));
}

function adapterTable(adapters) {
  // Where each LoRA adapter lives: its holders, loads in progress, failed loads with their next try.
  const rows = adapters.map((a) => {
    const notes = [
      a.loading.length ? "loading on " + a.loading.join(", ") : null,
      a.waiting.length ? "to load on " + a.waiting.join(", ") : null,
      ...a.failures.map((f) => `failed on ${f.replica} (${f.attempts}x, next try ${f.retry_in === null ? "?" :
        f.retry_in <= 0 ? "due now" : "in " + age(f.retry_in)}): ${f.reason}`),
      a.short ? "short: " + a.short : null,
    ].filter(Boolean);
    return el("tr", { "data-adapter": a.adapter, "data-held": String(a.holders.length) },
      el("td", {}, a.adapter), el("td", {}, a.wanted === null ? "all" : a.wanted),
      el("td", {}, a.holders.map((h) => el("span", { class: "chip", style: `background:${colour(h.replica)}` },
        `${h.replica}@${h.node}`))),
      el("td", {}, a.demand ? a.demand.toFixed(a.demand < 10 ? 2 : 0) : "-"),
      el("td", { class: a.short || a.failures.length ? "error" : "muted" }, notes.join("; ")));
  });
  return el("div", {}, el("h4", {}, "LoRA adapters"),
    el("table", {}, el("tr", {}, ["adapter", "wanted", "held by", "demand", "note"].map((h) => el("th", {}, h))), rows));
}

function eventsQuery(after) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(state.events.filters)) if (v) q.set(k, v);
  if (after) q.set("after", after);
  return "/ui/api/events?" + q.toString();
}

async function renderEvents(view) {
  const ev = state.events;
  const r = await api(eventsQuery(ev.cursor));
  ev.list = ev.cursor ? ev.list.concat(r.events).slice(-1000) : r.events;
  ev.cursor = r.cursor;
  ev.kinds = r.kinds;
  let filters = view.querySelector(".filters");
  if (!filters) {
    const input = (name, placeholder) => el("input", { name, placeholder, value: ev.filters[name], onchange: (e) => {
      ev.filters[name] = e.target.value.trim(); ev.cursor = null; refresh(); } });
    const kind = el("select", { name: "kind", onchange: (e) => { ev.filters.kind = e.target.value; ev.cursor = null; refresh(); } },
      el("option", { value: "" }, "any kind"), ev.kinds.map((k) => el("option", { value: k, selected: k === ev.filters.kind }, k)));
    filters = el("form", { class: "filters", onsubmit: (e) => e.preventDefault() },
      input("model", "model"), input("node", "node"), kind);
    show(view, filters, el("div", { id: "event-list" }));
  }
  const rows = ev.list.slice().reverse().map((e) => el("tr", { "data-kind": e.kind, "data-event": e.id },
    el("td", {}, when(e.ts)), el("td", {}, e.kind), el("td", {}, [e.model, e.profile].filter(Boolean).join("/")),
    el("td", {}, e.node), el("td", {}, e.replica), el("td", {}, e.message), el("td", { class: "muted" }, e.source)));
  show(view.querySelector("#event-list"), rows.length
    ? el("table", {}, el("tr", {}, ["time (UTC)", "kind", "model", "node", "replica", "what happened", "by"]
      .map((h) => el("th", {}, h))), rows)
    : el("p", { class: "muted" }, "No event matches."));
}

async function renderCatalog(view) {
  const r = await api("/ui/api/catalog" + (state.catalogVersion ? "?version=" + state.catalogVersion : ""));
  const seen = JSON.stringify(r);
  if (seen === state.catalogSeen && view.childElementCount) return; // unchanged: keep what is scrolled
  state.catalogSeen = seen;
  const rows = r.history.map((h) => el("tr", {
    class: "clickable", "data-version": h.version,
    onclick: () => { state.catalogVersion = h.version; refresh(); },
  }, el("td", {}, h.version === r.version ? el("b", {}, h.version) : h.version), el("td", {}, when(h.applied_at)),
    el("td", {}, h.applied_by), el("td", {}, h.source), el("td", {}, h.models), el("td", {}, h.replicas)));
  const head = r.version
    ? [el("h2", {}, `version ${r.version}`, state.catalogVersion ? " (from the history)" : " (applied)"),
      el("div", { class: "muted" }, `applied ${when(r.applied_at)} by ${r.applied_by} from ${r.source}; hash ${r.hash}`),
      el("div", { class: "muted", id: "catalog-how" }, "Fields left out take their defaults. To change it: ",
        el("code", {}, `llmgw catalog show -o yaml${state.catalogVersion ? " --version " + r.version : ""} > catalog.yaml`),
        ", edit, then ", el("code", {}, "llmgw catalog apply catalog.yaml"), "."),
      state.catalogVersion ? el("button", { type: "button", onclick: () => { state.catalogVersion = null; refresh(); } },
        "show the applied version") : null]
    : [el("p", { class: "muted" }, "No catalog applied yet (llmgw catalog apply FILE).")];
  show(view, el("div", { class: "split" },
    el("div", {}, el("h2", {}, "history"), el("table", {},
      el("tr", {}, ["version", "applied (UTC)", "by", "source", "models", "replicas"].map((h) => el("th", {}, h))), rows)),
    el("div", {}, ...head, el("pre", { id: "catalog-yaml" }, r.yaml))));
}

async function renderBatches(view) {
  // The Batch API's batches, every key's: progress, lines per second, when it should end (docs/batch.md).
  const r = await api("/ui/api/batches");
  const counts = Object.entries(r.counts).map(([k, v]) => `${v} ${k}`).join(", ") || "none yet";
  const rows = r.batches.map((b) => el("tr", { "data-batch": b.id, "data-status": b.status },
    el("td", {}, el("span", { class: "chip" }, b.id)), el("td", {}, b.owner), el("td", {}, b.model),
    el("td", {}, stateBadge(b.status)),
    el("td", {}, el("div", { class: "bars" }, bar("", b.done, b.total || 1, {
      text: (v) => `${v} / ${b.total} (${Math.round(b.progress * 100)}%)` + (b.failed ? `, ${b.failed} failed` : ""),
    }))),
    el("td", {}, b.rate === null ? "-" : `${b.rate.toFixed(1)}/s`),
    el("td", {}, b.eta_seconds === null ? "-" : age(b.eta_seconds)),
    el("td", {}, when(b.created_at))));
  show(view, el("div", { class: "summary" }, `batches ended: ${counts}`),
    r.batches.length ? el("table", {},
      el("tr", {}, ["batch", "owner", "model", "status", "lines answered", "rate", "ETA", "created (UTC)"]
        .map((h) => el("th", {}, h))), rows)
      : el("p", { class: "muted" }, "No batch yet (POST /v1/batches, or the openai client's batches.create)."));
}

const RENDER = { fleet: renderFleet, models: renderModels, events: renderEvents, catalog: renderCatalog,
                 batches: renderBatches, playground: renderPlayground, keys: renderKeys };

// --- the loop -------------------------------------------------------------------------------------
async function refresh() {
  clearTimeout(state.timer);
  const view = document.getElementById("view");
  const tab = state.tab;
  try {
    await RENDER[tab](view);
    document.getElementById("auth").hidden = true;
    document.getElementById("forget-key").hidden = !state.key;
    setStatus(ON_DEMAND.has(tab) ? "" : `updated ${new Date().toLocaleTimeString()} · refreshes every ${REFRESH_MS / 1000} s`,
      false);
  } catch (e) {
    if (e instanceof AuthError) {
      showAuth(e.message);
      setStatus("an admin key is needed", true);
      return; // no polling until a key is entered
    }
    setStatus("cannot refresh: " + e.message, true);
  }
  if (tab === state.tab && !ON_DEMAND.has(tab)) state.timer = setTimeout(refresh, REFRESH_MS);
}

function selectTab() {
  const tab = location.hash.slice(1);
  state.tab = TABS.includes(tab) ? tab : "fleet";
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.tab === state.tab);
  document.getElementById("view").replaceChildren();
  refresh();
}

document.getElementById("auth-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = document.getElementById("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, state.key);
  document.getElementById("key-input").value = "";
  refresh();
});
document.getElementById("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORE);
  state.key = "";
  refresh();
});
window.addEventListener("hashchange", selectTab);
selectTab();
