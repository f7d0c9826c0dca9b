// llmgw console, the Playground page (docs/console.md#playground): try a model through the gateway itself,
// with the key pasted here, as any client would (keys, admission and fair share apply). Beside each answer:
// time to first token, tokens per second and the token counts, which replica served it and why (the
// gateway's record of the request: GET /v1/llmgw/requests/{X-Request-Id}), and the same request as curl
// and as Python. Loaded before console.js, whose helpers (el, show) it uses when called.
"use strict";

const PG_KEY_STORE = "llmgw.playground.key"; // sessionStorage only: never a cookie, never a URL
const SERVED_WAIT_MS = 8000;
const KEY_SETTLE_MS = 5000; // how long a refused key is asked about again (a new key reaching every gateway) // how long the page asks for the request's record after the answer ended

const pg = {
  root: null, // the page's DOM, kept across tab switches (the conversation stays)
  key: sessionStorage.getItem(PG_KEY_STORE) || "",
  messages: [], // the conversation so far: [{role, content}], the system message not included
  busy: false,
};

function pgKey() {
  // The playground's own key, else the console's (an admin key works here too).
  return pg.key || state.key || "";
}

async function pgFetch(path, opts) {
  const o = opts || {};
  const headers = Object.assign({}, o.headers || {});
  const key = pgKey();
  if (key) headers.Authorization = "Bearer " + key;
  return fetch(path, { method: o.method || "GET", headers, body: o.body, cache: "no-store", signal: o.signal });
}

async function pgJson(resp) {
  const text = await resp.text();
  try { return { text, doc: JSON.parse(text) }; } catch (e) { return { text, doc: null }; }
}

