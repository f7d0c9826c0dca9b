// llmgw console, the Keys page (docs/console.md#keys): what `llmgw keys` does, for an admin, through the
// same code path (/ui/api/keys: the CLI's flags by name, the store's writes, an event per change naming
// the admin key). A new key's secret is shown once. Loaded before console.js, whose helpers it uses.
"use strict";

const KEY_TEXT = [ // [field, label, placeholder, what clears it in an update]
  ["models", "models", "all (or a,b: names or aliases)", "all"],
  ["expires", "expires", "never (or 30d, 12h, 2026-12-31)", "never"],
  ["budget", "budget (tokens)", "none (or 5M, 250k)", "none"],
  ["rpm", "requests/min", "none", "none"],
  ["tpm", "tokens/min", "none", "none"],
  ["weight", "weight", "1", null],
  ["slo_ttft", "target: first byte", "none (or 500ms)", "none"],
  ["slo_tpot", "target: per token", "none (or 80ms)", "none"],
  ["slo_deadline", "target: whole answer", "none (or 60s)", "none"],
];
const KEY_SWITCHES = [["admin", "admin (console, keys)", false], ["sub_tenants", "may name sub-tenants", false],
  ["batches", "may use the Batch API", true], ["isolate_cache", "isolated prefix cache", false]];

const keysPage = { editing: null, message: null, secret: null, revoking: null };

function keyFormValues(rec) {
  // A record's fields as the form shows them (text as typed for the CLI's flags).
  if (!rec) return { models: "", expires: "", budget: "", budget_period: "month", rpm: "", tpm: "", weight: "",
    slo_ttft: "", slo_tpot: "", slo_deadline: "", priority: "", admin: false, sub_tenants: false, batches: true,
    isolate_cache: false };
  const secs = (v) => (v ? (v < 10 ? `${Math.round(v * 1e6) / 1e3}ms` : `${v}s`) : ""); // as llmgw.slo writes them
  return {
    models: (rec.models || []).join(","), expires: rec.expires_at ? new Date(rec.expires_at * 1000).toISOString() : "",
    budget: rec.budget ? String(rec.budget) : "", budget_period: rec.budget_period || "month",
    rpm: rec.rpm ? String(rec.rpm) : "", tpm: rec.tpm ? String(rec.tpm) : "", weight: String(rec.weight),
    slo_ttft: secs(rec.slo_ttft), slo_tpot: secs(rec.slo_tpot), slo_deadline: secs(rec.slo_deadline),
    priority: rec.priority || "", admin: rec.admin, sub_tenants: rec.sub_tenants, batches: rec.batches,
    isolate_cache: rec.isolate_cache,
  };
}

function keyForm(id, rec, onsubmit) {
  const v = keyFormValues(rec);
  const inputs = KEY_TEXT.map(([f, label, ph]) => el("label", { class: "pg-field" }, el("span", { class: "muted" }, label),
    el("input", { name: f, value: v[f], placeholder: ph, size: f === "models" || f === "expires" ? 26 : 10 })));
  const period = el("label", { class: "pg-field" }, el("span", { class: "muted" }, "budget per"),
    el("select", { name: "budget_period" }, ["month", "day"].map((p) => el("option", { value: p, selected: v.budget_period === p }, p))));
  const priority = el("label", { class: "pg-field" }, el("span", { class: "muted" }, "priority"),
    el("select", { name: "priority" }, ["", "critical", "standard", "sheddable"].map((p) =>
      el("option", { value: p, selected: v.priority === p }, p || "default"))));
  const switches = KEY_SWITCHES.map(([f, label]) => el("label", { class: "switch" },
    el("input", { type: "checkbox", name: f, checked: v[f] }), " " + label));
  return el("form", { id, class: "card key-form", onsubmit: (e) => { e.preventDefault(); onsubmit(e.target, v); } },
    rec ? el("h3", {}, `change key ${rec.name}`) : el("h3", {}, "create a key"),
    el("div", { class: "row" }, rec ? null : el("label", { class: "pg-field" }, el("span", { class: "muted" }, "name"),
      el("input", { name: "name", required: true, placeholder: "team-a" })), inputs, period, priority),
    el("div", { class: "row" }, switches),
    el("div", { class: "row" }, el("button", { type: "submit", name: "save" }, rec ? "save" : "create"),
      rec ? el("button", { type: "button", onclick: () => { keysPage.editing = null; refresh(); } }, "cancel") : null));
}

