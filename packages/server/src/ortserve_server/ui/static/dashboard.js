// The server at a glance: the models (what `ortserve ps` shows, from /v1/models), load and
// unload (the admin key where the server has one), and tokens/s and queue depth from /metrics.
import { API, METRICS, call, getJSON } from "./api.js";

const $ = (selector) => document.querySelector(selector);
const WINDOW = 120; // seconds plotted
const samples = []; // {t, tps, queue}
let lastTokens = null;

const human = (bytes) => {
  if (bytes == null) return "-";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) (bytes /= 1024), i++;
  return `${bytes.toFixed(i ? 1 : 0)} ${units[i]}`;
};

function cell(row, text) {
  const td = row.insertCell();
  td.textContent = text;
  return td;
}

let shown = ""; // the list as last drawn: a table redrawn each second under the pointer would lose clicks

export async function showModels(onChange) {
  const { data } = await getJSON(`${API}/models`);
  const drawn = JSON.stringify(data.map(({ last_used, expires_at, ...m }) => m));
  if (drawn === shown) return data;
  shown = drawn;
  const body = $("#models tbody");
  body.replaceChildren();
  for (const model of data.filter((m) => !m.parent)) {
    const row = body.insertRow();
    row.dataset.model = model.id;
    cell(row, model.id);
    cell(row, model.kind ?? "-");
    cell(row, model.status + (model.error ? `: ${model.error}` : ""));
    cell(row, model.engine ?? "-");
    const kv = model.kv_cache_bytes == null ? "" : ` + KV ${human(model.kv_cache_bytes)}`;
    cell(row, model.resident_bytes == null ? "-" : `${human(model.resident_bytes)}${kv}`);
    cell(row, String(model.in_flight ?? "-"));
    const actions = cell(row, "");
    const loaded = model.status === "ready";
    const button = document.createElement("button");
    button.type = "button";
    button.textContent = loaded ? "Unload" : "Load";
    button.setAttribute("aria-label", `${button.textContent} ${model.id}`);
    button.addEventListener("click", async () => {
      button.disabled = true;
      try {
        await call(`${API}/models/${loaded ? "unload" : "load"}`, { kind: "admin", json: { model: model.id } });
      } catch (error) {
        row.cells[2].textContent = error.message;
        return;
      } finally {
        button.disabled = false;
      }
      await showModels(onChange);
      onChange?.();
    });
    actions.append(button);
  }
  return data;
}

// Sums of the samples of each metric family that /metrics gives (over models).
function parseMetrics(text) {
  const sums = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = line.match(/^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)/);
    if (match) sums[match[1]] = (sums[match[1]] ?? 0) + Number(match[2]);
  }
  return sums;
}

export async function sampleMetrics() {
  if (!METRICS) return;
  const text = await (await call(METRICS)).text();
  const sums = parseMetrics(text);
  const now = performance.now() / 1000;
  const tokens = sums.ortserve_completion_tokens_total ?? 0;
  const tps = lastTokens ? Math.max(0, (tokens - lastTokens.tokens) / (now - lastTokens.t)) : 0;
  lastTokens = { t: now, tokens };
  samples.push({ t: now, tps, queue: sums.ortserve_queue_depth ?? 0 });
  while (samples.length && samples[0].t < now - WINDOW) samples.shift();
  const peak = Math.max(...samples.map((s) => s.tps));
  $("#plot-now").textContent = `now: ${tps.toFixed(1)} tokens/s, ${samples.at(-1).queue} queued; peak ${peak.toFixed(1)} tokens/s`;
  draw();
}

function draw() {
  const canvas = $("#plot");
  const ctx = canvas.getContext("2d");
  const { width, height } = canvas;
  const style = getComputedStyle(canvas);
  ctx.clearRect(0, 0, width, height);
  ctx.strokeStyle = style.getPropertyValue("--grid");
  ctx.strokeRect(0.5, 0.5, width - 1, height - 1);
  if (!samples.length) return;
  const end = samples.at(-1).t;
  const series = [
    ["tps", style.getPropertyValue("--tps")],
    ["queue", style.getPropertyValue("--queue")],
  ];
  for (const [key, colour] of series) {
    const top = Math.max(1, ...samples.map((s) => s[key]));
    ctx.strokeStyle = colour;
    ctx.lineWidth = 2;
    ctx.beginPath();
    samples.forEach((s, i) => {
      const x = width - ((end - s.t) / WINDOW) * width;
      const y = height - 4 - (s[key] / top) * (height - 8);
      i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.stroke();
    ctx.fillStyle = colour;
    ctx.fillText(`${key === "tps" ? "max tokens/s" : "max queued"} ${top.toFixed(key === "tps" ? 1 : 0)}`, 6, key === "tps" ? 14 : 28);
  }
}