// --- the request as code ----------------------------------------------------------------------------
function shellQuote(s) {
  return "'" + s.replace(/'/g, "'\\''") + "'";
}

function pyValue(v, indent) {
  // A JSON value as a Python literal (True/False/None), indented like json.dumps(indent=4).
  const pad = " ".repeat(indent + 4), end = " ".repeat(indent);
  if (v === null || v === undefined) return "None";
  if (v === true) return "True";
  if (v === false) return "False";
  if (typeof v === "number" || typeof v === "string") return JSON.stringify(v);
  if (Array.isArray(v)) {
    if (!v.length) return "[]";
    return "[\n" + v.map((x) => pad + pyValue(x, indent + 4)).join(",\n") + ",\n" + end + "]";
  }
  const entries = Object.entries(v);
  if (!entries.length) return "{}";
  return "{\n" + entries.map(([k, x]) => pad + JSON.stringify(k) + ": " + pyValue(x, indent + 4)).join(",\n")
    + ",\n" + end + "}";
}

function curlOf(body) {
  const url = location.origin + "/v1/chat/completions";
  return `curl ${body.stream ? "-N " : ""}${url} \\\n  -H "Authorization: Bearer $LLMGW_API_KEY" \\\n`
    + `  -H "Content-Type: application/json" \\\n  -d ${shellQuote(JSON.stringify(body))}`;
}

function pythonOf(body) {
  const args = Object.entries(body).map(([k, v]) => `    ${k}=${pyValue(v, 4)},`).join("\n");
  const use = body.stream
    ? "for chunk in stream:\n    if chunk.choices and chunk.choices[0].delta.content:\n"
      + "        print(chunk.choices[0].delta.content, end=\"\", flush=True)\n    if chunk.usage:\n        print(\"\\n\", chunk.usage)"
    : "print(answer.choices[0].message.content)\nprint(answer.usage)";
  return `import os\n\nfrom openai import OpenAI\n\nclient = OpenAI(base_url=${JSON.stringify(location.origin + "/v1")}, `
    + `api_key=os.environ["LLMGW_API_KEY"])\n${body.stream ? "stream" : "answer"} = client.chat.completions.create(\n`
    + `${args}\n)\n${use}`;
}

function copyButton(source) {
  // navigator.clipboard needs a secure context (https or localhost); elsewhere the text is selected and
  // copied the old way.
  return el("button", { type: "button", class: "copy", onclick: async (e) => {
    const text = typeof source === "function" ? source() : source;
    let ok = false;
    try {
      if (navigator.clipboard && window.isSecureContext) { await navigator.clipboard.writeText(text); ok = true; }
    } catch (err) { ok = false; }
    if (!ok) {
      const area = el("textarea", { style: "position:fixed;left:-9999px" });
      area.value = text;
      document.body.append(area);
      area.select();
      try { ok = document.execCommand("copy"); } catch (err) { ok = false; }
      area.remove();
    }
    e.target.textContent = ok ? "copied" : "select and copy";
    setTimeout(() => { e.target.textContent = "copy"; }, 1500);
  } }, "copy");
}

function codeBlock(title, cls, text) {
  return el("details", { class: "code " + cls }, el("summary", {}, title, " ", copyButton(text)),
    el("pre", { class: cls }, text));
}

// --- the page ---------------------------------------------------------------------------------------
function pgField(label, input) {
  return el("label", { class: "pg-field" }, el("span", { class: "muted" }, label), input);
}

function buildPlayground() {
  const keyInput = el("input", { id: "pg-key", type: "password", autocomplete: "off", size: 40,
    placeholder: "sk-llmgw-… (kept in this tab only)" });
  const keyForm = el("form", { id: "pg-key-form", class: "row", onsubmit: (e) => {
    e.preventDefault();
    pg.key = keyInput.value.trim();
    keyInput.value = "";
    if (pg.key) sessionStorage.setItem(PG_KEY_STORE, pg.key); else sessionStorage.removeItem(PG_KEY_STORE);
    loadKeyAndModels();
  } }, keyInput, el("button", { type: "submit", id: "pg-key-use" }, "use this key"),
    el("button", { type: "button", id: "pg-key-forget", onclick: () => {
      pg.key = "";
      sessionStorage.removeItem(PG_KEY_STORE);
      loadKeyAndModels();
    } }, "forget"));
  const form = el("form", { id: "pg-form", class: "pg-form", onsubmit: (e) => { e.preventDefault(); send(); } },
    el("div", { class: "row" },
      pgField("model", el("input", { id: "pg-model", list: "pg-models", size: 28, placeholder: "a model or alias" })),
      el("datalist", { id: "pg-models" }),
      pgField("max_tokens", el("input", { id: "pg-max-tokens", type: "number", min: 1, value: 256, style: "width:6rem" })),
      pgField("temperature", el("input", { id: "pg-temperature", type: "number", min: 0, max: 2, step: 0.1, value: 0.7,
        style: "width:5rem" })),
      el("label", { class: "switch" }, el("input", { id: "pg-stream", type: "checkbox", checked: true }), " stream")),
    pgField("system message", el("textarea", { id: "pg-system", rows: 2, placeholder: "You are a helpful assistant." })),
    el("div", { id: "pg-conversation" }),
    pgField("your message", el("textarea", { id: "pg-user", rows: 3, placeholder: "Ask something…",
      onkeydown: (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); send(); } } })),
    el("div", { class: "row" }, el("button", { type: "submit", id: "pg-send" }, "send"),
      el("button", { type: "button", id: "pg-reset", onclick: resetConversation }, "new conversation"),
      el("span", { class: "muted" }, "Ctrl+Enter sends")));
  return el("div", { id: "playground" },
    el("h2", {}, "Playground"),
    el("div", { class: "card pg-keybar" }, el("div", { id: "pg-key-info", class: "muted" }, "…"), keyForm),
    form);
}

async function renderPlayground(view) {
  if (!pg.root) {
    pg.root = buildPlayground();
    show(view, pg.root);
    await loadKeyAndModels();
    return;
  }
  if (!view.contains(pg.root)) show(view, pg.root);
}

function keyLine(k) {
  // What the key may call, from GET /v1/llmgw/usage.
  const parts = [`models: ${k.models ? k.models.join(", ") : "all"}`,
    `expires: ${k.expires_at || "never"}`];
  if (k.budget) parts.push(`budget: ${k.budget.used} of ${k.budget.tokens} tokens this ${k.budget.period}`);
  if (k.rpm || k.tpm) parts.push(`limits: ${k.rpm || "-"} rpm, ${k.tpm || "-"} tpm`);
  parts.push(`weight ${k.weight}`);
  if (k.admin) parts.push("admin");
  return parts.join(" · ");
}

