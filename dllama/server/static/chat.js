// The chat page of `dllama serve`: no build step, no dependency. It talks to the server's own
// OpenAI-compatible API (streamed /v1/chat/completions) and polls /status for the cluster panel.
//
// Safety: model output is untrusted. Every piece of it reaches the page as a text node
// (textContent / createTextNode) inside elements this script creates; innerHTML is never used.
"use strict";

const STORE = {conversation: "dllama.conversation.v1", settings: "dllama.settings.v1", apiKey: "dllama.apiKey"};
const STATUS_EVERY_MS = 2000;

const $ = (id) => document.getElementById(id);
const ui = {
  messages: $("messages"), emptyHint: $("empty-hint"), composer: $("composer"), prompt: $("prompt"),
  send: $("send"), stop: $("stop"), newChat: $("new-chat"), system: $("system-prompt"),
  temperature: $("temperature"), maxTokens: $("max-tokens"), apiKey: $("api-key"), settings: $("settings"),
  statusPanel: $("status"), statusLine: $("status-line"), statusNodes: $("status-nodes"),
  statusFigures: $("status-figures"), healthDot: $("health-dot"), modelName: $("model-name"),
};

// ------------------------------------------------------------------ storage

function load(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch (e) {  // storage disabled or a corrupt entry: start afresh rather than not at all
    return fallback;
  }
}

function save(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
  } catch (e) { /* full or disabled: the page still works, it just forgets */ }
}

// messages: [{role: "user"|"assistant", content, stopped?, error?}]
let conversation = load(STORE.conversation, {messages: []});
if (!conversation || !Array.isArray(conversation.messages)) conversation = {messages: []};

function saveConversation() { save(STORE.conversation, conversation); }

function loadSettings() {
  const s = load(STORE.settings, {});
  if (typeof s.system === "string") ui.system.value = s.system;
  if (typeof s.temperature === "number") ui.temperature.value = String(s.temperature);
  if (typeof s.maxTokens === "number") ui.maxTokens.value = String(s.maxTokens);
  ui.apiKey.value = load(STORE.apiKey, "") || "";
}

function saveSettings() {
  save(STORE.settings, {system: ui.system.value, temperature: numberOf(ui.temperature, 0.7),
                        maxTokens: Math.round(numberOf(ui.maxTokens, 512))});
  save(STORE.apiKey, ui.apiKey.value.trim());
}

function numberOf(input, fallback) {
  const v = parseFloat(input.value);
  return Number.isFinite(v) ? v : fallback;
}

function authHeaders() {
  const key = ui.apiKey.value.trim();
  return key ? {"Authorization": "Bearer " + key} : {};
}

// ------------------------------------------------------------------ safe markdown
// A small subset: fenced code blocks, headings, bullet and numbered lists, paragraphs, and inline
// **bold**, *italic*, `code`. Every string ends up in a text node.

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

