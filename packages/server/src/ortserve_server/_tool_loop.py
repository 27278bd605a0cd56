"""What the Responses and Anthropic routes share for a request whose turns the server runs
(MCP calls between them): usage summed over the turns, delivery whole or streamed, and the
MCP connections released either way.

A streamed loop opens (its API's opening events), runs its turns (a later turn that cannot
start is an in-band error event, as errors after the first byte must be), and closes (its
API's closing events); a whole one runs the same turns, their events unsent, stopped if the
client leaves.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request
from ortserve_client import protocol as p

from ._connection import while_connected
from ._mcp import McpTools
from ._record import current
from ._state import OrtServe

__all__ = ["ToolLoop"]


class ToolLoop(abc.ABC):
    """One request's turns, as an API family runs them (:meth:`run_turns`)."""

    def __init__(self, state: OrtServe, request: Request[Any, Any, Any], mcp: McpTools) -> None:
        self.state, self.request, self.mcp = state, request, mcp
        record = current()
        if record is not None:
            record.tool_loop = True  # each turn is a span of its own
        self.failed = False
        """An error event was sent: the stream ends there."""
        self.usage = p.CompletionUsage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        """Every turn's usage summed (cached prompt tokens included)."""

    @abc.abstractmethod
    def run_turns(self, stream: bool) -> AsyncIterator[bytes]:
        """Every turn's events (a whole answer runs through it too, its events unsent)."""

    @abc.abstractmethod
    def opening(self) -> bytes:
        """The events a stream starts with."""

    @abc.abstractmethod
    def closing(self) -> bytes:
        """The events a stream ends with, once every turn ran."""

    async def last_events(self) -> bytes:
        """:meth:`closing`, once what it needs is done (a stored response written)."""
        return self.closing()

    @abc.abstractmethod
    def error_event(self, exc: Exception) -> bytes:
        """``exc`` as the API's in-band error event."""

    def add_usage(self, usage: p.CompletionUsage) -> None:
        """Count one turn's ``usage`` in :attr:`usage`."""
        total = self.usage
        total.prompt_tokens += usage.prompt_tokens
        total.completion_tokens += usage.completion_tokens
        total.total_tokens += usage.total_tokens
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        details = total.prompt_tokens_details or p.PromptTokensDetails(cached_tokens=0)
        details.cached_tokens += cached
        total.prompt_tokens_details = details

    def failure(self, exc: Exception) -> bytes:
        """:meth:`error_event`, the stream ending with it."""
        self.failed = True
        return self.error_event(exc)

    async def finish(self) -> None:
        """Run every turn for a whole answer, stopped if the client leaves."""
        try:
            await while_connected(self.request, self.state, self._drain())
        finally:
            await self.mcp.close()

    async def _drain(self) -> None:
        async for _ in self.run_turns(stream=False):
            pass

    async def stream(self) -> AsyncIterator[bytes]:
        try:
            yield self.opening()
            try:
                async for chunk in self.run_turns(stream=True):
                    yield chunk
            except Exception as exc:  # noqa: BLE001  # a later turn that could not start: in-band
                yield self.failure(exc)
            if not self.failed:
                yield await self.last_events()
        finally:
            await self.mcp.close()