async function loadKeyAndModels() {
  const info = document.getElementById("pg-key-info");
  const key = pgKey();
  let models = await pgFetch("/v1/models");
  // A key made a moment ago reaches every gateway process within its key refresh
  // (LLMGW_GATEWAY_KEYS_INTERVAL): a refused key is asked about again for a few seconds.
  const until = performance.now() + KEY_SETTLE_MS;
  while (key && models.status === 401 && performance.now() < until) {
    show(info, el("span", { class: "muted", "data-key-state": "checking" }, "checking the key…"));
    await new Promise((r) => setTimeout(r, 500));
    models = await pgFetch("/v1/models");
  }
  const got = await pgJson(models);
  if (models.status === 401 || models.status === 403) {
    show(info, el("span", { class: "error", "data-key-state": "needed" },
      key ? `this key is refused: ${got.doc && got.doc.error ? got.doc.error.message : models.status}`
        : "The gateway requires an API key: paste one below (llmgw keys create NAME, or the Keys page)."));
    fillModels([]);
    return;
  }
  fillModels(got.doc && got.doc.data ? got.doc.data : []);
  if (!key) {
    show(info, el("span", { "data-key-state": "none" }, "No key: this gateway requires none (LLMGW_GATEWAY_AUTH)."));
    return;
  }
  const usage = await pgFetch("/v1/llmgw/usage");
  const u = await pgJson(usage);
  if (!usage.ok || !u.doc) {
    show(info, el("span", { "data-key-state": "unknown" }, "A key is set; the gateway requires none, and says nothing of it."));
    return;
  }
  const whose = pg.key ? "this playground's key" : "the console's key";
  show(info, el("span", { "data-key-state": "key", "data-key-name": u.doc.key },
    `Using ${whose} `, el("b", {}, u.doc.key), ` (${u.doc.id}): ${keyLine(u.doc)}`));
}

function fillModels(cards) {
  const list = document.getElementById("pg-models");
  const names = [...new Set(cards.flatMap((c) => [c.id, ...(c.aliases || [])]))];
  show(list, names.map((n) => el("option", { value: n })));
  const input = document.getElementById("pg-model");
  if (!input.value && cards.length) input.value = cards[0].id;
}

function resetConversation() {
  pg.messages = [];
  document.getElementById("pg-conversation").replaceChildren();
}

function requestBody() {
  const model = document.getElementById("pg-model").value.trim();
  const system = document.getElementById("pg-system").value.trim();
  const body = { model, messages: (system ? [{ role: "system", content: system }] : []).concat(pg.messages) };
  const max = document.getElementById("pg-max-tokens").value;
  const temp = document.getElementById("pg-temperature").value;
  // As typed: a bad value goes to the gateway, which says which field is wrong (docs/gateway.md#bad-fields).
  if (max !== "") body.max_tokens = Number(max);
  if (temp !== "") body.temperature = Number(temp);
  if (document.getElementById("pg-stream").checked) {
    body.stream = true;
    body.stream_options = { include_usage: true };
  }
  return body;
}

function stat(name, label, value) {
  return el("span", { class: "stat", "data-stat": name }, el("span", { class: "muted" }, label + " "), value);
}

