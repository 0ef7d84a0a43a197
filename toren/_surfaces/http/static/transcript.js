// The run page's transcript: the conversation as a person reads it, built from the run's events
// in order. The input, what the assistant said, each tool call with its arguments and then what
// became of it (the approval asked and who decided, the sandbox it ran in, the child run it
// started, its result, errors marked), human messages, compactions, and the output or failure.
// A kind of event this page does not know (a later version's) is shown by its name and data.
//
// Every string comes from the journal and is untrusted (model output, tool results, human
// messages): it goes in as text through el() / visible(), never as HTML; a long one shows its
// first CUT characters and a "show all" button. Each entry keeps its events' raw JSON behind
// one click (a <details>, written when first opened, so a long run's page stays light).
"use strict";

const CUT = 2000;
const RAW_CUT = 20000;

// `text` in a `tag` element: its first `limit` characters, the rest behind a button.
function longText(tag, className, text, limit = CUT) {
  const full = String(text ?? "");
  const node = el(tag, className);
  if (full.length <= limit) {
    node.textContent = visible(full);
    return node;
  }
  const code = full.charCodeAt(limit - 1);
  const end = code >= 0xd800 && code <= 0xdbff ? limit - 1 : limit; // never split a pair
  node.textContent = visible(full.slice(0, end));
  const all = el("button", "show-all", `show all (${full.length.toLocaleString("en")} characters)`);
  all.type = "button";
  all.onclick = () => { node.textContent = visible(full); };
  node.append("… ", all);
  return node;
}

// An event's raw JSON, one click away.
function rawView(event) {
  const box = el("details", "raw");
  box.append(el("summary", "", "raw"));
  box.addEventListener("toggle", () => {
    if (box.open && box.children.length === 1) {
      box.append(longText("pre", "json", JSON.stringify(event, null, 2), RAW_CUT));
    }
  });
  return box;
}

function node(part) {
  return part instanceof Node ? part : el("span", "", part);
}

function when(event) {
  const at = new Date(event.at);
  return Number.isNaN(at.getTime()) ? "" : at.toLocaleTimeString();
}

function newTranscript(root) {
  return { root, cards: {}, intents: {}, cwds: {}, sandboxed: new Set(), calling: null };
}

// An entry of the transcript for one event: a heading, its parts, its raw JSON.
function entry(t, event, kind, label, ...parts) {
  const box = el("div", `entry ${kind}`);
  box.dataset.seq = String(event.seq);
  box.dataset.type = String(event.type);
  const head = el("div", "entry-head");
  head.append(el("span", "label", label), el("span", "muted", ` · #${event.seq} · ${when(event)}`));
  box.append(head, ...parts.filter((p) => p !== "" && p != null).map(node), rawView(event));
  t.root.append(box);
  return box;
}

// A tool call as the model asked for it: a card its later events add their lines to.
function callCard(t, call) {
  const card = el("div", "entry call");
  card.dataset.call = String(call.id);
  const head = el("div", "entry-head");
  head.append(el("span", "label", "Tool call "), el("code", "", call.name),
    el("span", "muted", ` · ${call.id}`));
  card.append(head, argumentsView(call));
  t.root.append(card);
  t.cards[call.id] = card;
  return card;
}

function argumentsView(call) {
  const args = call.arguments;
  if (args === null || typeof args !== "object") {
    return longText("pre", "args bad", `arguments that are not a JSON object: ${call.raw_arguments ?? ""}`);
  }
  if (call.name === "bash" && typeof args.command === "string") {
    return longText("pre", "args", `$ ${args.command}`);
  }
  return longText("pre", "args", JSON.stringify(args, null, 2));
}

// A line on a call's card for one of its events (a card is made if the call was not seen).
function step(t, event, className, ...parts) {
  const id = event.data.call_id;
  const card = t.cards[id] ?? callCard(t, { id, name: event.data.name ?? "?",
    arguments: event.data.arguments ?? {} });
  const line = el("div", `step ${className}`);
  const what = el("div", "what");
  what.append(...parts.filter((p) => p !== "" && p != null).map(node));
  line.append(what, rawView(event));
  card.append(line);
  return line;
}

function principalText(d) {
  const by = d.by;
  if (by && typeof by === "object") return `${by.name} via ${by.via} (${by.kind} ${by.id})`;
  return `${d.who ?? "?"} via ${d.channel ?? "?"}`;
}

function childLink(run, text) {
  if (!/^run\/[0-9a-f-]{36}$/.test(run || "")) return el("code", "", run);
  const a = el("a", "", text);
  a.href = `#/runs/${run.slice(4)}`;
  return a;
}

