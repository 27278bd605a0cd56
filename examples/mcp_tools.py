"""MCP tools the server runs itself: a small MCP server (the official SDK's MCPServer,
once FastMCP) that ortserve starts over stdio, and a Responses request that lets the model
call its tool. The server makes the call and hands the result back to the model; the
response shows the listing, the call with its output, and the answer.

    uv run python examples/mcp_tools.py

The same server by hand: `ortserve serve --mcp-server "calc=stdio:python examples/mcp_tools.py serve-mcp"`.
On the tiny random model the call is forced (`tool_choice`) and its arguments are random;
on SmolLM2-135M or larger the model picks the tool and the numbers from the question.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys

from _common import MODEL_DIR, PORT
from ortserve_client import LocalServer
from ortserve_client import responses_protocol as rp


def serve_mcp() -> None:
    """The MCP server ortserve starts (``serve-mcp``): one tool, over stdio."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("calc")

    @server.tool(description="Add two integers")
    def add(a: int, b: int) -> int:
        return a + b

    server.run("stdio")


async def main() -> None:
    command = shlex.join([sys.executable, __file__, "serve-mcp"])
    # The operator names the servers requests may use; a request cannot add its own.
    serve_args = ["--mcp-server", f"calc=stdio:{command}"]
    local = LocalServer({"tiny": MODEL_DIR}, port=PORT, serve_args=serve_args)
    async with local as server, server.client() as client:
        response = await client.responses.create(
            model="tiny",
            input="What is 2 + 3? Use the calculator.",
            tools=[rp.McpTool(server_label="calc", require_approval="never")],
            tool_choice=rp.ToolChoiceMcp(server_label="calc", name="add"),
            max_tool_calls=1,
            max_output_tokens=300,  # the random model writes long numbers
        )
    for item in response.output:
        if isinstance(item, rp.McpListToolsItem):
            print(f"listed {item.server_label}: {', '.join(tool.name for tool in item.tools)}")
        elif isinstance(item, rp.McpCallItem):
            arguments = json.loads(item.arguments)
            print(f"called {item.name}({arguments['a']}, {arguments['b']}) -> {item.output}")
    print("answer:", response.output_text)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve-mcp"]:
        serve_mcp()
    else:
        asyncio.run(main())
