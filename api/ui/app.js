// gpuwarden dashboard: plain JavaScript, no build step, nothing fetched but from this daemon.
//
// Every request goes through api(): it carries the token (kept in this tab's sessionStorage)
// as an Authorization header, never a cookie (credentials: "omit"), so the daemon's Host and
// Origin guard stays whole. The live log is read through a fetch stream (an EventSource could
// send no header).
"use strict";

const $ = (id) => document.getElementById(id);
const TOKEN_KEY = "gpuwarden.token";
const POLL_MS = 1000;
const LOG_KEEP = 2000;
const TIMELINE_KINDS = new Set([
  "launch", "exit", "swap", "restart", "swap_settled", "rollback", "crash_loop",
  "probation_passed", "preflight_refused", "death_announced", "gpu_orphans_killed",
  "sweep_started", "sweep_finished", "sweep_restored", "state_file_corrupt", "internal_error",
  "swap_resumed", "sweep_restore_failed", "sweep_interrupted", "adopted", "server_left_running",
  "unmanaged_process", "shim_lost", "prewarm_ended", "weight_cache_started", "weight_cache_stopped",
  "weight_cache_exited",
]);

let token = sessionStorage.getItem(TOKEN_KEY);
let tokenWaiter = null;
let lastStatus = null;
let eventsKey = "";
let eventsAt = 0;

// -- the daemon's API ---------------------------------------------------------------------

async function api(path, opts = {}) {
  for (;;) {
    const headers = new Headers(opts.headers || {});
    if (token) headers.set("Authorization", "Bearer " + token);
    const res = await fetch(path, { ...opts, headers, credentials: "omit", cache: "no-store" });
    if (res.status !== 401) return res;
    const refused = token !== null;
    forgetToken();
    await askToken(refused ? "The token was refused." : "");
  }
}

async function apiJson(path, opts) {
  const res = await api(path, opts);
  let body = null;
  try { body = await res.json(); } catch (_) { body = null; }
  return { res, body };
}

function forgetToken() {
  token = null;
  sessionStorage.removeItem(TOKEN_KEY);
  $("forget-token").hidden = true;
}

// One prompt at a time, however many requests were refused; each waits for a working token.
function askToken(message) {
  if (tokenWaiter) return tokenWaiter;
  tokenWaiter = new Promise((resolve) => {
    const dialog = $("token-dialog");
    const form = $("token-form");
    const input = $("token-input");
    const error = $("token-error");
    error.textContent = message;
    error.hidden = !message;
    input.value = "";
    const onCancel = (e) => e.preventDefault(); // no way round it: the page needs the token
    const onSubmit = async (e) => {
      e.preventDefault();
      const given = input.value.trim();
      if (!given) return;
      $("token-submit").disabled = true;
      try {
        const res = await fetch("/status", {
          headers: { Authorization: "Bearer " + given }, credentials: "omit", cache: "no-store",
        });
        if (res.status === 401) {
          error.textContent = "The token was refused.";
          error.hidden = false;
          return;
        }
        token = given;
        sessionStorage.setItem(TOKEN_KEY, given);
        $("forget-token").hidden = false;
        form.removeEventListener("submit", onSubmit);
        dialog.removeEventListener("cancel", onCancel);
        dialog.close();
        tokenWaiter = null;
        resolve();
      } catch (err) {
        error.textContent = "The daemon cannot be reached: " + err.message;
        error.hidden = false;
      } finally {
        $("token-submit").disabled = false;
      }
    };
    form.addEventListener("submit", onSubmit);
    dialog.addEventListener("cancel", onCancel);
    if (!dialog.open) dialog.showModal();
    input.focus();
  });
  return tokenWaiter;
}

// -- small helpers ------------------------------------------------------------------------

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function duration(s) {
  if (s === null || s === undefined) return "-";
  s = Math.max(0, Math.floor(s));
  const d = Math.floor(s / 86400), h = Math.floor((s % 86400) / 3600);
  const m = Math.floor((s % 3600) / 60), sec = s % 60;
  if (d) return `${d}d ${h}h ${m}m`;
  if (h) return `${h}h ${m}m`;
  if (m) return `${m}m ${sec}s`;
  return `${sec}s`;
}

