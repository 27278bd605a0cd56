"""A bound on the request bodies the server holds in memory at once, across all requests.

Litestar reads a JSON body whole before the handler runs, and a request keeps it until
its answer is sent; with the 16 MiB body limit alone, 100 connections sending 15 MB each
took the server from 0.40 to 1.88 GB. :class:`BodyBudget` counts the bytes of the bodies
read or held, as they arrive (a stalled upload holds only what it sent, and the connection
rate limit in ``_serving`` cuts it); a request whose declared ``Content-Length`` cannot fit
is refused before any of its body is read, and one that would go past the budget while
arriving is refused then: 503 with ``Retry-After``. The bytes come back to the budget when
the request ends. Nothing is read before the route's guards pass, so a caller without the
API key cannot charge it. Multipart uploads (transcriptions) are counted too: Litestar
spools a file part to disk past 1 MiB as it arrives, but the handler reads it back whole
to decode it.
"""

from __future__ import annotations

from typing import Any

from litestar.types import ASGIApp, Receive, Scope, Send

from ._errors import OverloadedError

__all__ = ["BodyBudget"]


class BodyBudget:
    """Bytes of request bodies held at once (``limit``), and a Litestar middleware (call
    the instance on an app) that charges each request's body to it."""

    def __init__(self, limit: int, max_body_size: int) -> None:
        self.limit = limit
        self.max_body_size = max_body_size
        """Bodies larger than this are refused with 413 by Litestar (having read at most
        this much), so a larger declared length needs only this much room."""
        self.held = 0
        """Bytes charged by requests that have not ended."""

    def _charge(self, size: int) -> None:
        if self.held + size > self.limit:
            raise OverloadedError(
                f"the server holds {self.held} bytes of request bodies, no room for {size} more "
                f"(--max-body-memory-mb); try again shortly",
                headers={"Retry-After": "1"},
            )
        self.held += size

    def __call__(self, app: ASGIApp) -> ASGIApp:
        async def charging(scope: Scope, receive: Receive, send: Send) -> None:
            declared = _content_length(scope)
            if declared is not None and self.held + min(declared, self.max_body_size + 1) > self.limit:
                self._charge(declared)  # refused before anything is read
            charged = 0

            async def counted() -> Any:
                nonlocal charged
                message = await receive()
                if message["type"] == "http.request":
                    size = len(message.get("body", b""))
                    self._charge(size)
                    charged += size
                return message

            try:
                await app(scope, counted, send)
            finally:
                self.held -= charged

        return charging


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return max(0, int(value))
            except ValueError:
                return None
    return None
