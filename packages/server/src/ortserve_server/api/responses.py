"""``/v1/responses``: OpenAI's Responses API as a thin adapter over the chat path.

A request becomes a :class:`~ortserve_client.protocol.ChatCompletionRequest` (items ->
messages, flat function tools -> chat tools, ``text.format`` -> ``response_format``,
``max_output_tokens`` -> ``max_completion_tokens``) and runs through exactly what chat
completions run (:func:`start_chat`: the checks, the template, forced-call grammars, the
tool-call parser, the queue limits); errors that name a chat field are renamed to the
Responses field they came from (:mod:`.responses_input`). What comes back is turned into
output items, whole or as the typed stream events (:mod:`.responses_output`).

With ``mcp`` tools a response is a loop of model turns (:class:`_Loop`): the server makes
the MCP calls the model writes (:mod:`.._mcp`) and feeds the results into the next turn,
until an answer, a function call for the client, an approval request, or a limit.

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
- An unknown ``previous_response_id`` is a 404 naming it (OpenAI's
  ``previous_response_not_found``); an unknown id in the path of ``GET``/``DELETE`` a 404.
  A stored response belongs to the API key that stored it: to another key it is unknown.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody
from ortserve_client import protocol as p
from ortserve_client import responses_protocol as rp
from ortserve_runtime import ChatModel, ToolCall

from .._auth import caller_of
from .._errors import BadRequestError, NotFoundError, UnsupportedParameterError
from .._generation import Generation, error_detail, stream_response
from .._ids import new_id
from .._leases import require_model
from .._mcp import McpTool as McpToolSpec
from .._mcp import McpToolError, McpTools
from .._openapi import GET_ERRORS, error_responses, generation_docs
from .._plan import check_tool_count, start_chat
from .._record import note
from .._state import OrtServe
from .._tool_loop import ToolLoop
from .responses_input import _chat_request, _chat_tools, _input, _messages, _named_as_responses
from .responses_items import ResponseNotFoundError, list_input_items, with_id
from .responses_output import _as_input, _Output, _usage

__all__ = ["PreviousResponseNotFoundError", "ResponseNotFoundError", "check_metadata", "responses_route_handlers"]

_METADATA_KEYS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's bounds on ``metadata`` (which a stored response keeps)."""


class PreviousResponseNotFoundError(NotFoundError):
    code = "previous_response_not_found"  # OpenAI's code and status (404) for it


# -- request checks and mapping -------------------------------------------------------------


def _check(data: rp.ResponseCreateRequest, state: OrtServe, model: ChatModel) -> None:
    """Refuse what we cannot honour, naming the field, rather than ignore it."""
    check_tool_count(data.tools)
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
        # "medium", OpenAI's default, asks for nothing different (twentieth probe: any value was
        # echoed and ignored).
        "service_tier": data.service_tier not in (msgspec.UNSET, None, "auto", "default"),
        "text.verbosity": isinstance(data.text, rp.TextConfig)
        and data.text.verbosity not in (msgspec.UNSET, None, "medium"),
    }
    for name, asked in refused.items():
        if asked:
            raise UnsupportedParameterError(f"'{name}' is not supported by this server", param=name)
    if data.store is True and not state.responses.enabled:
        raise UnsupportedParameterError("this server stores no responses (responses_store_max is 0)", param="store")
    check_metadata(data.metadata if isinstance(data.metadata, dict) else None)


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds on ``metadata`` (a response's, a batch's): kept with what it labels,
    so no caller may store more than a few hundred bytes of it."""
    if metadata is not None and (
        len(metadata) > _METADATA_KEYS
        or any(len(k) > _METADATA_KEY_CHARS or len(v) > _METADATA_VALUE_CHARS for k, v in metadata.items())
    ):
        raise BadRequestError(
            f"'metadata' holds at most {_METADATA_KEYS} pairs, keys of at most {_METADATA_KEY_CHARS} characters "
            f"and values of at most {_METADATA_VALUE_CHARS}",
            param="metadata",
        )


def _without_secrets(tool: rp.Tool) -> rp.Tool:
    """A tool as the response echoes (and the store keeps) it: an MCP tool's headers and
    authorization are the caller's secrets, so they are left out."""
    if isinstance(tool, rp.McpTool) and (tool.headers or tool.authorization):
        return msgspec.structs.replace(tool, headers=None, authorization=None)
    return tool