function clock(iso) {
  if (!iso) return "-";
  const t = new Date(iso);
  return isNaN(t) ? iso : t.toLocaleTimeString([], { hour12: false });
}

function ago(iso) {
  if (!iso) return "";
  const s = (Date.now() - new Date(iso).getTime()) / 1000;
  return isNaN(s) ? "" : `${duration(s)} ago`;
}

function mib(n) {
  if (n === null || n === undefined) return "-";
  return n >= 1024 ? `${(n / 1024).toFixed(1)} GiB` : `${n} MiB`;
}

function setConn(ok, text) {
  $("conn").className = "dot " + (ok ? "live" : "down");
  $("conn-text").textContent = text;
}

function banner(text, bad) {
  const b = $("banner");
  b.hidden = !text;
  b.textContent = text || "";
  b.className = "banner" + (bad ? " bad" : "");
}

// -- /status: polled every second ----------------------------------------------------------

async function pollStatus() {
  for (;;) {
    try {
      const { res, body } = await apiJson("/status");
      if (!res.ok || !body) throw new Error(`/status answered ${res.status}`);
      lastStatus = body;
      setConn(true, "live");
      renderStatus(body);
      const key = [body.state, body.launch_id, body.swap && body.swap.phase,
        body.last_exit && body.last_exit.at, body.sweep && body.sweep.done].join("|");
      if (key !== eventsKey || Date.now() - eventsAt > 10000) {
        eventsKey = key;
        eventsAt = Date.now();
        refreshEvents();
      }
    } catch (err) {
      setConn(false, "daemon unreachable");
    }
    await sleep(POLL_MS);
  }
}

function renderStatus(st) {
  const badge = $("state");
  badge.textContent = st.state;
  badge.dataset.state = st.state;
  badge.className = "badge state-" + st.state;
  $("config").textContent = st.config || "no config";
  $("uptime").textContent = st.uptime_s !== null && st.uptime_s !== undefined
    ? `up ${duration(st.uptime_s)}` : "";
  document.title = `${st.state} · ${st.config || "-"} · gpuwarden`;

  const facts = [
    ["state", st.state],
    ["config", st.config || "-"],
    ["pid", st.pid ?? "-"],
    ["launch", st.launch_id || "-", "mono"],
    ["uptime", duration(st.uptime_s)],
    ["started", st.started_at ? `${clock(st.started_at)} (${ago(st.started_at)})` : "-"],
    ["restarts", st.restarts],
    ["failures", st.failures + (st.crash_loop ? " · crash loop" : "")],
    ["last good", st.last_good_config || "-"],
  ];
  if (st.phase) facts.push(["phase", phaseText(st.phase)]);
  if (st.startup) facts.push(["start took", startupText(st.startup)]);
  if (st.next_retry_at) facts.push(["next retry", `${clock(st.next_retry_at)}`]);
  if (st.rolled_back_from) facts.push(["rolled back from", st.rolled_back_from]);
  const m = st.server_metrics;
  if (m) {
    const parts = [];
    if (m.gen_throughput_tok_s != null) parts.push(`${m.gen_throughput_tok_s} tok/s`);
    if (m.accept_len != null) parts.push(`accept len ${m.accept_len}`);
    if (m.running_req != null) parts.push(`running ${m.running_req}`);
    if (m.queue_req != null) parts.push(`queued ${m.queue_req}`);
    if (parts.length) facts.push(["server", parts.join(" · ")]);
  }
  if (st.weight_cache) {
    const wc = st.weight_cache;
    facts.push(["weight cache", `pid ${wc.pid} · ${wc.state} · ${wc.fingerprint} (for ${wc.config})` +
      (wc.ready_s != null ? ` · loaded in ${secs(wc.ready_s)}` : "")]);
  }
  if (st.proxy) facts.push(["proxy", proxyText(st.proxy)]);
  if (st.booting) facts.push(["daemon", "booting: restoring its previous life"]);
  if (!st.supervising) facts.push(["supervision", "STUCK (see /healthz)"]);
  const dl = $("server-facts");
  dl.replaceChildren(...facts.flatMap(([k, v, cls]) => [el("dt", { text: k }), el("dd", { class: cls, text: String(v) })]));

  const sp = $("swap-progress");
  sp.hidden = !st.swap;
  if (st.swap) {
    sp.textContent = `${st.swap.id}: ${st.swap.from || "-"} → ${st.swap.to} · ${st.swap.phase}` +
      (st.swap.prewarm ? ` · ${prewarmText(st.swap.prewarm)}` : "") +
      (st.phase ? ` · ${phaseText(st.phase)}` : "");
  }
  const sw = $("sweep-progress");
  sw.hidden = !st.sweep;
  if (st.sweep) {
    sw.textContent = `sweep ${st.sweep.id}: ${st.sweep.done}/${st.sweep.total}` +
      (st.sweep.current ? ` · measuring ${st.sweep.current}` : "") +
      (st.phase ? ` · ${phaseText(st.phase)}` : "");
    noteSweep(st.sweep.id);
  }

  const notes = [];
  if (st.write_errors && Object.keys(st.write_errors).length) {
    notes.push("Write failures: " + Object.entries(st.write_errors).map(([k, v]) => `${k}: ${v}`).join("; "));
  }
  if (st.gpu_error) notes.push(`GPU read error: ${st.gpu_error}`);
  for (const u of st.unmanaged || []) {
    notes.push(`Unmanaged: pid ${u.pid} (${u.name || "?"}), not verifiably ours, left running: ${u.why}`);
  }
  banner(notes.join(" · "), true);

  renderExit(st.last_exit);
  renderGpus(st);
}

