"""A request's work tied to its connection: stopped when the client leaves, or when a
shutdown cuts work off (then a 503 answers)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from litestar import Request

from ._errors import ClientDisconnectedError, ShuttingDownError
from ._state import OrtServe

__all__ = ["fetching_while_connected", "while_connected"]

T = TypeVar("T")


async def while_connected(request: Request[Any, Any, Any], state: OrtServe, work: Awaitable[T]) -> T:
    """``work``, cancelled if the client disconnects first (a non-streamed generation or
    transcription stops and frees its slot, as a streamed one does when its stream
    closes), or if a shutdown cuts work off (then a 503 answers)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    with state.cut_signal() as cut:
        try:
            waiting: set[asyncio.Future[Any]] = {task, gone, cut}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        was_cut = cut.done() and not cut.cancelled()
    if task.cancelled():
        if was_cut:
            state.cut_requests += 1
            raise ShuttingDownError("the server is shutting down; the request was cut off")
        raise ClientDisconnectedError("the client disconnected before the answer was ready")
    return task.result()


def fetching_while_connected(
    request: Request[Any, Any, Any] | None, state: OrtServe
) -> Callable[[Awaitable[None]], Awaitable[None]] | None:
    """What :func:`chat_messages` runs its remote image fetches through: stopped when the
    client leaves (``None`` without a request)."""
    if request is None:
        return None
    return lambda work: while_connected(request, state, work)


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Returns when the server reports the client gone (the body was read already, so
    ``receive`` has nothing else to say; under WSGI it never returns)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
