"""``/v1/responses``: OpenAI's Responses API as a thin adapter over the chat path.

A request becomes a :class:`~ortserve_client.protocol.ChatCompletionRequest` (items ->
messages, flat function tools -> chat tools, ``text.format`` -> ``response_format``,
``max_output_tokens`` -> ``max_completion_tokens``) and runs through exactly what chat
completions run (:func:`start_chat`: the checks, the template, forced-call grammars, the
tool-call parser, the queue limits); errors that name a chat field are renamed to the
Responses field they came from. What comes back is turned into output items, whole or as
the typed stream events.

Decisions, where OpenAI leaves room:

- ``store`` defaults to false (stateless), unlike OpenAI: a stored response lives only
  in this process's bounded :class:`ResponseStore` (``responses_store_*`` settings), so
  storing is asked for, not assumed.
- A reasoning model's thinking is a ``reasoning`` item before the answer, its text
  verbatim in ``content`` (``reasoning_text`` parts, streamed as
  ``response.reasoning_text.delta``/``.done``, as vLLM does); there is no summarizer, so
  ``summary`` is empty unless ``reasoning.summary`` asks for one, and then it holds the
  same text (streamed as ``response.reasoning_summary_text.*``). ``reasoning.effort``
  reaches the chat template as ``reasoning_effort``, as chat completions pass it.
- For a model that does not reason, ``reasoning.effort`` (or ``summary``) is a 400
  naming it, as OpenAI answers.
- ``reasoning`` input items (an earlier turn's output handed back, or kept with a
  stored response) are not dropped, as OpenAI may for stateless use: their text becomes
  the next assistant message's ``reasoning_content``, as chat completions pass it, and
  the template decides what the model sees (Qwen3's keeps it only for the turn still in
  progress, e.g. between a function call and its output).
- An unknown ``previous_response_id`` is a 400 naming it (OpenAI's
  ``previous_response_not_found``); an unknown id in the path of ``GET``/``DELETE`` a 404.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from ortserve_client import protocol as p
from ortserve_client import responses_protocol as rp
from ortserve_runtime import ChatModel, InvalidRequestError, ToolCall

from ._errors import BadRequestError, NotFoundError, ServerError, UnsupportedParameterError
from ._ids import new_id
from ._mapping import require_model
from ._mcp import McpTool as McpToolSpec
from ._mcp import McpToolError, McpTools
from ._openapi import GET_ERRORS, error_responses, generation_docs
from ._routes import _Generation, _stream_response, _while_connected, error_detail, start_chat
from ._state import OrtServe

__all__ = ["PreviousResponseNotFoundError", "ResponseNotFoundError", "responses_route_handlers"]

_encode = msgspec.json.Encoder().encode
_METADATA_KEYS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's bounds on ``metadata`` (which a stored response keeps)."""


class ResponseNotFoundError(NotFoundError):
    code = "response_not_found"


class PreviousResponseNotFoundError(BadRequestError):
    code = "previous_response_not_found"  # OpenAI's code for it


# -- request checks and mapping -------------------------------------------------------------


def _check(data: rp.ResponseCreateRequest, state: OrtServe, model: ChatModel) -> None:
    """Refuse what we cannot honour, naming the field, rather than ignore it."""
    reasoning = data.reasoning
    if isinstance(reasoning, rp.Reasoning) and model.reasoning is None:
        for name in ("effort", "summary"):
            if getattr(reasoning, name) is not None:
                raise UnsupportedParameterError(
                    f"'reasoning.{name}' is not supported with model {data.model!r}: it is not a reasoning model",
                    param=f"reasoning.{name}",
                )
    refused: dict[str, bool] = {
        "background": data.background is True,
        "include": bool(data.include),
        "truncation": data.truncation not in (msgspec.UNSET, None, "disabled"),
        "top_logprobs": data.top_logprobs not in (msgspec.UNSET, None, 0),
        "conversation": data.conversation not in (msgspec.UNSET, None),
        "prompt": data.prompt not in (msgspec.UNSET, None),
    }
    for name, asked in refused.items():
        if asked:
            raise UnsupportedParameterError(f"'{name}' is not supported by this server", param=name)
    if data.store is True and not state.responses.enabled:
        raise UnsupportedParameterError("this server stores no responses (responses_store_max is 0)", param="store")
    metadata = data.metadata if isinstance(data.metadata, dict) else {}
    if len(metadata) > _METADATA_KEYS or any(
        len(k) > _METADATA_KEY_CHARS or len(v) > _METADATA_VALUE_CHARS for k, v in metadata.items()
    ):
        raise BadRequestError(
            f"'metadata' holds at most {_METADATA_KEYS} pairs, keys of at most {_METADATA_KEY_CHARS} characters "
            f"and values of at most {_METADATA_VALUE_CHARS}",
            param="metadata",
        )


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
        return "Error: " + "\n".join(str(block.get("text", "")) for block in content)
    return f"Error ({error.type} {error.code}): {error.message}"


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


