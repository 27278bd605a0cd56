"""The OpenAI Responses API (``/v1/responses``) as msgspec Structs, shared by client and server.

Same conventions as :mod:`ortserve_client.protocol`: request-side Structs omit absent
fields, response-side Structs always carry the fields OpenAI always sends, and decoding
tolerates unknown fields. Items, content parts, tools and stream events are unions tagged
by ``type``.

One exception to the typing: a request's ``input`` list is decoded as plain JSON objects,
because OpenAI lets a message item leave out its ``"type": "message"`` tag, and msgspec
needs the tag to pick a Struct. :func:`input_items` turns that list into
:data:`InputItem` Structs (the server calls it; a ``msgspec.ValidationError`` names the
offending item).

Long on purpose (over 600 lines): one Struct per item, tool and stream event of the
Responses API (MCP's included), in the one namespace its users import.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from .protocol import InputAudio, _Request, _Response  # the same conventions as the chat protocol

__all__ = [
    "ContentPartAddedEvent",
    "ContentPartDoneEvent",
    "ErrorEvent",
    "FunctionCallArgumentsDeltaEvent",
    "FunctionCallArgumentsDoneEvent",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "IncompleteDetails",
    "InputAudioPart",
    "InputContent",
    "InputImage",
    "InputItem",
    "InputItemList",
    "InputMessage",
    "InputText",
    "InputTokensDetails",
    "McpApprovalFilter",
    "McpApprovalRequestItem",
    "McpApprovalResponseItem",
    "McpCallArgumentsDeltaEvent",
    "McpCallArgumentsDoneEvent",
    "McpCallCompletedEvent",
    "McpCallFailedEvent",
    "McpCallInProgressEvent",
    "McpCallItem",
    "McpListToolsCompletedEvent",
    "McpListToolsFailedEvent",
    "McpListToolsInProgressEvent",
    "McpListToolsItem",
    "McpListToolsTool",
    "McpTool",
    "McpToolCallError",
    "McpToolFilter",
    "OutputItem",
    "OutputItemAddedEvent",
    "OutputItemDoneEvent",
    "OutputMessage",
    "OutputText",
    "OutputTextDeltaEvent",
    "OutputTextDoneEvent",
    "OutputTokensDetails",
    "Reasoning",
    "ReasoningItem",
    "ReasoningSummaryPartAddedEvent",
    "ReasoningSummaryPartDoneEvent",
    "ReasoningSummaryTextDeltaEvent",
    "ReasoningSummaryTextDoneEvent",
    "ReasoningText",
    "ReasoningTextDeltaEvent",
    "ReasoningTextDoneEvent",
    "Response",
    "ResponseCompletedEvent",
    "ResponseCreateRequest",
    "ResponseCreatedEvent",
    "ResponseDeleted",
    "ResponseError",
    "ResponseFailedEvent",
    "ResponseInProgressEvent",
    "ResponseIncompleteEvent",
    "ResponseStreamEvent",
    "ResponseUsage",
    "SummaryText",
    "TextConfig",
    "TextFormat",
    "TextFormatJSONObject",
    "TextFormatJSONSchema",
    "TextFormatText",
    "Tool",
    "ToolChoice",
    "ToolChoiceFunction",
    "ToolChoiceMcp",
    "input_items",
]


# -- input items ----------------------------------------------------------------------------


class InputText(_Request, tag_field="type", tag="input_text"):
    """``{"type": "input_text", "text": ...}``."""

    text: str


class InputImage(_Request, tag_field="type", tag="input_image"):
    """An image as a ``data:`` URL (or an ``http(s)`` URL where the server allows its host).
    ``file_id`` is OpenAI's Files API, which ortserve does not have."""

    image_url: str | UnsetType | None = UNSET
    file_id: str | UnsetType | None = UNSET
    detail: Literal["auto", "low", "high"] | UnsetType = UNSET

    @classmethod
    def from_bytes(cls, data: bytes, media_type: str = "image/png") -> InputImage:
        """The image inline, as a ``data:`` URL."""
        return cls(image_url=f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}")