// A start's phase (`/status` phase): "loading weights 12.0s · ready in ~40.0s".
const PHASE_LABELS = {
  init: "initialising", weights: "loading weights", kv_cache: "allocating the KV cache",
  cuda_graphs: "capturing CUDA graphs", warmup: "warming up",
};
function secs(s) { return s < 60 ? `${Math.max(0, s).toFixed(1)}s` : duration(s); }

// A swap's read of the next config's weights: `pre-warm 1.2 GiB/3.4 GiB read · 512 MiB cached`.
function proxyText(p) {
  const mode = { open: "passing", hold: "holding", reject: "rejecting" }[p.mode] || p.mode;
  const parts = [`${p.listen} ${mode}` + (p.connected ? "" : " (not connected)")];
  if (p.held) parts.push(`${p.held} held` + (p.oldest_held_s ? `, oldest ${secs(p.oldest_held_s)}` : ""));
  const counts = ["released", "rejected", "retried", "continued", "cut"]
    .filter((k) => p[k]).map((k) => `${p[k]} ${k}`);
  if (counts.length) parts.push(counts.join(", "));
  return parts.join(" · ");
}

function prewarmText(p) {
  const size = (n) => (n >= 1024 ** 3 ? `${(n / 1024 ** 3).toFixed(1)} GiB` : `${Math.round(n / 1024 ** 2)} MiB`);
  let text = `pre-warm ${size(p.read_bytes)}/${size(p.total_bytes - p.cached_bytes)} read`;
  if (p.cached_bytes) text += ` · ${size(p.cached_bytes)} cached`;
  if (p.state !== "reading") text += ` · ${p.state}`;
  return text;
}
function phaseText(p) {
  const eta = p.eta_s != null ? ` · ready in ~${secs(p.eta_s)}` : "";
  return `${PHASE_LABELS[p.name] || p.name} ${secs(p.elapsed_s || 0)}${eta}`;
}
function startupText(s) {
  const parts = Object.entries(s.phases || {}).map(([k, v]) => `${k} ${secs(v)}`);
  return secs(s.ready_s) + (parts.length ? `: ${parts.join(", ")}` : "");
}