# -- output ---------------------------------------------------------------------------------


class _Output:
    """Builds the output items from the generation's text, calls and finish, and says each
    step as the stream events OpenAI sends (the whole answer runs through it too, so both
    forms have the same items). ``sequence_number`` counts every event of the stream."""

    def __init__(self, summarize: bool = False, mcp: McpTools | None = None) -> None:
        self.mcp = mcp
        """The request's MCP servers: a call to one of their tools is an ``mcp_call`` (or an
        ``mcp_approval_request``), not a ``function_call`` for the client."""
        self.calling: list[rp.McpCallItem] = []
        """MCP calls the model wrote in the turn under way, for :class:`_Loop` to make."""
        self.items: list[rp.OutputItem] = []
        self.turn_start = 0
        """Where the items of the model turn under way begin."""
        self.sequence = 0
        self._message: rp.OutputMessage | None = None
        self._reasoning: rp.ReasoningItem | None = None
        self.summarize = summarize
        """Whether the reasoning item's ``summary`` carries the thinking too (asked for
        with ``reasoning.summary``; there is nothing shorter to give)."""

    def event(self, kind: type[Any], **fields: Any) -> bytes:
        event = kind(sequence_number=self.sequence, **fields)
        self.sequence += 1
        tag: str = kind.__struct_config__.tag
        return b"event: " + tag.encode() + b"\ndata: " + _encode(event) + b"\n\n"

    def reasoning(self, text: str) -> list[bytes]:
        """Thinking: the reasoning item opens at its first piece (it comes first: the
        think block starts the output) and closes when the answer or a call begins."""
        out = []
        item = self._reasoning
        if item is None:
            item = self._reasoning = rp.ReasoningItem(id=new_id("rs_"), status="in_progress")
            self.items.append(item)
            out.append(self.event(rp.OutputItemAddedEvent, output_index=len(self.items) - 1, item=item))
        where = {"item_id": item.id, "output_index": self.items.index(item)}
        if not item.content:  # the parts open at once, as OpenAI's stream opens them
            item.content.append(rp.ReasoningText(text=""))
            out.append(self.event(rp.ContentPartAddedEvent, content_index=0, part=rp.ReasoningText(text=""), **where))
            if self.summarize:
                item.summary.append(rp.SummaryText(text=""))
                summary = rp.SummaryText(text="")
                out.append(self.event(rp.ReasoningSummaryPartAddedEvent, summary_index=0, part=summary, **where))
        if text:
            item.content[0].text += text
            out.append(self.event(rp.ReasoningTextDeltaEvent, content_index=0, delta=text, **where))
            if self.summarize:
                item.summary[0].text += text
                out.append(self.event(rp.ReasoningSummaryTextDeltaEvent, summary_index=0, delta=text, **where))
        return out

    def close_reasoning(self, status: str = "completed") -> list[bytes]:
        item = self._reasoning
        if item is None:
            return []
        self._reasoning = None
        item.status = status  # type: ignore[assignment]  # one of the three, by the callers
        index = self.items.index(item)
        part = item.content[0]
        where = {"item_id": item.id, "output_index": index}
        out = [
            self.event(rp.ReasoningTextDoneEvent, content_index=0, text=part.text, **where),
            self.event(rp.ContentPartDoneEvent, content_index=0, part=part, **where),
        ]
        if self.summarize:
            summary = item.summary[0]
            out.append(self.event(rp.ReasoningSummaryTextDoneEvent, summary_index=0, text=summary.text, **where))
            out.append(self.event(rp.ReasoningSummaryPartDoneEvent, summary_index=0, part=summary, **where))
        out.append(self.event(rp.OutputItemDoneEvent, output_index=index, item=item))
        return out

    def text(self, text: str) -> list[bytes]:
        out = self.close_reasoning()
        message = self._message
        if message is None:
            message = self._message = rp.OutputMessage(id=new_id("msg_"), content=[], status="in_progress")
            self.items.append(message)
            index = len(self.items) - 1
            out.append(self.event(rp.OutputItemAddedEvent, output_index=index, item=message))
            message.content.append(rp.OutputText(text=""))
            out.append(
                self.event(
                    rp.ContentPartAddedEvent,
                    item_id=message.id,
                    output_index=index,
                    content_index=0,
                    part=rp.OutputText(text=""),
                )
            )
        if text:
            message.content[0].text += text
            where = {"item_id": message.id, "output_index": len(self.items) - 1, "content_index": 0}
            out.append(self.event(rp.OutputTextDeltaEvent, delta=text, **where))
        return out

    def close_message(self, status: str = "completed") -> list[bytes]:
        message = self._message
        if message is None:
            return []
        self._message = None
        message.status = status  # type: ignore[assignment]  # one of the three, by the callers
        part = message.content[0]
        where = {"item_id": message.id, "output_index": self.items.index(message), "content_index": 0}
        return [
            self.event(rp.OutputTextDoneEvent, text=part.text, **where),
            self.event(rp.ContentPartDoneEvent, part=part, **where),
            self.event(rp.OutputItemDoneEvent, output_index=where["output_index"], item=message),
        ]

    def call(self, call: ToolCall) -> list[bytes]:
        out = self.close_reasoning() + self.close_message()
        label = self.mcp.owner(call.name) if self.mcp is not None else None
        if label is not None:
            assert self.mcp is not None
            if self.mcp.needs_approval(label, call.name):
                request = rp.McpApprovalRequestItem(
                    id=new_id("mcpr_"), server_label=label, name=call.name, arguments=call.arguments
                )
                return out + self.added(request) + self.done(request)
            return out + self.mcp_call(label, call.name, call.arguments)
        item = rp.FunctionCallItem(
            id=new_id("fc_"),
            call_id="call_" + uuid.uuid4().hex[:24],
            name=call.name,
            arguments="",
            status="in_progress",
        )
        self.items.append(item)
        index = len(self.items) - 1
        out.append(self.event(rp.OutputItemAddedEvent, output_index=index, item=item))
        out.append(
            self.event(rp.FunctionCallArgumentsDeltaEvent, item_id=item.id, output_index=index, delta=call.arguments)
        )
        item.arguments, item.status = call.arguments, "completed"
        out.append(
            self.event(
                rp.FunctionCallArgumentsDoneEvent,
                item_id=item.id,
                output_index=index,
                arguments=call.arguments,
                name=call.name,
            )
        )
        out.append(self.event(rp.OutputItemDoneEvent, output_index=index, item=item))
        return out

    def added(self, item: rp.OutputItem) -> list[bytes]:
        self.items.append(item)
        return [self.event(rp.OutputItemAddedEvent, output_index=len(self.items) - 1, item=item)]

    def done(self, item: rp.OutputItem) -> list[bytes]:
        return [self.event(rp.OutputItemDoneEvent, output_index=self.items.index(item), item=item)]

    def listed(self, item: rp.McpListToolsItem) -> list[bytes]:
        where = {"item_id": item.id, "output_index": len(self.items)}
        out = self.added(item)
        out.append(self.event(rp.McpListToolsInProgressEvent, **where))
        out.append(self.event(rp.McpListToolsCompletedEvent, **where))
        return out + self.done(item)

    def mcp_call(self, label: str, name: str, arguments: str, approval: str | None = None) -> list[bytes]:
        """An MCP call opens (added, in progress, its arguments); :meth:`mcp_result` closes it."""
        item = rp.McpCallItem(
            id=new_id("mcp_"),
            server_label=label,
            name=name,
            arguments="",
            status="in_progress",
            approval_request_id=approval,
        )
        where = {"item_id": item.id, "output_index": len(self.items)}
        out = self.added(item)
        out.append(self.event(rp.McpCallInProgressEvent, **where))
        out.append(self.event(rp.McpCallArgumentsDeltaEvent, delta=arguments, **where))
        item.arguments = arguments
        out.append(self.event(rp.McpCallArgumentsDoneEvent, arguments=arguments, **where))
        self.calling.append(item)
        return out

    def mcp_result(self, item: rp.McpCallItem) -> list[bytes]:
        failed = item.error is not None
        item.status = "failed" if failed else "completed"
        where = {"item_id": item.id, "output_index": self.items.index(item)}
        kind = rp.McpCallFailedEvent if failed else rp.McpCallCompletedEvent
        return [self.event(kind, **where), *self.done(item)]

    def finish(self, reason: str) -> list[bytes]:
        """The end of a turn: an answer with neither text nor calls is one empty message
        (so that ``output_text`` is ``""``, not missing), after any reasoning (which
        ``max_tokens`` may have cut short: then it is incomplete)."""
        status = "incomplete" if reason == "length" else "completed"
        out = self.close_reasoning(status)
        if all(isinstance(item, rp.ReasoningItem) for item in self.items[self.turn_start :]):
            out += self.text("")
        return out + self.close_message(status)

    def feed(self, reasoning: str, text: str, calls: list[ToolCall], reason: str | None) -> list[bytes]:
        out = self.reasoning(reasoning) if reasoning else []
        out += self.text(text) if text else []
        for call in calls:
            out += self.call(call)
        if reason is not None:
            out += self.finish(reason)
        return out


