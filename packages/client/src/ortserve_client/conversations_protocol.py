"""The web page's conversations (``/v1/ui/conversations``, an ortserve extension) as msgspec
Structs, shared by client and server; the conventions of :mod:`ortserve_client.protocol`.

A conversation is what the page shows and sends again: its messages in the chat API's
shape (content as a string or OpenAI content parts, images as ``data:`` URLs), the system
prompt and sampling settings it was held with, and per reply what the page measured. The
server keeps them per API key in its state database; it does not interpret the messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, UnsetType

from .protocol import _Request, _Response

__all__ = [
    "MAX_NAME_CHARS",
    "Conversation",
    "ConversationDeleted",
    "ConversationExport",
    "ConversationImport",
    "ConversationList",
    "ConversationMessage",
    "ConversationSettings",
    "ConversationSummary",
    "ConversationWrite",
    "ImportedConversation",
]

MAX_NAME_CHARS = 1000
"""The longest ``title`` or ``model`` a conversation takes: a list shows up to 1,000 of each,
so they stay short (the messages are bounded as the conversation's bytes)."""
_Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]


class ConversationSettings(_Request):
    """The sampling settings a conversation's requests are sent with (absent: the server's defaults)."""

    temperature: float | UnsetType = UNSET
    top_p: float | UnsetType = UNSET
    max_tokens: int | UnsetType = UNSET
    min_tokens: int | UnsetType = UNSET
    seed: int | UnsetType = UNSET
    tools: list[dict[str, Any]] | UnsetType = UNSET
    """Function tools offered to the model (the chat API's ``tools``); the user answers their calls."""
    tool_choice: str | UnsetType = UNSET
    """``auto``, ``required`` or ``none``."""
    mcp_servers: list[str] | UnsetType = UNSET
    """Labels of the server's MCP servers the model may call (the page then uses the Responses API)."""


class ConversationMessage(_Request):
    """One turn, as the chat API takes it, plus what the page shows beside it (a key it does
    not have is a 400 naming it, unless the server is lenient)."""

    role: Literal["user", "assistant", "tool"]
    content: str | list[dict[str, Any]]
    """Text, or OpenAI content parts (``text``, ``image_url``, ``input_audio``)."""
    reasoning: str | UnsetType = UNSET
    """A reasoning model's thinking for this reply."""
    tool_calls: list[dict[str, Any]] | UnsetType = UNSET
    tool_call_id: str | UnsetType = UNSET
    mcp_calls: list[dict[str, Any]] | UnsetType = UNSET
    """The MCP calls the server made for this reply (label, name, arguments, output or error)."""
    model: str | UnsetType = UNSET
    """The model that wrote this reply."""
    stats: dict[str, float | int | bool | None] | UnsetType = UNSET
    """What the page measured for this reply (tokens, tokens/s, time to first token, cached tokens)."""


class ConversationWrite(_Request):
    """``POST /v1/ui/conversations`` (create) and ``POST /v1/ui/conversations/{id}``
    (update: only the fields given change; rename with ``title`` alone)."""

    title: _Name | UnsetType = UNSET
    model: _Name | UnsetType = UNSET
    system: str | UnsetType = UNSET
    """The system prompt ("" for none)."""
    settings: ConversationSettings | UnsetType = UNSET
    messages: list[ConversationMessage] | UnsetType = UNSET


class Conversation(_Response):
    """A conversation as stored; timestamps are Unix seconds."""

    id: str
    title: str
    model: str
    system: str
    settings: ConversationSettings
    messages: list[ConversationMessage]
    created_at: float
    updated_at: float
    object: Literal["ui.conversation"] = "ui.conversation"


class ConversationSummary(_Response):
    """A conversation in a list: no messages, their count."""

    id: str
    title: str
    model: str
    message_count: int
    created_at: float
    updated_at: float
    object: Literal["ui.conversation"] = "ui.conversation"


class ConversationList(_Response):
    data: list[ConversationSummary]
    has_more: bool = False
    object: Literal["list"] = "list"


class ConversationDeleted(_Response):
    id: str
    deleted: bool = True
    object: Literal["ui.conversation"] = "ui.conversation"


class ConversationExport(_Response):
    """``GET /v1/ui/conversations/export``: every conversation of the key, whole; what
    ``POST /v1/ui/conversations/import`` takes back."""

    data: list[Conversation]
    object: Literal["list"] = "list"


class ImportedConversation(ConversationWrite):
    """A conversation of an export: its ``id`` is replaced by a new one (ids are the
    server's); its timestamps are kept."""

    id: str | UnsetType = UNSET
    object: str | UnsetType = UNSET
    created_at: float | UnsetType = UNSET
    updated_at: float | UnsetType = UNSET


class ConversationImport(_Request):
    """``POST /v1/ui/conversations/import``: an export's ``data`` (``object`` optional)."""

    data: list[ImportedConversation]
    object: str | UnsetType = UNSET