function renderExit(ex) {
  const box = $("exit-body");
  if (!ex) {
    box.className = "muted";
    box.textContent = "no exit yet";
    return;
  }
  box.className = "";
  const how = ex.signal != null ? `signal ${ex.signal}` : ex.code != null ? `exit code ${ex.code}` : "";
  const bad = ex.reason !== "requested_stop";
  box.replaceChildren(
    el("div", { class: "exit-reason" },
      el("span", { class: "tag " + (bad ? "bad" : "ok"), text: ex.reason }),
      how && el("span", { text: how }),
      el("span", { class: "muted", text: `${clock(ex.at)} · ${ago(ex.at)}` })),
    ex.launch_id && el("div", { class: "muted small-text", text: `launch ${ex.launch_id}` }),
    ex.evidence && el("pre", { class: "evidence", text: ex.evidence }),
  );
}

function holderKind(p) {
  if (p.holder) return p.holder;
  return p.ours ? "ours" : "foreign";
}

// Set through the CSSOM: the page's Content-Security-Policy allows no inline style attribute.
function bar(pct) {
  const fill = el("span");
  fill.style.width = `${pct.toFixed(1)}%`;
  return el("div", { class: "bar", title: `${pct.toFixed(0)}% of its memory` }, fill);
}

function renderGpus(st) {
  const box = $("gpus");
  const gpus = st.gpus || [];
  $("gpu-meta").textContent = `${st.gpu_backend || ""}` +
    (st.gpu_snapshot_age_s != null ? ` · ${st.gpu_snapshot_age_s.toFixed(1)} s old` : "");
  if (!gpus.length) {
    box.replaceChildren(el("p", { class: "muted", text: "no GPU seen (backend: " + (st.gpu_backend || "none") + ")" }));
    return;
  }
  box.replaceChildren(...gpus.map((g) => {
    const pct = g.total_mib ? Math.min(100, (100 * g.used_mib) / g.total_mib) : 0;
    const holders = (g.processes || []).map((p) => {
      const kind = holderKind(p);
      return el("li", { "data-holder": kind },
        el("span", { class: "tag " + kind, text: kind }),
        el("span", { class: "mono", text: `pid ${p.pid}` }),
        el("span", { text: p.name || "?" }),
        el("span", { class: "muted", text: mib(p.used_mib) }));
    });
    return el("div", { class: "gpu", "data-gpu": g.index },
      el("div", { class: "line" },
        el("strong", { text: `GPU ${g.index}` }),
        el("span", { class: "muted", text: `${mib(g.used_mib)} / ${mib(g.total_mib)}` +
          (g.utilization_pct != null ? ` · ${g.utilization_pct}% util` : "") })),
      bar(pct),
      holders.length ? el("ul", { class: "holders" }, ...holders) : null);
  }));
}

// -- the timeline (/events) ----------------------------------------------------------------

async function refreshEvents() {
  try {
    const { res, body } = await apiJson("/events?limit=400");
    if (!res.ok || !body) return;
    renderTimeline(body.events.filter((e) => TIMELINE_KINDS.has(e.event) ||
      (e.event === "state" && e.to === "failed")));
    for (const e of body.events) if (e.event === "sweep_started" && e.sweep_id) noteSweep(e.sweep_id);
  } catch (_) { /* the status poll reports the connection */ }
}

