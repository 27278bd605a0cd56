"""The keyword arguments of the client's methods, typed after the request Structs.

Each ``TypedDict`` lists the optional fields of one request Struct (a test keeps them in
step). Nested values may be the protocol Structs or plain dicts in OpenAI's JSON shape;
the client converts and validates them into the request Struct before sending.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, TypedDict

from .protocol import ChatMessage, NamedToolChoice, PredictionContent, ResponseFormat, StreamOptions, Tool

__all__ = [
    "ChatCompletionParams",
    "CompletionParams",
    "EmbeddingParams",
    "JSONObject",
    "MessageParam",
    "PromptParam",
]

JSONObject = Mapping[str, Any]
"""A JSON object in OpenAI's shape, accepted wherever a nested Struct is."""

MessageParam = ChatMessage | JSONObject
"""A chat message: a message Struct or ``{"role": ..., "content": ...}``."""

PromptParam = str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]]
"""Text, texts, token ids, or lists of token ids (not mixed)."""


class _SamplingParams(TypedDict, total=False):
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    repetition_penalty: float | None
    min_tokens: int | None
    n: int | None
    stream_options: StreamOptions | JSONObject | None
    stop: str | Sequence[str] | None
    seed: int | None
    user: str
    presence_penalty: float | None
    frequency_penalty: float | None
    logit_bias: Mapping[str, float] | None
    min_p: float | None
    response_format: ResponseFormat | JSONObject | None
    guided_regex: str | None
    guided_grammar: str | None
    guided_choice: Sequence[str] | None
    guided_json: JSONObject | str | None
    lora: Sequence[JSONObject] | None
    keep_alive: float | str | None
    cache_salt: str | None
    prediction: PredictionContent | JSONObject | None


class ChatCompletionParams(_SamplingParams, total=False):
    """Optional fields of :class:`~ortserve_client.protocol.ChatCompletionRequest`."""

    max_completion_tokens: int | None
    logprobs: bool | None
    top_logprobs: int | None
    tools: Sequence[Tool | JSONObject] | None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | JSONObject | None
    parallel_tool_calls: bool | None
    modalities: Sequence[str] | None
    audio: JSONObject | None
    reasoning_effort: str | None
    reasoning_budget: int | None
    chat_template_kwargs: JSONObject | None
    store: bool | None
    metadata: Mapping[str, str] | None
    service_tier: str | None
    verbosity: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None


class CompletionParams(_SamplingParams, total=False):
    """Optional fields of :class:`~ortserve_client.protocol.CompletionRequest`."""

    echo: bool | None
    suffix: str | None
    best_of: int | None
    logprobs: int | None


class EmbeddingParams(TypedDict, total=False):
    """Optional fields of :class:`~ortserve_client.protocol.EmbeddingRequest` (other than
    ``encoding_format``, which the method takes itself)."""

    dimensions: int | None
    user: str
    truncate: bool | None
    keep_alive: float | str | None
