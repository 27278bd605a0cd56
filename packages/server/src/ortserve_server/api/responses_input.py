"""The Responses API's request as the chat request it means: items -> chat messages
(function calls and outputs, MCP calls and approvals, reasoning), tools -> chat tools, and
the chat path's error fields renamed to the Responses fields they came from."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import msgspec
from ortserve_client import protocol as p
from ortserve_client import responses_protocol as rp
from ortserve_runtime import InvalidRequestError

from .._errors import BadRequestError, ServerError
from .._mcp import McpTools, failure_text, tool_error_text

__all__ = ["_chat_request", "_chat_tools", "_input", "_messages", "_named_as_responses"]


_AT_PATH = re.compile(r" - at `\$\[(\d+)\](.*)`$")


def _input(data: rp.ResponseCreateRequest) -> list[rp.InputItem]:
    if isinstance(data.input, str):
        return [rp.InputMessage(role="user", content=data.input)]
    try:
        return rp.input_items(data.input)
    except msgspec.ValidationError as exc:
        where = _AT_PATH.search(str(exc))
        param = f"input[{where.group(1)}]{where.group(2)}" if where else "input"
        raise BadRequestError(f"{_AT_PATH.sub('', str(exc))} (field {param!r})", param=param) from exc


def _text_parts(content: str | list[rp.InputContent], where: str) -> str | list[p.TextContentPart]:
    """Content that may hold text only (system, developer, assistant, tool results)."""
    if isinstance(content, str):
        return content
    parts = []
    for number, part in enumerate(content):
        if isinstance(part, rp.InputImage | rp.InputAudioPart):
            what = "images" if isinstance(part, rp.InputImage) else "audio"
            raise BadRequestError(f"only user messages may hold {what}", param=f"{where}.content[{number}]")
        parts.append(p.TextContentPart(text=part.text))
    return parts


def _user_parts(content: str | list[rp.InputContent], where: str) -> str | list[p.ContentPart]:
    if isinstance(content, str):
        return content
    parts: list[p.ContentPart] = []
    for number, part in enumerate(content):
        if isinstance(part, rp.InputAudioPart):
            parts.append(p.InputAudioContentPart(input_audio=part.input_audio))
        elif not isinstance(part, rp.InputImage):
            parts.append(p.TextContentPart(text=part.text))
        elif not isinstance(part.image_url, str):
            # file_id names OpenAI's Files API, which this server does not have.
            raise BadRequestError(
                "an input_image needs image_url (a data: URL); file_id is not supported",
                param=f"{where}.content[{number}].image_url",
            )
        else:
            parts.append(p.ImageContentPart(image_url=p.ImageURL(url=part.image_url, detail=part.detail)))
    return parts


def _messages(instructions: str | None, items: list[tuple[str, rp.InputItem]]) -> tuple[list[p.ChatMessage], list[str]]:
    """Chat messages for the model's template, and per message the request field it came
    from (``instructions``, ``input[2]``, ``previous_response_id``). Consecutive function
    calls, and calls right after assistant text, make one assistant message with
    ``tool_calls``, which is how the model wrote them."""
    messages: list[p.ChatMessage] = []
    origins: list[str] = []
    if instructions:
        messages.append(p.SystemMessage(content=instructions))
        origins.append("instructions")
    thought = ""  # a reasoning item's text, for the assistant message it came before
    for where, item in items:
        message: p.ChatMessage
        if isinstance(item, rp.ReasoningItem):
            thought = "\n\n".join(filter(None, (thought, item.text)))
            continue
        if isinstance(item, rp.McpListToolsItem) or (isinstance(item, rp.McpApprovalResponseItem) and item.approve):
            continue  # tools reach the template as tools; an approved call's result follows as its mcp_call
        if isinstance(item, rp.FunctionCallItem | rp.McpApprovalRequestItem | rp.McpCallItem):
            call = _call_of(item)
            if call is not None:
                last = messages[-1] if messages else None
                if not isinstance(last, p.AssistantMessage):
                    last = p.AssistantMessage(content=None, tool_calls=[])
                    messages.append(last)
                    origins.append(where)
                last.tool_calls = [*(last.tool_calls or []), call]
                thought = _add_thought(last, thought)
            if not isinstance(item, rp.McpCallItem):
                continue
            # An MCP call carries its result: after the call the model wrote (the next call
            # is a new turn), or after the approval request the call was made on.
            message = p.ToolMessage(content=_mcp_result(item), tool_call_id=item.approval_request_id or item.id)
        elif isinstance(item, rp.McpApprovalResponseItem):  # refused
            reason = f": {item.reason}" if isinstance(item.reason, str) and item.reason else ""
            message = p.ToolMessage(
                content=f"The user did not approve this call{reason}", tool_call_id=item.approval_request_id
            )
        elif isinstance(item, rp.FunctionCallOutputItem):
            output = _text_parts(item.output, where)
            text = output if isinstance(output, str) else "".join(part.text for part in output)
            message = p.ToolMessage(content=text, tool_call_id=item.call_id)
        elif item.role == "user":
            message = p.UserMessage(content=_user_parts(item.content, where))
        elif item.role == "assistant":
            message = p.AssistantMessage(content=_text_parts(item.content, where))
        elif item.role == "system":
            message = p.SystemMessage(content=_text_parts(item.content, where))
        else:
            message = p.DeveloperMessage(content=_text_parts(item.content, where))
        # Thinking with no assistant turn right after it belongs to none: dropped.
        thought = _add_thought(message, thought) if isinstance(message, p.AssistantMessage) else ""
        messages.append(message)
        origins.append(where)
    return messages, origins


def _call_of(item: rp.FunctionCallItem | rp.McpApprovalRequestItem | rp.McpCallItem) -> p.ToolCall | None:
    """The call an item says the model wrote (a function call, an MCP call the server made
    on its own, or one waiting for approval), as chat completions carry it; ``None`` for
    an MCP call made on approval (the approval request was the call)."""
    if isinstance(item, rp.FunctionCallItem):
        call_id, name, arguments = item.call_id, item.name, item.arguments
    elif isinstance(item, rp.McpCallItem) and item.approval_request_id is not None:
        return None
    else:
        call_id, name, arguments = item.id, item.name, item.arguments
    return p.ToolCall(id=call_id, function=p.FunctionCall(name=name, arguments=arguments))


def _mcp_result(item: rp.McpCallItem) -> str:
    """What the model reads of an MCP call: its output, or its error."""
    error = item.error
    if error is None:
        return item.output or ""
    if error.type == "mcp_tool_execution_error":
        content = error.content if isinstance(error.content, list) else []
        return tool_error_text("\n".join(str(block.get("text", "")) for block in content))
    return failure_text(error.type, error.code, error.message)


def _add_thought(message: p.AssistantMessage, thought: str) -> str:
    """Puts a reasoning item's text on the assistant message it preceded (as chat
    completions take an earlier turn's ``reasoning_content``); returns what is left."""
    if thought:
        given = message.reasoning_content if isinstance(message.reasoning_content, str) else ""
        message.reasoning_content = "\n\n".join(filter(None, (given, thought)))
    return ""


