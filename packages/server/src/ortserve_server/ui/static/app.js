// The page: chat with the server's models, conversations kept on the server, the server at
// a glance. It calls only the public HTTP API (api.js), with the key the user gives it.
import { API, MCP, ApiError, conversations, getJSON, keys, onKeyNeeded } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { chatDeltas, responsesDeltas } from "./streams.js";
import { contentPart, record, speak, transcribe } from "./media.js";
import { sampleMetrics, showModels } from "./dashboard.js";

const $ = (selector) => document.querySelector(selector);
const SETTINGS = ["temperature", "top_p", "max_tokens", "min_tokens", "seed"];

const state = {
  models: [], // /v1/models
  chat: emptyChat(), // the conversation shown
  attachments: [], // content parts waiting to be sent
  streaming: null, // the AbortController of the reply under way
};

function emptyChat() {
  return { id: null, title: "", model: "", system: "", settings: {}, messages: [] };
}

const status = (text) => ($("#status").textContent = text);

// -- keys ------------------------------------------------------------------------------

let asking = null; // the dialog's answer while it is open: calls that need a key meanwhile wait for it

function askKey(kind, rejected) {
  if (asking) return asking;
  const dialog = $("#key-dialog");
  $("#key-title").textContent = kind === "admin" ? "Admin key" : "API key";
  $("#key-why").textContent = rejected
    ? `The server refused ${keys.get(kind) ? "this" : "the missing"} ${kind === "admin" ? "admin" : "API"} key. It is kept for this tab only.`
    : `This server needs ${kind === "admin" ? "its admin key to load and unload models" : "an API key"}. It is kept for this tab only.`;
  $("#key-input").value = "";
  let given = false;
  $("#key-form").onsubmit = (event) => {
    event.preventDefault();
    keys.set(kind, $("#key-input").value.trim());
    given = true;
    dialog.close();
  };
  $("#key-cancel").onclick = () => dialog.close();
  dialog.showModal();
  // Closed by the form, by Cancel or by Escape.
  asking = new Promise((resolve) => dialog.addEventListener("close", () => resolve(given), { once: true }));
  return asking.finally(() => (asking = null));
}
onKeyNeeded(askKey);
$("#key-button").addEventListener("click", async () => (await askKey("api", false)) && start());

// -- models ----------------------------------------------------------------------------

const model = (id) => state.models.find((m) => m.id === id);
const takes = (m) => new Set(m?.input_modalities ?? ["text"]);

function describe(m) {
  if (!m) return "";
  const what = [...takes(m)].filter((t) => t !== "text");
  if (m.tool_format) what.push("tools");
  if (m.reasoning) what.push("reasoning");
  if (m.status !== "ready") what.push(m.status);
  return what.length ? `takes text, ${what.join(", ")}` : "takes text";
}

async function loadModels() {
  state.models = (await getJSON(`${API}/models`)).data;
  const select = $("#model");
  const chosen = select.value || state.chat.model;
  select.replaceChildren(
    ...state.models
      .filter((m) => m.kind === "generative" || m.kind == null)
      .map((m) => new Option(`${m.id}${m.status === "ready" ? "" : ` (${m.status})`}`, m.id)),
  );
  if (model(chosen)) select.value = chosen;
  showTakes();
  $("#mic").hidden = !state.models.some((m) => m.kind === "speech");
}

function showTakes() {
  const m = model($("#model").value);
  $("#model-takes").textContent = describe(m);
  const accept = [...takes(m)].filter((t) => t !== "text").map((t) => `${t}/*`);
  $("#attach").accept = accept.join(",");
  $("#attach-label").hidden = $("#attach").disabled = !accept.length; // (paste and drop still say why not)
}
$("#model").addEventListener("change", showTakes);

// -- messages --------------------------------------------------------------------------

const textOf = (content) =>
  typeof content === "string" ? content : content.filter((p) => p.type === "text").map((p) => p.text).join("\n");

function button(label, onClick, aria) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  if (aria) b.setAttribute("aria-label", aria);
  b.addEventListener("click", onClick);
  return b;
}

function statsLine(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.tokens != null) parts.push(`${stats.tokens} tokens`);
  if (stats.tokens_per_second != null) parts.push(`${stats.tokens_per_second.toFixed(1)} tokens/s`);
  if (stats.ttft_ms != null) parts.push(`first token ${Math.round(stats.ttft_ms)} ms`);
  if (stats.cached_tokens != null) parts.push(`${stats.cached_tokens} cached`);
  if (stats.stopped) parts.push("stopped");
  return parts.join(" · ");
}

