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
from collections.abc import Iterator
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
        "max_tool_calls": data.max_tool_calls not in (msgspec.UNSET, None),
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
        if isinstance(item, rp.FunctionCallItem):
            call = p.ToolCall(id=item.call_id, function=p.FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if isinstance(last, p.AssistantMessage):
                last.tool_calls = [*(last.tool_calls or []), call]
                thought = _add_thought(last, thought)
                continue
            message = p.AssistantMessage(content=None, tool_calls=[call])
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


def _add_thought(message: p.AssistantMessage, thought: str) -> str:
    """Puts a reasoning item's text on the assistant message it preceded (as chat
    completions take an earlier turn's ``reasoning_content``); returns what is left."""
    if thought:
        given = message.reasoning_content if isinstance(message.reasoning_content, str) else ""
        message.reasoning_content = "\n\n".join(filter(None, (given, thought)))
    return ""


def _chat_request(data: rp.ResponseCreateRequest, messages: list[p.ChatMessage]) -> p.ChatCompletionRequest:
    tools = (
        msgspec.UNSET
        if not data.tools
        else [
            p.Tool(
                function=p.FunctionDefinition(
                    name=tool.name,
                    description=msgspec.UNSET if tool.description is None else tool.description,
                    parameters=msgspec.UNSET if tool.parameters is None else tool.parameters,
                    strict=tool.strict,
                )
            )
            for tool in data.tools
        ]
    )
    choice = data.tool_choice
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
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=data.parallel_tool_calls,
        response_format=response_format,
        max_completion_tokens=data.max_output_tokens,
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

    def __init__(self, summarize: bool = False) -> None:
        self.items: list[rp.OutputItem] = []
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

    def finish(self, reason: str) -> list[bytes]:
        """The end: an answer with neither text nor calls is one empty message (so that
        ``output_text`` is ``""``, not missing), after any reasoning (which ``max_tokens``
        may have cut short: then it is incomplete)."""
        status = "incomplete" if reason == "length" else "completed"
        out = self.close_reasoning(status)
        if all(isinstance(item, rp.ReasoningItem) for item in self.items):
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
            tool_choice=data.tool_choice if isinstance(data.tool_choice, str | rp.ToolChoiceFunction) else "auto",
            tools=list(data.tools) if isinstance(data.tools, list) else [],
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
    instructions = data.instructions if isinstance(data.instructions, str) else None
    messages, origins = _messages(instructions, items)
    with _named_as_responses(origins):
        run = await start_chat(
            ortserve, model, _chat_request(data, messages), f"{ortserve.config.path}/responses", request
        )
    exchange = _Exchange(data, ortserve, [item for _, item in items])
    output = _Output(summarize=isinstance(data.reasoning, rp.Reasoning) and data.reasoning.summary is not None)
    if data.stream is True:
        return _stream_response(_events(run, exchange, output))
    texts, calls, finish, usage = await _while_connected(request, ortserve, run.collect())
    output.feed(run.reasonings[0], texts[0], calls[0], finish[0])
    response = exchange.finished(output.items, finish[0], usage, run.reasoning_tokens[0])
    if exchange.saving is not None:  # on disk before the client learns its id (a streamed one: as it is sent)
        await asyncio.wrap_future(exchange.saving)
    return Response(response)


def _events(run: _Generation, exchange: _Exchange, output: _Output) -> Any:
    reason = ["stop"]

    def events(_: int, text: str, calls: list[ToolCall], finish: str | None) -> list[bytes]:
        if finish is not None:
            reason[0] = finish
        return output.feed(run.event_reasoning, text, calls, finish)

    def completed(usage: p.CompletionUsage) -> bytes:
        response = exchange.finished(output.items, reason[0], usage, run.reasoning_tokens[0])
        kind = rp.ResponseIncompleteEvent if response.status == "incomplete" else rp.ResponseCompletedEvent
        return output.event(kind, response=response)

    def error(exc: Exception) -> bytes:
        detail = error_detail(exc)
        return output.event(rp.ErrorEvent, message=detail.message, code=detail.code or detail.type, param=detail.param)

    opening = exchange.response([], "in_progress")
    return run.sse(
        events,
        completed,
        [
            output.event(rp.ResponseCreatedEvent, response=opening),
            output.event(rp.ResponseInProgressEvent, response=opening),
        ],
        error_event=error,
        closing=b"",
    )


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