function texts(response) {
  const blocks = (response && Array.isArray(response.content)) ? response.content : [];
  return {
    text: blocks.filter((b) => b && typeof b.text === "string").map((b) => b.text).join("\n\n"),
    calls: blocks.filter((b) => b && typeof b.name === "string" && "id" in b),
  };
}

function result(t, event, d) {
  const bad = d.is_error || d.denied;
  const state = d.denied ? "denied" : d.is_error ? "error" : "result";
  if (t.sandboxed.has(d.call_id)) {
    const c = parseCommand(t.intents[d.call_id], d, t.cwds[d.call_id]);
    return step(t, event, bad ? "result bad" : "result",
      el("span", "state", c.how || state), c.cwd ? ` · ran in ${c.cwd}` : "",
      d.truncated_from ? ` · cut from ${d.truncated_from} bytes` : "",
      longText("pre", "content", c.output));
  }
  return step(t, event, bad ? "result bad" : "result", el("span", "state", state),
    d.truncated_from ? ` · cut from ${d.truncated_from} bytes` : "",
    longText("pre", "content", d.content));
}

const ENTRIES = {
  "run.started": (t, e, d) => entry(t, e, "input", `Input${d.by ? ` from ${principalText(d)}` : ""}`,
    longText("div", "text", d.input),
    d.parent ? (() => {
      const p = el("p", "muted", "a cross-agent call from ");
      p.append(childLink(d.parent, d.parent));
      return p;
    })() : ""),
  "message.received": (t, e, d) => entry(t, e, "human", `Message from ${principalText(d)}`,
    longText("div", "text", d.text)),
  "model.called": (t, e, d) => {
    const { text, calls } = texts(d.response);
    const cost = d.cost_usd == null ? "unpriced" : `$${d.cost_usd}`;
    entry(t, e, "assistant", `Assistant · step ${d.step} · ${d.model} · ${cost}`,
      text ? longText("div", "text", text) : el("p", "muted", "(tool calls only)"));
    for (const call of calls) callCard(t, call);
  },
  // A model call announced before its step is made: shown only until something answers it (a
  // call lost in flight shows as `model.lost` once the run goes on).
  "model.calling": (t, e, d) => {
    const cost = d.cost_usd == null ? "" : `, about $${d.cost_usd}`;
    t.calling = entry(t, e, "note calling", `Calling ${d.model} for step ${d.step}`,
      el("p", "muted", `about ${d.input_tokens} input tokens${cost}; no answer recorded yet ` +
        "(in flight, or lost if its worker stopped)"));
  },
  "model.lost": (t, e, d) => entry(t, e, "bad",
    `${d.count} model call(s) lost in flight at step ${d.step} · ${d.model} · ` +
    `${d.cost_usd == null ? "unpriced" : `about $${d.cost_usd}`}`,
    el("p", "muted", "its worker stopped before the answer was recorded; the provider may have " +
      "billed it; the call was made again")),
  "model.unreadable": (t, e, d) => entry(t, e, "bad", `Model answer unreadable · step ${d.step}`,
    longText("div", "text", d.error)),
  "tool.intent": (t, e, d) => {
    t.intents[d.call_id] = d;
    step(t, e, "muted", "started");
  },
  "sandbox.requested": (t, e, d) => {
    t.sandboxed.add(d.call_id);
    step(t, e, "muted", `sent to the sandbox${t.cwds[d.call_id] ? ` (in ${t.cwds[d.call_id]})` : ""}`);
  },
  "tool.result": (t, e, d) => result(t, e, d),
  "approval.requested": (t, e, d) => {
    if (d.cwd) t.cwds[d.call_id] = d.cwd;
    t.intents[d.call_id] ??= d;
    step(t, e, "ask", `approval asked${d.cwd ? ` to run it in ${d.cwd}` : ""}`);
  },
  "approval.decided": (t, e, d) => step(t, e, d.approved ? "approved" : "denied bad",
    el("span", "state", d.approved ? "approved" : "denied"), ` by ${principalText(d)}`,
    d.reason ? longText("span", "reason", `: ${d.reason}`) : ""),
  "decision.refused": (t, e, d) => step(t, e, "bad",
    `a decision (${d.approved ? "approve" : "deny"}) by ${principalText(d)} was refused: ${d.outcome}`),
  "decision.refusals_muted": (t, e, d) => step(t, e, "bad",
    `${d.recorded} decisions refused within the hour: more, until ${new Date(d.until * 1000).toLocaleTimeString()}, are refused without a record`),
  "timer.set": (t, e, d) => step(t, e, "muted", `sleeping ${d.seconds} s`),
  "timer.fired": (t, e, d) => step(t, e, "muted", "woke up"),
  "child.started": (t, e, d) => step(t, e, "child", `child run of ${d.agent}: `,
    childLink(d.run_id, d.run_id)),
  "child.approval_requested": (t, e, d) => step(t, e, "ask",
    `child run of ${d.agent} asks approval for ${d.name}: `, childLink(d.run_id, d.run_id)),
  "child.finished": (t, e, d) => step(t, e, d.status === "completed" ? "child" : "child bad",
    `child run of ${d.agent} `, el("span", "state", d.status), ` · ${d.calls_made} calls, $${d.usd_paid} `,
    childLink(d.run_id, "open"),
    d.error ? longText("pre", "content", `${d.error_class}: ${d.error}`) : ""),
  "context.compacted": (t, e, d) => entry(t, e, "note", `Context compacted (${d.tier})`,
    el("p", "", brief(e)),
    d.summary ? longText("div", "text", texts(d.summary).text) : ""),
  // A long conversation let go of its old turns (its state keeps the recent ones; the events
  // above stay in the journal, or its archive).
  "history.released": (t, e, d) => entry(t, e, "note",
    `Calls before step ${d.before_calls} settled: taken as recorded, never checked or made again`),
  "steps.invalidated": (t, e, d) => entry(t, e, "bad",
    `Steps from ${d.from_step} invalidated (made again)`, longText("div", "text", d.reason)),
  "run.resumed": (t, e, d) => entry(t, e, "note",
    `Resumed: ${d.replayed} calls replayed from the journal, not re-paid`),
  "run.retrying": (t, e, d) => entry(t, e, "note", `Attempt ${d.attempt} failed, retrying in ${d.delay} s`,
    longText("div", "text", d.error)),
  "run.retried": (t, e, d) => entry(t, e, "note", `Retried by ${principalText(d)}`),
  // A fork: the events above are a copy of the source's up to the step; what it replaced.
  "run.forked": (t, e, d) => {
    const from = el("p", "");
    from.append("Forked from ", childLink(d.source, d.source), ` at step ${d.step} by ` +
      `${principalText(d)}: ${d.calls} call(s) above copied and replayed, not paid again` +
      `${d.upgrade ? "; on the agent's current version" : ""}`);
    entry(t, e, "note", "Forked", from,
      d.message != null ? longText("div", "text", `the last message replaced by: ${d.message}`) : "",
      d.input != null ? longText("div", "text", `the input replaced by: ${d.input}`) : "");
  },
  "sandbox.noted": (t, e, d) => entry(t, e, "note", "Sandbox", longText("div", "text", d.text)),
  "sandbox.failed": (t, e, d) => entry(t, e, "bad", "Sandbox failed", longText("div", "text", d.error)),
  "callees.described": (t, e, d) => entry(t, e, "note",
    `Agents it may call: ${Object.keys(d.descriptions || {}).join(", ")}`),
  "run.completed": (t, e, d) => entry(t, e, "output", "Output", longText("div", "text", d.output)),
  "run.failed": (t, e, d) => entry(t, e, "bad",
    `${d.error_class === "cancelled" ? "Cancelled" : `Failed (${d.error_class})`}` +
      `${d.by ? `, by ${principalText(d)}` : ""}`,
    longText("div", "text", d.message)),
  "toren.failed": (t, e, d) => entry(t, e, "bad", `Failed (${d.error_class})`,
    longText("div", "text", d.error)),
};

// What answers an announced model call, or ends its wait (a summary's call is a hard
// compaction's; a soft one makes no call).
const ANSWERS = new Set(["model.calling", "model.called", "model.lost", "model.unreadable",
  "run.retrying", "run.completed", "run.failed", "toren.failed"]);
function answers(event, d) {
  return ANSWERS.has(event.type) || (event.type === "context.compacted" && d.tier === "hard");
}

// Adds one event to transcript `t`. An event this page cannot read as its kind says (an
// unknown kind, or fields of an unexpected shape) is shown by its name and data.
function addToTranscript(t, event) {
  const d = event.data && typeof event.data === "object" ? event.data : {};
  if (t.calling && answers(event, d)) {
    t.calling.remove();
    t.calling = null;
  }
  const render = Object.hasOwn(ENTRIES, event.type) ? ENTRIES[event.type] : null;
  if (render) {
    try {
      render(t, event, d);
      return;
    } catch (e) {
      console.warn(`event ${event.seq} (${event.type}) shown as data:`, e);
    }
  }
  entry(t, event, "other", String(event.type), longText("code", "", JSON.stringify(d), 300));
}
