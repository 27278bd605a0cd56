"""A faulty MCP server, speaking JSON-RPC by hand (the SDK's server would not send what this
one does): on stdio, ``python mcp_faulty_server.py``; over streamable HTTP, ``python
mcp_faulty_server.py http PORT`` (answers as JSON, ``chatty``'s as an event stream).

Its tools: ``ok`` answers "ok"; ``deep`` answers with ``structuredContent`` nested 300
deep, past the depth the MCP SDK's parser reads (its call waited out the whole call
timeout: the SDK's session only logs a message it cannot read); ``chatty`` sends 200,000
log notifications before it answers (the SDK handles each on the event loop); ``loud``
fails with an error message of 200 KB; ``crowd`` answers 30,000 content items (900 KB: the SDK
made each a model on the event loop); ``nested`` answers ``structuredContent`` holding
200,000 empty arrays (600 KB); ``throng`` 12,000 content items (within a request body's
bounds, 210-380 ms of the loop) and ``wide`` an array of 200,000 numbers. ``python mcp_faulty_server.py crowded`` lists 10,000
tools instead (parsing them held the event loop 0.6 s; over HTTP, 2 s for 50,000), and
``heavy`` 999 tools of 14 properties each (47,000 keys, 830 KB: 100-200 ms of the loop). HTTP
only: ``huge`` answers 2 MB; ``zipped`` answers "ok" gzip-encoded; ``bomb`` answers 100 MB
of text gzip-encoded into 100 KB (httpx decoded it above the transport's bounds); ``stuck``
never answers, sending an SSE comment every 0.1 s until its client closes the connection
(the SDK kept reading such an answer after the call timed out); ``dropped`` answers
"dropped N", N the ``stuck`` answers whose connection the client closed; ``abyss`` answers
``structuredContent`` nested 5,000 deep, past the depth Python's ``json`` decodes (over HTTP
as an event stream: the event's decoding raised a RecursionError). Stdio only: ``python
mcp_faulty_server.py orphan PIDFILE`` has ``orphan`` start ``sleep 60`` in a session of its own
(outside the process group ortserve stops) holding the server's stdout, add its pid to PIDFILE
and exit without answering (ortserve learnt that the server ended only from the end of its
stdout, so every later call waited out the call timeout)."""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import subprocess
import sys
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_CROWDED = sys.argv[-1:] == ["crowded"]
_HEAVY = sys.argv[-1:] == ["heavy"]
_PROPERTIES = {f"p{n}": {"type": "string", "description": "x"} for n in range(14)}
_TOOLS = [
    {"name": name, "description": description, "inputSchema": {"type": "object", "properties": {}}}
    for name, description in (
        ("ok", "Answers ok"),
        ("deep", "Answers with a result nested 300 deep"),
        ("chatty", "Sends 200,000 log notifications, then answers"),
        ("huge", "Answers 2 MB"),
        ("loud", "Fails with an error message of 200 KB"),
        ("crowd", "Answers 30,000 content items"),
        ("nested", "Answers with 200,000 empty arrays"),
        ("throng", "Answers 12,000 content items"),
        ("wide", "Answers with an array of 200,000 numbers"),
        ("zipped", "Answers ok, gzip-encoded"),
        ("bomb", "Answers 100 MB gzip-encoded into 100 KB"),
        ("stuck", "Never answers (HTTP: trickles SSE comments until the connection is closed)"),
        ("dropped", "Says how many stuck answers had their connection closed"),
        ("orphan", "Exits, leaving a process of its own session holding stdout"),
        ("abyss", "Answers with a result nested 5,000 deep (HTTP: as an event stream)"),
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
        if _HEAVY:
            schema = {"type": "object", "properties": _PROPERTIES}
            return {"tools": [{**_TOOLS[0], "name": f"t{n}", "inputSchema": schema} for n in range(999)]}
        return {"tools": _TOOLS}
    if method == "tools/call" and isinstance(params, dict) and params.get("name") == "huge":
        return {"content": [{"type": "text", "text": "x" * 2_000_000}]}
    if method == "tools/call" and isinstance(params, dict) and params.get("name") == "crowd":
        return {"content": [{"type": "text", "text": "x"}] * 30_000}
    if method == "tools/call" and isinstance(params, dict) and params.get("name") == "throng":
        return {"content": [{"type": "text", "text": "x"}] * 12_000}
    if method == "tools/call" and isinstance(params, dict) and params.get("name") == "wide":
        return {"content": [{"type": "text", "text": "x"}], "structuredContent": {"a": [0] * 200_000}}
    if method == "tools/call" and isinstance(params, dict) and params.get("name") == "nested":
        return {"content": [{"type": "text", "text": "x"}], "structuredContent": {"a": [[]] * 200_000}}
    if method == "tools/call" and isinstance(params, dict) and params.get("name") == "dropped":
        return {"content": [{"type": "text", "text": f"dropped {_Handler.dropped}"}]}
    if method == "tools/call" and isinstance(params, dict) and params.get("name") == "deep":
        return {
            "content": [{"type": "text", "text": "deep"}],
            "structuredContent": json.loads('{"a":' * 300 + "1" + "}" * 300),
        }
    return {"content": [{"type": "text", "text": "ok"}]}


_NOTICE = json.dumps({"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "x"}})


def _called(message: dict[str, object]) -> object:
    """The name of the tool ``message`` calls, if it calls one."""
    params = message.get("params")
    return params.get("name") if message.get("method") == "tools/call" and isinstance(params, dict) else None


def _chatty(message: dict[str, object]) -> bool:
    return _called(message) == "chatty"


def _abyss(message: dict[str, object]) -> str:
    """``abyss``'s answer, written by hand: ``json`` cannot write it either."""
    nested = '{"a":' * 5000 + "1" + "}" * 5000
    answer = '{"content": [{"type": "text", "text": "abyss"}], "structuredContent": ' + nested + "}"
    return f'{{"jsonrpc": "2.0", "id": {json.dumps(message["id"])}, "result": {answer}}}'


def _reply(message: dict[str, object]) -> dict[str, object]:
    if _called(message) == "loud":
        return {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -32000, "message": "E" * 200_000}}
    return {"jsonrpc": "2.0", "id": message["id"], "result": _answer(message)}


@functools.cache
def _bomb_start() -> tuple[bytes, zlib._Compress]:
    """A JSON answer's first 100 MB, gzip-compressed, and the compressor that made it (its id
    comes last: one start made for all answers)."""
    compressor = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    start = [compressor.compress(b'{"jsonrpc": "2.0", "result": {"content": [{"type": "text", "text": "')]
    block = b"x" * 2**20
    start += [compressor.compress(block) for _ in range(100)]
    return b"".join(start), compressor


def _bomb(message_id: object) -> bytes:
    start, compressor = _bomb_start()
    rest = compressor.copy()
    return start + rest.compress(f'"}}]}}, "id": {json.dumps(message_id)}}}'.encode()) + rest.flush()


def _serve_stdio() -> None:
    for line in sys.stdin:
        message = json.loads(line)
        if _called(message) == "orphan" and sys.argv[1:2] == ["orphan"]:
            helper = subprocess.Popen(["sleep", "60"], start_new_session=True, stdout=sys.stdout)
            with open(sys.argv[2], "a") as pids:
                pids.write(f"{helper.pid}\n")
            return
        if _chatty(message):
            try:
                sys.stdout.write((_NOTICE + "\n") * 200_000)
            except BrokenPipeError:  # stopped for it
                break
        if "id" in message:  # notifications need no answer
            sys.stdout.write((_abyss(message) if _called(message) == "abyss" else json.dumps(_reply(message))) + "\n")
            sys.stdout.flush()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    dropped = 0
    """``stuck`` answers whose client closed the connection."""

    def _stuck(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")  # no length: the answer runs until the close
        self.end_headers()
        try:
            while True:
                self.wfile.write(b": still working\n\n")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:  # the client closed it
            type(self).dropped += 1
            self.close_connection = True

    def do_POST(self) -> None:  # http.server's name
        message = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "id" not in message:  # a notification
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if _called(message) == "stuck":
            self._stuck()
            return
        answer = (_abyss(message) if _called(message) == "abyss" else json.dumps(_reply(message))).encode()
        encoding = "gzip" if _called(message) in ("zipped", "bomb") else None
        if _called(message) == "bomb":
            body, kind = _bomb(message["id"]), "application/json"
        elif encoding is not None:
            body, kind = gzip.compress(answer), "application/json"
        elif _called(message) == "abyss":
            body, kind = b"event: message\ndata: " + answer + b"\n\n", "text/event-stream"
        elif _chatty(message):
            body = f"event: message\ndata: {_NOTICE}\n\n".encode() * 200_000
            body += b"event: message\ndata: " + answer + b"\n\n"
            kind = "text/event-stream"
        else:
            body, kind = answer, "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        if encoding is not None:
            self.send_header("Content-Encoding", encoding)
        self.end_headers()
        with contextlib.suppress(OSError):  # refused midway
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


if sys.argv[1:2] == ["http"]:
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), _Handler).serve_forever()
else:
    _serve_stdio()