function formBody(form, before, update) {
  // The fields to send: on create every field given; on update only those changed, an emptied one as
  // the word that clears it (as `llmgw keys update --rpm none`).
  const out = {};
  const value = (f) => form.elements[f].value.trim();
  for (const [f, , , clear] of KEY_TEXT) {
    const now = value(f);
    if (!update) { if (now) out[f] = now; continue; }
    if (now === before[f]) continue;
    if (now) out[f] = now;
    else if (clear) out[f] = clear;
  }
  for (const f of ["budget_period", "priority"]) {
    const now = value(f);
    if (update ? now !== before[f] : now && (f !== "budget_period" || out.budget)) out[f] = now || "none";
  }
  for (const [f] of KEY_SWITCHES) {
    const now = form.elements[f].checked;
    if (!update || now !== before[f]) out[f] = now;
  }
  if (!update) out.name = value("name");
  return out;
}

async function keyAction(path, method, body) {
  // An action's answer, or its error shown on the page (an auth error goes to the console's key form).
  try {
    return await api(path, { method, body });
  } catch (e) {
    if (e instanceof AuthError) throw e;
    keysPage.message = { error: true, text: e.message };
    return null;
  }
}

async function renderKeys(view) {
  const r = await api("/ui/api/keys");
  const rows = r.keys.map((k) => el("tr", { "data-key": k.name, "data-key-id": k.id, "data-admin": String(k.admin) },
    el("td", {}, el("b", {}, k.name)), el("td", {}, el("code", {}, k.id)), el("td", {}, k.describe),
    el("td", {}, when(k.created_at)),
    el("td", {}, el("button", { type: "button", name: "edit", onclick: () => { keysPage.editing = k.id; refresh(); } }, "change"),
      " ", el("button", { type: "button", name: "revoke", class: keysPage.revoking === k.id ? "danger" : "",
        onclick: async () => {
          if (keysPage.revoking !== k.id) { keysPage.revoking = k.id; refresh(); return; }
          keysPage.revoking = null;
          const done = await keyAction("/ui/api/keys/" + encodeURIComponent(k.id), "DELETE");
          if (done) keysPage.message = { text: `revoked ${k.name} (${done.revoked}); gateways stop taking it within `
            + "their key refresh (LLMGW_GATEWAY_KEYS_INTERVAL)" + (done.warning ? "; " + done.warning : "") };
          refresh();
        } }, keysPage.revoking === k.id ? "confirm revoke" : "revoke"))));
  const editing = r.keys.find((k) => k.id === keysPage.editing);
  const create = keyForm("key-create", null, async (form) => {
    const body = formBody(form, keyFormValues(null), false);
    const made = await keyAction("/ui/api/keys", "POST", body);
    if (made) {
      keysPage.secret = { name: made.record.name, key: made.key, first: r.bootstrap };
      keysPage.message = made.note || made.warning ? { text: [made.note, made.warning].filter(Boolean).join("; ") } : null;
      if (r.bootstrap) { // the console's key from now on: the gateway requires keys once one exists
        state.key = made.key;
        sessionStorage.setItem(KEY_STORE, made.key);
      }
    }
    refresh();
  });
  const edit = editing ? keyForm("key-edit", editing, async (form, before) => {
    const body = formBody(form, before, true);
    const done = await keyAction("/ui/api/keys/" + encodeURIComponent(editing.id), "PATCH", body);
    if (done) {
      keysPage.editing = null;
      keysPage.message = { text: `updated ${done.record.name}: ${done.record.describe}`
        + (done.note ? "; " + done.note : "") + (done.warning ? "; " + done.warning : "") };
    }
    refresh();
  }) : null;
  const s = keysPage.secret;
  const secret = s ? el("div", { class: "card secret", id: "new-secret", "data-key": s.name },
    el("h3", {}, `the key ${s.name}: shown this once`),
    el("div", { class: "row" }, el("code", { id: "new-secret-value" }, s.key), copyButton(s.key),
      el("button", { type: "button", onclick: () => { keysPage.secret = null; refresh(); } }, "I have stored it")),
    el("div", { class: "muted" }, s.first
      ? "The first key is an admin key, and this console now uses it; the gateway requires a key from now on."
      : "Send it as Authorization: Bearer <key> (the openai client's api_key). Only its hash is stored.")) : null;
  const m = keysPage.message;
  show(view,
    el("h2", {}, "API keys"),
    r.bootstrap ? el("p", { class: "card", id: "keys-bootstrap" }, "No key exists yet, so the gateway requires none "
      + "(LLMGW_GATEWAY_AUTH=auto). The first key made here is an admin key; from then on every request needs a key.") : null,
    m ? el("p", { id: "keys-message", class: m.error ? "error" : "muted" }, m.text) : null,
    secret,
    rows.length ? el("table", { id: "keys" }, el("tr", {}, ["name", "id", "may", "created (UTC)", ""].map((h) => el("th", {}, h))), rows)
      : el("p", { class: "muted" }, "No API key."),
    edit, create,
    el("p", { class: "muted" }, "The same as ", el("code", {}, "llmgw keys create|update|revoke"),
      "; every change is in the Events page (key_created, key_updated, key_revoked), naming the admin key that made it."));
}