// One message's element; for a reply under way, its parts are updated in place.
function messageElement(message, index) {
  const item = document.createElement("li");
  item.className = `message ${message.role}`;
  item.dataset.index = index;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = { user: "You", tool: "Tool result" }[message.role] ?? (message.model || "Assistant");
  const reasoning = document.createElement("details");
  reasoning.className = "reasoning";
  reasoning.append(Object.assign(document.createElement("summary"), { textContent: "Reasoning" }));
  reasoning.append(Object.assign(document.createElement("div"), { className: "reasoning-text" }));
  const media = document.createElement("div");
  media.className = "media";
  for (const part of Array.isArray(message.content) ? message.content : []) {
    if (part.type === "image_url") media.append(Object.assign(new Image(), { src: part.image_url.url, alt: "attached image" }));
    if (part.type === "input_audio") media.append(Object.assign(document.createElement("span"), { textContent: `audio (${part.input_audio.format})` }));
  }
  const body = document.createElement("div");
  body.className = "content";
  const calls = document.createElement("div");
  calls.className = "tool-calls";
  const stats = document.createElement("div");
  stats.className = "stats";
  const actions = document.createElement("div");
  actions.className = "actions";
  if (message.role === "user") actions.append(button("Edit", () => editMessage(index, item), "Edit this message"));
  if (message.role === "assistant") {
    actions.append(button("Regenerate", () => regenerate(index), "Regenerate this reply"));
    const voice = state.models.find((m) => m.kind === "voice");
    if (voice) actions.append(button("Read aloud", () => speak(voice.id, textOf(message.content)).catch(showError), "Read this reply aloud"));
  }
  item.append(who, reasoning, media, body, calls, stats, actions);
  updateMessage(item, message);
  return item;
}

function updateMessage(item, message) {
  const reasoning = item.querySelector(".reasoning");
  reasoning.hidden = !message.reasoning;
  reasoning.querySelector(".reasoning-text").textContent = message.reasoning ?? "";
  const body = item.querySelector(".content");
  if (message.role === "assistant") renderMarkdown(body, textOf(message.content));
  else body.textContent = textOf(message.content);
  item.querySelector(".stats").textContent = statsLine(message.stats);
  item
    .querySelector(".tool-calls")
    .replaceChildren(...(message.tool_calls ?? []).map(toolCallElement), ...(message.mcp_calls ?? []).map(mcpCallElement));
}

// A tool call as it streams; once the reply is over (and it is the last), a box for its result.
function toolCallElement(call) {
  const box = document.createElement("details");
  box.className = "tool-call";
  box.open = true;
  box.append(Object.assign(document.createElement("summary"), { textContent: `Tool call: ${call.function.name}` }));
  box.append(Object.assign(document.createElement("pre"), { textContent: call.function.arguments }));
  return box;
}

// An MCP call the server makes: its arguments as the model writes them, then its output.
function mcpCallElement(call) {
  const box = document.createElement("details");
  box.className = "mcp-call";
  box.open = true;
  const summary = `MCP call: ${call.server_label}.${call.name}${call.status ? ` (${call.status})` : ""}`;
  box.append(Object.assign(document.createElement("summary"), { textContent: summary }));
  box.append(Object.assign(document.createElement("pre"), { className: "arguments", textContent: call.arguments }));
  // An error is a string, or (a failed tool) an object with content parts.
  const error = typeof call.error === "string" || call.error == null ? call.error : call.error.content?.map((c) => c.text).join("\n") ?? JSON.stringify(call.error);
  if (call.output != null || error != null) {
    box.append(Object.assign(document.createElement("pre"), { className: "output", textContent: error ?? call.output }));
  }
  return box;
}

function askToolResults(item, message) {
  const form = document.createElement("div");
  form.className = "tool-results";
  const fields = message.tool_calls.map((call) => {
    const field = document.createElement("textarea");
    field.setAttribute("aria-label", `Result of ${call.function.name}`);
    field.placeholder = `Result of ${call.function.name}`;
    return field;
  });
  const submit = button("Send results", async () => {
    message.tool_calls.forEach((call, i) =>
      state.chat.messages.push({ role: "tool", tool_call_id: call.id, content: fields[i].value }),
    );
    form.remove();
    showMessages();
    await reply();
  });
  form.append(...fields, submit);
  item.append(form);
}

function showMessages() {
  $("#messages").replaceChildren(...state.chat.messages.map(messageElement));
  $("#messages").lastElementChild?.scrollIntoView({ block: "end" });
}