const FENCE = /^\s*(```+|~~~+)\s*([\w+#.-]*)\s*$/;
const LIST_ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
// __bold__ only outside words, as in CommonMark: window.__name or a__b stays text
const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*([^*\n]+?)\*\*|(?<!\w)__([^_\n]+?)__(?!\w)|\*([^*\s][^*\n]*?)\*/g;

function renderMarkdown(text) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {  // until the closing fence, or the end (an answer still streaming)
      const body = [];
      i++;
      while (i < lines.length && !(lines[i].trim().startsWith(fence[1]) && FENCE.test(lines[i]))) body.push(lines[i++]);
      i++;
      const pre = el("pre");
      if (fence[2]) pre.dataset.lang = fence[2];
      pre.appendChild(el("code", "", body.join("\n")));
      out.appendChild(pre);
      continue;
    }
    if (!line.trim()) { i++; continue; }
    const heading = HEADING.exec(line);
    if (heading) {
      const h = el("h" + Math.min(heading[1].length + 2, 6));
      appendInline(h, heading[2]);
      out.appendChild(h);
      i++;
      continue;
    }
    const item = LIST_ITEM.exec(line);
    if (item) {
      const ordered = /\d/.test(item[1][0]);
      const list = el(ordered ? "ol" : "ul");
      if (ordered) list.start = parseInt(item[1], 10);
      let m;
      while (i < lines.length && (m = LIST_ITEM.exec(lines[i])) && /\d/.test(m[1][0]) === ordered) {
        const li = el("li");
        appendInline(li, m[2]);
        list.appendChild(li);
        i++;
      }
      out.appendChild(list);
      continue;
    }
    const para = [];
    while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !LIST_ITEM.test(lines[i]) &&
           !HEADING.test(lines[i])) para.push(lines[i++]);
    const p = el("p");
    appendInline(p, para.join("\n"));
    out.appendChild(p);
  }
  return out;
}

function appendInline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    if (m[1]) parent.appendChild(el("code", "", m[2].trim() ? m[2].replace(/^ (.*) $/s, "$1") : m[2]));
    else if (m[3] || m[4]) parent.appendChild(el("strong", "", m[3] || m[4]));
    else parent.appendChild(el("em", "", m[5]));
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

// ------------------------------------------------------------------ the conversation

function messageNode(msg) {
  const node = el("article", "msg " + (msg.error ? "error" : msg.role));
  node.appendChild(el("div", "who", msg.error ? "error" : msg.role === "user" ? "you" : "assistant"));
  const content = el("div", "content");
  fillContent(content, msg);
  node.appendChild(content);
  return node;
}

function fillContent(content, msg) {
  content.replaceChildren();
  if (msg.error) content.textContent = msg.error;
  else if (msg.role === "user") content.textContent = msg.content;  // the user's words, as typed
  else content.appendChild(renderMarkdown(msg.content));
  if (msg.stopped) content.appendChild(el("p", "note", "(stopped)"));
}

function renderConversation() {
  ui.messages.replaceChildren(ui.emptyHint);
  ui.emptyHint.hidden = conversation.messages.length > 0;
  for (const msg of conversation.messages) ui.messages.appendChild(messageNode(msg));
  scrollToEnd();
}

function scrollToEnd() {
  ui.messages.scrollTop = ui.messages.scrollHeight;
  if (window.matchMedia("(max-width: 760px)").matches) window.scrollTo(0, document.body.scrollHeight);
}

let inFlight = null;  // the AbortController of the answer streaming now

function setStreaming(on) {
  ui.send.hidden = on;
  ui.stop.hidden = !on;
  ui.messages.classList.toggle("streaming", on);
}

function requestMessages() {
  const out = [];
  const system = ui.system.value.trim();
  if (system) out.push({role: "system", content: system});
  for (const m of conversation.messages) {
    if (!m.error && m.content) out.push({role: m.role, content: m.content});
  }
  return out;
}

async function send(text) {
  saveSettings();
  conversation.messages.push({role: "user", content: text});
  const answer = {role: "assistant", content: ""};
  conversation.messages.push(answer);
  saveConversation();
  renderConversation();
  const content = ui.messages.lastElementChild.querySelector(".content");
  let pending = false;  // one render per animation frame, however many pieces arrive
  const render = () => {
    pending = false;
    fillContent(content, answer);
    saveConversation();
    scrollToEnd();
  };
  const controller = new AbortController();
  inFlight = controller;
  setStreaming(true);
  try {
    const body = {messages: requestMessages(), stream: true,  // the empty answer is left out
                  temperature: numberOf(ui.temperature, 0.7),
                  max_tokens: Math.max(1, Math.round(numberOf(ui.maxTokens, 512)))};
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: {"Content-Type": "application/json", ...authHeaders()}, body: JSON.stringify(body)});
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const event of sseEvents(resp.body)) {
      if (event.error) throw new Error(event.error.message || "the server reported an error");
      const piece = event.choices && event.choices[0] && event.choices[0].delta && event.choices[0].delta.content;
      if (piece) {
        answer.content += piece;
        if (!pending) { pending = true; requestAnimationFrame(render); }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      answer.stopped = true;  // closing the connection is what cancels the generation on the server
    } else if (!answer.content) {
      answer.error = e.message;
    } else {
      answer.stopped = true;
      conversation.messages.push({role: "assistant", content: "", error: e.message});
    }
  } finally {
    inFlight = null;
    setStreaming(false);
    saveConversation();
    renderConversation();
    pollStatus();  // the panel shows this answer's speed at once
  }
}

async function errorText(resp) {
  let message = `HTTP ${resp.status}`;
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) message += ": " + body.error.message;
  } catch (e) { /* not JSON */ }
  if (resp.status === 401) {
    ui.settings.open = true;
    ui.apiKey.focus();
    message += " Enter the server's API key in Settings.";
  }
  return message;
}

// Server-sent events from a fetch body: yields each event's data, parsed ("[DONE]" ends it).
async function* sseEvents(stream) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buffer = (buffer + decoder.decode(value, {stream: true})).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
        if (!data.length) continue;
        const text = data.join("\n");
        if (text === "[DONE]") return;
        yield JSON.parse(text);
      }
    }
  } finally {
    reader.releaseLock();
  }
}

// ------------------------------------------------------------------ the status panel

function fmt(value, digits, unit) {
  return typeof value === "number" && Number.isFinite(value) ? value.toFixed(digits) + (unit || "") : "–";
}

function figure(term, value) {
  ui.statusFigures.appendChild(el("dt", "", term));
  ui.statusFigures.appendChild(el("dd", "", value));
}

function showStatus(s) {
  ui.healthDot.className = "dot " + (s.status === "ok" ? "ok" : s.status === "loading" ? "loading" : "bad");
  ui.modelName.textContent = s.model || "";
  const nodes = Array.isArray(s.nodes) ? s.nodes : [];
  const up = nodes.filter((n) => n.up).length;
  ui.statusLine.textContent = s.status === "loading" ? "loading the model…" :
    `${s.status}: ${up} of ${nodes.length} node${nodes.length === 1 ? "" : "s"} up` + (s.error ? ` (${s.error})` : "");
  ui.statusNodes.replaceChildren();
  for (const n of nodes) {
    const li = el("li", "node " + (n.up ? "up" : "down"));
    const head = el("div", "node-head");
    head.appendChild(el("span", "dot " + (n.up ? "ok" : "bad")));
    head.appendChild(el("strong", "", n.address ? n.node.replace(/\s*\(.*\)$/, "") : n.node));
    head.appendChild(el("span", "addr", n.address || "this server"));
    li.appendChild(head);
    const figures = el("div", "node-figures");
    for (const part of [n.up ? "up" : "down", `share ${fmt(n.share * 100, 0, "%")}`,
                        fmt(n.ms_per_token, 1, " ms/token"), `RSS ${fmt(n.rss_mb, 0, " MB")}`]) {
      figures.appendChild(el("span", "", part));
    }
    li.appendChild(figures);
    ui.statusNodes.appendChild(li);
  }
  ui.statusFigures.replaceChildren();
  if (s.sync) figure("sync", `${s.sync} · ${s.sync_mode} · ${s.sync_dtype}`);
  const last = s.last_answer;
  if (last) {
    const ms = last.ms_per_token || {};
    const split = ms.compute + ms.sync;
    figure("last answer", `${fmt(last.tokens_per_s, 1, " tok/s")} · ${last.tokens} tokens`);
    figure("per token", `${fmt(ms.total, 1, " ms")}: compute ${fmt(ms.compute, 1, " ms")}` +
      (split > 0 ? ` (${fmt(100 * ms.compute / split, 0, "%")})` : "") + ` · sync ${fmt(ms.sync, 1, " ms")}`);
    figure("prompt", fmt(last.prefill_tokens_per_s, 1, " tok/s"));
  } else {
    figure("last answer", "none yet");
  }
  const spec = s.speculation;
  if (spec && spec.drafted > 0) {
    figure("drafts kept", `${fmt(100 * spec.accepted / spec.drafted, 0, "%")} of ${spec.drafted} · ` +
      `${fmt(1 + spec.accepted / spec.verifications, 2, " tokens")} per verifying step`);
  }
  if (typeof s.queue_length === "number") figure("queue", `${s.queue_length} waiting · ${s.running} running`);
  if (s.context) figure("context", `${s.context} tokens`);
  if (s.last_event) figure("last event", s.last_event);
  if (typeof s.max_tokens_limit === "number") ui.maxTokens.max = String(s.max_tokens_limit);
}

let statusTimer = null;

async function pollStatus() {
  clearTimeout(statusTimer);
  if (!document.hidden) {
    try {
      const resp = await fetch("/status", {headers: authHeaders(), cache: "no-store"});
      if (resp.status === 401) {
        ui.healthDot.className = "dot bad";
        ui.statusLine.textContent = "This server needs an API key: enter it in Settings.";
        ui.statusNodes.replaceChildren();
        ui.statusFigures.replaceChildren();
      } else if (resp.ok) {
        showStatus(await resp.json());
      } else {
        ui.statusLine.textContent = await errorText(resp);
      }
    } catch (e) {
      ui.healthDot.className = "dot bad";
      ui.statusLine.textContent = "The server does not answer.";
    }
  }
  statusTimer = setTimeout(pollStatus, STATUS_EVERY_MS);
}

// ------------------------------------------------------------------ wiring

ui.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = ui.prompt.value.trim();
  if (!text || inFlight) return;
  ui.prompt.value = "";
  send(text);
});
ui.prompt.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    ui.composer.requestSubmit();
  }
});
$("settings-form").addEventListener("submit", (e) => { e.preventDefault(); saveSettings(); pollStatus(); });
ui.stop.addEventListener("click", () => { if (inFlight) inFlight.abort(); });
ui.newChat.addEventListener("click", () => {
  if (inFlight) inFlight.abort();
  conversation = {messages: []};
  saveConversation();
  renderConversation();
  ui.prompt.focus();
});
for (const input of [ui.system, ui.temperature, ui.maxTokens]) input.addEventListener("change", saveSettings);
ui.apiKey.addEventListener("change", () => { saveSettings(); pollStatus(); });
document.addEventListener("visibilitychange", () => { if (!document.hidden) pollStatus(); });

// on a phone the panels start folded: the conversation comes first
if (window.matchMedia("(max-width: 760px)").matches) {
  ui.settings.open = false;
  ui.statusPanel.open = false;
}
loadSettings();
renderConversation();
pollStatus();
