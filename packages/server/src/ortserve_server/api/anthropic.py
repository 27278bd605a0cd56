"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A thin adapter over the chat completions path: a request becomes the OpenAI-shaped
:class:`~ortserve_client.protocol.ChatCompletionRequest` it means, so that it is checked,
planned (tools through the chat template, forced calls through the same grammar) and run
exactly as a chat completion is (the request side: :mod:`.anthropic_request`); the output
goes back as Anthropic content blocks. With ``mcp_servers`` a message is a loop of model
turns in which the server makes the MCP calls the model writes (:class:`_MessageLoop`). Errors
on these routes have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``,
with the field at fault named the way Anthropic names it (``messages.1.content.0.source``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import anthropic_protocol as a
from ortserve_client import protocol as p
from ortserve_runtime import ChatModel, ToolCall

from .._errors import (
    ServerError,
    reshaped_exception_handlers,
    unavailable_detail,
)
from .._generation import Generation, sse_event, stream_response
from .._leases import require_model
from .._mcp import McpToolError, McpTools, tool_error_text
from .._openapi import POST_ERRORS, also_sends, with_error_responses
from .._plan import start_chat
from .._record import current, note
from .._state import OrtServe
from .._tool_loop import ToolLoop
from .anthropic_request import _add_mcp_servers, _counted_prompt, _map, _Mapped, _named

__all__ = ["anthropic_exception_handlers", "anthropic_route_handlers"]

_encode = msgspec.json.Encoder().encode
_ERRORS = (*POST_ERRORS, 529)  # 529: a full queue, as Anthropic reports overload


# -- errors --------------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def _anthropic_error(
    status: int, message: str, param: str | None, code: str | None
) -> tuple[int, a.AnthropicErrorDetail]:
    """Status and error body as Anthropic sends them: a full queue is its 529
    ``overloaded_error`` (which its clients retry); the field at fault leads the message,
    as in Anthropic's own ``max_tokens: Field required``."""
    if code == "server_overloaded":
        status = 529
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return status, a.AnthropicErrorDetail(type=_ERROR_TYPES.get(status, "api_error"), message=message)


def _reshape(response: Response[p.ErrorResponse]) -> Response[a.AnthropicErrorResponse]:
    error = response.content.error
    status, detail = _anthropic_error(response.status_code or 500, error.message, error.param, error.code)
    return Response(a.AnthropicErrorResponse(error=detail), status_code=status, headers=response.headers)


anthropic_exception_handlers = reshaped_exception_handlers(_reshape)
"""The server's error translation with Anthropic's body and statuses (these routes only)."""


def _error_event(exc: Exception) -> bytes:
    """An error after the stream started, as Anthropic reports it (``event: error``)."""
    if isinstance(exc, ServerError):
        _, detail = _anthropic_error(exc.status_code, exc.message, None, exc.code)
    elif (unavailable := unavailable_detail(exc)) is not None:  # the model unloaded or crashed under it
        _, detail = _anthropic_error(503, unavailable.message, None, unavailable.code)
    else:  # unexpected: the message reveals nothing internal
        detail = a.AnthropicErrorDetail(type="api_error", message="the generation failed")
    record = current()
    return _event(a.AnthropicErrorResponse(error=detail, request_id=record.id if record is not None else msgspec.UNSET))


def _event(event: msgspec.Struct) -> bytes:
    """One server-sent event, named as its ``type``, as Anthropic frames them."""
    return sse_event(event, str(event.__struct_config__.tag))


# -- routes --------------------------------------------------------------------------------


