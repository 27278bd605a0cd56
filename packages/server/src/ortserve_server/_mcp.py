"""MCP servers the server calls itself, for the Responses API's ``mcp`` tools and the
Messages API's ``mcp_servers`` (the tool loop runs where the model runs).

The operator decides what may run: a request names a server by the label the operator
configured (``--mcp-server LABEL=URL`` or ``LABEL=stdio:COMMAND ARGS``), or by a URL only
when it is under one of ``--allow-mcp-url``'s prefixes. No request can make the server
start a process or reach an address that is not named in its configuration.

A configured server is connected on first use and stays connected (a stdio server is one
process for all requests) until the app stops; one that drops (a stdio server's process
exited, or was stopped for a message past ``mcp_max_message_bytes``; an HTTP server's
session, closed when a call or a listing ran past its timeout) is connected again on
next use. Its tool list is kept for ``mcp_list_ttl`` seconds. A server a request names by URL is
connected for that request only (its headers are the request's) and closed with it.

Every connection lives in a task of its own, since the MCP SDK's client (anyio task
groups) must be closed by the task that opened it; requests call through it from theirs.
A request cancelled mid-call (its client went away) abandons the call, and the SDK tells
the MCP server so (``notifications/cancelled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from ortserve_client import protocol as p

from ._config import url_allowed
from ._errors import BadRequestError, ServerError
from ._mcp_stdio import StdioLink
from ._record import span

if TYPE_CHECKING:
    from ._config import ServerConfig
    from ._metrics import Metrics

__all__ = [
    "McpHub",
    "McpTool",
    "McpToolError",
    "McpTools",
    "McpUnavailableError",
    "failure_text",
    "tool_error_text",
]

logger = logging.getLogger("ortserve.mcp")


class _OneLine(logging.Filter):
    """The MCP SDK logs an answer it cannot parse (a faulty server's, nested too deep...)
    with its traceback at ERROR, though the call fails and says why (the error the caller
    gets names it): one WARNING line here, as ortserve logs a server that misbehaves."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info is not None and record.exc_info[1] is not None:
            error = record.exc_info[1]
            first = next(iter(str(error).splitlines()), "")[:300]
            record.msg = f"{record.getMessage()}: {type(error).__name__}: {first}"
            record.args = ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


logging.getLogger("mcp.client.streamable_http").addFilter(_OneLine())


class McpUnavailableError(ServerError):
    """An MCP server could not be reached or could not list its tools: 424, as OpenAI
    answers (the request depended on it)."""

    status_code = 424
    type = "external_connector_error"
    code = "mcp_server_unavailable"


class McpToolError(Exception):
    """A call that did not give a result: ``kind`` is OpenAI's error type
    (``mcp_protocol_error``, ``http_error``), ``code`` the MCP or HTTP code."""

    def __init__(self, kind: str, code: int, message: str) -> None:
        super().__init__(message)
        self.kind, self.code, self.message = kind, code, message

    @property
    def text(self) -> str:
        """What the model reads of it (as its tool's output)."""
        return failure_text(self.kind, self.code, self.message)


def failure_text(kind: str, code: object, message: object) -> str:
    """What the model reads of a call that gave no result (Responses' ``mcp_protocol_error``...)."""
    return f"Error ({kind} {code}): {message}"


def tool_error_text(content: str) -> str:
    """What the model reads of a tool that ran and reported an error."""
    return f"Error: {content}"


@dataclass(frozen=True, slots=True)
class McpTool:
    """A tool as the server listed it."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    annotations: dict[str, Any] | None = None

    @property
    def read_only(self) -> bool:
        return bool((self.annotations or {}).get("readOnlyHint"))


@dataclass(slots=True)
class _Result:
    """A call's outcome: the text the model reads, and whether the tool said it failed
    (then ``content`` is its content blocks, for OpenAI's ``mcp_tool_execution_error``)."""

    text: str
    is_error: bool
    content: list[dict[str, Any]]


class _Link:
    """One open MCP connection, owned by a task of its own (see the module's docstring)."""

    def __init__(
        self, name: str, target: Any, headers: dict[str, str], start_timeout: float, max_message_bytes: int
    ) -> None:
        self.name = name
        self._target = target
        self._headers = headers
        self._start_timeout = start_timeout
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.client: Any = None
        self._max_message_bytes = max_message_bytes
        self._stdio = StdioLink(target, max_message_bytes, name) if isinstance(target, tuple) else None
        self._given_up: str | None = None
        """Why an HTTP session was closed (a call past its timeout), else ``None``."""

    @property
    def ended(self) -> str | None:
        """Why the connection is over (a stdio server's process ended, an HTTP session was
        given up...), else ``None``."""
        return self._stdio.ended if self._stdio is not None else self._given_up

    def fresh(self) -> _Link:
        """A link, not yet open, to the same server with the same headers."""
        return _Link(self.name, self._target, self._headers, self._start_timeout, self._max_message_bytes)

    def _timed_out(self, what: str) -> None:
        """An HTTP session whose request ran past its timeout is closed: in the protocol
        version ortserve speaks the SDK only posts ``notifications/cancelled`` and keeps
        reading that request's answer (a server trickling it held the connection, and a
        task reading it, for as long as it liked). The owning task closes the session, its
        HTTP client and connections; the next use opens a fresh one. Calls in flight on it
        then fail."""
        if self._stdio is None and self._given_up is None:
            self._given_up = f"{what}: its connection was closed and opens again on next use"
            logger.warning("MCP server %s: %s", self.name, self._given_up)
            self._stop.set()

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done() and self.client is not None and self.ended is None

    async def open(self) -> None:
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._own(ready), name=f"mcp:{self.name}")
        try:
            await asyncio.wait_for(asyncio.shield(ready), self._start_timeout)
        except TimeoutError:
            await self.close()
            raise McpUnavailableError(
                f"MCP server {self.name!r} did not answer within {self._start_timeout:g} s"
            ) from None
        except BaseException:  # unreachable, or the request was cancelled while waiting
            await self.close()
            raise

    async def _own(self, ready: asyncio.Future[None]) -> None:
        from mcp import Client
        from mcp.client.streamable_http import streamable_http_client

        from ._mcp_http import bounded_http_client

        target = self._target
        try:
            async with contextlib.AsyncExitStack() as stack:
                if self._stdio is not None:
                    server: Any = self._stdio.transport()
                else:
                    bound = self._max_message_bytes
                    # Made on a worker thread: its transport's TLS context loads the certificate
                    # authorities' bundle, 30-70 ms of the GIL.
                    client = await asyncio.to_thread(bounded_http_client, self._headers, bound)
                    http = await stack.enter_async_context(client)
                    server = streamable_http_client(target, http_client=http, max_sse_event_size=bound)
                self.client = await stack.enter_async_context(Client(server, mode="legacy", cache=None))
                ready.set_result(None)
                await self._stop.wait()
        except Exception as exc:  # noqa: BLE001  # any failure to connect is the server's
            if not ready.done():
                ready.set_exception(McpUnavailableError(f"MCP server {self.name!r} cannot be reached: {_why(exc)}"))
            else:
                logger.warning("MCP server %s dropped: %s", self.name, _why(exc))
        finally:
            self.client = None

    async def close(self) -> None:
        """Closes the connection (a stdio server's process ends with it); one still being
        opened (a server that does not answer) is given up at once."""
        self._stop.set()
        task = self._task
        if task is None or task.done():
            return
        if self.client is None:
            task.cancel()
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, 5)  # wait_for cancels it when the time is up

    async def list_tools(self) -> list[McpTool]:
        tools: list[McpTool] = []
        cursor = None
        while True:
            try:
                page = await asyncio.wait_for(self.client.list_tools(cursor=cursor), self._start_timeout)
            except TimeoutError:
                self._timed_out(f"listing its tools took more than {self._start_timeout:g} s")
                raise
            for tool in page.tools:
                annotations = (
                    tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else None
                )
                tools.append(McpTool(tool.name, tool.input_schema, tool.description, annotations))
            cursor = page.next_cursor
            if not cursor:
                return tools

    def _call_timed_out(self, timeout: float) -> McpToolError:
        from mcp_types import REQUEST_TIMEOUT

        self._timed_out(f"a call took more than {timeout:g} s")
        return McpToolError("mcp_protocol_error", REQUEST_TIMEOUT, f"the tool did not answer within {timeout:g} s")

    async def call(self, name: str, arguments: dict[str, Any], timeout: float) -> _Result:
        from mcp.shared.exceptions import MCPError
        from mcp_types import REQUEST_TIMEOUT

        client = self.client
        if client is None or self.ended:  # closed since the caller got it (another call timed out)
            raise McpToolError("mcp_protocol_error", -32000, self.ended or "the connection to the MCP server is closed")
        try:
            result = await client.call_tool(name, arguments, read_timeout_seconds=timeout)
        except MCPError as exc:
            if exc.code == REQUEST_TIMEOUT:  # the SDK's own, at read_timeout_seconds
                raise self._call_timed_out(timeout) from exc
            raise McpToolError("mcp_protocol_error", exc.code, self.ended or exc.error.message) from exc
        except TimeoutError as exc:
            raise self._call_timed_out(timeout) from exc
        except Exception as exc:  # the transport's failures: the model is told
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if isinstance(status, int):
                raise McpToolError("http_error", status, _why(exc)) from exc
            raise McpToolError("mcp_protocol_error", -32603, _why(exc)) from exc
        content = [block.model_dump(by_alias=True, exclude_none=True) for block in result.content]
        texts = [block["text"] for block in content if block.get("type") == "text"]
        text = "\n".join(texts)
        if not texts and result.structured_content is not None:
            text = json.dumps(result.structured_content, ensure_ascii=False)
        elif len(texts) < len(content):
            text += "".join(
                f"\n[{block.get('type')} content not shown]" for block in content if block.get("type") != "text"
            )
        return _Result(text, bool(result.is_error), content)


