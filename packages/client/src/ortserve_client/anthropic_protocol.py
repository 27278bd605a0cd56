"""The Anthropic Messages API (``POST /v1/messages``) as msgspec Structs.

The wire contract of ortserve's Anthropic-compatible routes, kept apart from the OpenAI one
in :mod:`ortserve_client.protocol`. Requests use ``UNSET`` for absent fields; responses
always carry the fields Anthropic always sends (``null`` included), so the official
``anthropic`` SDK decodes them. Unions are tagged by ``type`` as in Anthropic's JSON:
content blocks (:data:`ContentBlockParam`), image sources, ``tool_choice``, stream events
(:data:`StreamEvent`) and deltas. Decoding tolerates unknown fields (``cache_control``,
``citations``...), so newer SDKs keep working. Names that OpenAI's protocol also uses carry
a prefix (``AnthropicErrorResponse``), so the two sit side by side in one OpenAPI schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, UnsetType

# The same bases as OpenAI's protocol: requests omit absent fields, responses send them all.
from .protocol import _Request, _Response

__all__ = [
    "AnthropicErrorDetail",
    "AnthropicErrorResponse",
    "Base64ImageSource",
    "ContentBlock",
    "ContentBlockDeltaEvent",
    "ContentBlockParam",
    "ContentBlockStartEvent",
    "ContentBlockStopEvent",
    "CountTokensRequest",
    "CountTokensResponse",
    "ImageBlockParam",
    "InputJSONDelta",
    "McpServerDefinition",
    "McpToolConfiguration",
    "McpToolResultBlock",
    "McpToolResultBlockParam",
    "McpToolUseBlock",
    "McpToolUseBlockParam",
    "Message",
    "MessageDelta",
    "MessageDeltaEvent",
    "MessageDeltaUsage",
    "MessageParam",
    "MessageStartEvent",
    "MessageStopEvent",
    "MessageUsage",
    "MessagesRequest",
    "Metadata",
    "PingEvent",
    "RedactedThinkingBlockParam",
    "StreamEvent",
    "TextBlock",
    "TextBlockParam",
    "TextDelta",
    "ThinkingBlock",
    "ThinkingBlockParam",
    "ThinkingDelta",
    "ToolChoice",
    "ToolChoiceAny",
    "ToolChoiceAuto",
    "ToolChoiceNone",
    "ToolChoiceTool",
    "ToolParam",
    "ToolResultBlockParam",
    "ToolUseBlock",
    "ToolUseBlockParam",
    "URLImageSource",
]


# -- request content blocks ----------------------------------------------------------------


class TextBlockParam(_Request, tag_field="type", tag="text"):
    """``{"type": "text", "text": ...}``."""

    text: str


class Base64ImageSource(_Request, tag_field="type", tag="base64"):
    """An image inline: base64 ``data`` of ``media_type``."""

    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLImageSource(_Request, tag_field="type", tag="url"):
    """An image by URL (the server fetches only from hosts it is told to allow)."""

    url: str


class ImageBlockParam(_Request, tag_field="type", tag="image"):
    """``{"type": "image", "source": {...}}``."""

    source: Base64ImageSource | URLImageSource


class ToolUseBlockParam(_Request, tag_field="type", tag="tool_use"):
    """An earlier call of the assistant's, sent back in the history."""

    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlockParam(_Request, tag_field="type", tag="tool_result"):
    """The result of the call ``tool_use_id`` (in a user message)."""

    tool_use_id: str
    content: str | list[TextBlockParam | ImageBlockParam] | UnsetType = UNSET
    is_error: bool | UnsetType = UNSET


class ThinkingBlockParam(_Request, tag_field="type", tag="thinking"):
    """An earlier turn's thinking, as clients send the history back. ortserve hands it to
    the chat template as the assistant message's ``reasoning_content``; the template
    decides what the model sees (Qwen3's keeps only the thinking of the turn in progress,
    as Anthropic keeps it only within a tool-use loop). The signature is not checked."""

    thinking: str
    signature: str | UnsetType = UNSET


class RedactedThinkingBlockParam(_Request, tag_field="type", tag="redacted_thinking"):
    """Redacted (encrypted) thinking of an earlier turn: dropped, since ortserve has no
    way to read it (and never sends it)."""

    data: str