function describe(e) {
  const arrow = (a, b) => `${a || "-"} → ${b || "-"}`;
  switch (e.event) {
    case "launch": return [`${e.config || ""} pid ${e.pid}`, "ok"];
    case "adopted": return [`${e.config || ""} pid ${e.pid}, taken over as it runs`, "ok"];
    case "unmanaged_process": return [`pid ${e.pid}: ${e.why}`, "warn"];
    case "shim_lost": return [e.error || "", "bad"];
    case "exit": {
      const how = e.signal != null ? `signal ${e.signal}` : e.code != null ? `code ${e.code}` : "";
      return [`${e.reason}${how ? " (" + how + ")" : ""}${e.evidence ? ": " + e.evidence : ""}`,
        e.reason === "requested_stop" ? "" : "bad"];
    }
    case "swap": return [arrow(e.from_config, e.to_config), ""];
    case "prewarm_ended": return [`${e.swap_id}: ${prewarmText({ ...e, state: e.outcome })}${e.outcome === "done" ? "" : " · " + (e.detail || "")}`,
      e.outcome === "done" ? "ok" : "warn"];
    case "restart": return [e.to_config || "", ""];
    case "swap_settled": return [`${e.swap_id}: ${e.outcome}${e.reason ? " (" + e.reason + ")" : ""}`,
      e.outcome === "ready" ? "ok" : "bad"];
    case "rollback": return [`${arrow(e.from_config, e.to_config)}: ${e.reason || ""}${e.evidence ? " · " + e.evidence : ""}`, "bad"];
    case "crash_loop": return [`${e.failures} failures (${e.reason})`, "bad"];
    case "preflight_refused": return [`${e.config || ""}: ${e.detail || ""}`, "bad"];
    case "death_announced": return [e.line || "", "bad"];
    case "state": return [`failed${e.detail ? ": " + e.detail : ""}`, "bad"];
    case "sweep_started": return [`${e.sweep_id}: ${(e.configs || []).join(", ")}`, ""];
    case "sweep_finished": return [`${e.sweep_id}: ${e.state}${e.winner ? " · winner " + e.winner : ""}`, "ok"];
    case "gpu_orphans_killed": return [(e.killed || []).map((k) => `pid ${k.pid} on GPU ${k.gpu}`).join(", "), "warn"];
    default: return [e.detail || e.config || "", ""];
  }
}

function renderTimeline(events) {
  const list = $("timeline");
  if (!events.length) {
    list.replaceChildren(el("li", { class: "muted", text: "no events yet" }));
    return;
  }
  list.replaceChildren(...events.slice(-120).reverse().map((e) => {
    const [what, tone] = describe(e);
    return el("li", { "data-event": e.event },
      el("time", { datetime: e.ts, title: e.ts, text: clock(e.ts) }),
      el("span", { class: "kind" }, el("span", { class: "tag " + tone, text: e.event.replace("_", " ") })),
      el("span", { class: "what", text: what }));
  }));
}

// -- the live log (a fetch stream of server-sent events) -----------------------------------

// SSE's framing: fields per line, events ended by a blank line, CRLF/LF/CR line ends.
function sseParser(onEvent) {
  let buf = "", event = "message", data = [];
  return (chunk) => {
    buf += chunk;
    for (;;) {
      const m = /\r\n|\r|\n/.exec(buf);
      if (!m || (m[0] === "\r" && m.index === buf.length - 1)) break; // a CRLF cut in two
      const line = buf.slice(0, m.index);
      buf = buf.slice(m.index + m[0].length);
      if (line === "") {
        if (data.length) onEvent(event, data.join("\n"));
        event = "message";
        data = [];
      } else if (!line.startsWith(":")) {
        const c = line.indexOf(":");
        const field = c < 0 ? line : line.slice(0, c);
        let value = c < 0 ? "" : line.slice(c + 1);
        if (value.startsWith(" ")) value = value.slice(1);
        if (field === "event") event = value;
        else if (field === "data") data.push(value);
      }
    }
  };
}

// The lines the daemon's dump marks with `!`: tracebacks, exceptions, CUDA OOM, NCCL errors,
// SGLang's death lines, argparse errors, watchdog timeouts.
const ERROR_RX = new RegExp([
  "Traceback \\(most recent call last\\)", "^(?:\\[[^\\]]*\\] )?(?:[A-Za-z_][\\w.]*\\.)?[A-Z]\\w*(?:Error|Exception)\\b",
  "CUDA out of memory", "OutOfMemoryError", "Not enough memory", "NCCL.*(?:error|Watchdog caught)",
  "crashed with exit code", "SIGQUIT received", "Received sigquit", "hit an exception",
  "address already in use", ": error: ", "[Ww]atchdog timeout", "scheduler is dead",
  "Health check failed", "\\bERROR\\b", "\\bFATAL\\b",
].join("|"));
const WARN_RX = /\bWARN(?:ING)?\b|\bwarning\b/;
let inTraceback = false;

