"""The OpenAI-compatible wire protocol as msgspec Structs, shared by client and server.

Requests use ``UNSET`` for absent optional fields (absent differs from ``null``) and omit
them when encoded. Responses always carry the fields OpenAI always sends (``null``
included). Decoding tolerates unknown fields, so the client also works against other
OpenAI-compatible servers and the server accepts SDKs that send newer fields.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

__all__ = [
    "UNSET",
    "AssistantMessage",
    "ChatCompletion",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionChunkChoice",
    "ChatCompletionMessage",
    "ChatCompletionRequest",
    "ChatMessage",
    "ChoiceDelta",
    "ChoiceDeltaFunctionCall",
    "ChoiceDeltaToolCall",
    "Completion",
    "CompletionChoice",
    "CompletionRequest",
    "CompletionUsage",
    "ContentPart",
    "CreateEmbeddingResponse",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "DeveloperMessage",
    "Embedding",
    "EmbeddingRequest",
    "EmbeddingUsage",
    "ErrorDetail",
    "ErrorResponse",
    "FunctionCall",
    "FunctionDefinition",
    "Health",
    "HealthModel",
    "ImageContentPart",
    "ImageURL",
    "InputAudio",
    "InputAudioContentPart",
    "JSONSchema",
    "Model",
    "ModelList",
    "NamedToolChoice",
    "NamedToolChoiceFunction",
    "ResponseFormat",
    "ResponseFormatJSONObject",
    "ResponseFormatJSONSchema",
    "ResponseFormatText",
    "StreamOptions",
    "SystemMessage",
    "TextContentPart",
    "TokenizeRequest",
    "TokenizeResponse",
    "Tool",
    "ToolCall",
    "ToolMessage",
    "UnsetType",
    "UserMessage",
]


class _Request(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of request-side Structs: keyword-only, absent fields omitted when encoded."""


class _Response(msgspec.Struct, kw_only=True):
    """Base of response-side Structs: every field encoded, ``null`` included."""


# -- chat messages -------------------------------------------------------------------------


class TextContentPart(_Request, tag_field="type", tag="text"):
    text: str


class ImageURL(_Request):
    url: str
    detail: Literal["auto", "low", "high"] | UnsetType = UNSET


class ImageContentPart(_Request, tag_field="type", tag="image_url"):
    image_url: ImageURL


class InputAudio(_Request):
    data: str
    """Base64-encoded audio bytes."""
    format: str


class InputAudioContentPart(_Request, tag_field="type", tag="input_audio"):
    input_audio: InputAudio


ContentPart = TextContentPart | ImageContentPart | InputAudioContentPart


class FunctionCall(_Response):
    name: str
    arguments: str
    """The arguments as a JSON string, as OpenAI sends them."""


class ToolCall(_Response):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class SystemMessage(_Request, tag_field="role", tag="system"):
    content: str | list[TextContentPart]
    name: str | UnsetType = UNSET


class DeveloperMessage(_Request, tag_field="role", tag="developer"):
    content: str | list[TextContentPart]
    name: str | UnsetType = UNSET


class UserMessage(_Request, tag_field="role", tag="user"):
    content: str | list[ContentPart]
    name: str | UnsetType = UNSET


class AssistantMessage(_Request, tag_field="role", tag="assistant"):
    content: str | list[TextContentPart] | None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET
    name: str | UnsetType = UNSET
    refusal: str | UnsetType | None = UNSET


class ToolMessage(_Request, tag_field="role", tag="tool"):
    content: str | list[TextContentPart]
    tool_call_id: str


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


# -- tools and response formats ------------------------------------------------------------


class FunctionDefinition(_Request):
    name: str
    description: str | UnsetType = UNSET
    parameters: dict[str, Any] | UnsetType = UNSET
    strict: bool | UnsetType | None = UNSET


class Tool(_Response):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Response):
    function: NamedToolChoiceFunction
    type: Literal["function"] = "function"


class JSONSchema(_Request):
    name: str
    description: str | UnsetType = UNSET
    schema: dict[str, Any] | UnsetType = UNSET
    strict: bool | UnsetType | None = UNSET


class ResponseFormatText(_Request, tag_field="type", tag="text"):
    pass


class ResponseFormatJSONObject(_Request, tag_field="type", tag="json_object"):
    pass


class ResponseFormatJSONSchema(_Request, tag_field="type", tag="json_schema"):
    json_schema: JSONSchema


ResponseFormat = ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema


class StreamOptions(_Request):
    include_usage: bool = False


# -- chat completions ----------------------------------------------------------------------


