"""A real MCP server (the official SDK's MCPServer, once FastMCP) for the MCP tests:
``python mcp_tools_server.py stdio [MARKER [fragile]]`` or ``python mcp_tools_server.py http PORT``.

Its tools: ``add`` answers; ``fail`` raises a tool error; ``nap`` writes ``MARKER.started``,
sleeps 3 s, then writes ``MARKER.finished`` (a cancelled call never finishes); ``big``
returns 200,000 characters; with ``fragile``, ``huge`` returns 2,000,000 and ``quit`` ends
the process; ``lookup`` is read-only (annotated so); ``whoami`` returns the
Authorization header the call came with. The tiny test model
writes random arguments, so the tools the tests force take none, or check what they get."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

server = MCPServer("ortserve-test-tools")


Small = Annotated[int, Field(ge=-999, le=999)]
"""Bounded, so that the random model's forced calls stay short (the grammar keeps bounds)."""


@server.tool(description="Add two integers")
def add(a: Small, b: Small) -> int:
    return a + b


@server.tool(description="Always fails")
def fail() -> str:
    raise ToolError("failed on purpose")


@server.tool(description="Sleep, then answer")
async def nap() -> str:
    marker = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "stdio" else None
    if marker:
        Path(marker + ".started").write_text("started")
    await asyncio.sleep(3)
    if marker:
        Path(marker + ".finished").write_text("finished")
    return "slept"


@server.tool(description="A long answer")
def big() -> str:
    return "x" * 200_000


@server.tool(description="Look a word up", annotations=ToolAnnotations(readOnlyHint=True))
def lookup() -> str:
    return "ortserve: a word"


@server.tool(description="Who is asking")
def whoami(ctx: Context) -> str:
    """The Authorization header the call came with (over HTTP), else "none"."""
    request = getattr(ctx.request_context, "request", None)
    headers = getattr(request, "headers", None) or {}
    return str(headers.get("authorization", "none"))


def huge() -> str:
    return "y" * 2_000_000


def quit() -> str:
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "stdio" and sys.argv[3:] == ["fragile"]:  # tools that end the server, or its link
        server.tool(description="A longer answer than one message may be")(huge)
        server.tool(description="Exit the server's process")(quit)
    if sys.argv[1] == "stdio":
        server.run("stdio")
    else:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