function lineClass(text) {
  if (text.startsWith("# gpuwarden:")) return "note";
  if (inTraceback) {
    if (/^\s/.test(text)) return "err";
    inTraceback = false;
    return "err"; // the exception line that ends it
  }
  if (/Traceback \(most recent call last\)/.test(text)) {
    inTraceback = true;
    return "err";
  }
  if (ERROR_RX.test(text)) return "err";
  if (WARN_RX.test(text)) return "warn";
  return "";
}

function appendLines(items) {
  const pane = $("log");
  const follow = $("log-follow").checked;
  const frag = document.createDocumentFragment();
  for (const [text, cls] of items) frag.append(el("span", { class: "l " + cls, text: text + "\n" }));
  pane.append(frag);
  while (pane.childElementCount > LOG_KEEP) pane.firstElementChild.remove();
  $("log-count").textContent = `${pane.childElementCount} lines`;
  if (follow) pane.scrollTop = pane.scrollHeight;
}

async function followLog() {
  for (;;) {
    try {
      const res = await api("/logs/stream?history=300", { headers: { Accept: "text/event-stream" } });
      if (!res.ok || !res.body) throw new Error(`/logs/stream answered ${res.status}`);
      $("log").replaceChildren();
      inTraceback = false;
      let batch = [];
      const parse = sseParser((event, data) => {
        if (event === "line") batch.push([data, lineClass(data)]);
        else if (event === "dropped") batch.push([`# ${data}`, "note"]);
      });
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        parse(value);
        if (batch.length) {
          appendLines(batch);
          batch = [];
        }
      }
    } catch (_) { /* reconnect below */ }
    appendLines([["# gpuwarden: the log stream ended; reconnecting", "note"]]);
    await sleep(1000);
  }
}

// -- configs: argv, preflight, swap --------------------------------------------------------

async function loadConfigs() {
  const { res, body } = await apiJson("/configs");
  if (!res.ok || !body) return;
  const select = $("config-select");
  const keep = select.value;
  select.replaceChildren(...body.configs.map((name) => {
    const marks = [name === body.current && "current", name === body.last_good && "last good"].filter(Boolean);
    return el("option", { value: name, text: name + (marks.length ? ` (${marks.join(", ")})` : "") });
  }));
  if (!body.configs.length) select.append(el("option", { value: "", text: "no configs" }));
  select.value = body.configs.includes(keep) ? keep : body.current || body.configs[0] || "";
  showConfig(select.value);
}

async function showConfig(name) {
  const box = $("config-argv");
  if (!name) {
    box.textContent = "-";
    return;
  }
  const { res, body } = await apiJson(`/configs/${encodeURIComponent(name)}`);
  if (!res.ok || !body) {
    box.className = "argv";
    box.textContent = `${name}: ${body ? body.detail : res.status}`;
    return;
  }
  box.className = "argv";
  box.textContent = body.argv.map(shellQuote).join(" ");
}

function shellQuote(s) {
  return /^[\w@%+=:,./-]+$/.test(s) ? s : `'${s.replace(/'/g, "'\\''")}'`;
}

function result(kind, title, items = []) {
  const box = $("config-result");
  box.hidden = false;
  box.className = "result " + kind;
  box.replaceChildren(el("div", { text: title }),
    items.length ? el("ul", {}, ...items.map((t) => el("li", { text: t }))) : null);
}