class InputAudioPart(_Request, tag_field="type", tag="input_audio"):
    """``{"type": "input_audio", "input_audio": {"data", "format"}}``: audio inline, for
    models that hear (the same part as chat's)."""

    input_audio: InputAudio

    @classmethod
    def from_bytes(cls, data: bytes, format: str = "wav") -> InputAudioPart:
        """The audio inline, base64-encoded."""
        return cls(input_audio=InputAudio(data=base64.b64encode(data).decode("ascii"), format=format))


class OutputText(_Response, tag_field="type", tag="output_text"):
    """Text the model wrote: a part of an output message, and of an assistant message
    handed back as input."""

    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


InputContent = InputText | InputImage | InputAudioPart | OutputText


class InputMessage(_Request, tag_field="type", tag="message"):
    """A message of the conversation (``type`` may be left out on the wire)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContent]
    id: str | UnsetType = UNSET
    status: str | UnsetType = UNSET


class FunctionCallItem(_Response, tag_field="type", tag="function_call"):
    """A call the model made: an output item, and an input item when handed back."""

    call_id: str
    name: str
    arguments: str
    """The arguments as a JSON string."""
    id: str | UnsetType = UNSET
    status: Literal["in_progress", "completed", "incomplete"] | UnsetType = UNSET


class FunctionCallOutputItem(_Request, tag_field="type", tag="function_call_output"):
    """The result of the call ``call_id``, as the caller's code computed it."""

    call_id: str
    output: str | list[InputContent]
    id: str | UnsetType = UNSET
    status: str | UnsetType = UNSET


class SummaryText(_Response, tag_field="type", tag="summary_text"):
    """A part of a reasoning item's ``summary``."""

    text: str


class ReasoningText(_Response, tag_field="type", tag="reasoning_text"):
    """A part of a reasoning item's ``content``: the model's thinking as it wrote it."""

    text: str


class ReasoningItem(_Response, tag_field="type", tag="reasoning"):
    """A reasoning model's thinking: an output item before the answer, and an input item
    when handed back. ortserve has no summarizer, so ``content`` carries the thinking
    verbatim (``reasoning_text``, as vLLM sends it); ``summary`` carries the same text
    only when the request asked for a summary (``reasoning.summary``), and is empty
    otherwise. Nothing is encrypted: ``encrypted_content`` is never sent."""

    id: str
    summary: list[SummaryText] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] | UnsetType = UNSET

    @property
    def text(self) -> str:
        """The thinking: the content's text, else the summary's (what a client kept)."""
        return "".join(part.text for part in self.content) or "\n\n".join(part.text for part in self.summary)


class McpListToolsTool(_Response):
    """A tool an MCP server listed."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    annotations: dict[str, Any] | None = None


class McpListToolsItem(_Response, tag_field="type", tag="mcp_list_tools"):
    """The tools of the MCP server ``server_label``, as the server listed them (a follow-up
    that hands it back, or continues from a stored response, is not listed again)."""

    id: str
    server_label: str
    tools: list[McpListToolsTool]
    error: str | None = None


class McpToolCallError(_Response):
    """Why an ``mcp_call`` has no output: ``type`` ``mcp_protocol_error`` (``code``: MCP's
    JSON-RPC code; -32001 a timeout), ``http_error`` (``code``: the HTTP status), or
    ``mcp_tool_execution_error`` (the tool said it failed: ``content`` is what it said)."""

    type: Literal["mcp_protocol_error", "http_error", "mcp_tool_execution_error"]
    code: int | UnsetType = UNSET
    message: str | UnsetType = UNSET
    content: list[dict[str, Any]] | UnsetType = UNSET


class McpCallItem(_Response, tag_field="type", tag="mcp_call"):
    """A tool call the server made on an MCP server: its ``output``, or its ``error``."""

    id: str
    server_label: str
    name: str
    arguments: str
    output: str | None = None
    error: McpToolCallError | None = None
    status: Literal["in_progress", "completed", "incomplete", "calling", "failed"] | UnsetType = UNSET
    approval_request_id: str | None = None


class McpApprovalRequestItem(_Response, tag_field="type", tag="mcp_approval_request"):
    """A call the model wants to make that needs the user's approval first: answer with an
    :class:`McpApprovalResponseItem` (and ``previous_response_id``, or this item handed back)."""

    id: str
    server_label: str
    name: str
    arguments: str


class McpApprovalResponseItem(_Request, tag_field="type", tag="mcp_approval_response"):
    """The user's answer to ``approval_request_id``: approved, the call is made and the
    model goes on with its result; refused, the model is told so."""

    approval_request_id: str
    approve: bool
    id: str | UnsetType | None = UNSET
    reason: str | UnsetType | None = UNSET


InputItem = (
    InputMessage
    | FunctionCallItem
    | FunctionCallOutputItem
    | ReasoningItem
    | McpListToolsItem
    | McpCallItem
    | McpApprovalRequestItem
    | McpApprovalResponseItem
)

_input_item_list = list[InputItem]


def input_items(items: Sequence[dict[str, Any]]) -> list[InputItem]:
    """The ``input`` list as Structs; an item without ``type`` is a message, as OpenAI
    reads it. Raises ``msgspec.ValidationError`` naming ``$[i]...``."""
    tagged = [item if "type" in item else {**item, "type": "message"} for item in items]
    return msgspec.convert(tagged, _input_item_list)


# -- tools, text format, reasoning ----------------------------------------------------------


class FunctionTool(_Response, tag_field="type", tag="function"):
    """A function the model may call: ``parameters`` is its arguments' JSON schema."""

    name: str
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ToolChoiceFunction(_Response, tag_field="type", tag="function"):
    """``tool_choice: {"type": "function", "name": ...}``: call this function."""

    name: str


