"""``client.responses``: the OpenAI Responses API (``/responses``) on :class:`AsyncClient`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict, Unpack, cast, overload
from urllib.parse import urlencode

import msgspec

from . import responses_protocol as rp
from ._streaming import AsyncStream
from ._transport import Transport, request_struct

__all__ = ["InputItemParam", "ResponseCreateParams", "Responses"]

JSONObject = Mapping[str, Any]
InputItemParam = rp.InputItem | JSONObject
"""An input item: an item Struct or ``{"role": ..., "content": ...}`` / ``{"type": ...}``."""


class ResponseCreateParams(TypedDict, total=False):
    """Optional fields of :class:`~ortserve_client.responses_protocol.ResponseCreateRequest`."""

    instructions: str | None
    keep_alive: float | str | None
    cache_salt: str | None
    tools: Sequence[rp.FunctionTool | rp.McpTool | JSONObject] | None
    tool_choice: Literal["none", "auto", "required"] | rp.ToolChoiceFunction | rp.ToolChoiceMcp | JSONObject | None
    parallel_tool_calls: bool | None
    text: rp.TextConfig | JSONObject | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    reasoning: rp.Reasoning | JSONObject | None
    store: bool | None
    previous_response_id: str | None
    metadata: Mapping[str, str] | None
    user: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None
    service_tier: str | None
    background: bool | None
    include: Sequence[str] | None
    truncation: str | None
    top_logprobs: int | None
    max_tool_calls: int | None
    conversation: Any
    prompt: Any


_STREAM_EVENT = cast("type[rp.ResponseStreamEvent]", rp.ResponseStreamEvent)
"""The tagged union of the stream's events, as the type the stream decodes each one to."""


class Responses:
    """``client.responses``: create (whole or streamed), retrieve and delete responses."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    @overload
    async def create(
        self,
        *,
        model: str,
        input: str | Sequence[InputItemParam],
        stream: Literal[False] = False,
        **options: Unpack[ResponseCreateParams],
    ) -> rp.Response: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        input: str | Sequence[InputItemParam],
        stream: Literal[True],
        **options: Unpack[ResponseCreateParams],
    ) -> AsyncStream[rp.ResponseStreamEvent]: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        input: str | Sequence[InputItemParam],
        stream: bool,
        **options: Unpack[ResponseCreateParams],
    ) -> rp.Response | AsyncStream[rp.ResponseStreamEvent]: ...

    async def create(
        self,
        *,
        model: str,
        input: str | Sequence[InputItemParam],
        stream: bool = False,
        **options: Unpack[ResponseCreateParams],
    ) -> rp.Response | AsyncStream[rp.ResponseStreamEvent]:
        """``POST /responses``. ``input`` is text or items (Structs or dicts); ``options``
        are the request's other fields. With ``stream=True``, an :class:`AsyncStream` of
        the typed events (``response.created`` ... ``response.completed``); an ``error``
        event raises :class:`~ortserve_client.StreamError`."""

        # The wire Struct keeps input items as JSON objects (see responses_protocol), so
        # Structs become their JSON form first; checked as Structs all the same.
        items = input if isinstance(input, str) else [msgspec.to_builtins(item) for item in input]
        if not isinstance(items, str):
            try:
                rp.input_items(items)
            except msgspec.ValidationError as exc:  # as _request reports its fields'
                raise TypeError(f"invalid input items: {exc}") from exc
        body = request_struct(rp.ResponseCreateRequest, {"model": model, "input": items, "stream": stream, **options})
        url = f"{self._transport.base_url}/responses"
        if stream:
            return await self._transport.stream(url, body, _STREAM_EVENT)
        return await self._transport.send("POST", url, body, rp.Response)

    async def retrieve(self, response_id: str) -> rp.Response:
        """``GET /responses/{id}``: a response stored with ``store=True``."""
        return await self._transport.send(
            "GET", f"{self._transport.base_url}/responses/{response_id}", None, rp.Response
        )

    async def input_items(
        self,
        response_id: str,
        *,
        limit: int | None = None,
        order: Literal["asc", "desc"] | None = None,
        after: str | None = None,
        before: str | None = None,
    ) -> rp.InputItemList:
        """``GET /responses/{id}/input_items``: a page of what a stored response took as input
        (the conversation it continued, then its own input; newest first unless ``order="asc"``)."""
        given = {"limit": limit, "order": order, "after": after, "before": before}
        query = urlencode({key: value for key, value in given.items() if value is not None})
        url = f"{self._transport.base_url}/responses/{response_id}/input_items{'?' if query else ''}{query}"
        return await self._transport.send("GET", url, None, rp.InputItemList)

    async def delete(self, response_id: str) -> rp.ResponseDeleted:
        """``DELETE /responses/{id}``."""
        url = f"{self._transport.base_url}/responses/{response_id}"
        return await self._transport.send("DELETE", url, None, rp.ResponseDeleted)