def _stop_reason(reason: str, stop_sequence: str | None) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finish reason."""
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if stop_sequence is not None:
        return "stop_sequence", stop_sequence
    return "end_turn", None  # the end-of-turn token, or a grammar that completed


def _tool_use(call: ToolCall) -> a.ToolUseBlock:
    # The parser hands back arguments as a JSON object in text; Anthropic sends the object.
    # A call cut short by max_tokens (stop_reason max_tokens) holds JSON that does not parse
    # yet: its input is then empty (a stream's input_json_delta still carries what was written).
    try:
        arguments = json.loads(call.arguments)
    except (ValueError, RecursionError):
        arguments = {}
    return a.ToolUseBlock(
        id=f"toolu_{uuid.uuid4().hex[:24]}", name=call.name, input=arguments if isinstance(arguments, dict) else {}
    )


def _usage(usage: p.CompletionUsage) -> a.MessageUsage:
    """Anthropic counts prompt tokens read from the cache apart from ``input_tokens``."""
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return a.MessageUsage(
        input_tokens=usage.prompt_tokens - cached,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=cached,
    )


class _Blocks:
    """The content blocks of a message, and the stream events that say them: thinking,
    text and tool calls as the generation writes them (the thinking block, first since
    the think block starts the output, closes when the answer or a call begins), and MCP
    calls and their results as the server makes them."""

    def __init__(self) -> None:
        self.index = 0
        self.open: str | None = None
        """The kind of the block open now (``thinking`` or ``text``), if any."""
        self.content: list[a.ContentBlock] = []
        self.calling: list[tuple[a.McpToolUseBlock, str]] = []
        """The MCP calls written so far, with their arguments as the model wrote them."""

    def thinking(self, text: str) -> list[bytes]:
        out = self._open("thinking", a.ThinkingBlock(thinking=""))
        block = self.content[-1]
        assert isinstance(block, a.ThinkingBlock)
        block.thinking += text
        return [*out, _event(a.ContentBlockDeltaEvent(index=self.index, delta=a.ThinkingDelta(thinking=text)))]

    def text(self, text: str) -> list[bytes]:
        out = self._open("text", a.TextBlock(text=""))
        block = self.content[-1]
        assert isinstance(block, a.TextBlock)
        block.text += text
        return [*out, _event(a.ContentBlockDeltaEvent(index=self.index, delta=a.TextDelta(text=text)))]

    def _open(self, kind: str, empty: a.ContentBlock) -> list[bytes]:
        if self.open == kind:
            return []
        out = self.close()
        out.append(_event(a.ContentBlockStartEvent(index=self.index, content_block=empty)))
        self.content.append(empty)
        self.open = kind
        return out

    def tool(self, call: ToolCall) -> list[bytes]:
        block = _tool_use(call)
        opening = a.ToolUseBlock(id=block.id, name=block.name, input={})  # Anthropic's order: input follows
        return self._call(block, opening, call.arguments)

    def mcp_use(self, call: ToolCall, label: str) -> list[bytes]:
        plain = _tool_use(call)
        block = a.McpToolUseBlock(id="mcp" + plain.id, name=plain.name, server_name=label, input=plain.input)
        self.calling.append((block, call.arguments))
        return self._call(
            block, a.McpToolUseBlock(id=block.id, name=block.name, server_name=label, input={}), call.arguments
        )

    def _call(self, block: a.ContentBlock, opening: a.ContentBlock, arguments: str) -> list[bytes]:
        out = self.close()
        self.content.append(block)
        return [
            *out,
            _event(a.ContentBlockStartEvent(index=self.index, content_block=opening)),
            _event(a.ContentBlockDeltaEvent(index=self.index, delta=a.InputJSONDelta(partial_json=arguments))),
            *self._stop(),
        ]

    def mcp_result(self, block: a.McpToolResultBlock) -> list[bytes]:
        out = self.close()
        self.content.append(block)
        return [*out, _event(a.ContentBlockStartEvent(index=self.index, content_block=block)), *self._stop()]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return self._stop()

    def _stop(self) -> list[bytes]:
        self.index += 1
        return [_event(a.ContentBlockStopEvent(index=self.index - 1))]


@post(
    "/messages",
    status_code=200,
    summary="Create a message (Anthropic Messages API)",
    responses=with_error_responses(a.Message, "The message", *_ERRORS, error_body=a.AnthropicErrorResponse),
    operation_class=also_sends(
        "text/event-stream", "with stream: true, server-sent events: `event: <type>` and `data: <event JSON>` lines"
    ),
)
async def create_message(
    data: JSONBody[a.MessagesRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[Any]:
    mcp = McpTools(ortserve.mcp)
    try:
        model = await require_model(ortserve, data.model, data.keep_alive)
        await _add_mcp_servers(data, mcp)
        loop = _MessageLoop(data, ortserve, request, model, mcp)
        await loop.start()  # the first turn's refusals are HTTP errors
    except BaseException:
        await mcp.close()
        raise
    if data.stream is True:
        return stream_response(loop.stream())
    await loop.finish()
    stop_reason, stop_sequence = loop.stop()
    message = a.Message(
        id=loop.id,
        model=data.model,
        content=loop.blocks.content,
        stop_reason=stop_reason,  # type: ignore[arg-type]  # one of the four, by _stop_reason
        stop_sequence=stop_sequence,
        usage=_usage(loop.usage),
    )
    return Response(message)


class _MessageLoop(ToolLoop):
    """One message's turns. Without MCP servers, one turn. With them, the server makes
    the MCP calls the model writes (``mcp_tool_use`` and ``mcp_tool_result`` blocks) and
    puts their results into the next turn's prompt, until the model answers, calls one of
    the request's own tools (the client's to make), or reaches ``max_tokens`` (which
    bounds all turns together). A forced ``tool_choice`` holds for the first turn only;
    after the server's ``mcp_max_tool_calls`` calls the model must answer without tools."""

    def __init__(
        self,
        data: a.MessagesRequest,
        state: OrtServe,
        request: Request[Any, Any, Any],
        model: ChatModel,
        mcp: McpTools,
    ) -> None:
        super().__init__(state, request, mcp)
        self.data, self.model = data, model
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        note(response_id=self.id)
        self.blocks = _Blocks()
        self.reason = "stop"
        self.stop_sequence: str | None = None
        self.first_prompt = 0
        self.mapped = _Mapped(p.ChatCompletionRequest(model=data.model, messages=[]))
        self.turns: list[p.ChatMessage] = []
        """The messages of the turns so far (the calls written and their results)."""

    async def start(self) -> None:
        with _named(self.mapped):
            self.mapped = _map(self.data, self.model, self.mcp)
        self.run = await self._turn()

    async def _turn(self) -> Generation:
        data, mapped = self.data, self.mapped
        chat = msgspec.structs.replace(
            mapped.request,
            messages=[*mapped.request.messages, *self.turns],
            max_tokens=data.max_tokens - self.usage.completion_tokens,
        )
        if self.mcp.uses and self.mcp.spent:
            chat = msgspec.structs.replace(chat, tool_choice="none")  # same tools: the cached prompt holds
        elif self.turns and chat.tool_choice not in (msgspec.UNSET, "auto", "none"):
            chat = msgspec.structs.replace(chat, tool_choice="auto")  # forced for the first turn only
        with _named(mapped):
            started = await start_chat(self.state, self.model, chat, self.request, fit=bool(self.turns))
        self.first_prompt = self.first_prompt or started.prompt_tokens
        return Generation(self.state, f"{self.state.config.path}/messages", started)

    def _count(self, usage: p.CompletionUsage, run: Generation) -> None:
        self.add_usage(usage)
        self.stop_sequence = run.stop_sequences[0]

    def stop(self) -> tuple[str, str | None]:
        return _stop_reason(self.reason, self.stop_sequence)

    def _feed(self, run: Generation, thought: str, text: str, calls: list[ToolCall], reason: str | None) -> list[bytes]:
        blocks = self.blocks
        out = blocks.thinking(thought) if thought else []
        out += blocks.text(text) if text else []
        for call in calls:
            label = self.mcp.owner(call.name)
            out += blocks.tool(call) if label is None else blocks.mcp_use(call, label)
        if reason is not None:
            self.reason = reason
            out += blocks.close()
        return out

    async def run_turns(self, stream: bool) -> AsyncIterator[bytes]:
        run = self.run
        while True:
            start = len(self.blocks.content)
            calls_before = len(self.blocks.calling)
            if stream:
                async for chunk in run.sse(*self._callbacks(run), error_event=self.failure, closing=b""):
                    yield chunk
                if self.failed:
                    return
            else:
                texts, calls, finish, usage = await run.collect()
                self._count(usage, run)
                self._feed(run, run.reasonings[0], texts[0], calls[0], finish[0])
            turn = self.blocks.content[start:]
            calling = self.blocks.calling[calls_before:]
            if not calling:
                return
            # The turn as the model wrote it, then the results the server got.
            thought = "".join(b.thinking for b in turn if isinstance(b, a.ThinkingBlock))
            text = "".join(b.text for b in turn if isinstance(b, a.TextBlock))
            written = [
                p.ToolCall(
                    id=b.id, function=p.FunctionCall(name=b.name, arguments=json.dumps(b.input, ensure_ascii=False))
                )
                for b in turn
                if isinstance(b, a.ToolUseBlock | a.McpToolUseBlock)
            ]
            self.turns.append(
                p.AssistantMessage(content=text, tool_calls=written, reasoning_content=thought or msgspec.UNSET)
            )
            for use, arguments in calling:
                try:
                    result = await self.mcp.call(use.server_name, use.name, arguments)
                    answer, failed = result.text, result.is_error
                    read = tool_error_text(answer) if failed else answer
                except McpToolError as exc:
                    answer = read = exc.text
                    failed = True
                self.turns.append(p.ToolMessage(content=read, tool_call_id=use.id))
                for chunk in self.blocks.mcp_result(a.McpToolResultBlock(use.id, failed, [a.TextBlock(text=answer)])):
                    yield chunk
            if any(isinstance(b, a.ToolUseBlock) for b in turn):
                return  # calls of the client's own tools: stop_reason tool_use
            if self.reason == "length" or self.usage.completion_tokens >= self.data.max_tokens:
                self.reason = "length"  # max_tokens bounds all turns together
                return
            self.run = run = await self._turn()

    def _callbacks(self, run: Generation) -> tuple[Any, Any]:
        def events(_: int, text: str, calls: list[ToolCall], reason: str | None) -> list[bytes]:
            return self._feed(run, run.event_reasoning, text, calls, reason)

        def counted(usage: p.CompletionUsage) -> bytes:
            self._count(usage, run)
            return b""

        return events, counted

    def error_event(self, exc: Exception) -> bytes:
        return _error_event(exc)

    def opening(self) -> bytes:
        # The prompt's cached part is known only at the end: message_start counts it all
        # as input, and message_delta's cumulative counts correct that.
        started = a.Message(
            id=self.id,
            model=self.data.model,
            content=[],
            stop_reason=None,
            stop_sequence=None,
            usage=a.MessageUsage(input_tokens=self.first_prompt, output_tokens=0),
        )
        return _event(a.MessageStartEvent(message=started)) + _event(a.PingEvent())

    def closing(self) -> bytes:
        stop_reason, stop_sequence = self.stop()
        counts = _usage(self.usage)
        delta = a.MessageDeltaEvent(
            delta=a.MessageDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
            usage=a.MessageDeltaUsage(
                output_tokens=counts.output_tokens,
                input_tokens=counts.input_tokens,
                cache_read_input_tokens=counts.cache_read_input_tokens,
            ),
        )
        return _event(delta) + _event(a.MessageStopEvent())


@post(
    "/messages/count_tokens",
    status_code=200,
    summary="Count the tokens of a message's prompt (Anthropic Messages API)",
    responses=with_error_responses(
        a.CountTokensResponse, "The prompt's size", *_ERRORS, error_body=a.AnthropicErrorResponse
    ),
)
async def count_tokens(
    data: JSONBody[a.CountTokensRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> a.CountTokensResponse:
    prompt = await _counted_prompt(data, ortserve, request)
    ortserve.metrics.count_request(f"{ortserve.config.path}/messages/count_tokens", data.model, 200)
    note(model=data.model)
    return a.CountTokensResponse(input_tokens=len(prompt))


anthropic_route_handlers = [create_message, count_tokens]
