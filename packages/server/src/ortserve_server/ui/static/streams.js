// A reply as it streams, as one sequence of pieces whichever API makes it: text, reasoning,
// function calls, MCP calls, usage.
import { API, call, events } from "./api.js";

// A reply's pieces through the chat API: text, reasoning, function calls, usage.
export async function* chatDeltas(chat, sent, signal) {
  const { mcp_servers, ...settings } = chat.settings;
  const body = { model: chat.model, messages: sent, stream: true, stream_options: { include_usage: true }, ...settings };
  for await (const chunk of events(await call(`${API}/chat/completions`, { json: body, signal }))) {
    if (chunk.error) throw new Error(chunk.error.message);
    const usage = chunk.usage;
    if (usage) yield { usage: { tokens: usage.completion_tokens, cached: usage.prompt_tokens_details?.cached_tokens } };
    const delta = chunk.choices?.[0]?.delta;
    if (delta) yield { content: delta.content, reasoning: delta.reasoning_content, toolCalls: delta.tool_calls };
  }
}

// The same through the Responses API, which runs the MCP servers' tools on the server: their
// calls come as items (added, arguments, done with the output).
export async function* responsesDeltas(chat, sent, signal) {
  const { mcp_servers, tool_choice, max_tokens, temperature, top_p } = chat.settings;
  const part = (p) => {
    if (p.type === "text") return { type: "input_text", text: p.text };
    if (p.type === "image_url") return { type: "input_image", image_url: p.image_url.url };
    throw new Error("audio goes through the chat API: turn the MCP servers off to send it");
  };
  const input = sent
    .filter((m) => m.role === "user" || m.role === "assistant")
    .map((m) => ({ role: m.role, content: typeof m.content === "string" ? m.content : m.content.map(part) }));
  const body = {
    model: chat.model,
    input,
    stream: true,
    tools: mcp_servers.map((label) => ({ type: "mcp", server_label: label, require_approval: "never" })),
    ...(chat.system && { instructions: chat.system }),
    ...(tool_choice && { tool_choice }),
    ...(max_tokens && { max_output_tokens: max_tokens }),
    ...(temperature != null && { temperature }),
    ...(top_p != null && { top_p }),
  };
  for await (const event of events(await call(`${API}/responses`, { json: body, signal }))) {
    const item = event.item;
    if (event.type === "response.output_text.delta") yield { content: event.delta };
    else if (event.type === "response.reasoning_text.delta") yield { reasoning: event.delta };
    else if (event.type === "response.mcp_call_arguments.delta") yield { mcpArguments: { id: event.item_id, delta: event.delta } };
    else if (event.type.startsWith("response.output_item.") && item.type === "mcp_call") {
      const { id, server_label, name, arguments: args, output, error, status } = item;
      yield { mcpCall: { id, server_label, name, arguments: args, output, error, status } };
    } else if (event.type === "response.completed" || event.type === "response.incomplete") {
      const usage = event.response.usage;
      yield { usage: { tokens: usage?.output_tokens, cached: usage?.input_tokens_details?.cached_tokens } };
    } else if (event.type === "response.failed" || event.type === "error") {
      throw new Error(event.response?.error?.message ?? event.message ?? "the response failed");
    }
  }
}
