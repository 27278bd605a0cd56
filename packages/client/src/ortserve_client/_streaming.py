"""Server-sent events: the async iterator of chunks that ``stream=True`` returns."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Generic, TypeVar

import httpx
import msgspec

from ._errors import StreamError, translate_transport_errors
from .protocol import ErrorDetail, ErrorResponse

__all__ = ["AsyncStream", "ServerSentEvent", "iter_sse"]

T = TypeVar("T")  # a Struct, or a tagged union of them (the Responses API's events)
_decode_error = msgspec.json.Decoder(ErrorResponse).decode
_decode_error_event = msgspec.json.Decoder(ErrorDetail).decode


class ServerSentEvent(msgspec.Struct, frozen=True):
    """One event: its ``event`` name (``""`` when none was given) and its ``data`` lines."""

    event: str
    data: str


async def iter_sse(lines: AsyncIterator[str]) -> AsyncIterator[ServerSentEvent]:
    """Parse SSE lines (``data:`` lines joined by ``\\n``, dispatched at a blank line;
    comments and unknown fields skipped), as the WHATWG spec describes."""
    event = ""
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield ServerSentEvent(event, "\n".join(data))
            event, data = "", []
            continue
        if line.startswith(":"):
            continue  # a comment: keep-alives
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "data":
            data.append(value)
        elif field == "event":
            event = value
    if data:  # the stream ended without the final blank line
        yield ServerSentEvent(event, "\n".join(data))


class AsyncStream(Generic[T]):
    """The chunks of a streamed response, up to ``data: [DONE]``.

    Use it as ``async with stream: async for chunk in stream: ...``. Leaving early
    (``break``, an exception, the end of the ``async with`` block, or :meth:`aclose`) closes
    the HTTP response, which tells the server to stop generating. An error the server
    reports after the stream started (an ``error`` event, or an ``{"error": ...}`` body in
    place of a chunk) raises :class:`StreamError`.
    """

    def __init__(self, response: httpx.Response, chunk_type: type[T]) -> None:
        self.response = response
        self.request_id: str | None = response.headers.get("x-request-id")
        self._decode = msgspec.json.Decoder(chunk_type).decode
        self._iterator: AsyncGenerator[T, None] = self._chunks()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterator

    async def __anext__(self) -> T:
        return await self._iterator.__anext__()

    async def _chunks(self) -> AsyncGenerator[T, None]:
        try:
            with translate_transport_errors(str(self.response.request.url)):
                async for sse in iter_sse(self.response.aiter_lines()):
                    if sse.data == "[DONE]":
                        return
                    if sse.event == "error":
                        raise _stream_error(sse.data)
                    try:
                        chunk = self._decode(sse.data)
                    except msgspec.DecodeError as exc:
                        raise _stream_error(sse.data) from exc
                    yield chunk
        finally:
            await self.response.aclose()

    async def aclose(self) -> None:
        """Stop reading and close the HTTP response (safe to call more than once)."""
        await self._iterator.aclose()
        await self.response.aclose()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()


def _stream_error(data: str) -> StreamError:
    """The error for an event that is not a chunk: the server's error body if it is one."""
    try:
        body = _decode_error(data)
    except msgspec.DecodeError:
        try:  # the Responses API's error event: the error's fields at the top level
            body = ErrorResponse(error=_decode_error_event(data))
        except msgspec.DecodeError:
            return StreamError(f"unexpected event in the stream: {data[:200]!r}")
    return StreamError(f"the server reported an error mid-stream: {body.error.message}", body=body)