class McpToolFilter(_Response):
    """Tools of an MCP server picked by name or by the server's read-only hint."""

    tool_names: list[str] | None = None
    read_only: bool | None = None


class McpApprovalFilter(_Response):
    """``require_approval`` by tool: those ``never`` names need none; all others do."""

    always: McpToolFilter | None = None
    never: McpToolFilter | None = None


class McpTool(_Response, tag_field="type", tag="mcp"):
    """The tools of an MCP server, called by the server itself. ``server_label`` names a
    server the operator configured (``--mcp-server``); ``server_url`` (with ``headers``)
    names one only where the operator allows it (``--allow-mcp-url``)."""

    server_label: str
    server_url: str | None = None
    allowed_tools: list[str] | McpToolFilter | None = None
    require_approval: Literal["always", "never"] | McpApprovalFilter | None = None
    """``None``: ``"always"``, as OpenAI."""
    headers: dict[str, str] | None = None
    authorization: str | None = None
    """Sent as ``Authorization: Bearer <authorization>`` (a ``server_url`` server only)."""
    server_description: str | None = None


Tool = FunctionTool | McpTool


class ToolChoiceMcp(_Response, tag_field="type", tag="mcp"):
    """``tool_choice: {"type": "mcp", "server_label": ..., "name": ...}``: call a tool of
    that server (the tool ``name``, else any of its tools)."""

    server_label: str
    name: str | None = None


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction | ToolChoiceMcp


class TextFormatText(_Response, tag_field="type", tag="text"):
    """Free text (the default)."""


class TextFormatJSONObject(_Response, tag_field="type", tag="json_object"):
    """Any JSON object."""


class TextFormatJSONSchema(_Response, tag_field="type", tag="json_schema"):
    """JSON that matches ``schema`` (constrained decoding, so always, strict or not)."""

    name: str
    schema: dict[str, Any]
    description: str | UnsetType | None = UNSET
    strict: bool | None = None


TextFormat = TextFormatText | TextFormatJSONObject | TextFormatJSONSchema


class TextConfig(_Response):
    """``text``: the format of the text output."""

    format: TextFormat = msgspec.field(default_factory=TextFormatText)
    verbosity: str | UnsetType | None = UNSET


class Reasoning(_Response):
    """``reasoning``: for a reasoning model, ``effort`` reaches its chat template as
    ``reasoning_effort`` and ``summary`` (any value) adds the thinking to the reasoning
    item's ``summary``; for other models both must be null. The response echoes it."""

    effort: str | None = None
    summary: str | None = None


# -- the request ----------------------------------------------------------------------------


