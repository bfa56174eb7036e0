// Chat page: streams /v1/chat/completions, keeps conversations in localStorage, renders answers with the
// safe Markdown renderer (common.js). Stop aborts the fetch; the server sees the disconnect and aborts the
// request in the engine.
"use strict";

const STORE = "pagedllm.conversations";
const CURRENT = "pagedllm.current";
const SETTINGS = "pagedllm.settings";
const $ = (id) => document.getElementById(id);

const state = { convs: [], current: null, controller: null };

function load() {
  try { state.convs = JSON.parse(localStorage.getItem(STORE) || "[]"); } catch (e) { state.convs = []; }
  state.current = state.convs.find((c) => c.id === localStorage.getItem(CURRENT)) || null;
  try {
    const s = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
    for (const id of ["system", "temperature", "top-p", "max-tokens"]) if (s[id] !== undefined) $(id).value = s[id];
  } catch (e) { /* ignore bad settings */ }
}

function save() {
  localStorage.setItem(STORE, JSON.stringify(state.convs));
  if (state.current) localStorage.setItem(CURRENT, state.current.id);
  const s = {};
  for (const id of ["system", "temperature", "top-p", "max-tokens"]) s[id] = $(id).value;
  localStorage.setItem(SETTINGS, JSON.stringify(s));
}

function newConversation() {
  const c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 8), title: "New chat", messages: [] };
  state.convs.unshift(c);
  state.current = c;
  save();
  renderAll();
}

function renderSidebar() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of state.convs) {
    const li = document.createElement("li");
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = c.title;
    b.className = c === state.current ? "active" : "";
    b.addEventListener("click", () => { if (!state.controller) { state.current = c; save(); renderAll(); } });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.title = "Delete";
    del.textContent = "\u00d7";
    del.addEventListener("click", () => {
      if (state.controller) return;
      state.convs = state.convs.filter((x) => x !== c);
      if (state.current === c) state.current = state.convs[0] || null;
      save();
      renderAll();
    });
    li.append(b, del);
    ul.appendChild(li);
  }
}

function messageElement(msg) {
  const div = document.createElement("div");
  div.className = "msg " + msg.role;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = msg.role;
  const content = document.createElement("div");
  content.className = "content";
  if (msg.role === "assistant") Markdown.render(msg.content, content); else content.textContent = msg.content;
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = msg.stats || "";
  div.append(role, content, stats);
  return div;
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  if (!state.current) return;
  for (const m of state.current.messages) box.appendChild(messageElement(m));
  box.scrollTop = box.scrollHeight;
}

function renderAll() { renderSidebar(); renderMessages(); }

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("prompt").disabled = busy;
}

async function loadModels() {
  try {
    const r = await Api.fetch("/v1/models");
    const body = await r.json();
    const sel = $("model");
    const prev = sel.value;
    sel.replaceChildren();
    for (const m of body.data) {
      const o = document.createElement("option");
      o.value = m.id;
      o.textContent = m.id;
      sel.appendChild(o);
    }
    if (prev) sel.value = prev;
    $("status").textContent = "";
  } catch (e) {
    $("status").textContent = e.status === 401 ? "API key required" : "Cannot list models: " + e.message;
  }
}

function number(id, parse) { const v = parse($(id).value); return Number.isFinite(v) ? v : undefined; }

async function send(text) {
  if (!state.current) newConversation();
  const conv = state.current;
  conv.messages.push({ role: "user", content: text });
  if (conv.title === "New chat") conv.title = text.slice(0, 40);
  const answer = { role: "assistant", content: "", stats: "" };
  conv.messages.push(answer);
  save();
  renderAll();
  const el = $("messages").lastElementChild;
  const contentEl = el.querySelector(".content");
  const statsEl = el.querySelector(".stats");
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of conv.messages.slice(0, -1)) messages.push({ role: m.role, content: m.content });
  const body = {
    model: $("model").value || undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    temperature: number("temperature", parseFloat),
    top_p: number("top-p", parseFloat),
    max_tokens: number("max-tokens", (v) => parseInt(v, 10)),
  };
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const t0 = performance.now();
  let tFirst = null;
  let tLast = null;
  let chunks = 0;
  let usageTokens = null;
  let pending = false;
  const paint = () => {
    pending = false;
    Markdown.render(answer.content, contentEl);
    $("messages").scrollTop = $("messages").scrollHeight;
  };
  const rate = () => {
    const n = usageTokens !== null ? usageTokens : chunks;
    const secs = tFirst !== null && tLast > tFirst ? (tLast - tFirst) / 1000 : 0;
    const parts = [n + " tokens"];
    if (secs > 0 && n > 1) parts.push(((n - 1) / secs).toFixed(1) + " tok/s");
    if (tFirst !== null) parts.push("TTFT " + ((tFirst - t0) / 1000).toFixed(2) + " s");
    return parts.join(" \u00b7 ");
  };
  try {
    const r = await Api.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new ApiError(chunk.error.code || 500, chunk.error.message);
          if (chunk.usage) usageTokens = chunk.usage.completion_tokens;
          const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (delta && delta.content) {
            const now = performance.now();
            if (tFirst === null) tFirst = now;
            tLast = now;
            chunks++;
            answer.content += delta.content;
            if (!pending) { pending = true; requestAnimationFrame(paint); }
            statsEl.textContent = rate();
          }
        }
      }
    }
    answer.stats = rate();
  } catch (e) {
    if (e.name === "AbortError") answer.stats = rate() + " \u00b7 stopped";
    else answer.stats = "Error: " + e.message;
  } finally {
    state.controller = null;
    setBusy(false);
    paint();
    statsEl.textContent = answer.stats;
    save();
    $("prompt").focus();
  }
}

function init() {
  load();
  KeyPrompt.init(loadModels);
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || state.controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
  $("new-chat").addEventListener("click", () => { if (!state.controller) newConversation(); });
  for (const id of ["system", "temperature", "top-p", "max-tokens"]) $(id).addEventListener("change", save);
  renderAll();
  loadModels();
}

init();
