// Peregrine's chat page: how messages, errors, JSON answers and tool calls are drawn (loaded before chat.js,
// which calls these; both are classic deferred scripts sharing the page's globals).
"use strict";

// --- rendering --------------------------------------------------------------------------------------------

function element(tag, cls, text) {
  const el = document.createElement(tag);
  if (cls) el.className = cls;
  if (text !== undefined) el.textContent = text;  // textContent only: model output is never parsed as HTML
  return el;
}

function addMessage(role, text) {
  const box = element("div", `msg ${role}`);
  box.append(element("div", "role", role), element("div", "content", text || ""));
  $("messages").append(box);
  scrollDown();
  return box;
}

function scrollDown() {
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

function showError(err, what) {
  const box = element("div", "msg error-box");
  box.dataset.status = err.status || "";
  box.append(element("div", "role", what || "Error"), element("div", "content", err.message));
  const detail = [err.status && `HTTP ${err.status}`, err.type, err.code && `code ${err.code}`,
    err.param && `param ${err.param}`, err.retryAfter && `retry after ${err.retryAfter} s`].filter(Boolean);
  if (detail.length) box.append(element("div", "detail", detail.join(" · ")));
  $("messages").append(box);
  scrollDown();
}

/** A JSON answer (the whole text, or one fenced ```json block) as parsed data; otherwise undefined. */
function jsonAnswer(text) {
  const fenced = /^\s*```(?:json)?\s*\n([\s\S]*?)\n```\s*$/.exec(text);
  const body = (fenced ? fenced[1] : text).trim();
  if (!/^[[{]/.test(body)) return undefined;
  try { return JSON.parse(body); } catch (_) { return undefined; }
}

function pretty(value) { return JSON.stringify(value, null, 2); }

function renderJSON(box, text) {
  const data = jsonAnswer(text);
  if (data === undefined) return;
  const content = box.querySelector(".content");
  content.replaceChildren(element("span", "badge", "JSON"), element("pre", "json", pretty(data)));
}

function renderToolCalls(box, calls) {
  box.querySelectorAll(".tool-call").forEach((el) => el.remove());
  for (const call of calls) {
    const fn = call.function || {};
    const div = element("div", "tool-call");
    div.append(element("span", "badge", "tool call"), document.createTextNode(" "),
      element("span", "name", fn.name || "(unnamed)"));
    if (call.id) div.append(element("span", "muted small", `  ${call.id}`));
    let args = fn.arguments || "";
    try { args = pretty(JSON.parse(args)); } catch (_) { /* partial or not JSON: show as sent */ }
    div.append(element("pre", "", args));
    box.querySelector(".content").after(div);
  }
  scrollDown();
}