class McpToolUseBlockParam(_Request, tag_field="type", tag="mcp_tool_use"):
    """An MCP call the server made in an earlier turn (handed back in an assistant message)."""

    id: str
    name: str
    server_name: str
    input: dict[str, Any]


class McpToolResultBlockParam(_Request, tag_field="type", tag="mcp_tool_result"):
    """The result of the MCP call ``tool_use_id`` (handed back in an assistant message)."""

    tool_use_id: str
    content: str | list[TextBlockParam] | UnsetType = UNSET
    is_error: bool | UnsetType = UNSET


ContentBlockParam = (
    TextBlockParam
    | ImageBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam
    | McpToolUseBlockParam
    | McpToolResultBlockParam
)


class MessageParam(_Request):
    """One turn: ``content`` is a string or content blocks."""

    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


# -- tools ---------------------------------------------------------------------------------


class Metadata(_Request):
    """A request's metadata: Anthropic's one field, an opaque id of the end user (at most
    256 characters)."""

    user_id: Annotated[str, Meta(max_length=256)] | UnsetType | None = UNSET


class ToolParam(_Request):
    """A client tool: ``input_schema`` is its input's JSON schema. Anthropic's server tools
    (web search, code execution...) have other ``type`` values and are refused."""

    name: str
    input_schema: dict[str, Any]
    description: str | UnsetType = UNSET
    type: Literal["custom"] | UnsetType | None = UNSET


class ToolChoiceAuto(_Request, tag_field="type", tag="auto"):
    """The model decides whether to call a tool."""

    disable_parallel_tool_use: bool | UnsetType = UNSET


class ToolChoiceAny(_Request, tag_field="type", tag="any"):
    """The model must call one of the tools (OpenAI's ``required``)."""

    disable_parallel_tool_use: bool | UnsetType = UNSET


class ToolChoiceTool(_Request, tag_field="type", tag="tool"):
    """The model must call the tool ``name``."""

    name: str
    disable_parallel_tool_use: bool | UnsetType = UNSET


class ToolChoiceNone(_Request, tag_field="type", tag="none"):
    """The model must not call tools (they stay in the prompt)."""


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


# -- requests ------------------------------------------------------------------------------


class CountTokensRequest(_Request):
    """``POST /v1/messages/count_tokens``: what the prompt of these messages would take."""

    model: str
    messages: list[MessageParam]
    system: str | list[TextBlockParam] | UnsetType = UNSET
    tools: list[ToolParam] | UnsetType = UNSET
    tool_choice: ToolChoice | UnsetType = UNSET
    thinking: dict[str, Any] | UnsetType = UNSET
    """``{"type": "enabled", "budget_tokens": N}`` (or ``adaptive``): for a reasoning
    model, thinking on (the budget is not enforced: ``max_tokens`` bounds thinking and
    answer together); ``{"type": "disabled"}`` or none: thinking off, as Anthropic's
    default is, where the template can turn it off. A 400 for other models unless
    disabled."""


class McpToolConfiguration(_Request):
    """Which tools of an MCP server the model may call (all, unless ``allowed_tools``
    names some; none when ``enabled`` is false)."""

    enabled: bool | UnsetType | None = UNSET
    allowed_tools: list[str] | UnsetType | None = UNSET


class McpServerDefinition(_Request):
    """An ``mcp_servers`` entry (Anthropic's MCP connector): the server calls its tools.
    A ``name`` the operator configured (``--mcp-server``) uses that server, whatever
    ``url`` says; any other ``url`` must be allowed by ``--allow-mcp-url``."""

    type: Literal["url"]
    name: str
    url: str
    authorization_token: str | UnsetType | None = UNSET
    """Sent as ``Authorization: Bearer <token>`` (a server named by URL only)."""
    tool_configuration: McpToolConfiguration | UnsetType | None = UNSET


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: int
    keep_alive: float | str | UnsetType | None = UNSET
    """Extension (Ollama's): how long the model stays loaded once idle after this request
    (seconds or ``"5m"``; 0 unloads it, negative keeps it). Absent: ``--idle-unload``."""
    cache_salt: str | UnsetType | None = UNSET
    """Extension (vLLM's): the prefix-cache scope. Key/value rows a request computed serve
    only later requests with the same salt, so users given different salts cannot learn
    from ``cached_tokens`` or timing what the other sent."""
    stop_sequences: list[str] | UnsetType = UNSET
    temperature: float | UnsetType = UNSET
    """0 to 1, as Anthropic allows."""
    top_p: float | UnsetType = UNSET
    top_k: int | UnsetType = UNSET
    stream: bool | UnsetType = UNSET
    metadata: Metadata | UnsetType = UNSET
    """Accepted (``user_id``) and not used."""
    service_tier: str | UnsetType = UNSET
    """``auto`` or ``standard_only``: this server has one tier."""
    mcp_servers: list[McpServerDefinition] | UnsetType = UNSET
    """MCP servers whose tools the server calls for the model (``mcp_tool_use`` and
    ``mcp_tool_result`` blocks in the answer), in a loop until the model answers."""


