"""The bounds of MCP over streamable HTTP, where the MCP SDK's own transport reads and parses
what a server sends.

The SDK reads a JSON answer whole and parses it on the event loop, and hands every SSE event
on as a message: a server listing 50,000 tools (4 MB) held the loop 2 s and grew the process
216 MiB before the request was refused for its 128-tool bound. :func:`bounded_http_client`
is the SDK's HTTP client with a transport that watches every answer's bytes as they arrive,
before the SDK parses them, with the stdio transport's bounds: a message (an SSE event, or a
whole JSON answer) past ``max_bytes`` or listing more than :data:`MAX_LISTED_TOOLS` tools,
or more than :data:`MAX_NOTIFICATIONS_PER_SECOND` events in a second, or (counted on a worker
thread once it is whole) with more keys or items than a request body may have
(``_json_bounds``), or an event nested past the depth Python's ``json`` decodes, ends that answer with an error the SDK reports as the call's (or the
tool list's) failure. Events that carry
notifications are dropped, as on stdio.

The bounds count the bytes the SDK will read, decoded: httpx decodes a ``Content-Encoding``
above the transport, where a gzip answer of 300 KB became 300 MB for the SDK to parse (the
event loop held 8 s, +1.4 GiB). So the transport asks for gzip or deflate only, inflates
them itself a piece at a time (:class:`._inflate.Inflater`), and hands the answer on as not
encoded.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx2

from ._inflate import ACCEPT_ENCODING, CodingError, Inflater
from ._mcp_stdio import (
    MAX_LISTED_TOOLS,
    MAX_NOTIFICATIONS_PER_SECOND,
    NESTED_TOO_DEEP,
    PerSecond,
    is_notification,
    message_past_bounds,
)

__all__ = ["MessageRefusedError", "bounded_http_client"]

_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
"""Where an SSE event ends (a blank line, in any of the three line endings)."""
_TOOL = b'"inputSchema"'
"""Every listed tool has one; a quote inside a JSON string is escaped, so text cannot fake one."""


class MessageRefusedError(httpx2.StreamError, httpx2.SSEError):
    """An answer refused for its size, its tools or its pace. Both of the kinds the SDK turns
    into the failed request's error: a JSON answer's read fails with a ``StreamError``, an
    event stream's with an ``SSEError``."""

    def __init__(self, what: str) -> None:
        Exception.__init__(self, f"the MCP server sent {what}")


def bounded_http_client(headers: dict[str, str], max_bytes: int) -> httpx2.AsyncClient:
    """The client the SDK would make (its timeouts), reading through the bounds."""
    from mcp.shared._httpx_utils import MCP_DEFAULT_SSE_READ_TIMEOUT, MCP_DEFAULT_TIMEOUT

    return httpx2.AsyncClient(
        headers=headers,
        timeout=httpx2.Timeout(MCP_DEFAULT_TIMEOUT, read=MCP_DEFAULT_SSE_READ_TIMEOUT),
        transport=_BoundedTransport(httpx2.AsyncHTTPTransport(), max_bytes),
    )


class _BoundedTransport(httpx2.AsyncBaseTransport):
    def __init__(self, inner: httpx2.AsyncBaseTransport, max_bytes: int) -> None:
        self._inner = inner
        self._max_bytes = max_bytes

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.headers["Accept-Encoding"] = ACCEPT_ENCODING  # those inflated here
        response = await self._inner.handle_async_request(request)
        events = response.headers.get("content-type", "").lower().startswith("text/event-stream")
        # Decoded here, bounded, so that httpx, above the transport, decodes nothing.
        encoding = response.headers.pop("content-encoding", "").strip().lower() or "identity"
        if encoding != "identity":
            response.headers.pop("content-length", None)
        response.stream = _BoundedStream(response.stream, events, self._max_bytes, encoding)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _BoundedStream(httpx2.AsyncByteStream):
    """An answer's bytes, passed on as they come, with the message being received kept to
    count in: for an event stream, the current event (and the events of the current second);
    for anything else, the whole answer."""

    def __init__(self, inner: Any, events: bool, max_bytes: int, encoding: str = "identity") -> None:
        self._inner = inner
        self._encoding = encoding
        self._events = events
        self._max_bytes = max_bytes
        self._message = bytearray()
        self._listed = 0
        """Tools in the message so far (those wholly in ``_message`` before the last chunk)."""
        self._pace = PerSecond()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            inflater = Inflater(self._encoding)
            async for chunk in self._inner:
                for piece in inflater.pieces(chunk):
                    for passed in self._take(piece):
                        if self._events:
                            await _check_counts(passed)
                        yield passed
        except CodingError as exc:
            raise MessageRefusedError(str(exc)) from None
        if self._events and self._message:  # an event the stream ended in the middle of
            await _check_counts(self._message)
            yield bytes(self._message)
        elif not self._events:  # the whole answer, before the SDK reads it as a whole
            await _check_counts(self._message)

    def _take(self, chunk: bytes) -> list[bytes]:
        """What of ``chunk`` goes on to the SDK: all of it, or, in an event stream, the
        events it completes that are not notifications."""
        counted = max(0, len(self._message) - len(_TOOL) + 1)  # tools starting before are in _listed
        scan = max(0, len(self._message) - 3)  # an event's end may straddle two chunks
        self._message += chunk
        passed = [chunk]
        if self._events:
            passed, start = [], 0
            for end in _EVENT_END.finditer(self._message, scan):
                self._list(self._message.count(_TOOL, max(start, counted), end.start()))
                self._listed = 0
                self._count_event()
                event = bytes(self._message[start : end.end()])
                if not _is_notification(event):
                    passed.append(event)
                start = end.end()
            if start:
                del self._message[:start]
                counted = 0  # the rest began after the last end, after what was counted
        self._list(self._message.count(_TOOL, counted))
        if len(self._message) > self._max_bytes:
            raise MessageRefusedError(f"a message of more than {self._max_bytes} bytes")
        return passed

    def _list(self, tools: int) -> None:
        self._listed += tools
        if self._listed > MAX_LISTED_TOOLS:
            raise MessageRefusedError(f"a list of more than {MAX_LISTED_TOOLS} tools (the most taken)")

    def _count_event(self) -> None:
        if self._pace.past_bound():
            raise MessageRefusedError(f"more than {MAX_NOTIFICATIONS_PER_SECOND} messages in a second")

    async def aclose(self) -> None:
        await self._inner.aclose()


async def _check_counts(message: bytes | bytearray) -> None:
    """Refuses a message with more keys or items than a request body may have, counted on a
    worker thread before the SDK parses it on the event loop: a result of 200,000 content
    items (3 MB) held the loop 2.8-4 s while the SDK made them models."""
    past = await message_past_bounds(bytes(message))
    if past is not None:
        raise MessageRefusedError(f"a message of {past[0]}")


def _is_notification(event: bytes) -> bool:
    """Whether an SSE event carries a JSON-RPC notification (dropped: ortserve uses none a
    server sends, and the SDK handled each in a task of its own on the event loop)."""
    if len(event) > 64 * 1024:
        return False  # not looked into: a log line or progress is short
    data = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    try:
        message = json.loads(b"\n".join(data))
    except ValueError:
        return False  # the SDK says what is wrong with it
    except RecursionError:  # it ended the stream: "SSE stream ended without a response"
        raise MessageRefusedError(f"a message {NESTED_TOO_DEEP}") from None
    return is_notification(message)