def _cut(text: str, limit: int) -> str:
    """``text`` as the model reads it: its first ``limit`` bytes, with a note of the rest."""
    encoded = text.encode()
    if len(encoded) <= limit:
        return text
    return encoded[:limit].decode(errors="ignore") + f"\n[output cut: {len(encoded) - limit} more bytes]"


def _why(exc: BaseException) -> str:
    """The reason of an error, through the exception groups anyio wraps errors in."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return str(exc) or type(exc).__name__


class McpHub:
    """The configured servers' connections and tool lists, one per mounted ortserve."""

    def __init__(self, config: ServerConfig, metrics: Metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.servers = {server.label: server for server in config.mcp_servers}
        self._links: dict[str, _Link] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._tools: dict[str, tuple[float, list[McpTool]]] = {}

    async def link(self, label: str) -> _Link:
        lock = self._locks.setdefault(label, anyio.Lock())
        async with lock:
            link = self._links.get(label)
            if link is None or not link.alive:
                if link is not None:  # ended: its process is stopped before another starts
                    await link.close()
                server = self.servers[label]
                target = server.command if server.command else server.url
                config = self.config
                link = _Link(label, target, server.headers, config.mcp_start_timeout, config.mcp_max_message_bytes)
                await link.open()
                self._links[label] = link
            return link

    async def tools(self, label: str) -> list[McpTool]:
        kept = self._tools.get(label)
        if kept is not None and kept[0] > time.monotonic():
            return kept[1]
        link = await self.link(label)
        try:
            tools = await link.list_tools()
        except Exception as exc:
            why = link.ended or _why(exc)
            raise McpUnavailableError(f"MCP server {label!r} could not list its tools: {why}") from exc
        self._tools[label] = (time.monotonic() + self.config.mcp_list_ttl, tools)
        return tools

    async def close(self) -> None:
        links, self._links = list(self._links.values()), {}
        await asyncio.gather(*(link.close() for link in links))


@dataclass(slots=True)
class _Use:
    """A server as one request uses it: the tools it may call, and whether a call needs
    the user's approval first."""

    label: str
    link_label: str | None
    """The configured server's label; ``None`` for one named by URL (its own link)."""
    tools: dict[str, McpTool]
    approval: Any
    link: _Link | None = None
    description: str | None = None
    """What the request says the server is for (OpenAI's ``server_description``): it
    leads each of the server's tool descriptions, where the model reads it."""


class McpTools:
    """The MCP servers one request uses, for as long as it runs (then :meth:`close`):
    their tools as the model sees them, and the calls it makes."""

    def __init__(self, hub: McpHub, budget: int | None = None) -> None:
        self.hub = hub
        self.budget = hub.config.mcp_max_tool_calls if budget is None else min(budget, hub.config.mcp_max_tool_calls)
        """Calls this request may make (``max_tool_calls``, at most the server's bound)."""
        self.made = 0
        self.uses: dict[str, _Use] = {}
        self.by_tool: dict[str, str] = {}
        """Tool name -> the label of the server that has it."""
        self._own: list[_Link] = []

    async def close(self) -> None:
        """Closes the connections of the servers the request named by URL."""
        links, self._own = self._own, []
        await asyncio.gather(*(link.close() for link in links))

    async def add(
        self,
        label: str,
        param: str,
        *,
        url: str | None = None,
        headers: dict[str, str] | None = None,
        allowed: Callable[[McpTool], bool] | None = None,
        approval: Any = "never",
        listed: list[McpTool] | None = None,
        description: str | None = None,
    ) -> list[McpTool]:
        """Adds the server ``label`` (configured, or at ``url`` when the operator allows
        it; ``param`` names the request's field in refusals); returns its tools, those ``allowed``
        picks when given. ``listed``: a listing the conversation already holds."""
        hub = self.hub
        if label in self.uses:
            raise BadRequestError(f"MCP server label {label!r} is given twice", param=param)
        configured = label in hub.servers
        if not configured:
            if url is None:
                raise BadRequestError(
                    f"no MCP server is configured with the label {label!r} (configured: "
                    f"{', '.join(sorted(hub.servers)) or 'none'}); the operator adds them with --mcp-server",
                    param=param,
                )
            if not url_allowed(url, hub.config.mcp_allowed_urls):
                raise BadRequestError(
                    f"MCP server URL {url!r} is not allowed on this server: a request may name only the URLs "
                    "the operator allows with --allow-mcp-url, or a configured server's label",
                    param=param,
                )
        use = _Use(label, label if configured else None, {}, approval, description=description)
        if listed is None:
            started = time.perf_counter()
            if configured:
                listed = await hub.tools(label)
            else:
                assert url is not None
                link = _Link(label, url, headers or {}, hub.config.mcp_start_timeout, hub.config.mcp_max_message_bytes)
                await link.open()
                self._own.append(link)
                use.link = link
                try:
                    listed = await link.list_tools()
                except Exception as exc:
                    raise McpUnavailableError(f"MCP server {label!r} could not list its tools: {_why(exc)}") from exc
            hub.metrics.mcp_list_seconds.labels(self.metric_label(label)).observe(time.perf_counter() - started)
        tools = [tool for tool in listed if allowed is None or allowed(tool)]
        for tool in tools:
            other = self.by_tool.get(tool.name)
            if other is not None:
                raise BadRequestError(
                    f"MCP servers {other!r} and {label!r} both have a tool named {tool.name!r}; "
                    "narrow one with allowed_tools",
                    param=param,
                )
            self.by_tool[tool.name] = label
        use.tools = {tool.name: tool for tool in tools}
        self.uses[label] = use
        return tools

    def chat_tools(self) -> list[p.Tool]:
        """The servers' tools as chat tools (their input schemas as parameters)."""

        def described(use: _Use, tool: McpTool) -> str | msgspec.UnsetType:
            parts = [part for part in (use.description, tool.description) if part]
            return " ".join(parts) if parts else msgspec.UNSET

        return [
            p.Tool(
                function=p.FunctionDefinition(
                    name=tool.name, description=described(use, tool), parameters=tool.input_schema
                )
            )
            for use in self.uses.values()
            for tool in use.tools.values()
        ]

    def metric_label(self, label: str) -> str:
        """Metrics carry configured labels only (a request's own names are unbounded)."""
        return label if label in self.hub.servers else "(request url)"

    def owner(self, tool: str) -> str | None:
        return self.by_tool.get(tool)

    @property
    def spent(self) -> bool:
        """Whether the request made all the calls it may (the model must answer now)."""
        return self.made >= self.budget

    async def call(self, label: str, name: str, arguments: str) -> _Result:
        """Calls a tool; raises :class:`McpToolError` when there is no result (then the
        model reads the error), or when the request's calls are spent."""
        if self.spent:
            raise McpToolError("mcp_protocol_error", -32000, f"not called: the {self.budget} calls allowed are made")
        self.made += 1
        hub = self.hub
        use = self.uses[label]
        tool_label = name if use.link_label is not None else "(request url)"
        started = time.perf_counter()
        outcome = "error"
        try:
            try:
                parsed = json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                raise McpToolError("mcp_protocol_error", -32602, f"the arguments are not JSON: {exc}") from exc
            except RecursionError:
                raise McpToolError("mcp_protocol_error", -32602, "the arguments are nested too deeply") from None
            if not isinstance(parsed, dict):
                raise McpToolError("mcp_protocol_error", -32602, "the arguments are not a JSON object")
            if use.link is not None and not use.link.alive:  # given up after a timeout: a fresh one
                use.link = use.link.fresh()
                self._own.append(use.link)
                await use.link.open()
            link = use.link if use.link is not None else await hub.link(label)
            tool = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name, "ortserve.mcp.server": label}
            with span(f"execute_tool {name}", **tool):  # a span while tracing, else nothing
                result = await link.call(name, parsed, hub.config.mcp_call_timeout)
            result.text = _cut(result.text, hub.config.mcp_max_output_bytes)
            outcome = "tool_error" if result.is_error else "ok"
            return result
        except McpToolError as exc:  # an error's message, the server's own text too, is cut as a result is
            exc.message = _cut(exc.message, hub.config.mcp_max_output_bytes)
            raise
        except McpUnavailableError as exc:
            raise McpToolError("mcp_protocol_error", -32000, exc.message) from exc
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            hub.metrics.mcp_calls.labels(self.metric_label(label), tool_label, outcome).inc()
            hub.metrics.mcp_call_seconds.labels(self.metric_label(label)).observe(time.perf_counter() - started)

    def needs_approval(self, label: str, name: str) -> bool:
        """OpenAI's ``require_approval``: ``"always"`` (its default), ``"never"``, or filters
        ``{"always": {...}, "never": {...}}`` by tool names or read-only hint."""
        use = self.uses[label]
        rule = use.approval
        if rule in ("always", None):
            return True
        if rule == "never":
            return False
        tool = use.tools.get(name)

        def matches(which: Any) -> bool:
            if not isinstance(which, dict):
                return False
            names = which.get("tool_names")
            read_only = which.get("read_only")
            by_name = isinstance(names, list) and name in names
            by_hint = read_only is not None and tool is not None and tool.read_only == read_only
            return by_name or by_hint

        # A tool named by neither filter needs approval, as with the default "always".
        return matches(rule.get("always")) or not matches(rule.get("never"))