class ResponseCreateRequest(_Request):
    """``POST /v1/responses``."""

    model: str
    input: str | list[dict[str, Any]]
    """Text (one user message) or items: see :func:`input_items`."""
    keep_alive: float | str | UnsetType | None = UNSET
    """Extension (Ollama's): how long the model stays loaded once idle after this request
    (seconds or ``"5m"``; 0 unloads it, negative keeps it). Absent: ``--idle-unload``."""
    cache_salt: str | UnsetType | None = UNSET
    """Extension (vLLM's): the prefix-cache scope. Key/value rows a request computed serve
    only later requests with the same salt, so users given different salts cannot learn
    from ``cached_tokens`` or timing what the other sent."""
    instructions: str | UnsetType | None = UNSET
    """A system message put first; not carried over to a follow-up (as OpenAI does)."""
    tools: list[Tool] | UnsetType | None = UNSET
    tool_choice: ToolChoice | UnsetType | None = UNSET
    parallel_tool_calls: bool | UnsetType | None = UNSET
    text: TextConfig | UnsetType | None = UNSET
    max_output_tokens: int | UnsetType | None = UNSET
    temperature: float | UnsetType | None = UNSET
    top_p: float | UnsetType | None = UNSET
    reasoning: Reasoning | UnsetType | None = UNSET
    stream: bool | UnsetType | None = UNSET
    store: bool | UnsetType | None = UNSET
    previous_response_id: str | UnsetType | None = UNSET
    metadata: dict[str, str] | UnsetType | None = UNSET
    user: str | UnsetType | None = UNSET
    safety_identifier: str | UnsetType | None = UNSET
    """Who the end user is, as ``user``: taken, as this server monitors no one."""
    prompt_cache_key: str | UnsetType | None = UNSET
    """Taken: prompts are cached by their tokens here, whatever the key."""
    service_tier: str | UnsetType | None = UNSET
    """``auto`` or ``default``: this server has one tier."""
    max_tool_calls: int | UnsetType | None = UNSET
    """MCP calls this response may make (at most the server's ``mcp_max_tool_calls``,
    which also applies when this is absent); then the model answers without tools.
    Function calls are the client's to make, so they do not count."""
    # Fields ortserve refuses unless they ask for nothing (so that they are not ignored):
    background: bool | UnsetType | None = UNSET
    include: list[str] | UnsetType | None = UNSET
    truncation: str | UnsetType | None = UNSET
    top_logprobs: int | UnsetType | None = UNSET
    conversation: Any = UNSET
    prompt: Any = UNSET


# -- the response ---------------------------------------------------------------------------