def _chat_tools(data: rp.ResponseCreateRequest, mcp: McpTools) -> list[p.Tool]:
    """The functions the model may call: the request's function tools, then its MCP
    servers' tools (their input schemas as parameters)."""
    tools = [
        p.Tool(
            function=p.FunctionDefinition(
                name=tool.name,
                description=msgspec.UNSET if tool.description is None else tool.description,
                parameters=msgspec.UNSET if tool.parameters is None else tool.parameters,
                strict=tool.strict,
            )
        )
        for tool in data.tools or []
        if isinstance(tool, rp.FunctionTool)
    ]
    tools += mcp.chat_tools()
    return tools


def _chat_request(
    data: rp.ResponseCreateRequest,
    messages: list[p.ChatMessage],
    tools: list[p.Tool],
    choice: Any,
    spent: int = 0,
) -> p.ChatCompletionRequest:
    """The chat request of one model turn: ``tools`` and ``choice`` (``tool_choice``) are
    the turn's (:class:`_Loop` narrows them as MCP calls are spent); ``spent``: the tokens
    earlier turns wrote, which ``max_output_tokens`` counts too."""
    tool_choice = (
        p.NamedToolChoice(function=p.NamedToolChoiceFunction(name=choice.name))
        if isinstance(choice, rp.ToolChoiceFunction)
        else choice
    )
    fmt = data.text.format if isinstance(data.text, rp.TextConfig) else None
    response_format: p.ResponseFormat | msgspec.UnsetType = msgspec.UNSET
    if isinstance(fmt, rp.TextFormatJSONObject):
        response_format = p.ResponseFormatJSONObject()
    elif isinstance(fmt, rp.TextFormatJSONSchema):
        schema = p.JSONSchema(name=fmt.name, schema=fmt.schema, strict=fmt.strict)
        response_format = p.ResponseFormatJSONSchema(json_schema=schema)
    return p.ChatCompletionRequest(
        model=data.model,
        messages=messages,
        tools=tools or msgspec.UNSET,
        tool_choice=tool_choice,
        parallel_tool_calls=data.parallel_tool_calls,
        response_format=response_format,
        max_completion_tokens=(
            data.max_output_tokens - spent if isinstance(data.max_output_tokens, int) else data.max_output_tokens
        ),
        temperature=data.temperature,
        top_p=data.top_p,
        # _check let it through only for a reasoning model; the template reads it.
        reasoning_effort=data.reasoning.effort if isinstance(data.reasoning, rp.Reasoning) else msgspec.UNSET,
        cache_salt=data.cache_salt,
    )


_FIELDS = {
    "messages": "input",
    "response_format": "text.format",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
}
"""Chat fields the chat path's errors name -> the Responses fields they came from."""
_MESSAGE_PATH = re.compile(r"^messages\[(\d+)\](.*)$")


def _rename(param: str | None, origins: list[str]) -> str | None:
    if param is None:
        return None
    found = _MESSAGE_PATH.match(param)
    if found and int(found.group(1)) < len(origins):
        # A chat part's image_url.url is an input_image's image_url (detail: its detail).
        rest = found.group(2).replace(".image_url.url", ".image_url").replace(".image_url.detail", ".detail")
        return origins[int(found.group(1))] + rest
    return _FIELDS.get(param, param)


@contextlib.contextmanager
def _named_as_responses(origins: list[str]) -> Iterator[None]:
    """Errors of the chat path, naming the Responses fields instead of the chat ones."""
    try:
        yield
    except (ServerError, InvalidRequestError) as exc:
        exc.param = _rename(exc.param, origins)
        raise
