"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A thin adapter over the chat completions path: a request becomes the OpenAI-shaped
:class:`~ortserve_client.protocol.ChatCompletionRequest` it means, so that it is checked,
planned (tools through the chat template, forced calls through the same grammar) and run
exactly as a chat completion is; the output goes back as Anthropic content blocks. Errors
on these routes have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``,
with the field at fault named the way Anthropic names it (``messages.1.content.0.source``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import anthropic_protocol as a
from ortserve_client import protocol as p
from ortserve_runtime import ChatModel, InvalidRequestError, Prompt, ToolCall, ToolCallParser

from ._errors import (
    BadRequestError,
    ServerError,
    UnsupportedParameterError,
    reshaped_exception_handlers,
    unavailable_detail,
)
from ._mapping import (
    GenerationPlan,
    caller_of,
    chat_messages,
    check_room,
    plan_chat,
    require_model,
    template_kwargs,
)
from ._openapi import POST_ERRORS, also_sends, with_error_responses
from ._routes import _Generation, _stream_response, _while_connected, fetching_while_connected
from ._state import OrtServe

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
    return _event(a.AnthropicErrorResponse(error=detail))


def _event(event: msgspec.Struct) -> bytes:
    """One server-sent event, named as its ``type``, as Anthropic frames them."""
    name = str(event.__struct_config__.tag)
    return b"event: " + name.encode() + b"\ndata: " + _encode(event) + b"\n\n"


# -- request mapping -----------------------------------------------------------------------


_OPENAI_PATH = re.compile(r"messages\[(\d+)\](?:\.content\[(\d+)\])?(.*)")
_RENAMED = {"stop": "stop_sequences", "n": "messages", "prompt": "messages"}


@dataclass
class _Mapped:
    """An Anthropic request as the chat completion it means, and where each OpenAI
    message and content part came from (for errors that name the field at fault)."""

    request: p.ChatCompletionRequest
    messages: list[str] = field(default_factory=list)
    """Per OpenAI message: its Anthropic path (``messages.3``)."""
    parts: list[list[str]] = field(default_factory=list)
    """Per OpenAI message, per content part: its Anthropic path."""

    def add(self, message: p.ChatMessage, path: str, parts: Sequence[str] = ()) -> None:
        self.request.messages.append(message)
        self.messages.append(path)
        self.parts.append(list(parts))

    def param(self, param: str | None) -> str | None:
        """An OpenAI-side field name as Anthropic's request names it."""
        if param is None:
            return None
        found = _OPENAI_PATH.fullmatch(param)
        if found is None:
            return _RENAMED.get(param, param)
        message, part, rest = int(found[1]), found[2], found[3]
        if message >= len(self.messages):
            return "messages"
        if part is None or int(part) >= len(self.parts[message]):
            return self.messages[message]
        return self.parts[message][int(part)] + (".source" if rest.startswith(".image_url") else rest)


def _text(blocks: str | Sequence[a.TextBlockParam]) -> str:
    return blocks if isinstance(blocks, str) else "\n".join(block.text for block in blocks)


def _image(block: a.ImageBlockParam) -> p.ImageContentPart:
    """An image block as the OpenAI image part the chat path decodes (inline data as a
    ``data:`` URL, a URL source through the same allow-list as OpenAI image URLs)."""
    source = block.source
    if isinstance(source, a.Base64ImageSource):
        return p.ImageContentPart(image_url=p.ImageURL(url=f"data:{source.media_type};base64,{source.data}"))
    return p.ImageContentPart(image_url=p.ImageURL(url=source.url))


def _tool_result(block: a.ToolResultBlockParam, path: str) -> p.ToolMessage:
    content = block.content if not isinstance(block.content, msgspec.UnsetType) else ""
    if not isinstance(content, str):
        for number, item in enumerate(content):
            if isinstance(item, a.ImageBlockParam):
                raise BadRequestError(
                    "images in a tool_result are not supported: chat templates take text from tools",
                    param=f"{path}.content.{number}",
                )
        content = _text([item for item in content if isinstance(item, a.TextBlockParam)])
    if block.is_error is True:  # chat templates have no error flag: the model reads it
        content = f"Error: {content}"
    return p.ToolMessage(content=content, tool_call_id=block.tool_use_id)


def _user(mapped: _Mapped, message: a.MessageParam, path: str) -> None:
    """Tool results first, as separate tool messages (Anthropic puts them at the start
    of a user turn), then the rest of the turn as one user message."""
    if isinstance(message.content, str):
        mapped.add(p.UserMessage(content=message.content), path)
        return
    parts: list[p.ContentPart] = []
    origins: list[str] = []
    for number, block in enumerate(message.content):
        where = f"{path}.content.{number}"
        if isinstance(block, a.ToolResultBlockParam):
            mapped.add(_tool_result(block, where), where)
        elif isinstance(block, a.TextBlockParam | a.ImageBlockParam):
            parts.append(p.TextContentPart(text=block.text) if isinstance(block, a.TextBlockParam) else _image(block))
            origins.append(where)
        else:
            raise BadRequestError(f"a user message cannot hold a {block.__struct_config__.tag} block", param=where)
    if parts:
        mapped.add(p.UserMessage(content=parts), path, origins)


def _assistant(mapped: _Mapped, message: a.MessageParam, path: str) -> None:
    if isinstance(message.content, str):
        mapped.add(p.AssistantMessage(content=message.content), path)
        return
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[p.ToolCall] = []
    for number, block in enumerate(message.content):
        if isinstance(block, a.TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, a.ThinkingBlockParam):
            thoughts.append(block.thinking)
        elif isinstance(block, a.ToolUseBlockParam):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(p.ToolCall(id=block.id, function=p.FunctionCall(name=block.name, arguments=arguments)))
        elif not isinstance(block, a.RedactedThinkingBlockParam):  # redacted: unreadable, dropped
            raise BadRequestError("an assistant message cannot hold an image block", param=f"{path}.content.{number}")
    # Thinking goes to the template as chat completions pass it; the template decides
    # what of it the model sees (Qwen3's: only the thinking of the turn in progress).
    thought = "\n\n".join(thoughts) if thoughts else msgspec.UNSET
    assistant = p.AssistantMessage(content="".join(texts), tool_calls=calls or msgspec.UNSET, reasoning_content=thought)
    mapped.add(assistant, path)


def _tool_choice(choice: a.ToolChoice | msgspec.UnsetType) -> tuple[Any, bool | msgspec.UnsetType]:
    """OpenAI's ``tool_choice`` (``any`` is ``required``) and ``parallel_tool_calls``."""
    if isinstance(choice, msgspec.UnsetType):
        return msgspec.UNSET, msgspec.UNSET
    parallel = False if getattr(choice, "disable_parallel_tool_use", None) is True else msgspec.UNSET
    if isinstance(choice, a.ToolChoiceTool):
        return p.NamedToolChoice(function=p.NamedToolChoiceFunction(name=choice.name)), parallel
    return {"any": "required"}.get(str(choice.__struct_config__.tag), str(choice.__struct_config__.tag)), parallel


def _thinking(data: a.MessagesRequest | a.CountTokensRequest, model: ChatModel) -> dict[str, Any]:
    """The template variables of ``thinking``: a reasoning model thinks only when asked
    (Anthropic's default is off), through ``enable_thinking`` (Qwen3's variable; a
    template that always thinks, as DeepSeek-R1's, ignores it and thinks anyway)."""
    thinking = data.thinking
    kind = thinking.get("type") if isinstance(thinking, dict) else "disabled"
    if kind not in ("enabled", "adaptive", "disabled"):
        raise BadRequestError("thinking.type must be 'enabled', 'adaptive' or 'disabled'", param="thinking.type")
    if kind == "enabled":
        budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise BadRequestError("thinking.budget_tokens must be a positive integer", param="thinking.budget_tokens")
    if model.reasoning is None:
        if kind != "disabled":
            raise UnsupportedParameterError(
                f"'thinking' is not supported: model {model.name!r} does not reason", param="thinking"
            )
        return {}  # other templates are left as they are
    return {"enable_thinking": kind != "disabled"}


def _map(data: a.MessagesRequest | a.CountTokensRequest, model: ChatModel) -> _Mapped:
    """The chat completion an Anthropic request means (refusing what it cannot mean)."""
    template_variables = _thinking(data, model)
    choice, parallel = _tool_choice(data.tool_choice)
    tools: list[p.Tool] | msgspec.UnsetType = msgspec.UNSET
    if not isinstance(data.tools, msgspec.UnsetType):
        tools = [
            p.Tool(function=p.FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
            for t in data.tools
        ]
    request = p.ChatCompletionRequest(
        model=data.model,
        messages=[],
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=template_variables or msgspec.UNSET,
    )
    if isinstance(data, a.MessagesRequest):
        if not isinstance(data.temperature, msgspec.UnsetType) and not 0 <= data.temperature <= 1:
            raise BadRequestError("temperature must be between 0 and 1", param="temperature")
        if data.max_tokens < 1:
            raise BadRequestError("max_tokens must be at least 1", param="max_tokens")
        request = msgspec.structs.replace(
            request,
            cache_salt=data.cache_salt,
            max_tokens=data.max_tokens,
            temperature=data.temperature,
            top_p=data.top_p,
            top_k=data.top_k,
            stop=data.stop_sequences,
        )
    mapped = _Mapped(request)
    if not isinstance(data.system, msgspec.UnsetType):
        mapped.add(p.SystemMessage(content=_text(data.system)), "system")
    for number, message in enumerate(data.messages):
        (_user if message.role == "user" else _assistant)(mapped, message, f"messages.{number}")
    if data.messages and data.messages[-1].role == "assistant":
        # Anthropic continues a final assistant turn; a chat template would open a new one.
        raise BadRequestError(
            "a final assistant message (prefill) is not supported: end with a user message",
            param=f"messages.{len(data.messages) - 1}",
        )
    return mapped


async def _prepare(
    data: a.MessagesRequest | a.CountTokensRequest, state: OrtServe, request: Request[Any, Any, Any]
) -> tuple[ChatModel, GenerationPlan, Prompt]:
    """Model, plan and prompt of a request; a refusal names Anthropic's field."""
    keep_alive = data.keep_alive if isinstance(data, a.MessagesRequest) else msgspec.UNSET
    model = await require_model(state, data.model, keep_alive)
    mapped = _Mapped(p.ChatCompletionRequest(model=data.model, messages=[]))
    try:
        mapped = _map(data, model)
        plan = plan_chat(mapped.request, model, state.config, caller_of(request))
        if isinstance(data, a.MessagesRequest):  # counting tokens queues nothing
            check_room(state, model, plan.n, "n", "generations")  # before the prompt is prepared
        messages = await chat_messages(
            mapped.request.messages, state.config, model, fetching_while_connected(request, state)
        )
        prompt = await model.aprepare_chat(
            messages, tools=plan.tools.definitions, template_kwargs=template_kwargs(mapped.request)
        )
    except (ServerError, InvalidRequestError) as exc:
        exc.param = mapped.param(exc.param)
        raise
    return model, plan, prompt


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
    except ValueError:
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
    """Turns a streamed generation's thinking, text and tool calls into content block
    events; the thinking block (first, since the think block starts the output) closes
    when the answer or a call begins."""

    def __init__(self) -> None:
        self.index = 0
        self.open: str | None = None
        """The kind of the block open now (``thinking`` or ``text``), if any."""

    def thinking(self, text: str) -> list[bytes]:
        return self._delta("thinking", a.ThinkingBlock(thinking=""), a.ThinkingDelta(thinking=text))

    def text(self, text: str) -> list[bytes]:
        return self._delta("text", a.TextBlock(text=""), a.TextDelta(text=text))

    def _delta(self, kind: str, empty: a.ContentBlock, delta: a.TextDelta | a.ThinkingDelta) -> list[bytes]:
        out = []
        if self.open != kind:
            out += self.close()
            out.append(_event(a.ContentBlockStartEvent(index=self.index, content_block=empty)))
            self.open = kind
        out.append(_event(a.ContentBlockDeltaEvent(index=self.index, delta=delta)))
        return out

    def tool(self, call: ToolCall) -> list[bytes]:
        block = _tool_use(call)
        opening = a.ToolUseBlock(id=block.id, name=block.name, input={})  # Anthropic's order: input follows
        delta = a.InputJSONDelta(partial_json=call.arguments)
        return [
            *self.close(),
            _event(a.ContentBlockStartEvent(index=self.index, content_block=opening)),
            _event(a.ContentBlockDeltaEvent(index=self.index, delta=delta)),
            *self._stop(),
        ]

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
    model, plan, prompt = await _prepare(data, ortserve, request)
    tools = plan.tools
    streams = await plan.astart(ortserve, model, [prompt])
    parsers = [ToolCallParser(tools.format) for _ in streams] if tools.format else None
    parallel = getattr(data.tool_choice, "disable_parallel_tool_use", None) is not True
    run = _Generation(ortserve, f"{ortserve.config.path}/messages", model, streams, parsers, parallel, tools.forced)
    run.plan = plan
    run.split_reasoning(prompt)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    if data.stream is not True:
        texts, calls, finish, usage = await _while_connected(request, ortserve, run.collect())
        content: list[a.ContentBlock] = [a.ThinkingBlock(thinking=run.reasonings[0])] if run.reasonings[0] else []
        content += [a.TextBlock(text=texts[0])] if texts[0] else []
        content += [_tool_use(call) for call in calls[0]]
        stop_reason, stop_sequence = _stop_reason(finish[0], run.stop_sequences[0])
        message = a.Message(
            id=message_id,
            model=data.model,
            content=content,
            stop_reason=stop_reason,  # type: ignore[arg-type]  # one of the four, by _stop_reason
            stop_sequence=stop_sequence,
            usage=_usage(usage),
        )
        return Response(message)

    blocks = _Blocks()
    reasons: list[str] = []

    def events(_: int, text: str, calls: list[ToolCall], reason: str | None) -> list[bytes]:
        out = blocks.thinking(run.event_reasoning) if run.event_reasoning else []
        out += blocks.text(text) if text else []
        for call in calls:
            out += blocks.tool(call)
        if reason is not None:
            reasons.append(reason)
            out += blocks.close()
        return out

    def ending(usage: p.CompletionUsage) -> bytes:
        stop_reason, stop_sequence = _stop_reason(reasons[-1] if reasons else "stop", run.stop_sequences[0])
        counts = _usage(usage)
        delta = a.MessageDeltaEvent(
            delta=a.MessageDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
            usage=a.MessageDeltaUsage(
                output_tokens=counts.output_tokens,
                input_tokens=counts.input_tokens,
                cache_read_input_tokens=counts.cache_read_input_tokens,
            ),
        )
        return _event(delta) + _event(a.MessageStopEvent())

    # The prompt's cached part is known only at the end: message_start counts it all as
    # input, and message_delta's cumulative counts correct that.
    started = a.Message(
        id=message_id,
        model=data.model,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=a.MessageUsage(input_tokens=len(prompt), output_tokens=0),
    )
    opening = [_event(a.MessageStartEvent(message=started)), _event(a.PingEvent())]
    return _stream_response(run.sse(events, ending, opening, error_event=_error_event, closing=b""))


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
    _, _, prompt = await _prepare(data, ortserve, request)
    ortserve.metrics.count_request(f"{ortserve.config.path}/messages/count_tokens", data.model, 200)
    return a.CountTokensResponse(input_tokens=len(prompt))


anthropic_route_handlers = [create_message, count_tokens]