class OutputMessage(_Response, tag_field="type", tag="message"):
    """The model's text, as ``output_text`` parts."""

    id: str
    content: list[OutputText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem | McpListToolsItem | McpCallItem | McpApprovalRequestItem


class InputTokensDetails(_Response):
    cached_tokens: int = 0
    """Input tokens taken from the prefix cache (an earlier request's key/values)."""


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    """Token counts of a response."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(_Response):
    reason: str
    """``max_output_tokens`` (or OpenAI's ``content_filter``); a plain string, since a union
    of the literals and ``str`` documents as a ``oneOf`` that both branches match."""


class ResponseError(_Response):
    code: str
    message: str


class Response(_Response):
    """A model response: ``POST /v1/responses`` (not streamed), ``GET /v1/responses/{id}``,
    and the snapshot in the lifecycle events of a stream."""

    id: str
    created_at: int
    model: str
    output: list[OutputItem]
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled", "queued"]
    object: Literal["response"] = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)
    store: bool = False
    temperature: float | None = None
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    tool_choice: ToolChoice = "auto"
    tools: list[Tool] = msgspec.field(default_factory=list)
    max_tool_calls: int | None = None
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None

    @property
    def output_text(self) -> str:
        """The text of every ``output_text`` part, joined (what OpenAI's SDKs compute)."""
        return "".join(part.text for item in self.output if isinstance(item, OutputMessage) for part in item.content)


class InputItemList(_Response):
    """``GET /v1/responses/{id}/input_items``: a page of the items a stored response took as
    input (the conversation it continued, then its own ``input``), each with its id."""

    data: list[InputItem]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class ResponseDeleted(_Response):
    """``DELETE /v1/responses/{id}``."""

    id: str
    deleted: bool = True
    object: Literal["response.deleted"] = "response.deleted"


# -- stream events --------------------------------------------------------------------------


class _Event(_Response, tag_field="type"):
    sequence_number: int


class ResponseCreatedEvent(_Event, tag="response.created"):
    response: Response


class ResponseInProgressEvent(_Event, tag="response.in_progress"):
    response: Response


class ResponseCompletedEvent(_Event, tag="response.completed"):
    response: Response


class ResponseIncompleteEvent(_Event, tag="response.incomplete"):
    response: Response


class ResponseFailedEvent(_Event, tag="response.failed"):
    response: Response


class OutputItemAddedEvent(_Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDoneEvent(_Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAddedEvent(_Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDoneEvent(_Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDeltaEvent(_Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDoneEvent(_Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class FunctionCallArgumentsDeltaEvent(_Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(_Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str
    name: str | UnsetType = UNSET


class ReasoningTextDeltaEvent(_Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDoneEvent(_Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class ReasoningSummaryPartAddedEvent(_Event, tag="response.reasoning_summary_part.added"):
    item_id: str
    output_index: int
    summary_index: int
    part: SummaryText


class ReasoningSummaryPartDoneEvent(_Event, tag="response.reasoning_summary_part.done"):
    item_id: str
    output_index: int
    summary_index: int
    part: SummaryText


class ReasoningSummaryTextDeltaEvent(_Event, tag="response.reasoning_summary_text.delta"):
    item_id: str
    output_index: int
    summary_index: int
    delta: str


class ReasoningSummaryTextDoneEvent(_Event, tag="response.reasoning_summary_text.done"):
    item_id: str
    output_index: int
    summary_index: int
    text: str


class _McpItemEvent(_Event):
    item_id: str
    output_index: int


class McpListToolsInProgressEvent(_McpItemEvent, tag="response.mcp_list_tools.in_progress"):
    pass


class McpListToolsCompletedEvent(_McpItemEvent, tag="response.mcp_list_tools.completed"):
    pass


class McpListToolsFailedEvent(_McpItemEvent, tag="response.mcp_list_tools.failed"):
    pass


class McpCallInProgressEvent(_McpItemEvent, tag="response.mcp_call.in_progress"):
    pass


class McpCallCompletedEvent(_McpItemEvent, tag="response.mcp_call.completed"):
    pass


class McpCallFailedEvent(_McpItemEvent, tag="response.mcp_call.failed"):
    pass


class McpCallArgumentsDeltaEvent(_McpItemEvent, tag="response.mcp_call_arguments.delta"):
    delta: str


class McpCallArgumentsDoneEvent(_McpItemEvent, tag="response.mcp_call_arguments.done"):
    arguments: str


class ErrorEvent(_Event, tag="error"):
    """A failure after the stream started (the HTTP status was 200 by then)."""

    message: str
    code: str | None = None
    param: str | None = None


ResponseStreamEvent = (
    ResponseCreatedEvent
    | ResponseInProgressEvent
    | ResponseCompletedEvent
    | ResponseIncompleteEvent
    | ResponseFailedEvent
    | OutputItemAddedEvent
    | OutputItemDoneEvent
    | ContentPartAddedEvent
    | ContentPartDoneEvent
    | OutputTextDeltaEvent
    | OutputTextDoneEvent
    | FunctionCallArgumentsDeltaEvent
    | FunctionCallArgumentsDoneEvent
    | ReasoningTextDeltaEvent
    | ReasoningTextDoneEvent
    | ReasoningSummaryPartAddedEvent
    | ReasoningSummaryPartDoneEvent
    | ReasoningSummaryTextDeltaEvent
    | ReasoningSummaryTextDoneEvent
    | McpListToolsInProgressEvent
    | McpListToolsCompletedEvent
    | McpListToolsFailedEvent
    | McpCallInProgressEvent
    | McpCallCompletedEvent
    | McpCallFailedEvent
    | McpCallArgumentsDeltaEvent
    | McpCallArgumentsDoneEvent
    | ErrorEvent
)
