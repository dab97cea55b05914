// Peregrine's chat page: plain browser JavaScript, no build step, no CDN.
//
// Every URL is relative to the page (`v1/models`, `v1/chat/completions`), so the page works behind a proxy
// prefix (--root-path). Answers stream over server-sent events read with fetch(); Stop aborts the fetch,
// which closes the connection, and the server aborts the request in the engine. With auth on, the API key
// lives in sessionStorage: it is gone when the tab closes and never written to localStorage or a cookie.
"use strict";

const KEY_SLOT = "peregrine.apiKey";
const $ = (id) => document.getElementById(id);

const state = {
  history: [],          // the conversation sent with each request (OpenAI message objects)
  controller: null,     // the AbortController of the answer being streamed, if any
  models: [],
};

// --- API access -------------------------------------------------------------------------------------------

function apiKey() { return sessionStorage.getItem(KEY_SLOT) || ""; }

function headers(json) {
  const h = json ? { "Content-Type": "application/json" } : {};
  if (apiKey()) h.Authorization = "Bearer " + apiKey();
  return h;
}

class ApiError extends Error {
  constructor(status, envelope, fallback) {
    const err = (envelope && envelope.error) || {};
    super(err.message || fallback || `HTTP ${status}`);
    this.status = status;
    this.type = err.type || null;
    this.code = err.code ?? null;
    this.param = err.param || null;
  }
}

async function errorFrom(resp) {
  const text = await resp.text();
  let envelope = null;
  try { envelope = JSON.parse(text); } catch (_) { /* not JSON: show the start of the text */ }
  const err = new ApiError(resp.status, envelope, `HTTP ${resp.status} ${resp.statusText}: ${text.slice(0, 300)}`);
  const retry = resp.headers.get("Retry-After");
  if (retry) err.retryAfter = retry;
  if (resp.status === 401) askForKey(err.message);
  return err;
}

async function getJSON(path) {
  const resp = await fetch(path, { headers: headers(false) });
  if (!resp.ok) throw await errorFrom(resp);
  return resp.json();
}

// --- models -----------------------------------------------------------------------------------------------

function isChatModel(m) {
  const type = (m.custom_metadata && m.custom_metadata.model_type) || m.model_type || "llm";
  return type === "llm";
}

function modelLabel(m) {
  return m.state && m.state !== "loaded" ? `${m.id} (${m.state.replace(/_/g, " ")})` : m.id;
}

async function loadModels() {
  const select = $("model");
  const previous = select.value;
  try {
    const list = await getJSON("v1/models");
    state.models = (list.data || []).filter(isChatModel);
  } catch (err) {
    $("model-state").textContent = "";
    if (err.status !== 401) showError(err, "Could not list the models");
    return;
  }
  select.replaceChildren(...state.models.map((m) => new Option(modelLabel(m), m.id)));
  if (state.models.some((m) => m.id === previous)) select.value = previous;
  showModelState();
}

function showModelState() {
  const m = state.models.find((x) => x.id === $("model").value);
  const parts = [];
  if (m && m.max_model_len) parts.push(`context ${m.max_model_len}`);
  if (m && m.state) parts.push(m.state.replace(/_/g, " "));
  $("model-state").textContent = parts.join(" · ");
}

// --- the API key ------------------------------------------------------------------------------------------

function askForKey(message) {
  $("key-form").hidden = false;
  $("key-error").textContent = apiKey() ? message || "The key was refused." : "";
  $("api-key").focus();
}

function useKey(event) {
  event.preventDefault();
  const key = $("api-key").value.trim();
  if (!key) return;
  sessionStorage.setItem(KEY_SLOT, key);
  $("api-key").value = "";
  $("key-form").hidden = true;
  $("forget-key").hidden = false;
  loadModels();
}

function forgetKey() {
  sessionStorage.removeItem(KEY_SLOT);
  $("forget-key").hidden = true;
  askForKey();
}

// --- streaming --------------------------------------------------------------------------------------------

/** Yields the `data:` payload of each server-sent event in the response body. */
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;  // comment lines (": ping") carry no data
    }
  }
}

/** Folds streamed chunks into one assistant message: content, tool calls, finish reason, usage. */
class Answer {
  constructor(box) {
    this.box = box;
    this.content = "";
    this.toolCalls = [];
    this.finishReason = null;
    this.usage = null;
  }

  add(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    const choice = (chunk.choices || [])[0];
    if (!choice) return;
    const delta = choice.delta || {};
    if (delta.content) {
      this.content += delta.content;
      this.box.querySelector(".content").textContent = this.content;
      scrollDown();
    }
    if (delta.tool_calls) this.addToolCalls(delta.tool_calls);
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
  }

  addToolCalls(deltas) {
    for (const d of deltas) {
      const i = d.index ?? this.toolCalls.length;
      const call = this.toolCalls[i] || (this.toolCalls[i] = { id: "", type: "function", function: { name: "", arguments: "" } });
      if (d.id) call.id = d.id;
      if (d.type) call.type = d.type;
      if (d.function && d.function.name) call.function.name += d.function.name;
      if (d.function && d.function.arguments) call.function.arguments += d.function.arguments;
    }
    renderToolCalls(this.box, this.toolCalls.filter(Boolean));
  }