class CountTokensResponse(_Response):
    """``{"input_tokens": N}``."""

    input_tokens: int


# -- responses -----------------------------------------------------------------------------


class TextBlock(_Response, tag_field="type", tag="text"):
    """Text the model wrote."""

    text: str
    citations: list[Any] | None = None


class ToolUseBlock(_Response, tag_field="type", tag="tool_use"):
    """A call the model made: ``input`` is a JSON object matching the tool's schema."""

    id: str
    name: str
    input: dict[str, Any]


class ThinkingBlock(_Response, tag_field="type", tag="thinking"):
    """A reasoning model's thinking, before the answer. ``signature`` is empty: nothing
    here is signed, and the thinking a client hands back is taken as it is."""

    thinking: str
    signature: str = ""


class McpToolUseBlock(_Response, tag_field="type", tag="mcp_tool_use"):
    """A call the model made to a tool of the MCP server ``server_name``; the server made it."""

    id: str
    name: str
    server_name: str
    input: dict[str, Any]


class McpToolResultBlock(_Response, tag_field="type", tag="mcp_tool_result"):
    """What the MCP call ``tool_use_id`` gave (``is_error``: the tool failed, timed out or
    could not be reached; the model read the same)."""

    tool_use_id: str
    is_error: bool
    content: list[TextBlock]


ContentBlock = ThinkingBlock | TextBlock | ToolUseBlock | McpToolUseBlock | McpToolResultBlock


class MessageUsage(_Response):
    """Token counts. As Anthropic counts them, ``input_tokens`` excludes the prompt tokens
    read from the prefix cache (``cache_read_input_tokens``); their sum is the prompt."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class Message(_Response):
    """The response of ``POST /v1/messages`` (and the snapshot in ``message_start``)."""

    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessageUsage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


# -- stream events -------------------------------------------------------------------------


class TextDelta(_Response, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(_Response, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJSONDelta(_Response, tag_field="type", tag="input_json_delta"):
    """A fragment of a tool call's ``input`` as JSON text."""

    partial_json: str


class MessageStartEvent(_Response, tag_field="type", tag="message_start"):
    message: Message


class ContentBlockStartEvent(_Response, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class ContentBlockDeltaEvent(_Response, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJSONDelta


class ContentBlockStopEvent(_Response, tag_field="type", tag="content_block_stop"):
    index: int


class MessageDelta(_Response):
    stop_reason: str | None
    stop_sequence: str | None = None


class MessageDeltaUsage(_Response):
    """Cumulative counts at the end of a streamed message."""

    output_tokens: int
    input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageDeltaEvent(_Response, tag_field="type", tag="message_delta"):
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(_Response, tag_field="type", tag="message_stop"):
    pass


class PingEvent(_Response, tag_field="type", tag="ping"):
    pass


class AnthropicErrorDetail(_Response):
    """``type``: ``invalid_request_error``, ``authentication_error``, ``permission_error``,
    ``not_found_error``, ``request_too_large``, ``overloaded_error`` or ``api_error``."""

    type: str
    message: str


class AnthropicErrorResponse(_Response, tag_field="type", tag="error"):
    """The body of every error on these routes, ``{"type": "error", "error": {...}}``, and
    the payload of ``event: error`` when a stream fails after it started. ``request_id``:
    as Anthropic's own errors carry it (ortserve's ``x-request-id``)."""

    error: AnthropicErrorDetail
    request_id: str | UnsetType = UNSET


StreamEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
    | PingEvent
    | AnthropicErrorResponse
)