function editMessage(index, item) {
  if (state.streaming) return;
  const message = state.chat.messages[index];
  const editor = document.createElement("textarea");
  editor.value = textOf(message.content);
  editor.setAttribute("aria-label", "Edit the message");
  const save = button("Send edited", async () => {
    const text = editor.value.trim();
    if (!text) return;
    const media = Array.isArray(message.content) ? message.content.filter((p) => p.type !== "text") : [];
    state.chat.messages = state.chat.messages.slice(0, index);
    state.chat.messages.push({ role: "user", content: media.length ? [{ type: "text", text }, ...media] : text });
    showMessages();
    await reply();
  });
  item.querySelector(".content").replaceChildren(editor, save, button("Cancel", showMessages));
  editor.focus();
}

async function regenerate(index) {
  if (state.streaming) return;
  state.chat.messages = state.chat.messages.slice(0, index);
  showMessages();
  await reply();
}

// -- sending ---------------------------------------------------------------------------

function settingsFromForm() {
  const settings = {};
  for (const name of SETTINGS) {
    const value = $(`#${name}`).value;
    if (value !== "") settings[name] = Number(value);
  }
  if ($("#tool_choice").value) settings.tool_choice = $("#tool_choice").value;
  const mcp = [...document.querySelectorAll("#mcp-servers input:checked")].map((box) => box.value);
  if (mcp.length) settings.mcp_servers = mcp;
  const tools = $("#tools").value.trim();
  if (tools) {
    try {
      settings.tools = JSON.parse(tools);
    } catch (error) {
      throw new Error(`Tools: not JSON (${error.message})`);
    }
  }
  return settings;
}

function showSettings(settings) {
  for (const name of SETTINGS) $(`#${name}`).value = settings[name] ?? "";
  $("#tool_choice").value = settings.tool_choice ?? "";
  $("#tools").value = settings.tools ? JSON.stringify(settings.tools) : "";
  for (const box of document.querySelectorAll("#mcp-servers input")) box.checked = !!settings.mcp_servers?.includes(box.value);
}

// The MCP servers the operator configured, to be offered to the model.
for (const label of MCP) {
  const box = Object.assign(document.createElement("input"), { type: "checkbox", value: label });
  const name = document.createElement("label");
  name.append(box, ` ${label}`);
  $("#mcp-servers").append(name);
  $("#mcp-servers").hidden = false;
}

function showError(error) {
  status(error instanceof ApiError || error instanceof Error ? error.message : String(error));
}

async function send() {
  const text = $("#prompt").value.trim();
  if (state.streaming || (!text && !state.attachments.length)) return;
  settingsFromForm(); // a mistake in the tools' JSON keeps the message in the box
  const content = state.attachments.length ? [...(text ? [{ type: "text", text }] : []), ...state.attachments] : text;
  state.chat.messages.push({ role: "user", content });
  $("#prompt").value = "";
  state.attachments = [];
  showAttachments();
  showMessages();
  await reply();
}

// Keeps ``chat`` on the server (the one a reply belongs to, even if another is shown now).
async function save(chat) {
  const body = { title: chat.title, model: chat.model, system: chat.system, settings: chat.settings, messages: chat.messages };
  if (chat.id) await conversations.update(chat.id, body);
  else {
    body.title ||= textOf(chat.messages[0]?.content ?? "").slice(0, 60) || "New chat";
    const made = await conversations.create(body);
    Object.assign(chat, { id: made.id, title: made.title });
    if (state.chat === chat) history.replaceState(null, "", `#${made.id}`);
  }
  await showConversations();
}