def _usage(usage: p.CompletionUsage, reasoning_tokens: int) -> rp.ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return rp.ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        input_tokens_details=rp.InputTokensDetails(cached_tokens=cached),
        output_tokens_details=rp.OutputTokensDetails(reasoning_tokens=reasoning_tokens),
    )


def _as_input(item: rp.OutputItem) -> rp.InputItem:
    """An output item as the input item a follow-up hands back."""
    if isinstance(item, rp.OutputMessage):
        return rp.InputMessage(role="assistant", content=list(item.content), id=item.id)
    return item


def _without_secrets(tool: rp.Tool) -> rp.Tool:
    """A tool as the response echoes (and the store keeps) it: an MCP tool's headers and
    authorization are the caller's secrets, so they are left out."""
    if isinstance(tool, rp.McpTool) and (tool.headers or tool.authorization):
        return msgspec.structs.replace(tool, headers=None, authorization=None)
    return tool


class _Exchange:
    """One ``POST /v1/responses``: the echo of the request in the response object, and
    the response kept in the store when it asks for that."""

    def __init__(self, data: rp.ResponseCreateRequest, state: OrtServe, items: list[rp.InputItem]) -> None:
        self.data = data
        self.state = state
        self.items = items
        tag = state.config.response_id_tag  # a Ray replica's id: see ortserve_server.ray
        self.id = f"resp_{tag}-{uuid.uuid4().hex}" if tag else new_id("resp_")
        self.created = int(time.time())
        self.saving: concurrent.futures.Future[None] | None = None
        """The store's write of the finished response, where it goes to a file."""

    def response(
        self, output: list[rp.OutputItem], status: str, usage: rp.ResponseUsage | None = None, reason: str | None = None
    ) -> rp.Response:
        data = self.data
        return rp.Response(
            id=self.id,
            created_at=self.created,
            model=data.model,
            output=output,
            status=status,  # type: ignore[arg-type]  # one of the literals, by the callers
            incomplete_details=rp.IncompleteDetails(reason="max_output_tokens") if reason == "length" else None,
            instructions=data.instructions if isinstance(data.instructions, str) else None,
            max_output_tokens=data.max_output_tokens if isinstance(data.max_output_tokens, int) else None,
            metadata=data.metadata if isinstance(data.metadata, dict) else {},
            parallel_tool_calls=data.parallel_tool_calls is not False,
            previous_response_id=data.previous_response_id if isinstance(data.previous_response_id, str) else None,
            reasoning=data.reasoning if isinstance(data.reasoning, rp.Reasoning) else rp.Reasoning(),
            store=data.store is True,
            temperature=data.temperature if isinstance(data.temperature, float | int) else 1.0,
            text=data.text if isinstance(data.text, rp.TextConfig) else rp.TextConfig(),
            tool_choice=(
                data.tool_choice
                if isinstance(data.tool_choice, str | rp.ToolChoiceFunction | rp.ToolChoiceMcp)
                else "auto"
            ),
            max_tool_calls=data.max_tool_calls if isinstance(data.max_tool_calls, int) else None,
            tools=[_without_secrets(tool) for tool in data.tools or []],
            top_p=data.top_p if isinstance(data.top_p, float | int) else 1.0,
            usage=usage,
            user=data.user if isinstance(data.user, str) else None,
        )

    def finished(
        self, output: list[rp.OutputItem], reason: str, usage: p.CompletionUsage, reasoning_tokens: int
    ) -> rp.Response:
        status = "incomplete" if reason == "length" else "completed"
        response = self.response(output, status, _usage(usage, reasoning_tokens), reason)
        if self.data.store is True:
            self.saving = self.state.responses.put(response, [*self.items, *(_as_input(item) for item in output)])
        return response