async function send() {
  if (pg.busy) return;
  const userBox = document.getElementById("pg-user");
  const text = userBox.value.trim();
  if (!text) return;
  pg.busy = true;
  document.getElementById("pg-send").disabled = true;
  const conv = document.getElementById("pg-conversation");
  pg.messages.push({ role: "user", content: text });
  const body = requestBody();
  userBox.value = "";
  conv.append(el("div", { class: "turn user", "data-role": "user" }, el("div", { class: "who muted" }, "you"),
    el("div", { class: "content" }, text)));
  const answer = el("div", { class: "content answer" });
  const stats = el("div", { class: "stats" }, el("span", { class: "muted" }, "waiting for the first token…"));
  const served = el("div", { class: "served muted" }, "");
  const turn = el("div", { class: "turn assistant", "data-role": "assistant", "data-state": "streaming" },
    el("div", { class: "who muted" }, body.model),
    el("div", { class: "pg-answer" }, answer,
      el("div", { class: "pg-meta" }, stats, served, codeBlock("curl", "curl", curlOf(body)),
        codeBlock("Python (openai)", "python", pythonOf(body)))));
  conv.append(turn);
  turn.scrollIntoView({ block: "end" });
  const t0 = performance.now();
  let first = null, usage = null, content = "", rid = null, reached = false;
  try {
    const resp = await pgFetch("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", "X-LLMGW-Explain": "1" } });
    rid = resp.headers.get("X-Request-Id");
    reached = resp.headers.has("X-LLMGW-Endpoint"); // a replica answered (else the gateway refused it first)
    turn.setAttribute("data-request-id", rid || "");
    if (!resp.ok) {
      apiError(turn, answer, stats, resp.status, await pgJson(resp));
    } else if (body.stream && (resp.headers.get("Content-Type") || "").startsWith("text/event-stream")) {
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "", ended = false;
      while (!ended) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let cut;
        while ((cut = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, cut).trim();
          buffer = buffer.slice(cut + 1);
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") { ended = true; break; }
          let chunk;
          try { chunk = JSON.parse(data); } catch (e) { continue; }
          if (chunk.error) { apiError(turn, answer, stats, resp.status, { doc: chunk, text: data }); ended = true; break; }
          const piece = chunk.choices && chunk.choices[0] && chunk.choices[0].delta
            ? chunk.choices[0].delta.content : null;
          if (piece) {
            if (first === null) first = performance.now();
            content += piece;
            answer.textContent = content;
            answer.setAttribute("data-chunks", String(Number(answer.getAttribute("data-chunks") || 0) + 1));
          }
          if (chunk.usage) usage = chunk.usage;
        }
      }
    } else {
      const got = await pgJson(resp);
      first = performance.now();
      const msg = got.doc && got.doc.choices && got.doc.choices[0] ? got.doc.choices[0].message : null;
      content = msg && msg.content ? msg.content : "";
      answer.textContent = content;
      usage = got.doc ? got.doc.usage : null;
    }
  } catch (e) {
    turn.setAttribute("data-state", "error");
    answer.append(el("div", { class: "error" }, "the request failed: " + e.message));
    show(stats, el("span", { class: "muted" }, "no answer"));
  }
  const end = performance.now();
  if (turn.getAttribute("data-state") === "error") pg.messages.pop(); // a failed turn leaves the conversation
  if (turn.getAttribute("data-state") === "streaming") {
    turn.setAttribute("data-state", "done");
    if (content) pg.messages.push({ role: "assistant", content });
    const completion = usage ? usage.completion_tokens : null;
    const decodeSecs = first !== null && end > first ? (end - first) / 1000 : null;
    show(stats,
      stat("ttft", "time to first token", first !== null ? secs((first - t0) / 1000) : "n/a"),
      stat("tps", "tokens/s", completion && decodeSecs ? (completion / decodeSecs).toFixed(1) : "n/a"),
      stat("prompt_tokens", "prompt", usage ? String(usage.prompt_tokens) : "n/a"),
      stat("completion_tokens", "completion", completion !== null ? String(completion) : "n/a"),
      stat("total", "in all", secs((end - t0) / 1000)));
  }
  pg.busy = false;
  document.getElementById("pg-send").disabled = false;
  if (rid && reached) await servedBy(served, rid);
  else if (rid) show(served, el("span", { class: "muted" }, "no replica: the gateway answered itself (request ",
    el("code", {}, rid), ")"));
}

function apiError(turn, answer, stats, status, got) {
  // The error as the API returned it: its status and body.
  turn.setAttribute("data-state", "error");
  const err = got.doc && got.doc.error ? got.doc.error : null;
  turn.setAttribute("data-status", String(status));
  if (err) turn.setAttribute("data-code", err.code || "");
  answer.replaceChildren(el("div", { class: "api-error", "data-status": status },
    el("div", { class: "error" }, `HTTP ${status}`, err ? `: ${err.message}` : ""),
    el("pre", {}, got.doc ? JSON.stringify(got.doc, null, 2) : got.text)));
  show(stats, el("span", { class: "muted" }, "no answer"));
}

async function servedBy(box, rid) {
  // The gateway's record of how it served this request: once its gateway process has it (at once when
  // the same process answers here, else after its next flush).
  const deadline = performance.now() + SERVED_WAIT_MS;
  show(box, "which replica served it: asking the gateway…");
  while (performance.now() < deadline) {
    const resp = await pgFetch("/v1/llmgw/requests/" + encodeURIComponent(rid));
    if (resp.ok) {
      const rec = await resp.json();
      const by = rec.served_by || {};
      box.className = "served";
      box.setAttribute("data-request-id", rid);
      if (by.replica) box.setAttribute("data-replica", by.replica);
      const f = rec.routing_fields || {};
      show(box,
        el("div", {}, el("b", {}, by.replica ? `served by ${by.replica}` : "not served by a replica"),
          by.node ? ` on ${by.node}` : "", by.engine ? ` (${by.engine})` : "",
          f.endpoint_hit !== undefined ? ` · expected prefix hit ${Math.round(Number(f.endpoint_hit) * 100)}%` : "",
          f.ahead !== undefined ? ` · ${f.ahead} ahead there` : ""),
        el("ul", { class: "explanation" }, rec.explanation.map((line) => el("li", {}, line))),
        el("div", { class: "muted" }, "request ", el("code", {}, rid), " · the same in a terminal: ",
          el("code", {}, `llmgw explain ${rid}`)));
      return;
    }
    await new Promise((r) => setTimeout(r, 300));
  }
  show(box, el("span", { class: "muted" }, `no record of request ${rid} yet (llmgw explain ${rid} may know it later)`));
}