// Streams a reply to the conversation as it stands, then saves the conversation.
async function reply() {
  const chat = state.chat;
  chat.model = $("#model").value;
  chat.system = $("#system").value;
  try {
    chat.settings = settingsFromForm();
  } catch (error) {
    showError(error); // (send() checks first: this is an edit or a regeneration)
    return;
  }
  const message = { role: "assistant", content: "", model: chat.model };
  const sent = [...(chat.system ? [{ role: "system", content: chat.system }] : [])];
  for (const m of chat.messages) {
    const { role, content, tool_calls, tool_call_id } = m;
    sent.push({ role, content, ...(tool_calls && { tool_calls }), ...(tool_call_id && { tool_call_id }) });
  }
  chat.messages.push(message);
  const item = messageElement(message, chat.messages.length - 1);
  item.classList.add("streaming");
  item.setAttribute("aria-busy", "true"); // screen readers read it once it is complete
  $("#messages").append(item);
  const controller = new AbortController();
  state.streaming = controller;
  $("#send").hidden = true;
  $("#stop").hidden = false;
  status("");
  const started = performance.now();
  let first = null;
  let usage = null;
  let frame = 0;
  try {
    const deltas = chat.settings.mcp_servers?.length ? responsesDeltas : chatDeltas;
    for await (const delta of deltas(chat, sent, controller.signal)) {
      if (delta.usage) usage = delta.usage;
      for (const call of delta.toolCalls ?? []) {
        message.tool_calls ??= [];
        const known = (message.tool_calls[call.index] ??= { id: call.id, type: "function", function: { name: "", arguments: "" } });
        known.function.name += call.function?.name ?? "";
        known.function.arguments += call.function?.arguments ?? "";
      }
      if (delta.mcpCall) {
        message.mcp_calls ??= [];
        const at = message.mcp_calls.findIndex((c) => c.id === delta.mcpCall.id);
        message.mcp_calls.splice(at < 0 ? message.mcp_calls.length : at, 1, { ...delta.mcpCall });
      }
      if (delta.mcpArguments) {
        const known = message.mcp_calls?.find((c) => c.id === delta.mcpArguments.id);
        if (known) known.arguments += delta.mcpArguments.delta;
      }
      if (!delta.content && !delta.reasoning && !delta.toolCalls && !delta.mcpCall && !delta.mcpArguments) continue;
      first ??= performance.now();
      message.content += delta.content ?? "";
      if (delta.reasoning) message.reasoning = (message.reasoning ?? "") + delta.reasoning;
      // One render per frame, of this message only.
      frame ||= requestAnimationFrame(() => {
        frame = 0;
        updateMessage(item, message);
        item.scrollIntoView({ block: "end" });
      });
    }
  } catch (error) {
    if (error.name !== "AbortError") showError(error);
  } finally {
    cancelAnimationFrame(frame);
    state.streaming = null;
    $("#send").hidden = false;
    $("#stop").hidden = true;
  }
  const end = performance.now();
  message.stats = {
    tokens: usage?.tokens ?? null,
    tokens_per_second: usage?.tokens != null && first && end > first ? usage.tokens / ((end - first) / 1000) : null,
    ttft_ms: first ? first - started : null,
    cached_tokens: usage?.cached ?? null,
    stopped: controller.signal.aborted || null,
  };
  item.classList.remove("streaming");
  if (state.chat === chat) updateMessage(item, message);
  try {
    await save(chat);
    await loadModels(); // a model loaded on first use now says what it takes
  } catch (error) {
    showError(error);
  }
  item.removeAttribute("aria-busy");
  item.classList.add("done"); // shown, and kept on the server
  if (message.tool_calls?.length && state.chat === chat) askToolResults(item, message);
}

$("#stop").addEventListener("click", () => state.streaming?.abort());
$("#composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send().catch(showError);
});
$("#prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send().catch(showError);
  }
});

// -- attachments and the microphone ------------------------------------------------------

function showAttachments() {
  $("#attachments").replaceChildren(
    ...state.attachments.map((part, i) => {
      const chip = document.createElement("span");
      chip.className = "attachment";
      if (part.type === "image_url") chip.append(Object.assign(new Image(), { src: part.image_url.url, alt: "image to send" }));
      else chip.append(`audio (${part.input_audio.format})`);
      chip.append(button("×", () => (state.attachments.splice(i, 1), showAttachments()), "Remove this attachment"));
      return chip;
    }),
  );
}

async function attach(files) {
  const can = takes(model($("#model").value));
  for (const file of files) {
    const part = await contentPart(file, can);
    if (part instanceof Error) showError(part);
    else state.attachments.push(part);
  }
  showAttachments();
}
$("#attach").addEventListener("change", (event) => attach([...event.target.files]).finally(() => (event.target.value = "")));
$("#prompt").addEventListener("paste", (event) => {
  const files = [...event.clipboardData.files];
  if (files.length) {
    event.preventDefault();
    attach(files).catch(showError);
  }
});
$("#composer").addEventListener("dragover", (event) => event.preventDefault());
$("#composer").addEventListener("drop", (event) => {
  event.preventDefault();
  attach([...event.dataTransfer.files]).catch(showError);
});