async function preflight() {
  const name = $("config-select").value;
  if (!name) return;
  result("busy", `Checking ${name}…`);
  try {
    const { res, body } = await apiJson(`/configs/${encodeURIComponent(name)}/check`, { method: "POST" });
    if (res.ok && body && body.ok) {
      result("ok", `Preflight passed for ${name}${body.method ? " (" + body.method + ")" : ""}`, body.warnings || []);
    } else if (body && body.problems) {
      result("bad", `Preflight refused ${name}`, [...body.problems, ...(body.warnings || []).map((w) => "warning: " + w)]);
    } else {
      result("bad", `Preflight of ${name} failed: ${body ? body.detail : res.status}`);
    }
  } catch (err) {
    result("bad", `Preflight of ${name} failed: ${err.message}`);
  }
}

function confirmSwap(name) {
  return new Promise((resolve) => {
    const dialog = $("confirm-dialog");
    const from = lastStatus && lastStatus.config;
    $("confirm-title").textContent = `Swap to ${name}?`;
    $("confirm-text").textContent = (from && from !== name
      ? `The server now running ${from} is stopped and ${name} started in its place (preflight first; rolled back if it fails).`
      : `${name} is restarted.`);
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.returnValue = "";
    dialog.showModal();
    $("confirm-cancel").focus();
  });
}

async function swap() {
  const name = $("config-select").value;
  if (!name || !(await confirmSwap(name))) return;
  $("swap-btn").disabled = true;
  try {
    result("busy", `Swapping to ${name}: preflight…`);
    const { res, body } = await apiJson(`/restart?config=${encodeURIComponent(name)}`, { method: "POST" });
    if (!res.ok) {
      const items = body && body.problems ? body.problems : [];
      result("bad", `Swap to ${name} refused (${res.status}): ${body ? (typeof body.detail === "string" ? body.detail : body.error) : ""}`, items);
      return;
    }
    if (!body.swap_id) {
      result("ok", `${name} is already serving`);
      return;
    }
    await followSwap(body.swap_id, name);
  } catch (err) {
    result("bad", `Swap to ${name} failed: ${err.message}`);
  } finally {
    $("swap-btn").disabled = false;
    loadConfigs();
  }
}

// A swap's outcome: GET /swaps/ID where the daemon has it, else its swap_settled event.
async function followSwap(id, name) {
  let swapsRoute = true;
  for (;;) {
    if (swapsRoute) {
      const { res, body } = await apiJson(`/swaps/${encodeURIComponent(id)}`);
      if (res.status === 404) swapsRoute = false;
      else if (res.ok && body && body.outcome) return showOutcome(name, body);
      else if (res.ok && body) result("busy", `Swapping to ${name}: ${body.phase || "under way"}…`);
    }
    if (!swapsRoute) {
      const { body } = await apiJson("/events?kind=swap_settled&limit=50");
      const settled = body && body.events.find((e) => e.swap_id === id);
      if (settled) return showOutcome(name, settled);
      const st = lastStatus;
      const phase = st && st.swap && st.swap.id === id ? st.swap.phase : (st ? st.state : "…");
      result("busy", `Swapping to ${name}: ${phase}…`);
    }
    await sleep(500);
  }
}

function showOutcome(name, o) {
  const items = [o.reason && `reason: ${o.reason}`, o.evidence && `evidence: ${o.evidence}`].filter(Boolean);
  if (o.outcome === "ready") result("ok", `Swap to ${name}: ready`, items);
  else result("bad", `Swap to ${name}: ${o.outcome}`, items);
  refreshEvents();
}

// -- sweeps -------------------------------------------------------------------------------

const sweepIds = new Set();
let chartUrl = null;

function noteSweep(id) {
  if (sweepIds.has(id)) return;
  sweepIds.add(id);
  const select = $("sweep-select");
  const had = select.value;
  const ids = [...sweepIds].sort().reverse();
  select.replaceChildren(...ids.map((s) => el("option", { value: s, text: s })));
  select.hidden = false;
  select.value = had && sweepIds.has(had) ? had : ids[0];
  if (select.value !== had) showSweep(select.value);
}

