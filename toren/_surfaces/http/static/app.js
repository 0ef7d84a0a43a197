// The Toren console: a page over the HTTP API. Signed in with a session cookie; writes carry
// the session's CSRF token. The run page reads the run's events a page at a time, then follows
// its event stream (server-sent events).
"use strict";

const $ = (id) => document.getElementById(id);
let csrf = null;
let me = null; // who is signed in: { name, principal, scopes, agents, csrf }
let view = null; // the run page open (see openRun)
let listTimer = null;

function esc(text) {
  return String(text ?? "").replace(/[&<>"']/g, (c) => (
    { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

// Text from a run with every character that could hide or reorder what is shown written as an
// escape, as the CLI prints it (toren/_core/terminal.py): C0 controls but newline and tab, DEL, C1
// controls as \xNN; bidi controls, lone surrogates and the invisible characters that break a
// line or hide text (line and paragraph separators, zero-width space, word joiner, byte order
// mark) as \uNNNN; tag characters (invisible letters) as \UNNNNNNNN.
const UNSAFE = /[\u0000-\u0008\u000b-\u001f\u007f-\u009f\u061c\u200b\u200e\u200f\u2028\u2029\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]|\udb40[\udc00-\udc7f]|[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/g;
function visible(text) {
  return String(text ?? "").replace(UNSAFE, (c) => {
    const code = c.length > 1 ? c.codePointAt(0) : c.charCodeAt(0);
    if (code > 0xffff) return `\\U${code.toString(16).padStart(8, "0")}`;
    return code < 0x100 ? `\\x${code.toString(16).padStart(2, "0")}` : `\\u${code.toString(16).padStart(4, "0")}`;
  });
}

// Run text inside HTML built as a string (the runs list, the timeline's labels): shown as
// visible() shows it, then escaped as markup.
function escShown(text) {
  return esc(visible(text));
}

// An element holding text (never parsed as markup).
function el(tag, className = "", text = undefined) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = visible(text);
  return node;
}

async function api(path, options = {}) {
  const headers = { Accept: "application/json", ...(options.headers || {}) };
  if (options.body !== undefined) {
    headers["Content-Type"] = "application/json";
    headers["X-CSRF-Token"] = csrf;
  }
  const response = await fetch(path, { credentials: "same-origin", ...options, headers });
  if (response.status === 401) {
    // Signed out (the token was revoked, or the session ended): stop polling, or every poll
    // would count as a failed sign-in from this address.
    if (listTimer) { clearInterval(listTimer); listTimer = null; }
    leaveRun();
    show("signin");
    throw new Error("signed out");
  }
  const body = await response.json();
  if (!response.ok) throw new Error(body.detail || response.statusText);
  return body;
}

function show(section) {
  for (const id of ["signin", "runs", "run", "channels", "schedules", "versions"]) $(id).hidden = id !== section;
}

async function start() {
  $("denied").hidden = !location.search.includes("denied");
  try {
    me = await api("/session");
    csrf = me.csrf;
    $("who").textContent = `signed in as ${me.name} (${me.scopes.join(", ")})`;
    $("signout").hidden = false;
    $("nav").hidden = false;
  } catch (e) {
    show("signin");
    return;
  }
  $("signout").onclick = async () => {
    await fetch("/session", { method: "DELETE", headers: { "X-CSRF-Token": csrf } });
    location.href = "/";
  };
  $("status-filter").onchange = () => loadRuns();
  $("start").hidden = !may("operate");
  $("start-not-allowed").hidden = may("operate");
  $("start").onsubmit = startRun;
  $("send").onclick = () => { if (view) steer(view, "messages", { text: $("message-text").value }); };
  $("cancel").onclick = () => { if (view) steer(view, "cancel", { reason: $("steer-reason").value }); };
  $("retry").onclick = () => { if (view) steer(view, "retry", {}); };
  $("upgrade").onclick = () => { if (view) steer(view, "upgrade", {}); };
  $("more-button").onclick = () => { if (view) nextPage(view); };
  $("fork-form").onsubmit = forkRun;
  $("fork-close").onclick = () => { $("fork-form").hidden = true; };
  window.onhashchange = route;
  route();
}

// A run's page: `#/runs/<uuid>`, or `#/runs/run/<uuid>` with the id as the CLI and the API
// print it (`run/<uuid>`). Anything else under `#/runs/` shows the list and says why.
const RUN_HASH = /^#\/runs\/(?:run\/)?([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})$/i;

function route() {
  leaveRun();
  if (listTimer) { clearInterval(listTimer); listTimer = null; }
  notice("");
  const match = location.hash.match(RUN_HASH);
  if (match) { openRun(match[1].toLowerCase()); return; }
  if (location.hash.startsWith("#/runs/")) {
    notice(`${decoded(location.hash.slice(7))} is not a run id: a run's page is ` +
      "#/runs/<uuid> or #/runs/run/<uuid>.");
  }
  if (location.hash === "#/channels") {
    show("channels");
    loadChannels();
    listTimer = setInterval(loadChannels, 2000);
    return;
  }
  if (location.hash === "#/versions") {
    show("versions");
    loadVersions();
    listTimer = setInterval(loadVersions, 2000);
    return;
  }
  if (location.hash === "#/schedules") {
    show("schedules");
    loadSchedules();
    listTimer = setInterval(loadSchedules, 2000);
    return;
  }
  show("runs");
  loadRuns();
  listTimer = setInterval(loadRuns, 2000);
}

// Text from the address as the person typed it: decoded, unless it is not valid
// percent-encoding (a stray %), which decodeURIComponent throws on.
function decoded(text) {
  try { return decodeURIComponent(text); } catch { return text; }
}

// A line above the runs list saying why it shows instead of what was asked for.
function notice(text) {
  $("runs-notice").textContent = visible(text);
  $("runs-notice").hidden = !text;
}

// Whether this session may do what `scope` allows, to runs of `agent` if named (a token
// limited to some agents writes only to their runs). Only what it may do is offered; the
// server refuses the rest anyway.
function may(scope, agent) {
  return !!me && me.scopes.includes(scope) &&
    (agent === undefined || me.agents === null || me.agents.includes(agent));
}

async function loadRuns() {
  const status = $("status-filter").value;
  const page = await api(`/runs?limit=100${status ? `&status=${status}` : ""}`);
  const agents = new Set([...(me.agents || []), ...page.runs.map((r) => r.agent)]);
  $("agents").replaceChildren(...[...agents].filter((a) => may("operate", a)).sort()
    .map((a) => { const o = document.createElement("option"); o.value = a; return o; }));
  $("runs-body").innerHTML = page.runs.map((r) => `
    <tr data-run="${esc(r.id.slice(4))}">
      <td><span class="badge ${esc(r.status)}"${r.queued_for ? ` title="waiting for ${escShown(r.queued_for)}, #${r.queue_position} in line"` : r.waiting_for ? ` title="${escShown(r.waiting_for)}"` : ""}>${esc(r.status)}${r.queue_position ? ` #${r.queue_position}` : ""}</span></td>
      <td>${escShown(r.agent)}</td><td>${escShown(r.input.slice(0, 80))}</td>
      <td>${r.calls_made}</td><td>$${Number(r.usd_paid).toFixed(4)}</td>
      <td>${new Date(r.created_at).toLocaleString()}</td></tr>`).join("");
  for (const row of $("runs-body").querySelectorAll("tr")) {
    row.onclick = () => { location.hash = `#/runs/${row.dataset.run}`; };
  }
}

// Starting a run (the `operate` scope): the new run's page opens once the server took it.
async function startRun(event) {
  event.preventDefault();
  $("start-button").disabled = true;
  $("start-error").hidden = true;
  try {
    const run = await api("/runs", { method: "POST",
      body: JSON.stringify({ agent: $("start-agent").value.trim(), input: $("start-input").value }) });
    $("start-input").value = "";
    location.hash = `#/runs/${run.id.slice(4)}`;
  } catch (e) {
    $("start-error").textContent = visible(e.message);
    $("start-error").hidden = false;
  } finally { $("start-button").disabled = false; }
}

// A message, a cancellation or a retry (the `operate` scope) sent to the run shown; what the
// run does with it comes in on its event stream. A refusal is shown as the server gave it.
async function steer(v, action, body) {
  const buttons = ["send", "cancel", "retry", "upgrade"].map($);
  for (const b of buttons) b.disabled = true;
  $("steer-error").hidden = true;
  try {
    await api(`/runs/${v.uuid}/${action}`, { method: "POST", body: JSON.stringify(body) });
    if (action === "messages") $("message-text").value = "";
    $("steer-done").textContent = { messages: "Message sent: the run reads it at its next step.",
      cancel: "Cancellation sent: the run stops at its next step, unless it ends first.",
      retry: "Retry sent: the run resumes from its last good step.",
      upgrade: "Upgraded: the run moves to the newest version of its agent." }[action];
    $("steer-done").hidden = false;
  } catch (e) {
    $("steer-done").hidden = true;
    $("steer-error").textContent = visible(e.message);
    $("steer-error").hidden = false;
  } finally {
    for (const b of buttons) b.disabled = false;
    if (v === view) refreshRun(v.uuid);
  }
}

// The Channels page: each Telegram bot, its paired chats, and every outbound message it keeps
// with its delivery state. Titles, names and texts come from Telegram users and from runs: they
// go in as text (el), never as HTML.
async function loadChannels() {
  const { channels } = await api("/channels");
  const outboxes = await Promise.all(channels.map((c) =>
    api(`/channels/${encodeURIComponent(c.bot)}/messages`).catch(() => ({ messages: [] }))));
  $("channels-none").hidden = channels.length > 0;
  $("channels-list").replaceChildren(...channels.map((c, i) => channelView(c, outboxes[i].messages)));
}

function table(head, rows, empty) {
  const t = el("table", "list");
  const tr = el("tr");
  for (const h of head) tr.append(el("th", "", h));
  const thead = el("thead");
  thead.append(tr);
  const body = el("tbody");
  for (const cells of rows) {
    const row = el("tr");
    for (const cell of cells) {
      const td = el("td");
      td.append(cell instanceof Node ? cell : visible(cell));
      row.append(td);
    }
    body.append(row);
  }
  if (!rows.length) {
    const row = el("tr");
    const td = el("td", "note", empty);
    td.colSpan = head.length;
    row.append(td);
    body.append(row);
  }
  t.append(thead, body);
  return t;
}

function runLink(run) {
  if (!/^run\/[0-9a-f-]{36}$/.test(run || "")) return "-";
  const a = el("a", "", run);
  a.href = `#/runs/${run.slice(4)}`;
  return a;
}

function ago(seconds) {
  for (const [unit, size] of [["d", 86400], ["h", 3600], ["m", 60]]) {
    if (seconds >= size) return `${Math.floor(seconds / size)}${unit} ago`;
  }
  return `${Math.floor(Math.max(0, seconds))}s ago`;
}

function channelView(c, messages) {
  const box = el("div", "channel");
  box.dataset.bot = c.bot;
  const head = el("h2");
  // A live channel that Telegram does not answer is shown failing, with since when and why.
  const failing = c.status === "live" && c.failing ? c.failing : null;
  const status = failing ? "failing" : c.status;
  head.append(el("span", `badge ${status}`, status), " ", el("span", "", c.bot),
    " ", el("span", "muted", c.username ? `@${c.username}` : ""));
  box.append(head, el("p", "facts", `agent ${c.agent} · ${c.chats.length} paired chat(s) · ` +
    `${c.pending} pending, ${c.sent} sent, ${c.failed} failed · ${c.updates} updates`));
  if (failing) {
    const since = new Date(failing.since);
    box.append(el("p", "failing", `Failing since ${since.toLocaleString()} ` +
      `(${ago((Date.now() - since.getTime()) / 1000)}): ${failing.error}`));
  }
  box.append(el("h3", "", "Paired chats"));
  box.append(table(["Chat", "Title", "Type", "Paired by", "Blocked", "Conversation"],
    c.chats.map((chat) => [String(chat.chat_id), chat.title, chat.type,
      `${chat.paired_by} (${chat.paired_by_id})`, chat.blocked ? "yes" : "no", runLink(chat.run)]),
    "no chat is paired: `toren channels pair AGENT` prints a code to send to the bot"));
  box.append(el("h3", "", "Outbound messages"));
  const now = Date.now();
  box.append(table(["#", "Chat", "Kind", "State", "Queued", "Text"],
    messages.slice().reverse().map((m) => [String(m.n), String(m.chat_id), m.kind,
      el("span", `badge state ${m.state}`, m.state),
      ago((now - new Date(m.queued_at).getTime()) / 1000),
      m.text.length > 80 ? `${m.text.slice(0, 80)}...` : m.text]),
    "no outbound message yet"));
  return box;
}

// The agents' versions: for each, the versions live workers serve (the newest first), the
// workers serving each, and the runs not ended pinned to each. A version no live worker serves
// is flagged: its runs are parked until one does, or until they are upgraded (on their pages).
async function loadVersions() {
  const { agents } = await api("/agents/versions");
  $("versions-none").hidden = agents.length > 0;
  $("versions-list").replaceChildren(...agents.map(versionsView));
}

function versionsView(a) {
  const box = el("div", "agent-versions");
  box.dataset.agent = a.agent;
  const head = el("h2");
  head.append(el("span", "", a.agent));
  if (a.stranded_runs) {
    head.append(" ", el("span", "badge failing", `${a.stranded_runs} run(s) parked: no worker`));
  }
  box.append(head, el("p", "facts", `newest version ${a.newest || "none (no live worker)"} · ` +
    `${a.unpinned_runs} run(s) not pinned to a version`));
  box.append(table(["Version", "Policy", "Workers", "Runs not ended", ""],
    a.versions.map((v) => [v.version, v.policy || "-",
      v.workers.map((w) => `${w.name} (${w.code_version})`).join(", ") || "-",
      String(v.unfinished_runs),
      v.served ? (v.newest ? "newest" : "")
        : el("span", "bad", `no live worker${v.unfinished_runs ? `: ${v.unfinished_runs} run(s) parked` : ""}`)]),
    "no version published"));
  return box;
}

// The schedules (a token limited to agents sees theirs): next fire times in each schedule's
// own time zone as the API gives them, whether paused, the recent slots with their runs (linked
// to the runs' pages), missed slots and why the last slot did not start. Text from the API goes
// in as text (el).
async function loadSchedules() {
  const { schedules } = await api("/schedules");
  $("schedules-none").hidden = schedules.length > 0;
  $("schedules-list").replaceChildren(...schedules.map(scheduleView));
}

function scheduleView(s) {
  const box = el("div", "schedule");
  box.dataset.schedule = s.name;
  const d = s.schedule;
  const spec = d.cron ? `cron ${d.cron} (${d.timezone})` : `every ${d.every}s`;
  const state = s.paused ? "paused" : "active";
  const head = el("h2");
  head.append(el("span", `badge ${state}`, state), " ", el("span", "", s.name));
  box.append(head, el("p", "facts", `agent ${s.agent} · ${spec} · overlap ${d.overlap} · ` +
    `${s.started} started, ${s.skipped} skipped, ${s.missed} missed · ${s.in_flight.length} in flight`));
  if (s.paused) box.append(el("p", "failing", `Paused${s.paused_reason ? `: ${s.paused_reason}` : ""}`));
  if (s.last_reason) box.append(el("p", "note last-reason", `Last slot not started: ${s.last_reason}`));
  box.append(el("p", "next", s.next.length ? `Next: ${s.next.join(", ")}` : "Next: none"));
  box.append(table(["Slot", "How", "Outcome", "Run", "Status", "Reason"],
    s.recent.slice().reverse().map((r) => [r.key, r.how, r.outcome, runLink(r.run),
      r.run ? el("span", `badge ${r.run_status || "gone"}`, r.run_status || "gone") : "-",
      r.reason]),
    "no slot yet"));
  return box;
}

// A run's page reads the run's events in pages by cursor (`GET /runs/{id}/events?after=SEQ`
// answers at most PAGE), so a long run never loads its whole journal at once: past a full page,
// a button reads the next. After the last page it follows the run live through its event
// stream, read with fetch rather than an EventSource (which hears only the event names it is
// told: a kind added later, such as `model.calling`, would go unseen), and reconnects after
// the last event it got whenever the stream ends (idle, server restart), as an EventSource would.
const PAGE = 1000;
const RECONNECT_MS = 3000;

async function openRun(uuid) {
  leaveRun();
  show("run");
  $("steer-error").hidden = $("steer-done").hidden = true;
  $("fork-form").hidden = true;
  const v = view = {
    uuid, last: 0, events: [], calls: { intents: {}, cwds: {}, sandboxed: new Set() },
    transcript: newTranscript($("transcript")), abort: new AbortController(), pending: null,
  };
  $("transcript").replaceChildren();
  $("events-body").replaceChildren();
  $("timeline").replaceChildren();
  $("more").hidden = true;
  try {
    await refreshRun(uuid);
    // A pruned run has no journal: its page shows its audit record, no events to read.
    if (v.pruned) return;
  } catch (e) {
    if (v !== view || e.message === "signed out") return;
    leaveRun();
    show("runs");
    notice(e.message); // "no run run/<uuid>"
    loadRuns();
    listTimer = setInterval(loadRuns, 2000);
    return;
  }
  await nextPage(v);
}

function leaveRun() {
  if (!view) return;
  view.abort.abort();
  clearTimeout(view.pending);
  view = null;
}

async function nextPage(v) {
  $("more").hidden = true;
  const { events } = await api(`/runs/${v.uuid}/events?after=${v.last}`);
  if (v !== view) return;
  for (const event of events) addEvent(v, event);
  settle(v);
  if (events.length >= PAGE) {
    $("more-count").textContent = `${v.events.length} events shown; the run has more.`;
    $("more").hidden = false;
    return;
  }
  follow(v);
}

function addEvent(v, event) {
  if (event.seq <= v.last) return;
  v.last = event.seq;
  v.events.push(event);
  addToTranscript(v.transcript, event);
  const row = document.createElement("tr");
  const cell = document.createElement("td");
  cell.append(detail(event, v.calls));
  if (event.type === "model.called" && may("operate", v.agent)) {
    const fork = el("button", "fork-here", "Fork from here");
    fork.type = "button";
    fork.dataset.step = event.data.step;
    fork.onclick = () => openFork(v, event.data.step);
    cell.append(fork);
  }
  row.append(el("td", "", event.seq), el("td", "", event.type),
    el("td", "", new Date(event.at).toLocaleTimeString()), cell);
  $("events-body").append(row);
}

// After a page or a read of the stream (not after each event): the timeline drawn again, and
// the run's status read again once things are quiet for a moment.
function settle(v) {
  if (v !== view || !v.events.length) return;
  drawTimeline(v.events);
  clearTimeout(v.pending);
  v.pending = setTimeout(() => { if (v === view) refreshRun(v.uuid); }, 150);
}

async function follow(v) {
  while (v === view) {
    try {
      const response = await fetch(`/runs/${v.uuid}/events?after=${v.last}`, {
        credentials: "same-origin", headers: { Accept: "text/event-stream" }, signal: v.abort.signal,
      });
      if (response.status === 401) {
        api("/session").catch(() => {}); // shows the sign-in form
        return;
      }
      if (response.ok) {
        await readEvents(response.body, (type, data) => {
          if (type !== "toren.closed" && v === view) addEvent(v, JSON.parse(data));
        }, () => settle(v));
      }
    } catch (e) {
      if (v.abort.signal.aborted) return;
    }
    if (v !== view) return;
    await new Promise((resolve) => { setTimeout(resolve, RECONNECT_MS); });
  }
}

// Reads server-sent events from a response body until it ends, calling on(type, data) for
// each (`event:` and `data:` lines, a blank line ending one, `:` lines comments: pings), and
// read() after each piece of the body it got.
async function readEvents(body, on, read) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "", type = "", data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let from = 0, nl;
    while ((nl = buffer.indexOf("\n", from)) >= 0) {
      const line = buffer.slice(from, nl).replace(/\r$/, "");
      from = nl + 1;
      if (!line) {
        if (data.length) on(type || "message", data.join("\n"));
        type = "";
        data = [];
        continue;
      }
      const colon = line.indexOf(":");
      if (colon === 0) continue;
      const field = colon < 0 ? line : line.slice(0, colon);
      const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
      if (field === "event") type = text;
      else if (field === "data") data.push(text);
    }
    buffer = buffer.slice(from);
    read();
  }
}

// What an event's row shows: a sandboxed call's command and output, a sandbox's notes, the
// command an approval is asked for; else the event's data, cut (see brief).
function detail(event, calls) {
  const d = event.data;
  if (event.type === "tool.intent") calls.intents[d.call_id] = d;
  if (event.type === "sandbox.requested") calls.sandboxed.add(d.call_id);
  if (event.type === "tool.result" && calls.sandboxed.has(d.call_id)) {
    return commandView(calls.intents[d.call_id], d, calls.cwds[d.call_id]);
  }
  if (event.type === "approval.requested" && d.cwd) {
    // A sandboxed command asked about: its result is shown as a command's, even if denied.
    calls.intents[d.call_id] ??= d;
    calls.cwds[d.call_id] = d.cwd;
    calls.sandboxed.add(d.call_id);
    const box = el("div", "command");
    box.append("approval asked for ", commandLine(d.name, d.arguments, d.cwd));
    return box;
  }
  if (event.type === "sandbox.noted") return el("span", "note", `sandbox: ${d.text}`);
  if (event.type === "sandbox.failed") return el("span", "note bad", `sandbox failed: ${d.error}`);
  return el("code", "", brief(event));
}

// A sandboxed call as a line: `$ <command>` in <cwd>, or the file tool and its path.
function commandLine(name, args, cwd) {
  const line = document.createElement("span");
  const a = args || {};
  line.append(el("code", "", name === "bash" ? `$ ${a.command}` : `${name} ${a.path ?? "."}`));
  if (cwd) line.append(" in ", el("code", "", cwd));
  return line;
}

// A sandboxed call's result read apart: the sandbox writes it as `$ <command>`, `[in <cwd>;
// <how it ended>]`, then the output (the transcript reads it the same way).
function parseCommand(intent, d, asked = "") {
  const name = intent ? intent.name : "tool";
  const args = (intent && intent.arguments) || {};
  let output = String(d.content ?? ""), cwd = asked || "", how = "";
  if (name === "bash" && typeof args.command === "string") {
    const head = `$ ${args.command}\n[in `;
    const end = output.startsWith(head) ? output.indexOf("]", head.length) : -1;
    if (end >= 0) {
      const bracket = output.slice(head.length, end);
      const split = bracket.indexOf("; ");
      [cwd, how] = split < 0 ? [bracket, ""] : [bracket.slice(0, split), bracket.slice(split + 2)];
      output = output.slice(end + 1).replace(/^\n/, "");
    }
  }
  return { name, args, cwd, how, output };
}

// A sandboxed call's result: the command and where it ran, how it ended, and its output in a
// <pre>, folded when long. All of it is untrusted (markup, NULs, megabytes): it goes in as
// text, never as HTML.
const FOLD_LINES = 12, FOLD_CHARS = 2000;
function commandView(intent, d, asked = "") {
  const { name, args, cwd, how, output } = parseCommand(intent, d, asked);
  const box = el("div", "command");
  const line = el("div", "command-head");
  line.append(commandLine(name, args, cwd), " · ");
  const state = d.denied ? "denied" : how || (d.is_error ? "error" : "done");
  line.append(el("span", d.is_error || d.denied ? "bad" : "", state));
  if (d.truncated_from) line.append(` · cut from ${d.truncated_from} bytes`);
  box.append(line);
  if (!output) return box;
  const pre = el("pre", "output", output);
  const lines = output.split("\n").length;
  if (lines > FOLD_LINES || output.length > FOLD_CHARS) {
    const fold = el("details");
    fold.append(el("summary", "", `output: ${lines} lines, ${output.length} characters`), pre);
    box.append(fold);
  } else box.append(pre);
  return box;
}

// What an event's row shows by default: its data, cut; a compaction in words (its prefix is
// long).
function brief(event) {
  const d = event.data;
  if (event.type === "sandbox.requested") return `call ${d.call_id} sent to ${d.sandbox}`;
  if (event.type !== "context.compacted") return JSON.stringify(d).slice(0, 160);
  const why = d.reason === "refused" ? ", the request was refused as too large" : "";
  const cost = d.tier === "hard" ? `, summary by ${d.model} $${d.cost_usd ?? "unpriced"}` : "";
  return `${d.tier}${why}: about ${d.tokens_before} -> ${d.tokens_after} input tokens; ` +
    `${d.elided} tool results elided, ${d.summarised} messages summarised${cost}`;
}

async function refreshRun(uuid) {
  const run = await api(`/runs/${uuid}`);
  if (view && view.uuid === uuid) { view.agent = run.agent; view.pruned = !!run.pruned; }
  // Pruned (retention): shown from its audit record; it takes nothing more.
  const p = run.pruned;
  $("run-pruned").hidden = !p;
  $("run-pruned").textContent = p ? `journal pruned on ${p.pruned_at.slice(0, 10)} ` +
    `(${p.events} events; ${p.archive ? `archived at ${p.archive.location}` : "not archived"}); ` +
    `started by ${p.started_by ? `${p.started_by.name} via ${p.started_by.via}` : "?"}` +
    p.decisions.map((d) => `; call ${d.call_id} (${d.tool}) ${d.approved ? "approved" : "denied"} ` +
      `by ${d.who}${d.reason ? `: ${d.reason}` : ""}`).join("") : "";
  // A queued run waits for a slot of a concurrency limit: which one, and its place in line.
  // A run pinned to a version no live worker serves is parked: it says so (`waiting_for`).
  $("run-status").textContent = run.queued
    ? `queued: #${run.queued.position} for ${run.queued.limit}` + (run.queued.cap ? ` (cap ${run.queued.cap})` : "")
    : run.waiting_for ? `${run.status}: ${run.waiting_for}` : run.status;
  $("run-waiting").textContent = run.waiting_for ? `parked: ${run.waiting_for}` : "";
  $("run-waiting").hidden = !run.waiting_for;
  $("run-version").textContent = run.version ? `version ${run.version}` : "";
  $("run-status").className = `badge ${run.status}`;
  $("run-agent").textContent = run.agent;
  $("run-input").textContent = run.input;
  $("run-output").hidden = !(run.output || run.error);
  $("run-output").textContent = run.output || `${run.error_class}: ${run.error}`;
  // Parent and child runs of cross-agent calls, linked both ways.
  const link = (id, text) => `<a href="#/runs/${esc(id.slice(4))}">${escShown(text)}</a>`;
  // A run a schedule started names the schedule and its slot.
  const slot = run.schedule ? `${run.schedule.name} slot ${run.schedule.slot}` : "";
  const links = [
    ...(run.schedule ? [`started by schedule <a href="#/schedules">${escShown(slot)}</a>`] : []),
    ...(run.parent ? [`started by ${link(run.parent, run.parent)}`] : []),
    ...run.children.map((c) => `child ${link(c.run, `${c.agent} (${c.status})`)}` +
      (c.usd_paid !== null ? ` $${esc(c.usd_paid)}` : "")),
  ];
  // A fork names the run and step it was forked from, and what it did not pay again.
  const f = run.forked_from;
  if (f) links.unshift(`forked from ${link(f.run, f.run)} at step ${esc(f.step)} ` +
    `(${esc(f.calls_replayed)} call${f.calls_replayed === 1 ? "" : "s"} replayed, ` +
    `$${esc(f.usd_not_repaid)} not paid again)`);
  $("run-links").hidden = !links.length;
  $("run-links").innerHTML = links.join(" · ");
  // A call a child run waits on is shown (and decided) here too; the decision goes to it.
  const waiting = run.waiting_on[0];
  // Only what this session may do is offered (the server refuses the rest anyway): a token
  // limited to agents decides only the calls of runs of those agents.
  const mayDecide = !!waiting && me.scopes.includes("approve") &&
    (me.agents === null || me.agents.includes(waiting.agent));
  $("decision").hidden = !waiting;
  $("decision-controls").hidden = !mayDecide;
  $("decision-not-allowed").hidden = mayDecide;
  if (waiting) {
    // What is decided is shown as it is, as text (el): every character that could hide or
    // reorder it (a U+202E in a path) written as an escape, as the CLI shows it.
    // A sandboxed command is shown exactly, with the directory it would run in.
    const command = waiting.cwd && typeof waiting.arguments.command === "string";
    const what = [el("code", "", waiting.tool)];
    if (command) what.push(" in ", el("code", "", waiting.cwd));
    else what.push(" ", el("code", "", JSON.stringify(waiting.arguments)));
    if (waiting.run !== run.id) {
      const child = el("a", "", `${waiting.agent} ${waiting.run.slice(4, 12)}`);
      child.href = `#/runs/${waiting.run.slice(4)}`;
      what.push(" (child run ", child, ")");
    }
    if (command) what.push(el("pre", "output exact", `$ ${waiting.arguments.command}`));
    $("decision-what").replaceChildren(...what);
    // The decision names the call shown: if the run has moved on meanwhile, it is refused
    // (409) and never applied to another call.
    const decide = (approved) => async () => {
      $("approve").disabled = $("deny").disabled = true;
      $("decision-error").hidden = true;
      try {
        await api(`/runs/${uuid}/approvals`, { method: "POST",
          body: JSON.stringify({ call_id: waiting.call_id, run: waiting.run, approved,
            reason: $("decision-reason").value }) });
      } catch (e) {
        $("decision-error").textContent = e.message;
        $("decision-error").hidden = false;
        refreshRun(uuid);
      } finally { $("approve").disabled = $("deny").disabled = false; }
    };
    $("approve").onclick = decide(true);
    $("deny").onclick = decide(false);
  }
  // Message, cancel, retry: offered as the run's status allows them (a failed run takes no
  // message until retried; a cancelled one is not retried). A child run that has ended takes
  // neither a message nor a retry: its end went to its parent (the server refuses both).
  const mayOperate = may("operate", run.agent);
  const ended = ["completed", "failed", "cancelled"].includes(run.status);
  $("steer").hidden = !!p;
  $("steer-controls").hidden = !mayOperate;
  $("steer-not-allowed").hidden = mayOperate;
  $("message-form").hidden = run.status === "failed" || run.status === "cancelled" ||
    (ended && !!run.parent);
  $("cancel-form").hidden = ended;
  $("retry").hidden = !(run.status === "failed" && run.error_class !== "cancelled" && !run.parent);
  // Parked on a version no live worker serves: moved to the newest version from here.
  $("upgrade").hidden = !run.waiting_for;
  const r = run.receipt;
  $("receipt").innerHTML = [
    ["calls made", r.calls_made], ["calls replayed (not re-paid)", r.calls_replayed],
    ["tokens in / out", `${r.input_tokens} / ${r.output_tokens}`],
    ["paid", `$${r.usd_paid}`], ["not re-paid", `$${r.usd_not_repaid}`],
    ["unpriced calls", r.unpriced_calls],
    ...(r.calls_lost ? [["lost in flight", `${r.calls_lost} call(s), about ` +
      `$${r.usd_lost_estimated} estimated, not in paid`]] : []),
    ...(r.child_runs ? [["child runs", `${r.child_runs}: ${r.child_calls_made} calls, ` +
      `$${r.child_usd_paid} (total $${r.usd_total})` + (r.child_calls_lost ? `; ${r.child_calls_lost} ` +
      `lost in flight, about $${r.child_usd_lost_estimated} estimated` : "")]] : []),
    ...(r.compactions_soft || r.compactions_hard ? [["compactions (soft / hard)",
      `${r.compactions_soft} / ${r.compactions_hard}, about ${r.tokens_saved} input tokens saved`]] : []),
  ].map(([k, v]) => `<dt>${esc(k)}</dt><dd>${esc(v)}</dd>`).join("");
}

// Forking from model call `step` (the `operate` scope): the form offers the last human text
// before the step to edit (a message, else the run's input); only a changed text is sent. The
// new run's page opens once the server made it; a refusal is shown as the server gave it.
function openFork(v, step) {
  let text = "", field = "input";
  for (const e of v.events) {
    if (e.data.step === step && (e.type === "model.calling" || e.type === "model.called")) break;
    if (e.type === "run.started") { text = e.data.input ?? ""; field = "input"; }
    if (e.type === "message.received") { text = e.data.text ?? ""; field = "message"; }
  }
  v.fork = { step, field, text };
  $("fork-title").textContent = `Fork from step ${step}`;
  $("fork-text-label").textContent = field === "message"
    ? "The last human message before this step (edit it to send the fork another):"
    : "The run's input (edit it to start the fork from another):";
  $("fork-text").value = text;
  $("fork-upgrade").checked = false;
  $("fork-error").hidden = true;
  $("fork-form").hidden = false;
  $("fork-form").scrollIntoView({ block: "nearest" });
}

async function forkRun(event) {
  event.preventDefault();
  const v = view;
  if (!v || !v.fork) return;
  const body = { at: v.fork.step, upgrade: $("fork-upgrade").checked };
  if ($("fork-text").value !== v.fork.text) body[v.fork.field] = $("fork-text").value;
  $("fork-submit").disabled = true;
  $("fork-error").hidden = true;
  try {
    const made = await api(`/runs/${v.uuid}/fork`, { method: "POST", body: JSON.stringify(body) });
    location.hash = `#/runs/${made.id.slice(4)}`;
  } catch (e) {
    $("fork-error").textContent = visible(e.message);
    $("fork-error").hidden = false;
  } finally { $("fork-submit").disabled = false; }
}

// The timeline: one lane per kind of work, bars from start to end, markers for resumes and
// invalidations. Model calls served from the journal after a resume are drawn lighter.
function drawTimeline(events) {
  const t = (e) => new Date(e.at).getTime();
  const t0 = t(events[0]);
  const bars = [];
  const marks = [];
  const open = {};
  let replayed = 0;
  for (const e of events) {
    const d = e.data;
    if (e.type === "model.called") {
      bars.push({ lane: 0, from: t(e) - (d.latency_ms || 0), to: t(e), step: d.step,
        label: `step ${d.step}` });
    } else if (e.type === "tool.intent") {
      open[`tool:${d.call_id}`] = { at: t(e), name: d.name,
        command: d.name === "bash" ? (d.arguments || {}).command : undefined };
    } else if (e.type === "sandbox.requested" && open[`tool:${d.call_id}`]) {
      // A sandboxed command: the bar says which.
      const o = open[`tool:${d.call_id}`];
      if (typeof o.command === "string") o.name = visible(`$ ${o.command}`).slice(0, 80);
    } else if (e.type === "sandbox.noted" || e.type === "sandbox.failed") {
      marks.push({ at: t(e), label: visible(`sandbox: ${d.text ?? d.error}`).slice(0, 300),
        kind: e.type === "sandbox.failed" ? "bad" : "resume" });
    } else if (e.type === "tool.result" && open[`tool:${d.call_id}`]) {
      const o = open[`tool:${d.call_id}`];
      bars.push({ lane: 1, from: o.at, to: t(e), label: o.name, error: d.is_error });
    } else if (e.type === "approval.requested") open[`ask:${d.call_id}`] = { at: t(e), name: d.name };
    else if (e.type === "approval.decided" && open[`ask:${d.call_id}`]) {
      const o = open[`ask:${d.call_id}`];
      bars.push({ lane: 2, from: o.at, to: t(e), label: `${d.approved ? "approved" : "denied"} by ${d.who}`,
        error: !d.approved });
      delete open[`ask:${d.call_id}`];
    } else if (e.type === "child.started") open[`child:${d.run_id}`] = { at: t(e), name: d.agent };
    else if (e.type === "child.finished" && open[`child:${d.run_id}`]) {
      // A cross-agent call: the child run's whole life, in the tools lane.
      const o = open[`child:${d.run_id}`];
      bars.push({ lane: 1, from: o.at, to: t(e), label: `child ${o.name}`,
        error: d.status !== "completed" });
      delete open[`child:${d.run_id}`];
    } else if (e.type === "timer.set") open[`timer:${d.call_id}`] = { at: t(e) };
    else if (e.type === "timer.fired" && open[`timer:${d.call_id}`]) {
      bars.push({ lane: 3, from: open[`timer:${d.call_id}`].at, to: t(e), label: "sleep" });
      delete open[`timer:${d.call_id}`];
    } else if (e.type === "run.resumed") {
      replayed = Math.max(replayed, d.replayed);
      marks.push({ at: t(e), label: `resumed: ${d.replayed} replayed`, kind: "resume" });
    } else if (e.type === "run.upgraded") {
      marks.push({ at: t(e), label: `upgraded from version ${d.from_version || "?"} to ${d.to_version}`,
        kind: "resume" });
    } else if (e.type === "run.forked") {
      // The calls above were copied from the source: replayed, not paid by this run.
      replayed = Math.max(replayed, d.calls);
      marks.push({ at: t(e), label: `forked from ${d.source} at step ${d.step}`, kind: "resume" });
    } else if (e.type === "steps.invalidated") {
      marks.push({ at: t(e), label: `invalidated from step ${d.from_step}`, kind: "bad" });
    } else if (e.type === "decision.refused") {
      marks.push({ at: t(e), label: `decision for ${d.call_id} refused: ${d.outcome}`, kind: "bad" });
    } else if (e.type === "decision.refusals_muted") {
      marks.push({ at: t(e), label: `${d.recorded} decisions refused: more not recorded`, kind: "bad" });
    } else if (e.type === "context.compacted") {
      if (d.tier === "hard") bars.push({ lane: 0, from: t(e) - (d.latency_ms || 0), to: t(e),
        step: Infinity, label: "summary" });
      marks.push({ at: t(e), label: `compacted (${d.tier}): ${d.tokens_before} -> ${d.tokens_after} tokens`,
        kind: "resume" });
    } else if (e.type === "run.completed" || e.type === "run.failed" || e.type === "toren.failed") {
      const ended = d.error_class === "cancelled" ? "cancelled" : "failed";
      marks.push({ at: t(e), label: e.type === "run.completed" ? "completed" : ended,
        kind: e.type === "run.completed" ? "end" : "bad" });
    }
  }
  const now = Date.now();
  for (const [key, o] of Object.entries(open)) {
    if (key.startsWith("ask:")) bars.push({ lane: 2, from: o.at, to: now, label: "waiting", open: true });
    if (key.startsWith("timer:")) bars.push({ lane: 3, from: o.at, to: now, label: "sleeping", open: true });
  }
  const end = Math.max(t(events[events.length - 1]), ...bars.map((b) => b.to), t0 + 1);
  const W = 1000, left = 90, laneH = 34, top = 20;
  const x = (ms) => left + ((ms - t0) / (end - t0)) * (W - left - 20);
  const lanes = ["model calls", "tools", "approvals", "timers"];
  const colour = (b) => (b.error ? "var(--bad)" : b.open ? "var(--wait)" :
    ["var(--paid)", "var(--tool)", "var(--wait)", "var(--timer)"][b.lane]);
  let svg = `<svg viewBox="0 0 ${W} ${top + laneH * 4 + 30}" role="img" aria-label="timeline">`;
  lanes.forEach((name, i) => {
    svg += `<text class="lane" x="8" y="${top + i * laneH + 20}">${name}</text>
      <line x1="${left}" x2="${W - 20}" y1="${top + i * laneH + 30}" y2="${top + i * laneH + 30}" stroke="#eef0f5"/>`;
  });
  for (const b of bars) {
    const w = Math.max(3, x(b.to) - x(b.from));
    const fill = b.lane === 0 && b.step <= replayed ? "var(--replayed)" : colour(b);
    svg += `<rect x="${x(b.from)}" y="${top + b.lane * laneH + 8}" width="${w}" height="18" rx="3"
      fill="${fill}"><title>${escShown(b.label)}</title></rect>`;
    if (w > 50) svg += `<text x="${x(b.from) + 4}" y="${top + b.lane * laneH + 21}" font-size="11" fill="#fff">${escShown(b.label)}</text>`;
  }
  for (const m of marks) {
    const stroke = m.kind === "bad" ? "var(--bad)" : m.kind === "end" ? "var(--tool)" : "var(--muted)";
    svg += `<line x1="${x(m.at)}" x2="${x(m.at)}" y1="${top}" y2="${top + laneH * 4}" stroke="${stroke}"
      stroke-dasharray="${m.kind === "resume" ? "4 3" : ""}"><title>${escShown(m.label)}</title></line>`;
  }
  svg += `<text class="lane" x="${left}" y="${top + laneH * 4 + 20}">0 s</text>
    <text class="lane" x="${W - 60}" y="${top + laneH * 4 + 20}">${((end - t0) / 1000).toFixed(1)} s</text></svg>`;
  $("timeline").innerHTML = `${svg}<div class="legend">
    <span><i class="sw paid"></i>model call, paid</span>
    <span><i class="sw replayed"></i>replayed from the journal, not re-paid</span>
    <span><i class="sw tool"></i>tool</span><span><i class="sw wait"></i>waiting on a human</span>
    <span><i class="sw timer"></i>durable timer</span>
    <span><i class="sw bad"></i>error, denial, invalidation</span></div>`;
}

start();