let recording = null;
$("#mic").addEventListener("click", async () => {
  const mic = $("#mic");
  try {
    if (!recording) {
      recording = await record();
      mic.setAttribute("aria-pressed", "true");
      mic.textContent = "Stop dictating";
      return;
    }
    const audio = await recording.stop();
    recording = null;
    mic.setAttribute("aria-pressed", "false");
    mic.textContent = "Dictate";
    status("transcribing…");
    const speech = state.models.find((m) => m.kind === "speech");
    $("#prompt").value += (await transcribe(speech.id, audio)).trim();
    status("");
    $("#prompt").focus();
  } catch (error) {
    recording = null;
    showError(error);
  }
});

// -- conversations ---------------------------------------------------------------------

async function showConversations() {
  const { data } = await conversations.list($("#search").value.trim());
  $("#conversations").replaceChildren(
    ...data.map((c) => {
      const item = document.createElement("li");
      item.dataset.id = c.id;
      if (c.id === state.chat.id) item.setAttribute("aria-current", "true");
      const open = button(c.title || "Untitled", () => openConversation(c.id));
      open.className = "open";
      const rename = button("Rename", () => {
        const input = Object.assign(document.createElement("input"), { value: c.title, type: "text" });
        input.setAttribute("aria-label", "New title");
        input.addEventListener("keydown", async (event) => {
          if (event.key === "Escape") return showConversations();
          if (event.key !== "Enter") return;
          await conversations.update(c.id, { title: input.value.trim() || c.title });
          if (state.chat.id === c.id) state.chat.title = input.value.trim();
          await showConversations();
        });
        item.replaceChildren(input);
        input.focus();
      }, `Rename ${c.title}`);
      const remove = button("Delete", async () => {
        await conversations.remove(c.id);
        if (state.chat.id === c.id) newChat();
        await showConversations();
      }, `Delete ${c.title}`);
      item.append(open, rename, remove);
      return item;
    }),
  );
}

let searchTimer = 0;
$("#search").addEventListener("input", () => {
  clearTimeout(searchTimer);
  searchTimer = setTimeout(() => showConversations().catch(showError), 200);
});

async function openConversation(id) {
  if (state.streaming) state.streaming.abort();
  const c = await conversations.get(id);
  state.chat = { id: c.id, title: c.title, model: c.model, system: c.system, settings: c.settings, messages: c.messages };
  $("#system").value = c.system;
  showSettings(c.settings);
  if (model(c.model)) $("#model").value = c.model;
  showTakes();
  history.replaceState(null, "", `#${c.id}`);
  showMessages();
  await showConversations();
}

function newChat() {
  if (state.streaming) state.streaming.abort();
  state.chat = emptyChat();
  history.replaceState(null, "", location.pathname);
  showMessages();
  showConversations().catch(showError);
  $("#prompt").focus();
}
$("#new-chat").addEventListener("click", newChat);

$("#export").addEventListener("click", async () => {
  const data = await conversations.exportAll();
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([JSON.stringify(data, null, 1)], { type: "application/json" }));
  link.download = "ortserve-conversations.json";
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
});
$("#import-file").addEventListener("change", async (event) => {
  const file = event.target.files[0];
  event.target.value = "";
  if (!file) return;
  try {
    const made = await conversations.importAll(JSON.parse(await file.text()));
    status(`imported ${made.data.length} conversation${made.data.length === 1 ? "" : "s"}`);
    await showConversations();
  } catch (error) {
    showError(error);
  }
});

// -- views -----------------------------------------------------------------------------

let metricsTimer = 0;
function showView(name) {
  $("#chat-view").hidden = name !== "chat";
  $("#server-view").hidden = name !== "server";
  $("#tab-chat").setAttribute("aria-pressed", String(name === "chat"));
  $("#tab-server").setAttribute("aria-pressed", String(name === "server"));
  clearInterval(metricsTimer);
  if (name === "server") {
    const tick = () => sampleMetrics().catch(showError);
    showModels(loadModels).catch(showError);
    tick();
    metricsTimer = setInterval(() => {
      tick();
      showModels().catch(showError);
    }, 1000);
  }
}
$("#tab-chat").addEventListener("click", () => showView("chat"));
$("#tab-server").addEventListener("click", () => showView("server"));

async function start() {
  try {
    await loadModels();
    await showConversations();
    const id = location.hash.slice(1);
    if (id) await openConversation(id).catch(() => history.replaceState(null, "", location.pathname));
    status("");
  } catch (error) {
    showError(error);
  }
  document.body.dataset.ready = "true"; // for tests: the first load is over
}

start(); // its first call asks for the key where the server needs one
$("#prompt").focus();
