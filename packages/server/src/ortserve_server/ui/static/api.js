// The server's public HTTP API, as the page calls it: the same routes and keys as any SDK.

const meta = (name) => document.querySelector(`meta[name="${name}"]`)?.content ?? "";
export const API = meta("ortserve-api");
export const METRICS = meta("ortserve-metrics");
export const NEEDS = new Set(meta("ortserve-keys").split(" ").filter(Boolean)); // "api", "admin"
export const MCP = meta("ortserve-mcp").split(" ").filter(Boolean); // the configured MCP servers' labels

// Keys live in sessionStorage: this tab only, gone when it closes.
export const keys = {
  get: (kind) => sessionStorage.getItem(`ortserve.${kind}-key`) ?? "",
  set: (kind, value) => sessionStorage.setItem(`ortserve.${kind}-key`, value),
};

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

let askKey = async () => false; // set by the page: shows the key dialog, true once a key was given
export function onKeyNeeded(ask) {
  askKey = ask;
}

// fetch() with the key; a 401 asks for a (new) key once and tries again.
export async function call(path, { kind = "api", json, ...init } = {}) {
  if (NEEDS.has(kind) && !keys.get(kind) && !(await askKey(kind, false))) throw new ApiError(401, `no ${kind} key given`);
  for (let attempt = 0; ; attempt++) {
    const headers = new Headers(init.headers);
    const key = keys.get(kind) || (kind === "admin" ? keys.get("api") : "");
    if (key) headers.set("Authorization", `Bearer ${key}`);
    if (json !== undefined) {
      headers.set("Content-Type", "application/json");
      init.body = JSON.stringify(json);
      init.method ??= "POST";
    }
    const response = await fetch(path, { ...init, headers });
    if (response.ok) return response;
    if (response.status === 401 && attempt === 0 && (await askKey(kind, true))) continue;
    let message = `${response.status} ${response.statusText}`;
    try {
      message = (await response.json()).error?.message ?? message;
    } catch {
      /* not JSON: keep the status line */
    }
    throw new ApiError(response.status, message);
  }
}

export const getJSON = async (path, options) => (await call(path, options)).json();

// The data: payloads of a server-sent event stream, as parsed JSON.
export async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

export const conversations = {
  list: (search) =>
    getJSON(`${API}/ui/conversations?limit=200${search ? `&search=${encodeURIComponent(search)}` : ""}`),
  get: (id) => getJSON(`${API}/ui/conversations/${encodeURIComponent(id)}`),
  create: (body) => getJSON(`${API}/ui/conversations`, { json: body }),
  update: (id, body) => getJSON(`${API}/ui/conversations/${encodeURIComponent(id)}`, { json: body }),
  remove: (id) => call(`${API}/ui/conversations/${encodeURIComponent(id)}`, { method: "DELETE" }),
  exportAll: () => getJSON(`${API}/ui/conversations/export`),
  importAll: (body) => getJSON(`${API}/ui/conversations/import`, { json: body }),
};