class _Exchange:
    """One ``POST /v1/responses``: the echo of the request in the response object, and
    the response kept in the store when it asks for that."""

    def __init__(
        self, data: rp.ResponseCreateRequest, state: OrtServe, items: list[rp.InputItem], inherited: int, owner: str
    ) -> None:
        self.data = data
        self.owner = owner
        self.state = state
        self.items = items
        self.inherited = inherited
        """How many of ``items`` came from the previous response."""
        tag = state.config.response_id_tag  # a Ray replica's id: see ortserve_server.ray
        self.id = f"resp_{tag}-{uuid.uuid4().hex}" if tag else new_id("resp_")
        note(response_id=self.id)
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
            self.saving = self.state.responses.put(
                self.owner,
                response,
                [*map(with_id, self.items), *(_as_input(item) for item in output)],
                self.inherited,
            )
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
        previous = await ortserve.responses.get(caller_of(request).owner, data.previous_response_id)
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
        exchange = _Exchange(data, ortserve, [item for _, item in items], len(history), caller_of(request).owner)
        summarize = isinstance(data.reasoning, rp.Reasoning) and data.reasoning.summary is not None
        loop = _Loop(ortserve, model, data, request, items, exchange, _Output(summarize, mcp), mcp)
        loop.check_tool_choice()
        await loop.start(listings, approved)
    except BaseException:
        await mcp.close()
        raise
    if data.stream is True:
        return stream_response(loop.stream())
    await loop.finish()
    response = exchange.finished(loop.output.items, loop.reason, loop.usage, loop.reasoning_tokens)
    if exchange.saving is not None:  # on disk before the client learns its id (a streamed one: see last_events)
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
            description=tool.server_description,
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


class _Loop(ToolLoop):
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
        super().__init__(state, request, mcp)
        self.model, self.data = model, data
        self.items = items
        self.exchange = exchange
        self.output = output
        self.tools = _chat_tools(data, mcp)
        self.later = False
        """Whether the first turn was started (later turns are not forced)."""
        self.reason = "stop"
        self.reasoning_tokens = 0

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

    async def _turn(self) -> Generation:
        turn = [*self.items, *(("output", _as_input(item)) for item in self.output.items)]
        messages, origins = _messages(self.instructions, turn)
        tools, choice = self._turn_tools()
        self.later = True
        with _named_as_responses(origins):
            started = await start_chat(
                self.state,
                self.model,
                _chat_request(self.data, messages, tools, choice, self.usage.completion_tokens),
                self.request,
                fit=self.later,
            )
        return Generation(self.state, f"{self.state.config.path}/responses", started)

    @property
    def instructions(self) -> str | None:
        return self.data.instructions if isinstance(self.data.instructions, str) else None

    async def start(self, listings: list[rp.McpListToolsItem], approved: list[rp.McpApprovalRequestItem]) -> None:
        """Starts the first turn (before any byte is sent, so that its refusals are HTTP
        errors), unless approved calls must be made first (their results are its prompt)."""
        self.listings, self.approved = listings, approved
        self.first = None if approved else await self._turn()

    def _count(self, usage: p.CompletionUsage, run: Generation) -> None:
        self.add_usage(usage)
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

    async def run_turns(self, stream: bool) -> AsyncIterator[bytes]:
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
                    async for chunk in run.sse(*self._callbacks(run), error_event=self.failure, closing=b""):
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

    def _callbacks(self, run: Generation) -> tuple[Any, Any]:
        def events(_: int, text: str, calls: list[ToolCall], finish: str | None) -> list[bytes]:
            if finish is not None:
                self.reason = finish
            return self.output.feed(run.event_reasoning, text, calls, finish)

        def counted(usage: p.CompletionUsage) -> bytes:
            self._count(usage, run)
            return b""

        return events, counted

    def error_event(self, exc: Exception) -> bytes:
        detail = error_detail(exc)
        return self.output.event(
            rp.ErrorEvent, message=detail.message, code=detail.code or detail.type, param=detail.param
        )

    def opening(self) -> bytes:
        opening = self.exchange.response([], "in_progress")
        out = self.output
        return out.event(rp.ResponseCreatedEvent, response=opening) + out.event(
            rp.ResponseInProgressEvent, response=opening
        )

    def closing(self) -> bytes:
        response = self.exchange.finished(self.output.items, self.reason, self.usage, self.reasoning_tokens)
        kind = rp.ResponseIncompleteEvent if response.status == "incomplete" else rp.ResponseCompletedEvent
        return self.output.event(kind, response=response)

    async def last_events(self) -> bytes:
        """The closing events once the response is stored (asked to be): a store that
        failed (a full disk) ends the stream with an error event instead."""
        events = self.closing()
        if self.exchange.saving is not None:
            try:
                await asyncio.wrap_future(self.exchange.saving)
            except Exception as exc:  # noqa: BLE001  # in-band, as any failure after the stream started
                return self.failure(exc)
        return events


@get(
    "/responses/{response_id:str}",
    summary="Retrieve a stored response",
    responses=error_responses(404, *GET_ERRORS),
)
async def retrieve_response(
    response_id: FromPath[str], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> rp.Response:
    stored = await ortserve.responses.get(caller_of(request).owner, response_id)
    if stored is None:
        raise ResponseNotFoundError(f"response {response_id!r} was not found", param="response_id")
    return stored.response


@delete(
    "/responses/{response_id:str}",
    status_code=200,
    summary="Delete a stored response",
    responses=error_responses(404, *GET_ERRORS),
)
async def delete_response(
    response_id: FromPath[str], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> rp.ResponseDeleted:
    if not await ortserve.responses.delete(caller_of(request).owner, response_id):
        raise ResponseNotFoundError(f"response {response_id!r} was not found", param="response_id")
    return rp.ResponseDeleted(id=response_id)


responses_route_handlers = [create_response, retrieve_response, list_input_items, delete_response]