# -- routes ---------------------------------------------------------------------------------


@post(
    "/responses",
    status_code=200,
    summary="Create a model response (OpenAI Responses API)",
    **generation_docs(rp.Response, "The response"),
)
async def create_response(
    data: JSONBody[rp.ResponseCreateRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[Any]:
    model = await require_model(ortserve, data.model, data.keep_alive)
    _check(data, ortserve, model)
    history: list[tuple[str, rp.InputItem]] = []
    if isinstance(data.previous_response_id, str):
        previous = await ortserve.responses.get(data.previous_response_id)
        if previous is None:
            raise PreviousResponseNotFoundError(
                f"previous response {data.previous_response_id!r} was not found (responses are kept only when "
                "created with store: true, for a limited time, and across restarts only with a state dir)",
                param="previous_response_id",
            )
        history = [("previous_response_id", item) for item in previous.items]
    new = _input(data)
    items = [*history, *((f"input[{i}]", item) for i, item in enumerate(new))]
    mcp = McpTools(ortserve.mcp, data.max_tool_calls if isinstance(data.max_tool_calls, int) else None)
    try:
        listings = await _list_mcp_tools(data, mcp, items)
        approved = _approved_calls(items, len(history), mcp)
        exchange = _Exchange(data, ortserve, [item for _, item in items])
        summarize = isinstance(data.reasoning, rp.Reasoning) and data.reasoning.summary is not None
        loop = _Loop(ortserve, model, data, request, items, exchange, _Output(summarize, mcp), mcp)
        loop.check_tool_choice()
        await loop.start(listings, approved)
    except BaseException:
        await mcp.close()
        raise
    if data.stream is True:
        return _stream_response(loop.stream())
    try:
        await _while_connected(request, ortserve, loop.drain())
    finally:
        await mcp.close()
    response = exchange.finished(loop.output.items, loop.reason, loop.usage, loop.reasoning_tokens)
    if exchange.saving is not None:  # on disk before the client learns its id (a streamed one: as it is sent)
        await asyncio.wrap_future(exchange.saving)
    return Response(response)


async def _list_mcp_tools(
    data: rp.ResponseCreateRequest, mcp: McpTools, items: list[tuple[str, rp.InputItem]]
) -> list[rp.McpListToolsItem]:
    """Connects the request's ``mcp`` tools' servers (refusing what the operator did not
    allow) and lists their tools; a server the conversation listed already (an
    ``mcp_list_tools`` item handed back or stored) is not listed again, as OpenAI does.
    Returns the new listings, the response's first output items."""
    known = {item.server_label: item for _, item in items if isinstance(item, rp.McpListToolsItem) and not item.error}
    listings = []
    for number, tool in enumerate(data.tools or []):
        if not isinstance(tool, rp.McpTool):
            continue
        param = f"tools[{number}]"
        headers = dict(tool.headers or {})
        if tool.authorization:
            headers["Authorization"] = f"Bearer {tool.authorization}"
        if headers and tool.server_label in mcp.hub.servers:
            raise BadRequestError(
                f"MCP server {tool.server_label!r} is configured on this server, with the operator's headers; "
                "a request may not set its headers or authorization",
                param=f"{param}.headers",
            )
        chosen = tool.allowed_tools
        names = chosen if isinstance(chosen, list) else chosen.tool_names if chosen is not None else None
        read_only = chosen.read_only if isinstance(chosen, rp.McpToolFilter) else None
        before = known.get(tool.server_label)
        listed = (
            None
            if before is None
            else [McpToolSpec(t.name, t.input_schema, t.description, t.annotations) for t in before.tools]
        )

        def picked(tool: McpToolSpec, names: list[str] | None = names, read_only: bool | None = read_only) -> bool:
            return (names is None or tool.name in names) and (read_only is None or tool.read_only == read_only)

        given = await mcp.add(
            tool.server_label,
            param,
            url=tool.server_url,
            headers=headers,
            allowed=picked,
            approval=msgspec.to_builtins(tool.require_approval) if tool.require_approval is not None else "always",
            listed=listed,
        )
        if before is None:
            listings.append(
                rp.McpListToolsItem(
                    id=new_id("mcpl_"),
                    server_label=tool.server_label,
                    tools=[rp.McpListToolsTool(t.name, t.input_schema, t.description, t.annotations) for t in given],
                )
            )
    return listings


def _approved_calls(
    items: list[tuple[str, rp.InputItem]], first_new: int, mcp: McpTools
) -> list[rp.McpApprovalRequestItem]:
    """The calls the request's ``mcp_approval_response`` items approve (to be made before
    the model goes on); an answer to no request, or to one answered already, is a 400."""
    requests = {item.id: item for _, item in items if isinstance(item, rp.McpApprovalRequestItem)}
    answered = {
        item.approval_request_id for _, item in items[:first_new] if isinstance(item, rp.McpApprovalResponseItem)
    }
    answered |= {
        item.approval_request_id for _, item in items if isinstance(item, rp.McpCallItem) and item.approval_request_id
    }
    approved = []
    for where, item in items[first_new:]:
        if not isinstance(item, rp.McpApprovalResponseItem):
            continue
        asked = requests.get(item.approval_request_id)
        param = f"{where}.approval_request_id"
        if asked is None:
            raise BadRequestError(
                f"no mcp_approval_request {item.approval_request_id!r} in this conversation "
                "(hand it back in input, or continue with previous_response_id)",
                param=param,
            )
        if item.approval_request_id in answered:
            raise BadRequestError(
                f"mcp_approval_request {item.approval_request_id!r} was answered already", param=param
            )
        answered.add(item.approval_request_id)
        if item.approve:
            if asked.server_label not in mcp.uses:
                raise BadRequestError(
                    f"the approved call is to MCP server {asked.server_label!r}, which is not among this request's "
                    "tools (give its mcp tool again)",
                    param=param,
                )
            approved.append(asked)
    return approved


class _Loop:
    """One response's turns. The model writes; the server makes the MCP calls it wrote
    and puts their results into the next turn's prompt; until the model answers, calls a
    function (the client's to make), writes a call that waits for approval, or is cut by
    ``max_output_tokens``. A forced ``tool_choice`` holds for the first turn only; after
    ``max_tool_calls`` MCP calls, the next turn must answer without tools (``tool_choice``
    ``none``), so the loop always ends."""

    def __init__(
        self,
        state: OrtServe,
        model: ChatModel,
        data: rp.ResponseCreateRequest,
        request: Request[Any, Any, Any],
        items: list[tuple[str, rp.InputItem]],
        exchange: _Exchange,
        output: _Output,
        mcp: McpTools,
    ) -> None:
        self.state, self.model, self.data, self.request = state, model, data, request
        self.items = items
        self.exchange = exchange
        self.output = output
        self.mcp = mcp
        self.tools = _chat_tools(data, mcp)
        self.later = False
        """Whether the first turn was started (later turns are not forced)."""
        self.reason = "stop"
        self.usage = p.CompletionUsage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        self.reasoning_tokens = 0
        self.failed = False

    def check_tool_choice(self) -> None:
        choice = self.data.tool_choice
        if isinstance(self.data.max_tool_calls, int) and self.data.max_tool_calls < 0:
            raise BadRequestError("max_tool_calls must be 0 or more", param="max_tool_calls")
        if not isinstance(choice, rp.ToolChoiceMcp):
            return
        use = self.mcp.uses.get(choice.server_label)
        if use is None:
            raise BadRequestError(
                f"tool_choice names MCP server {choice.server_label!r}, which is not among the tools",
                param="tool_choice",
            )
        if choice.name is not None and choice.name not in use.tools:
            raise BadRequestError(
                f"tool_choice names {choice.name!r}, which MCP server {choice.server_label!r} does not offer",
                param="tool_choice",
            )
        if choice.name is None and not use.tools:
            raise BadRequestError(f"MCP server {choice.server_label!r} offers no tools", param="tool_choice")

    def _turn_tools(self) -> tuple[list[p.Tool], Any]:
        """The turn's tools and ``tool_choice``: a forced choice holds for the first turn
        only (then ``auto``, so that the model can answer with what the calls gave); after
        the last call allowed, ``none``. The tools stay the same, so that each turn's
        prompt starts with the last one's (its cached prefix)."""
        choice: Any = self.data.tool_choice
        tools = self.tools
        if isinstance(choice, rp.ToolChoiceMcp):
            names = set(self.mcp.uses[choice.server_label].tools)
            if choice.name is None:  # any tool of that server: the others are left out
                tools = [tool for tool in tools if tool.function.name in names]
            choice = (
                p.NamedToolChoice(function=p.NamedToolChoiceFunction(name=choice.name)) if choice.name else "required"
            )
        if self.mcp.uses and self.mcp.spent:
            return tools, "none"
        if self.later and choice not in (msgspec.UNSET, None, "auto", "none"):
            return tools, "auto"
        return tools, choice

    async def _turn(self) -> _Generation:
        turn = [*self.items, *(("output", _as_input(item)) for item in self.output.items)]
        messages, origins = _messages(self.instructions, turn)
        tools, choice = self._turn_tools()
        self.later = True
        with _named_as_responses(origins):
            return await start_chat(
                self.state,
                self.model,
                _chat_request(self.data, messages, tools, choice, self.usage.completion_tokens),
                f"{self.state.config.path}/responses",
                self.request,
                fit=self.later,
            )

    @property
    def instructions(self) -> str | None:
        return self.data.instructions if isinstance(self.data.instructions, str) else None

    async def start(self, listings: list[rp.McpListToolsItem], approved: list[rp.McpApprovalRequestItem]) -> None:
        """Starts the first turn (before any byte is sent, so that its refusals are HTTP
        errors), unless approved calls must be made first (their results are its prompt)."""
        self.listings, self.approved = listings, approved
        self.first = None if approved else await self._turn()

    def _count(self, usage: p.CompletionUsage, run: _Generation) -> None:
        """Usage sums every turn's."""
        total = self.usage
        total.prompt_tokens += usage.prompt_tokens
        total.completion_tokens += usage.completion_tokens
        total.total_tokens += usage.total_tokens
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        if cached:
            details = total.prompt_tokens_details or p.PromptTokensDetails(cached_tokens=0)
            details.cached_tokens += cached
            total.prompt_tokens_details = details
        self.reasoning_tokens += run.reasoning_tokens[0]

    async def _make_calls(self) -> AsyncIterator[bytes]:
        """Makes the MCP calls of the last turn (in order), each result an event."""
        out = self.output
        calling, out.calling = out.calling, []
        for item in calling:
            try:
                result = await self.mcp.call(item.server_label, item.name, item.arguments)
            except McpToolError as exc:
                item.error = rp.McpToolCallError(type=exc.kind, code=exc.code, message=exc.message)  # type: ignore[arg-type]
            else:
                if result.is_error:
                    item.error = rp.McpToolCallError(type="mcp_tool_execution_error", content=result.content)
                else:
                    item.output = result.text
            for chunk in out.mcp_result(item):
                yield chunk

    async def run(self, stream: bool) -> AsyncIterator[bytes]:
        """Every turn's events (whole answers run through it too, their events unsent)."""
        out = self.output
        for listing in self.listings:
            for chunk in out.listed(listing):
                yield chunk
        for asked in self.approved:
            for chunk in out.mcp_call(asked.server_label, asked.name, asked.arguments, approval=asked.id):
                yield chunk
        run = self.first
        while True:
            if run is not None:
                start = out.turn_start = len(out.items)
                if stream:
                    async for chunk in run.sse(*self._callbacks(run), error_event=self._error, closing=b""):
                        yield chunk
                    if self.failed:
                        return
                else:
                    texts, calls, finish, usage = await run.collect()
                    self.reason = finish[0]
                    self._count(usage, run)
                    for chunk in out.feed(run.reasonings[0], texts[0], calls[0], finish[0]):
                        yield chunk
                turn = out.items[start:]
            else:
                turn = []
            if not out.calling:
                return
            async for chunk in self._make_calls():
                yield chunk
            waits = any(isinstance(item, rp.FunctionCallItem | rp.McpApprovalRequestItem) for item in turn)
            limit = self.data.max_output_tokens
            if isinstance(limit, int) and self.usage.completion_tokens >= limit:
                self.reason = "length"  # max_output_tokens bounds the whole response
            if waits or self.reason == "length":
                return
            run = await self._turn()

    def _callbacks(self, run: _Generation) -> tuple[Any, Any]:
        def events(_: int, text: str, calls: list[ToolCall], finish: str | None) -> list[bytes]:
            if finish is not None:
                self.reason = finish
            return self.output.feed(run.event_reasoning, text, calls, finish)

        def counted(usage: p.CompletionUsage) -> bytes:
            self._count(usage, run)
            return b""

        return events, counted

    def _error(self, exc: Exception) -> bytes:
        self.failed = True
        detail = error_detail(exc)
        return self.output.event(
            rp.ErrorEvent, message=detail.message, code=detail.code or detail.type, param=detail.param
        )

    async def drain(self) -> None:
        async for _ in self.run(stream=False):
            pass

    async def stream(self) -> AsyncIterator[bytes]:
        out, exchange = self.output, self.exchange
        try:
            opening = exchange.response([], "in_progress")
            yield out.event(rp.ResponseCreatedEvent, response=opening)
            yield out.event(rp.ResponseInProgressEvent, response=opening)
            try:
                async for chunk in self.run(stream=True):
                    yield chunk
            except Exception as exc:  # noqa: BLE001  # a later turn that could not start: in-band, as sse says errors
                yield self._error(exc)
            if self.failed:
                return
            response = exchange.finished(out.items, self.reason, self.usage, self.reasoning_tokens)
            kind = rp.ResponseIncompleteEvent if response.status == "incomplete" else rp.ResponseCompletedEvent
            yield out.event(kind, response=response)
        finally:
            await self.mcp.close()


@get(
    "/responses/{response_id:str}",
    summary="Retrieve a stored response",
    responses=error_responses(404, *GET_ERRORS),
)
async def retrieve_response(response_id: FromPath[str], ortserve: NamedDependency[OrtServe]) -> rp.Response:
    stored = await ortserve.responses.get(response_id)
    if stored is None:
        raise ResponseNotFoundError(f"response {response_id!r} was not found", param="response_id")
    return stored.response


@delete(
    "/responses/{response_id:str}",
    status_code=200,
    summary="Delete a stored response",
    responses=error_responses(404, *GET_ERRORS),
)
async def delete_response(response_id: FromPath[str], ortserve: NamedDependency[OrtServe]) -> rp.ResponseDeleted:
    if not await ortserve.responses.delete(response_id):
        raise ResponseNotFoundError(f"response {response_id!r} was not found", param="response_id")
    return rp.ResponseDeleted(id=response_id)


responses_route_handlers = [create_response, retrieve_response, delete_response]
