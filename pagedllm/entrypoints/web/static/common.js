// Shared by the chat page and the dashboard: API-key handling, authenticated fetch, a safe Markdown
// renderer. The key lives in sessionStorage only and travels in the Authorization header, never in a URL.
"use strict";

const KEY_STORAGE = "pagedllm.apiKey";

const Api = {
  key() { return sessionStorage.getItem(KEY_STORAGE) || ""; },
  setKey(k) { if (k) sessionStorage.setItem(KEY_STORAGE, k); else sessionStorage.removeItem(KEY_STORAGE); },
  headers(extra) {
    const h = Object.assign({}, extra || {});
    const k = Api.key();
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  },
  /** fetch with the key; on 401 shows the key prompt and throws (the caller retries after onKey). */
  async fetch(path, opts) {
    const o = Object.assign({}, opts || {});
    o.headers = Api.headers(o.headers);
    const r = await fetch(path, o);
    if (r.status === 401) {
      KeyPrompt.show(Api.key() ? "That API key was refused." : "This server requires an API key.");
      throw new ApiError(401, "Unauthorized");
    }
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try { const b = await r.json(); if (b && b.error && b.error.message) msg = b.error.message; } catch (e) { /* not JSON */ }
      throw new ApiError(r.status, msg);
    }
    return r;
  },
};

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

const KeyPrompt = {
  onKey: null,
  show(reason) {
    const box = document.getElementById("key-prompt");
    document.getElementById("key-reason").textContent = reason;
    box.hidden = false;
    document.getElementById("key-input").focus();
  },
  init(onKey) {
    KeyPrompt.onKey = onKey;
    document.getElementById("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const input = document.getElementById("key-input");
      Api.setKey(input.value.trim());
      input.value = "";
      document.getElementById("key-prompt").hidden = true;
      if (KeyPrompt.onKey) KeyPrompt.onKey();
    });
  },
};

// ---- Markdown: builds DOM nodes with textContent only (no innerHTML anywhere), so model output can never
// inject markup: "<script>" or "<img onerror=...>" stays text. Supports fenced code blocks, headings,
// lists, paragraphs, inline `code`, **bold** and *italic*.
const Markdown = {
  render(text, container) {
    container.replaceChildren();
    const lines = String(text).split("\n");
    let i = 0;
    let para = [];
    const flushPara = () => {
      if (para.length) {
        const p = document.createElement("p");
        Markdown.inline(para.join("\n"), p);
        container.appendChild(p);
        para = [];
      }
    };
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(/^\s*```\s*([\w+-]*)\s*$/);
      if (fence) {
        flushPara();
        const code = [];
        i++;
        while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) code.push(lines[i++]);
        i++; // closing fence (or end of a still-streaming block)
        const pre = document.createElement("pre");
        const c = document.createElement("code");
        if (fence[1]) c.dataset.lang = fence[1];
        c.textContent = code.join("\n");
        pre.appendChild(c);
        container.appendChild(pre);
        continue;
      }
      const heading = line.match(/^(#{1,6})\s+(.*)$/);
      if (heading) {
        flushPara();
        const h = document.createElement("h" + Math.min(heading[1].length + 2, 6));
        Markdown.inline(heading[2], h);
        container.appendChild(h);
        i++;
        continue;
      }
      const item = line.match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
      if (item) {
        flushPara();
        const ordered = /\d/.test(item[1]);
        const list = document.createElement(ordered ? "ol" : "ul");
        while (i < lines.length) {
          const m = lines[i].match(/^\s*([-*+]|\d+[.)])\s+(.*)$/);
          if (!m || /\d/.test(m[1]) !== ordered) break;
          const li = document.createElement("li");
          Markdown.inline(m[2], li);
          list.appendChild(li);
          i++;
        }
        container.appendChild(list);
        continue;
      }
      if (line.trim() === "") flushPara(); else para.push(line);
      i++;
    }
    flushPara();
  },
  inline(text, parent) {
    const re = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\n]+\*)/g;
    let last = 0;
    let m;
    while ((m = re.exec(text)) !== null) {
      if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
      const tok = m[0];
      let el;
      if (tok.startsWith("`")) { el = document.createElement("code"); el.textContent = tok.slice(1, -1); }
      else if (tok.startsWith("**")) { el = document.createElement("strong"); el.textContent = tok.slice(2, -2); }
      else { el = document.createElement("em"); el.textContent = tok.slice(1, -1); }
      parent.appendChild(el);
      last = m.index + tok.length;
    }
    if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
  },
};
