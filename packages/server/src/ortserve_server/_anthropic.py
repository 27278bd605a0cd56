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
from collections.abc import AsyncIterator, Sequence
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
from ._mcp import McpToolError, McpTools
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

    def turn() -> None:
        # Thinking goes to the template as chat completions pass it; the template decides
        # what of it the model sees (Qwen3's: only the thinking of the turn in progress).
        thought = "\n\n".join(thoughts) if thoughts else msgspec.UNSET
        content = "".join(texts)
        mapped.add(
            p.AssistantMessage(content=content, tool_calls=calls or msgspec.UNSET, reasoning_content=thought), path
        )
        texts.clear()
        thoughts.clear()
        calls.clear()

    for number, block in enumerate(message.content):
        if isinstance(block, a.TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, a.ThinkingBlockParam):
            thoughts.append(block.thinking)
        elif isinstance(block, a.ToolUseBlockParam | a.McpToolUseBlockParam):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(p.ToolCall(id=block.id, function=p.FunctionCall(name=block.name, arguments=arguments)))
        elif isinstance(block, a.McpToolResultBlockParam):
            # The server made the call within the turn: the model read its result and went on.
            if texts or thoughts or calls:
                turn()
            given = block.content
            content: str | list[a.TextBlockParam | a.ImageBlockParam] | msgspec.UnsetType = (
                given if isinstance(given, str | msgspec.UnsetType) else list(given)
            )
            result = a.ToolResultBlockParam(tool_use_id=block.tool_use_id, content=content, is_error=block.is_error)
            where = f"{path}.content.{number}"
            mapped.add(_tool_result(result, where), where)
        elif not isinstance(block, a.RedactedThinkingBlockParam):  # redacted: unreadable, dropped
            raise BadRequestError("an assistant message cannot hold an image block", param=f"{path}.content.{number}")
    if texts or thoughts or calls or not message.content:
        turn()


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