class _GenerationRequest(_Request):
    """Fields chat and text completions share. ``top_k``, ``repetition_penalty`` and
    ``min_tokens`` are extensions that vLLM and others accept too."""

    max_tokens: int | UnsetType | None = UNSET
    temperature: float | UnsetType | None = UNSET
    top_p: float | UnsetType | None = UNSET
    top_k: int | UnsetType | None = UNSET
    repetition_penalty: float | UnsetType | None = UNSET
    min_tokens: int | UnsetType | None = UNSET
    n: int | UnsetType | None = UNSET
    stream: bool | UnsetType | None = UNSET
    stream_options: StreamOptions | UnsetType | None = UNSET
    stop: str | list[str] | UnsetType | None = UNSET
    seed: int | UnsetType | None = UNSET
    user: str | UnsetType = UNSET
    presence_penalty: float | UnsetType | None = UNSET
    frequency_penalty: float | UnsetType | None = UNSET
    logit_bias: dict[str, float] | UnsetType | None = UNSET
    response_format: ResponseFormat | UnsetType | None = UNSET
    """Structured output: ``json_object`` or ``json_schema`` (constrained decoding)."""
    guided_regex: str | UnsetType | None = UNSET
    """vLLM's extensions: output matching a regular expression, a Lark grammar, or one of
    the given strings."""
    guided_grammar: str | UnsetType | None = UNSET
    guided_choice: list[str] | UnsetType | None = UNSET


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    """``POST /v1/chat/completions``."""

    model: str
    messages: list[ChatMessage]
    max_completion_tokens: int | UnsetType | None = UNSET
    logprobs: bool | UnsetType | None = UNSET
    top_logprobs: int | UnsetType | None = UNSET
    tools: list[Tool] | UnsetType | None = UNSET
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | UnsetType | None = UNSET
    parallel_tool_calls: bool | UnsetType | None = UNSET


class CompletionUsage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET


class ChatCompletionChoice(_Response):
    index: int
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(_Response):
    id: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage | None = None
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None


class ChoiceDeltaFunctionCall(_Request):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ChoiceDeltaToolCall(_Request):
    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: ChoiceDeltaFunctionCall | UnsetType = UNSET


class ChoiceDelta(_Request):
    """Only the fields that changed: absent fields are omitted, as OpenAI streams them."""

    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType | None = UNSET
    tool_calls: list[ChoiceDeltaToolCall] | UnsetType = UNSET


class ChatCompletionChunkChoice(_Response):
    index: int
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(_Response):
    id: str
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: CompletionUsage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None


# -- legacy completions --------------------------------------------------------------------


class CompletionRequest(_GenerationRequest, kw_only=True):
    """``POST /v1/completions`` (legacy)."""

    model: str
    prompt: str | list[str | int | list[int]]
    """One string, strings, token ids, or lists of token ids (msgspec allows one list type
    per union; the server checks that the list is not mixed)."""
    echo: bool | UnsetType | None = UNSET
    suffix: str | UnsetType | None = UNSET
    best_of: int | UnsetType | None = UNSET
    logprobs: int | UnsetType | None = UNSET


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class Completion(_Response):
    """A text completion, and (with the same shape) each chunk of a streamed one."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None


# -- embeddings ----------------------------------------------------------------------------


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``; ``truncate`` is an extension (as text-embeddings-inference)."""

    model: str
    input: str | list[str | int | list[int]]
    """One string, strings, token ids, or lists of token ids (not mixed)."""
    encoding_format: Literal["float", "base64"] | UnsetType = UNSET
    dimensions: int | UnsetType | None = UNSET
    user: str | UnsetType = UNSET
    truncate: bool | UnsetType | None = UNSET


class Embedding(_Response):
    index: int
    embedding: list[float] | str
    """Floats, or little-endian float32 bytes in base64 when asked for ``base64``."""
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(_Response):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


# -- models, tokenizer extensions, health, errors ------------------------------------------


class Model(_Response):
    id: str
    created: int
    owned_by: str
    object: Literal["model"] = "model"


class ModelList(_Response):
    data: list[Model]
    object: Literal["list"] = "list"


class TokenizeRequest(_Request):
    """``POST /v1/tokenize`` (extension): either ``prompt`` or chat ``messages``."""

    model: str
    prompt: str | UnsetType = UNSET
    messages: list[ChatMessage] | UnsetType = UNSET
    add_generation_prompt: bool = True


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    model: str
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str


class HealthModel(_Response):
    id: str
    status: str
    """``unloaded`` (loads on first use), ``loading``, ``ready`` or ``error``."""


class Health(_Response):
    """``GET /health``: ``ok`` when every model is usable, else ``loading`` or ``error``."""

    status: str
    models: list[HealthModel]


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """The body of every error response: ``{"error": {...}}``."""

    error: ErrorDetail
