"""A faulty MCP server on stdio, speaking JSON-RPC lines by hand (the SDK's server would
not send what this one does): ``python mcp_faulty_server.py``.

Its tools: ``ok`` answers "ok"; ``deep`` answers with ``structuredContent`` nested 300
deep, past the depth the MCP SDK's parser reads (its call waited out the whole call
timeout: the SDK's session only logs a message it cannot read); ``chatty`` sends 200,000
log notifications before it answers (the SDK handles each on the event loop). ``python
mcp_faulty_server.py crowded`` lists 10,000 tools instead (parsing them held the
event loop 0.6 s)."""

from __future__ import annotations

import json
import sys

_CROWDED = sys.argv[1:] == ["crowded"]
_TOOLS = [
    {"name": name, "description": description, "inputSchema": {"type": "object", "properties": {}}}
    for name, description in (
        ("ok", "Answers ok"),
        ("deep", "Answers with a result nested 300 deep"),
        ("chatty", "Sends 200,000 log notifications, then answers"),
    )
]


def _answer(message: dict[str, object]) -> dict[str, object]:
    method, params = message.get("method"), message.get("params")
    if method == "initialize" and isinstance(params, dict):
        info = {"name": "faulty", "version": "1"}
        return {"protocolVersion": params["protocolVersion"], "capabilities": {"tools": {}}, "serverInfo": info}
    if method == "tools/list":
        if _CROWDED:
            return {"tools": [{**_TOOLS[0], "name": f"t{n}"} for n in range(10_000)]}
        return {"tools": _TOOLS}
    if method == "tools/call" and isinstance(params, dict) and params.get("name") == "deep":
        return {
            "content": [{"type": "text", "text": "deep"}],
            "structuredContent": json.loads('{"a":' * 300 + "1" + "}" * 300),
        }
    return {"content": [{"type": "text", "text": "ok"}]}


for line in sys.stdin:
    message = json.loads(line)
    params = message.get("params")
    if message.get("method") == "tools/call" and isinstance(params, dict) and params.get("name") == "chatty":
        notice = json.dumps(
            {"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "x"}}
        )
        try:
            sys.stdout.write((notice + "\n") * 200_000)
        except BrokenPipeError:  # stopped for it
            break
    if "id" in message:  # notifications need no answer
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": _answer(message)}) + "\n")
        sys.stdout.flush()