async function loadSweeps() {
  const { res, body } = await apiJson("/sweeps");
  if (res.status === 404 || !res.ok || !body) {
    $("sweep-note").textContent = "";  // no list route: the sweeps named in the events
    return;
  }
  const list = Array.isArray(body) ? body : body.sweeps || [];
  for (const s of list) noteSweep(typeof s === "string" ? s : s.id);
}

function markdownTable(md) {
  const rows = [], notes = [];
  for (const line of md.split("\n")) {
    if (line.startsWith("|")) {
      const cells = line.slice(1, line.endsWith("|") ? -1 : undefined).split("|").map((c) => c.trim());
      if (!cells.every((c) => /^-+$/.test(c))) rows.push(cells);
    } else if (line.trim() && !line.startsWith("# ")) {
      notes.push(line);
    }
  }
  return { rows, notes };
}

async function showSweep(id) {
  const box = $("sweep-body");
  if (!id) return;
  const { res, body } = await apiJson(`/sweeps/${encodeURIComponent(id)}`);
  if (!res.ok || !body) {
    box.replaceChildren(el("p", { class: "muted", text: `${id}: ${body ? body.detail : res.status}` }));
    return;
  }
  const parts = [];
  const md = await api(`/sweeps/${encodeURIComponent(id)}/table.md`);
  if (md.ok) {
    const { rows, notes } = markdownTable(await md.text());
    const [head, ...data] = rows;
    if (head) {
      const table = el("table", {},
        el("thead", {}, el("tr", {}, ...head.map((h) => el("th", { text: h })))),
        el("tbody", {}, ...data.map((r) => el("tr", { class: r[0] === body.winner ? "winner" : "" },
          ...r.map((c) => el("td", { text: c }))))));
      parts.push(el("div", { class: "tablewrap" }, table));
    }
    const chart = await api(`/sweeps/${encodeURIComponent(id)}/chart.png`);
    if (chart.ok) {
      if (chartUrl) URL.revokeObjectURL(chartUrl);
      chartUrl = URL.createObjectURL(await chart.blob());
      parts.push(el("img", { src: chartUrl, alt: `tok/s per config (${id})` }));
    } else {
      parts.push(el("p", { class: "muted", text: "no chart" }));
    }
    parts.push(el("pre", { class: "notes muted", text: `${body.state} · ${body.done}/${body.total}\n` + notes.join("\n") }));
  } else {
    parts.push(el("p", { class: "muted", text: `${body.state}: ${body.done}/${body.total} configs measured` }));
  }
  box.replaceChildren(...parts);
}

// -- the dump -----------------------------------------------------------------------------

async function openDump() {
  const pre = $("dump-text");
  pre.textContent = "loading…";
  $("dump-dialog").showModal();
  try {
    const res = await api("/dump", { headers: { Accept: "text/plain" } });
    pre.textContent = await res.text();
  } catch (err) {
    pre.textContent = `the dump could not be read: ${err.message}`;
  }
}

// -- start --------------------------------------------------------------------------------

function wire() {
  $("forget-token").hidden = !token;
  $("forget-token").addEventListener("click", () => {
    forgetToken();
    location.reload();
  });
  $("log-clear").addEventListener("click", () => { $("log").replaceChildren(); $("log-count").textContent = ""; });
  $("log-errors").addEventListener("change", (e) => $("log").classList.toggle("errors-only", e.target.checked));
  $("config-select").addEventListener("change", (e) => { $("config-result").hidden = true; showConfig(e.target.value); });
  $("check-btn").addEventListener("click", preflight);
  $("swap-btn").addEventListener("click", swap);
  $("sweep-select").addEventListener("change", (e) => showSweep(e.target.value));
  $("dump-open").addEventListener("click", openDump);
}

async function main() {
  wire();
  // The first request asks for the token if one is needed; the others wait for it.
  await apiJson("/status");
  pollStatus();
  followLog();
  loadConfigs();
  loadSweeps();
  setInterval(loadConfigs, 15000);
}

main();