  note(text) {
    let el = this.box.querySelector(".note");
    if (!el) { el = element("div", "note muted small"); this.box.querySelector(".content").before(el); }
    el.textContent = text;
    el.hidden = !text;
  }

  message() {
    const msg = { role: "assistant", content: this.content };
    const calls = this.toolCalls.filter(Boolean);
    if (calls.length) msg.tool_calls = calls;
    return msg;
  }
}

function requestBody(model) {
  const body = {
    model,
    messages: [...systemMessage(), ...state.history],
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number($("temperature").value),
    top_p: Number($("top-p").value),
  };
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens) body.max_tokens = Number(maxTokens);
  const extra = $("extra").value.trim();
  if (extra) {
    let fields;
    try { fields = JSON.parse(extra); } catch (e) { throw new ApiError(0, null, `Extra request fields: not valid JSON (${e.message})`); }
    if (!fields || typeof fields !== "object" || Array.isArray(fields)) throw new ApiError(0, null, "Extra request fields must be a JSON object");
    Object.assign(body, fields);
  }
  return body;
}

function systemMessage() {
  const text = $("system").value.trim();
  return text ? [{ role: "system", content: text }] : [];
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  const model = $("model").value;
  if (!text || state.controller) return;
  if (!model) { showError(new ApiError(0, null, "No model to talk to: the model list is empty or did not load.")); return; }
  let body;
  state.history.push({ role: "user", content: text });
  try {
    body = requestBody(model);
  } catch (err) {
    state.history.pop();
    showError(err);
    return;
  }
  $("prompt").value = "";
  addMessage("user", text);
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const answer = new Answer(box);
  const started = performance.now();
  setBusy(new AbortController());
  try {
    await stream(body, answer);
    finish(box, answer, started, answer.finishReason || "stop");
  } catch (err) {
    if (err.name === "AbortError") {
      finish(box, answer, started, "stopped");
    } else {
      box.classList.remove("streaming");
      if (!answer.content && !answer.toolCalls.length) { box.remove(); state.history.pop(); }
      showError(err);
    }
  } finally {
    setBusy(null);
    if ((box.isConnected && answer.content) || answer.toolCalls.length) state.history.push(answer.message());
    loadModels();  // a model may have been loaded on demand
  }
}

const RETRIED_CODES = new Set(["model_loading", "memory_budget_busy"]);  // 503s that say when to come back

async function stream(body, answer) {
  const signal = state.controller.signal;
  let resp;
  for (;;) {
    resp = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(true), body: JSON.stringify(body), signal,
    });
    if (resp.ok) break;
    const err = await errorFrom(resp);
    if (resp.status !== 503 || !err.retryAfter || !RETRIED_CODES.has(err.code)) throw err;
    answer.note(`${err.message} Retrying in ${err.retryAfter} s…`);  // e.g. the model is loading
    await sleep(Number(err.retryAfter) * 1000, signal);
  }
  answer.note("");
  for await (const data of sseData(resp.body)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(0, chunk, "error in the stream");
    answer.add(chunk);
  }
}

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener("abort", () => { clearTimeout(timer); reject(new DOMException("stopped", "AbortError")); },
      { once: true });
  });
}

function finish(box, answer, started, reason) {
  box.classList.remove("streaming");
  box.dataset.finish = reason;
  renderJSON(box, answer.content);
  const seconds = (performance.now() - started) / 1000;
  const tokens = answer.usage ? answer.usage.completion_tokens : null;
  const parts = [reason === "stopped" ? "stopped" : `finish: ${reason}`];
  if (tokens !== null) parts.push(`${tokens} tokens`, `${(tokens / seconds).toFixed(1)} tok/s`);
  parts.push(`${seconds.toFixed(1)} s`);
  box.append(element("div", "meta", parts.join(" · ")));
}

function setBusy(controller) {
  state.controller = controller;
  $("send").disabled = Boolean(controller);
  $("stop").hidden = !controller;
}

function stop() {
  if (state.controller) state.controller.abort();
}

function newChat() {
  stop();
  state.history = [];
  $("messages").replaceChildren();
  $("prompt").focus();
}

// --- wiring -----------------------------------------------------------------------------------------------

function bindRange(id) {
  const input = $(id);
  const out = $(`${id}-value`);
  const show = () => { out.textContent = input.value; };
  input.addEventListener("input", show);
  show();
}

function init() {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("refresh-models").addEventListener("click", loadModels);
  $("model").addEventListener("change", showModelState);
  $("key-form").addEventListener("submit", useKey);
  $("forget-key").addEventListener("click", forgetKey);
  $("forget-key").hidden = !apiKey();
  $("toggle-settings").addEventListener("click", () => {
    const aside = $("settings");
    aside.hidden = !aside.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!aside.hidden));
  });
  bindRange("temperature");
  bindRange("top-p");
  loadModels();
  $("prompt").focus();
}

document.addEventListener("DOMContentLoaded", init);
