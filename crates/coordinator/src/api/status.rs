//! `GET /v1/cluster` (the engine's [`crate::engine::ClusterStatus`] as JSON) and `GET /`, a
//! self-contained status page (no external assets) that polls it every 2 s.
//!
//! The page needs no key to load; when the API has keys, `/v1/cluster` answers 401 and the
//! page asks for one, keeps it in the browser's `localStorage` and sends it as a bearer
//! token.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::ApiState;

pub(crate) async fn cluster(State(state): State<Arc<ApiState>>) -> Response {
    Json(state.engine.status()).into_response()
}

pub(crate) async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        PAGE,
    )
        .into_response()
}

/// The page: plain HTML, CSS and JavaScript. Every value from the server is inserted as
/// text (`textContent`), never as markup.
const PAGE: &str = r#"<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Tessera</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .5em; }
h2 { font-size: 1.1em; margin: 1.2em 0 .3em; }
table { border-collapse: collapse; margin: .3em 0; }
th, td { border: 1px solid #ccc; padding: .2em .6em; text-align: left; }
th { background: #f3f3f3; }
.bar { width: 12em; height: .9em; background: #eee; border: 1px solid #bbb; display: inline-block; vertical-align: middle; }
.bar > div { height: 100%; background: #4a7; }
.serving, .ready { color: #270; } .down, .disconnected { color: #b00; } .drained { color: #a60; }
#error { color: #b00; } #key { display: none; margin: .5em 0; }
</style>
</head>
<body>
<h1>Tessera cluster</h1>
<div id="key">API key: <input id="keyinput" type="password" size="40"> <button id="keysave">Use</button></div>
<div id="error"></div>
<div id="groups"></div>
<p><small id="updated"></small></p>
<script>
"use strict";
const KEY = "tessera_api_key";
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}
function row(cells, header) {
  const tr = el("tr");
  for (const c of cells) {
    const td = el(header ? "th" : "td");
    if (c instanceof Node) td.appendChild(c); else td.textContent = c === null || c === undefined ? "-" : String(c);
    tr.appendChild(td);
  }
  return tr;
}
function bar(used, total) {
  const wrap = el("span");
  const b = el("span", null, "bar");
  const fill = el("div");
  fill.style.width = (total > 0 ? Math.min(100, 100 * used / total) : 0) + "%";
  b.appendChild(fill);
  wrap.appendChild(b);
  wrap.appendChild(document.createTextNode(" " + used + " / " + total));
  return wrap;
}
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return n.toFixed(i ? 1 : 0) + " " + units[i];
}
function render(status) {
  const root = document.getElementById("groups");
  root.replaceChildren();
  for (const m of status.models || []) {
    const canary = m.canary ? "; canary version " + m.canary.version + " at " + m.canary.percent + "% on " + m.canary.groups.join(", ") : "";
    root.appendChild(el("h2", "model " + m.name + ": stable version " + m.stable + canary));
    if (m.events.length) {
      const t = el("table");
      t.appendChild(row(["when", "rollout event"], true));
      for (const e of m.events.slice().reverse()) t.appendChild(row([new Date(e.at_ms).toLocaleString(), e.what]));
      root.appendChild(t);
    }
  }
  for (const g of status.groups) {
    root.appendChild(el("h2", "group " + g.name + " (model " + g.model + " version " + g.version + ", tp " + g.tp + ")"));
    const t = el("table");
    t.appendChild(row(["state", "epoch", "running", "waiting", "KV blocks used", "tokens/s", "prefix-cache hit tokens"], true));
    const away = g.drained ? " (drained)" : g.switching ? " (switching version)" : "";
    const state = away ? el("span", g.state + away, "drained") : el("span", g.state, g.state);
    t.appendChild(row([state, g.epoch, g.running, g.waiting,
      bar(g.kv_blocks_used, g.kv_blocks), g.tokens_per_second.toFixed(1), g.prefix_cache_hit_tokens]));
    root.appendChild(t);
    const s = el("table");
    s.appendChild(row(["rank", "host", "state", "pid", "device", "weights", "free KV blocks"], true));
    for (const r of g.shards) {
      s.appendChild(row([r.rank, r.host, el("span", r.state, r.state), r.pid, r.device,
        bytes(r.weight_bytes), r.kv_blocks_free]));
    }
    root.appendChild(s);
  }
  if (!status.groups.length) root.appendChild(el("p", "no groups"));
}
async function poll() {
  const headers = {};
  const key = localStorage.getItem(KEY);
  if (key) headers["Authorization"] = "Bearer " + key;
  const error = document.getElementById("error");
  try {
    const response = await fetch("/v1/cluster", { headers });
    if (response.status === 401) {
      document.getElementById("key").style.display = "block";
      error.textContent = "an API key is needed";
      return;
    }
    if (!response.ok) { error.textContent = "GET /v1/cluster: HTTP " + response.status; return; }
    render(await response.json());
    error.textContent = "";
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
  } catch (e) {
    error.textContent = "cannot reach the coordinator: " + e;
  }
}
document.getElementById("keysave").addEventListener("click", () => {
  localStorage.setItem(KEY, document.getElementById("keyinput").value.trim());
  document.getElementById("key").style.display = "none";
  poll();
});
poll();
setInterval(poll, 2000);
</script>
</body>
</html>
"#;