def _map(data: a.MessagesRequest | a.CountTokensRequest, model: ChatModel, mcp: McpTools | None = None) -> _Mapped:
    """The chat completion an Anthropic request means (refusing what it cannot mean);
    ``mcp``: the request's MCP servers, whose tools follow the request's own."""
    template_variables = _thinking(data, model)
    choice, parallel = _tool_choice(data.tool_choice)
    tools: list[p.Tool] | msgspec.UnsetType = msgspec.UNSET
    if not isinstance(data.tools, msgspec.UnsetType):
        tools = [
            p.Tool(function=p.FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
            for t in data.tools
        ]
    if mcp is not None and mcp.uses:
        tools = [*(tools or []), *mcp.chat_tools()]
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
    except (ServerError, InvalidRequestError) as exc:
        exc.param = mapped.param(exc.param)
        raise
    plan, prompt = await _plan(mapped, mapped.request, data, state, model, request)
    return model, plan, prompt


async def _plan(
    mapped: _Mapped,
    chat: p.ChatCompletionRequest,
    data: a.MessagesRequest | a.CountTokensRequest,
    state: OrtServe,
    model: ChatModel,
    request: Request[Any, Any, Any],
) -> tuple[GenerationPlan, Prompt]:
    """The plan and prompt of ``chat`` (``mapped``'s request, or a later turn of it)."""
    try:
        plan = plan_chat(chat, model, state.config, caller_of(request))
        if isinstance(data, a.MessagesRequest):  # counting tokens queues nothing
            check_room(state, model, plan.n, "n", "generations")  # before the prompt is prepared
        messages = await chat_messages(chat.messages, state.config, model, fetching_while_connected(request, state))
        prompt = await model.aprepare_chat(
            messages, tools=plan.tools.definitions, template_kwargs=template_kwargs(chat)
        )
    except (ServerError, InvalidRequestError) as exc:
        exc.param = mapped.param(exc.param)
        raise
    return plan, prompt


async def _add_mcp_servers(data: a.MessagesRequest, mcp: McpTools) -> None:
    """Connects the request's ``mcp_servers`` and lists their tools (refusing what the
    operator did not allow: a name that is not configured needs an allowed ``url``)."""
    for number, server in enumerate(data.mcp_servers or []):
        param = f"mcp_servers.{number}"
        configured = server.name in mcp.hub.servers
        token = server.authorization_token if isinstance(server.authorization_token, str) else None
        if token and configured:
            raise BadRequestError(
                f"MCP server {server.name!r} is configured on this server, with the operator's credentials; "
                "a request may not send its own authorization_token",
                param=f"{param}.authorization_token",
            )
        config = server.tool_configuration if isinstance(server.tool_configuration, a.McpToolConfiguration) else None
        enabled = config is None or config.enabled is not False
        names = config.allowed_tools if config is not None and isinstance(config.allowed_tools, list) else None
        await mcp.add(
            server.name,
            param,
            url=None if configured else server.url,
            headers={"Authorization": f"Bearer {token}"} if token else None,
            allowed=lambda tool, names=names, enabled=enabled: enabled and (names is None or tool.name in names),  # type: ignore[misc]
            approval="never",  # Anthropic's connector has no approvals: the operator chose the servers
        )


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
        return _stream_response(loop.stream())
    try:
        await _while_connected(request, ortserve, loop.drain())
    finally:
        await mcp.close()
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


class _MessageLoop:
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
        self.data, self.state, self.request, self.model, self.mcp = data, state, request, model, mcp
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.blocks = _Blocks()
        self.usage = p.CompletionUsage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        self.reason = "stop"
        self.stop_sequence: str | None = None
        self.failed = False
        self.first_prompt = 0
        self.mapped = _Mapped(p.ChatCompletionRequest(model=data.model, messages=[]))
        self.turns: list[p.ChatMessage] = []
        """The messages of the turns so far (the calls written and their results)."""

    async def start(self) -> None:
        try:
            self.mapped = _map(self.data, self.model, self.mcp)
        except (ServerError, InvalidRequestError) as exc:
            exc.param = self.mapped.param(exc.param)
            raise
        self.run = await self._turn()

    async def _turn(self) -> _Generation:
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
        plan, prompt = await _plan(mapped, chat, data, self.state, self.model, self.request)
        if self.turns:
            plan = plan.fitted(self.model, prompt)
        tools = plan.tools
        streams = await plan.astart(self.state, self.model, [prompt])
        parsers = [ToolCallParser(tools.format) for _ in streams] if tools.format else None
        parallel = getattr(data.tool_choice, "disable_parallel_tool_use", None) is not True
        endpoint = f"{self.state.config.path}/messages"
        run = _Generation(self.state, endpoint, self.model, streams, parsers, parallel, tools.forced)
        run.plan = plan
        run.split_reasoning(prompt)
        self.first_prompt = self.first_prompt or len(prompt)
        return run

    def _count(self, usage: p.CompletionUsage, run: _Generation) -> None:
        total = self.usage
        total.prompt_tokens += usage.prompt_tokens
        total.completion_tokens += usage.completion_tokens
        total.total_tokens += usage.total_tokens
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        details = total.prompt_tokens_details or p.PromptTokensDetails(cached_tokens=0)
        details.cached_tokens += cached
        total.prompt_tokens_details = details
        self.stop_sequence = run.stop_sequences[0]

    def stop(self) -> tuple[str, str | None]:
        return _stop_reason(self.reason, self.stop_sequence)

    def _feed(
        self, run: _Generation, thought: str, text: str, calls: list[ToolCall], reason: str | None
    ) -> list[bytes]:
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
                async for chunk in run.sse(*self._callbacks(run), error_event=self._error, closing=b""):
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
                except McpToolError as exc:
                    answer, failed = f"Error ({exc.kind} {exc.code}): {exc.message}", True
                self.turns.append(p.ToolMessage(content=f"Error: {answer}" if failed else answer, tool_call_id=use.id))
                for chunk in self.blocks.mcp_result(a.McpToolResultBlock(use.id, failed, [a.TextBlock(text=answer)])):
                    yield chunk
            if any(isinstance(b, a.ToolUseBlock) for b in turn):
                return  # calls of the client's own tools: stop_reason tool_use
            if self.reason == "length" or self.usage.completion_tokens >= self.data.max_tokens:
                self.reason = "length"  # max_tokens bounds all turns together
                return
            self.run = run = await self._turn()

    def _callbacks(self, run: _Generation) -> tuple[Any, Any]:
        def events(_: int, text: str, calls: list[ToolCall], reason: str | None) -> list[bytes]:
            return self._feed(run, run.event_reasoning, text, calls, reason)

        def counted(usage: p.CompletionUsage) -> bytes:
            self._count(usage, run)
            return b""

        return events, counted

    def _error(self, exc: Exception) -> bytes:
        self.failed = True
        return _error_event(exc)

    async def drain(self) -> None:
        async for _ in self.run_turns(stream=False):
            pass

    async def stream(self) -> AsyncIterator[bytes]:
        try:
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
            yield _event(a.MessageStartEvent(message=started))
            yield _event(a.PingEvent())
            try:
                async for chunk in self.run_turns(stream=True):
                    yield chunk
            except Exception as exc:  # noqa: BLE001  # a later turn that could not start: in-band
                yield self._error(exc)
            if self.failed:
                return
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
            yield _event(delta) + _event(a.MessageStopEvent())
        finally:
            await self.mcp.close()


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
