"""The OpenAI-compatible wire protocol as msgspec Structs, shared by client and server.

Requests use ``UNSET`` for absent optional fields (absent differs from ``null``) and omit
them when encoded. Responses always carry the fields OpenAI always sends (``null``
included). Decoding tolerates unknown fields, so the client also works against other
OpenAI-compatible servers and the server accepts SDKs that send newer fields.

Unions are tagged as in OpenAI's JSON: messages by ``role`` (:data:`ChatMessage`),
content parts and ``response_format`` by ``type`` (:data:`ContentPart`,
:data:`ResponseFormat`). Decode a request with a reusable decoder, for example
``msgspec.json.Decoder(ChatCompletionRequest).decode(body)``; a ``msgspec.ValidationError``
names the offending path (``$.messages[0].role``).

Long on purpose (over 600 lines): one Struct per object of OpenAI's schema, each with its
documentation, in the one namespace clients import (as ``openai.types`` groups them); the
Responses, Anthropic and Batch APIs have modules of their own.
"""

from __future__ import annotations

import base64
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
    "ChatCompletionTokenLogprob",
    "ChatMessage",
    "ChoiceDelta",
    "ChoiceDeltaFunctionCall",
    "ChoiceDeltaToolCall",
    "ChoiceLogprobs",
    "Completion",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionTokensDetails",
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
    "KeyUsage",
    "KeyUsageList",
    "LoraAdapterLoadRequest",
    "LoraAdapterUnloadRequest",
    "Model",
    "ModelDeleted",
    "ModelList",
    "ModelLoadRequest",
    "ModelUnloadRequest",
    "NamedToolChoice",
    "NamedToolChoiceFunction",
    "PredictionContent",
    "PromptTokensDetails",
    "RerankDocument",
    "RerankRequest",
    "RerankResponse",
    "RerankResult",
    "RerankUsage",
    "ResponseFormat",
    "ResponseFormatJSONObject",
    "ResponseFormatJSONSchema",
    "ResponseFormatText",
    "ScoreData",
    "ScoreRequest",
    "ScoreResponse",
    "SpeechAudioDeltaEvent",
    "SpeechAudioDoneEvent",
    "SpeechFormat",
    "SpeechRequest",
    "SpeechStreamEvent",
    "SpeechUsage",
    "StreamOptions",
    "SystemMessage",
    "TextContentPart",
    "TokenizeRequest",
    "TokenizeResponse",
    "Tool",
    "ToolCall",
    "ToolMessage",
    "TopLogprob",
    "Transcription",
    "TranscriptionSegment",
    "TranscriptionVerbose",
    "UnsetType",
    "UserMessage",
]


class _Request(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Base of request-side Structs: keyword-only, absent fields omitted when encoded."""


class _Response(msgspec.Struct, kw_only=True):
    """Base of response-side Structs: every field encoded, ``null`` included."""


# -- chat messages -------------------------------------------------------------------------


class TextContentPart(_Request, tag_field="type", tag="text"):
    """``{"type": "text", "text": ...}``."""

    text: str


class ImageURL(_Request):
    """An ``http(s)`` URL or a ``data:image/...;base64,`` URL."""

    url: str
    detail: Literal["auto", "low", "high"] | UnsetType = UNSET


class ImageContentPart(_Request, tag_field="type", tag="image_url"):
    """``{"type": "image_url", "image_url": {"url", "detail"}}``."""

    image_url: ImageURL

    @classmethod
    def from_bytes(cls, data: bytes, media_type: str = "image/png") -> ImageContentPart:
        """The image inline, as a ``data:`` URL (what servers accept without fetching)."""
        return cls(image_url=ImageURL(url=f"data:{media_type};base64,{base64.b64encode(data).decode('ascii')}"))


class InputAudio(_Request):
    """Audio inline: base64 ``data`` and its ``format`` (``wav``, ``mp3``, ...)."""

    data: str
    """Base64-encoded audio bytes."""
    format: str


class InputAudioContentPart(_Request, tag_field="type", tag="input_audio"):
    """``{"type": "input_audio", "input_audio": {"data", "format"}}``."""

    input_audio: InputAudio

    @classmethod
    def from_bytes(cls, data: bytes, format: str = "wav") -> InputAudioContentPart:
        """The audio inline, base64-encoded."""
        return cls(input_audio=InputAudio(data=base64.b64encode(data).decode("ascii"), format=format))


ContentPart = TextContentPart | ImageContentPart | InputAudioContentPart


class FunctionCall(_Response):
    """The function a tool call invokes."""

    name: str
    arguments: str
    """The arguments as a JSON string, as OpenAI sends them."""


class ToolCall(_Response):
    """A complete tool call, in an assistant message (request) or a reply (response)."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class SystemMessage(_Request, tag_field="role", tag="system"):
    """``role: system``."""

    content: str | list[TextContentPart]
    name: str | UnsetType = UNSET


class DeveloperMessage(_Request, tag_field="role", tag="developer"):
    """``role: developer`` (what newer OpenAI models call the system message)."""

    content: str | list[TextContentPart]
    name: str | UnsetType = UNSET


class UserMessage(_Request, tag_field="role", tag="user"):
    """``role: user``: text, or text, image and audio parts."""

    content: str | list[ContentPart]
    name: str | UnsetType = UNSET


class AssistantMessage(_Request, tag_field="role", tag="assistant"):
    """``role: assistant``: an earlier reply; ``content`` is ``null`` beside ``tool_calls``."""

    content: str | list[TextContentPart] | None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET
    name: str | UnsetType = UNSET
    refusal: str | UnsetType | None = UNSET
    reasoning_content: str | UnsetType | None = UNSET
    """An earlier turn's reasoning, as this server returns it (llama-server's name);
    ``reasoning`` is vLLM's. The chat template decides what of it the model sees."""
    reasoning: str | UnsetType | None = UNSET


class ToolMessage(_Request, tag_field="role", tag="tool"):
    """``role: tool``: the result of the tool call ``tool_call_id``."""

    content: str | list[TextContentPart]
    tool_call_id: str


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage


# -- tools and response formats ------------------------------------------------------------


class FunctionDefinition(_Request):
    """A callable function: ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str | UnsetType = UNSET
    parameters: dict[str, Any] | UnsetType = UNSET
    strict: bool | UnsetType | None = UNSET


class Tool(_Response):
    """``{"type": "function", "function": {...}}`` (``type`` is always encoded)."""

    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedToolChoiceFunction(_Request):
    """The function a named ``tool_choice`` forces."""

    name: str


class NamedToolChoice(_Response):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    function: NamedToolChoiceFunction
    type: Literal["function"] = "function"


class JSONSchema(_Request):
    """``response_format.json_schema``: the schema the reply must match."""

    name: str
    description: str | UnsetType = UNSET
    schema: dict[str, Any] | UnsetType = UNSET
    strict: bool | UnsetType | None = UNSET


class ResponseFormatText(_Request, tag_field="type", tag="text"):
    """Free text (the default)."""


class ResponseFormatJSONObject(_Request, tag_field="type", tag="json_object"):
    """Any JSON object."""


class ResponseFormatJSONSchema(_Request, tag_field="type", tag="json_schema"):
    """JSON that matches ``json_schema.schema``."""

    json_schema: JSONSchema


ResponseFormat = ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema


class StreamOptions(_Request):
    """``include_usage``: a last chunk with ``usage`` and no choices."""

    include_usage: bool = False


# -- chat completions ----------------------------------------------------------------------


class PredictionContent(_Request, tag_field="type", tag="content"):
    """OpenAI's Predicted Outputs: text the completion is expected to be close to (a file
    being edited); its tokens are drafts for speculative decoding. It changes how fast the
    completion comes, not what it is."""

    content: str | list[TextContentPart]


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
    """Token id (as a string, JSON keys being strings) -> bias in [-100, 100]."""
    min_p: float | UnsetType | None = UNSET
    """Extension (vLLM): drop tokens less likely than ``min_p`` times the most likely."""
    response_format: ResponseFormat | UnsetType | None = UNSET
    """Structured output: ``json_object`` or ``json_schema`` (constrained decoding)."""
    guided_regex: str | UnsetType | None = UNSET
    """vLLM's extensions: output matching a regular expression, a Lark grammar, or one of
    the given strings."""
    guided_grammar: str | UnsetType | None = UNSET
    guided_choice: list[str] | UnsetType | None = UNSET
    guided_json: dict[str, Any] | str | UnsetType | None = UNSET
    """vLLM's: output matching a JSON schema (an object, or its JSON text)."""
    lora: list[Any] | UnsetType | None = UNSET
    """llama-server's per-request adapter scales (``[{"id", "scale"}]``): refused with a 400
    that points at the model id ``MODEL:ADAPTER``, which is how a request picks an adapter here."""
    keep_alive: float | str | UnsetType | None = UNSET
    """Extension (Ollama's): how long the model stays loaded once idle after this
    request: seconds, or a duration (``"90s"``, ``"5m"``, ``"1h"``); 0 unloads it after
    the request, a negative value keeps it loaded. Absent: the server's ``--idle-unload``."""
    cache_salt: str | UnsetType | None = UNSET
    """Extension (vLLM's): the prefix-cache scope. Key/value rows a request computed serve
    only later requests with the same salt, so users given different salts cannot learn
    from ``cached_tokens`` or timing what the other sent."""
    prediction: PredictionContent | UnsetType | None = UNSET
    """Predicted Outputs (OpenAI's, on chat completions; here on completions too): usage's
    ``completion_tokens_details`` then counts the accepted and rejected prediction tokens."""


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
    """``POST /v1/chat/completions``."""

    model: str
    messages: list[ChatMessage]
    max_completion_tokens: int | UnsetType | None = UNSET
    logprobs: bool | UnsetType | None = UNSET
    top_logprobs: int | UnsetType | None = UNSET
    """0-20 most likely alternatives per token (needs ``logprobs: true``)."""
    tools: list[Tool] | UnsetType | None = UNSET
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | UnsetType | None = UNSET
    parallel_tool_calls: bool | UnsetType | None = UNSET
    modalities: list[str] | UnsetType | None = UNSET
    """Output modalities; this server writes ``["text"]``."""
    audio: dict[str, Any] | UnsetType | None = UNSET
    """Audio output settings (refused: no model here speaks)."""
    reasoning_effort: str | UnsetType | None = UNSET
    """Handed to the chat template as ``reasoning_effort`` (templates that know it use it);
    for a reasoning model whose template does not, a budget of thinking tokens (``none`` 0,
    ``minimal`` 256, ``low`` 1024, ``medium`` 4096; ``high``, ``xhigh``: none)."""
    reasoning_budget: int | UnsetType | None = UNSET
    """Extension: a reasoning model thinks at most this many tokens, then its think block
    is closed and it answers (what ``reasoning_effort`` sets, given exactly)."""
    chat_template_kwargs: dict[str, Any] | UnsetType | None = UNSET
    """Extension (vLLM, llama-server): more chat template variables, such as
    ``{"enable_thinking": false}``."""
    # OpenAI's fields that a local server honours by their defaults (others are refused):
    store: bool | UnsetType | None = UNSET
    """``false`` (chat completions are not stored here: the Responses API stores)."""
    metadata: dict[str, str] | UnsetType | None = UNSET
    """Kept with a stored completion at OpenAI: only empty here."""
    service_tier: str | UnsetType | None = UNSET
    """``auto`` or ``default``: this server has one tier."""
    verbosity: str | UnsetType | None = UNSET
    """``medium``, OpenAI's default: the model's own length."""
    safety_identifier: str | UnsetType | None = UNSET
    """Who the end user is, as ``user``: taken, as this server monitors no one."""
    prompt_cache_key: str | UnsetType | None = UNSET
    """Taken: prompts are cached by their tokens here, whatever the key (see
    ``--prefix-cache-scope`` for who shares them)."""


class PromptTokensDetails(_Response):
    """What of the prompt the server did not have to compute."""

    cached_tokens: int = 0
    """Prompt tokens taken from the prefix cache (an earlier request's key/values)."""


class CompletionTokensDetails(_Response):
    """What the completion tokens were spent on."""

    reasoning_tokens: int = 0
    """Tokens of a reasoning model's thinking (its think block, markers included)."""
    accepted_prediction_tokens: int = 0
    """Draft tokens (the request's ``prediction``, or the model's ``--speculative`` drafts)
    that became completion tokens."""
    rejected_prediction_tokens: int = 0
    """Draft tokens checked and not taken (their cost was spent; they are not billed as
    completion tokens here)."""


class CompletionUsage(_Response):
    """Token counts of a completion."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    """Set for reasoning models and for completions that checked draft tokens."""


class ChatCompletionMessage(_Response):
    """The reply: ``content`` is ``null`` when the model called tools."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    """A reasoning model's thinking (llama-server's and older vLLM's name); absent otherwise."""
    reasoning: str | UnsetType = UNSET
    """The same thinking under vLLM's current name."""


class TopLogprob(_Response):
    """One of the most likely tokens at a step. ``bytes``: the token's UTF-8 bytes (a token
    may hold part of a character; its ``token`` is then ``bytes:\\xe2...``)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(_Response):
    """A generated token, its log-probability and the most likely alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(_Response):
    """A chat choice's log-probabilities (or, streamed, those of the chunk's tokens)."""

    content: list[ChatCompletionTokenLogprob] | None = None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class ChatCompletionChoice(_Response):
    """One of the ``n`` replies."""

    index: int
    message: ChatCompletionMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None
    """``null`` unless the request set ``logprobs: true``."""


class ChatCompletion(_Response):
    """The response of ``POST /v1/chat/completions`` (not streamed)."""

    id: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: CompletionUsage | None = None
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None


class ChoiceDeltaFunctionCall(_Request):
    """The part of a tool call's function that this chunk adds."""

    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class ChoiceDeltaToolCall(_Request):
    """A tool call in pieces: ``id``, ``type`` and ``name`` come first, then ``arguments``
    in fragments; ``index`` says which call a fragment belongs to."""

    index: int
    id: str | UnsetType = UNSET
    type: Literal["function"] | UnsetType = UNSET
    function: ChoiceDeltaFunctionCall | UnsetType = UNSET


class ChoiceDelta(_Request):
    """Only the fields that changed: absent fields are omitted, as OpenAI streams them."""

    role: Literal["assistant"] | UnsetType = UNSET
    content: str | UnsetType | None = UNSET
    tool_calls: list[ChoiceDeltaToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    """A piece of a reasoning model's thinking (also sent as ``reasoning``)."""
    reasoning: str | UnsetType = UNSET


class ChatCompletionChunkChoice(_Response):
    """A choice's delta; ``finish_reason`` is ``null`` until its last chunk."""

    index: int
    delta: ChoiceDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Response):
    """One ``data:`` event of a streamed chat completion."""

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
    """0-5: each token's log-probability and that many most likely alternatives."""


class CompletionLogprobs(_Response):
    """The legacy shape: one entry per token in each list. ``top_logprobs`` maps token text
    to log-probability (the chosen token always among them); ``text_offset`` is where each
    token's text begins in the completion."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(_Response):
    """One of the ``n`` texts (or, streamed, the piece this chunk adds)."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


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
    keep_alive: float | str | UnsetType | None = UNSET
    """Extension (Ollama's): how long the model stays loaded once idle after this
    request: seconds, or a duration (``"90s"``, ``"5m"``, ``"1h"``); 0 unloads it after
    the request, a negative value keeps it loaded. Absent: the server's ``--idle-unload``."""


class Embedding(_Response):
    """One input's vector."""

    index: int
    embedding: list[float] | str
    """Floats, or little-endian float32 bytes in base64 when asked for ``base64``."""
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(_Response):
    """Token counts of an embeddings request."""

    prompt_tokens: int
    total_tokens: int


class CreateEmbeddingResponse(_Response):
    """The response of ``POST /v1/embeddings``, vectors in input order."""

    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


# -- rerank and score (cross-encoder models) -----------------------------------------------


class RerankDocument(_Response):
    """A document as an object (Jina's and Cohere v2's shape), and as results return it."""

    text: str


class RerankRequest(_Request):
    """``POST /v1/rerank``: the Jina/Cohere shape vLLM and llama-server accept. ``top_n``
    absent or 0 returns every document; ``return_documents`` defaults to true (vLLM and
    Jina send the documents back); ``truncate`` is an extension, as for embeddings."""

    model: str
    query: str
    documents: list[str | RerankDocument]
    top_n: int | UnsetType | None = UNSET
    return_documents: bool | UnsetType | None = UNSET
    truncate: bool | UnsetType | None = UNSET
    keep_alive: float | str | UnsetType | None = UNSET
    """Extension (Ollama's): how long the model stays loaded once idle after this request
    (seconds or ``"5m"``; 0 unloads it, negative keeps it). Absent: ``--idle-unload``."""


class RerankResult(_Response):
    """One document's place: its index in the request and its score (higher: more relevant)."""

    index: int
    relevance_score: float
    document: RerankDocument | UnsetType = UNSET
    """Absent when the request said ``return_documents: false``."""


class RerankUsage(_Response):
    """Tokens of every (query, document) pair scored."""

    prompt_tokens: int
    total_tokens: int


class RerankResponse(_Response):
    """The response of ``POST /v1/rerank``: results sorted by score, best first."""

    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreRequest(_Request):
    """``POST /v1/score`` (vLLM's): ``text_1`` against ``text_2``: one with one, one with
    each of a list (1:N), or pairwise (N:N, equal lengths)."""

    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    truncate: bool | UnsetType | None = UNSET
    keep_alive: float | str | UnsetType | None = UNSET
    """Extension (Ollama's): how long the model stays loaded once idle after this request
    (seconds or ``"5m"``; 0 unloads it, negative keeps it). Absent: ``--idle-unload``."""


class ScoreData(_Response):
    """The score of one pair, by its index in ``text_2``."""

    index: int
    score: float
    object: Literal["score"] = "score"


class ScoreResponse(_Response):
    """The response of ``POST /v1/score``, pairs in input order."""

    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: RerankUsage
    object: Literal["list"] = "list"


# -- models, tokenizer extensions, health, errors ------------------------------------------


class Model(_Response):
    """A served model, as ``GET /v1/models`` lists it."""

    id: str
    created: int
    owned_by: str
    object: Literal["model"] = "model"
    # ortserve's extensions (OpenAI's SDKs keep unknown fields as attributes):
    kind: str | None = None
    """``generative``, ``embedding``, ``rerank``, ``speech`` (to text) or ``voice`` (text to speech)."""
    status: str | None = None
    """``unloaded``, ``converting`` (a GGUF file being turned into its folder), ``loading``,
    ``ready``, ``unloading`` or ``error``."""
    progress: float | None = None
    """While ``converting``: the fraction done, 0 to 1."""
    provider: str | None = None
    """Execution provider: ``cpu``, ``cuda``, ``dml``, ``qnn``, ``openvino``, ``webgpu``, ``trt-rtx``."""
    engine: str | None = None
    """A loaded generative model's engine: ``ort-cpu``, ``og-engine`` or ``og-generator``."""
    engine_reason: str | None = None
    """Why it runs on that engine: what was asked for, what ``auto`` chose from the provider
    and the folder, or what the ort-cpu engine could not drive (then og-generator runs it)."""
    prefill_int8: bool | None = None
    """A loaded ``ort-cpu`` model: whether prompts prefill through its int8 copy
    (``--prefill-int8``); ``None`` for other engines."""
    kv_cache_dtype: str | None = None
    """A loaded ``ort-cpu`` model: what its key/value cache stores, ``float32``, ``float16``
    or ``int8`` (``--kv-cache-dtype``); ``None`` for other engines."""
    reproducible: bool | None = None
    """A loaded generative model: whether the same request (greedy, or sampled with a
    ``seed``) gets the same tokens and logprobs whatever the server's prefix cache holds and
    whoever shares the batch; ``false`` where the engine cannot promise it (ort-cpu with
    ``--prefill-int8``, og-engine's dynamic batches on an accelerator)."""
    input_modalities: list[str] | None = None
    """A loaded generative model: what its prompts may hold: ``["text"]``, plus ``"image"``
    and ``"audio"`` for the multimodal models that take them."""
    tool_format: str | None = None
    """A loaded generative model: how it writes tool calls (``hermes``, ``llama3``,
    ``mistral``, ``phi4``...); ``None``: tool requests are a 400."""
    reasoning: bool | None = None
    """A loaded generative model: whether it thinks before it answers (a think block in its
    chat template); its replies then carry ``reasoning_content``."""
    speculative: str | None = None
    """A loaded generative model's speculative decoding (``--speculative``): ``ngram``, or
    ``None`` (requests with a ``prediction`` still speculate on ort-cpu)."""
    draft_tokens: int | None = None
    """Draft tokens the model's engine checked since it loaded (ort-cpu; og-generator's
    count inside onnxruntime-genai)."""
    draft_acceptance_rate: float | None = None
    """The share of them that became output tokens (``None`` before any was checked)."""
    tools_in_system_prompt: bool | None = None
    """A loaded generative model: its chat template knows no tools, so they are described
    in its system prompt (Hermes format) and calls parsed from its output (``false``: the
    template handles them; give a model a better one with ``--model-option
    NAME:chat-template=FILE``)."""
    parent: str | None = None
    """For a LoRA adapter (id ``MODEL:ADAPTER``): the model it adapts (as vLLM lists LoRA modules)."""
    root: str | None = None
    """For a LoRA adapter: the base model it derives from (``parent`` here: adapters do not stack)."""
    error: str | None = None
    """Why the last load failed (status ``error``; the next request tries again)."""
    in_flight: int | None = None
    """Requests holding the model now (a stream until its last chunk)."""
    last_used: int | None = None
    """When a request last finished with the model (or it loaded), as a Unix time."""
    resident_bytes: int | None = None
    """A loaded model's memory: the growth of the server's resident set measured around
    its load (approximate)."""
    kv_cache_bytes: int | None = None
    """The full capacity of its KV cache where the engine reports one (ort-cpu), beyond
    ``resident_bytes``: pages become resident as tokens are cached."""
    expires_at: int | None = None
    """When the idle model will be unloaded (Unix time; ``None``: not scheduled)."""
    voices: list[str] | None = None
    """A voice model's voices (``voice`` of ``/v1/audio/speech``)."""


class ModelLoadRequest(_Request):
    """``POST /v1/models/load`` (extension): load a configured model by name."""

    model: str
    keep_alive: float | str | UnsetType | None = UNSET
    """Extension (Ollama's): how long the model stays loaded once idle after this
    request: seconds, or a duration (``"90s"``, ``"5m"``, ``"1h"``); 0 unloads it after
    the request, a negative value keeps it loaded. Absent: the server's ``--idle-unload``."""


class ModelUnloadRequest(_Request):
    """``POST /v1/models/unload`` (extension): unload a model by name."""

    model: str


class LoraAdapterLoadRequest(_Request):
    """``POST /v1/load_lora_adapter`` (vLLM's route; the server needs
    ``--allow-runtime-adapters``): serve an adapter file as ``MODEL:NAME``."""

    lora_name: str
    """The adapter's name, or ``MODEL:NAME``; the model is then ``model``, or the only
    generative model served."""
    lora_path: str
    """An ``.onnx_adapter`` file on the server's machine, made for the model."""
    model: str | None = None
    """The model the adapter is for (extension; vLLM serves one model)."""


class LoraAdapterUnloadRequest(_Request):
    """``POST /v1/unload_lora_adapter`` (vLLM's route): stop serving an adapter."""

    lora_name: str
    model: str | None = None


class ModelDeleted(_Response):
    """What an unloaded adapter answers (the shape of OpenAI's ``DELETE /v1/models/{model}``)."""

    id: str
    deleted: bool = True
    object: Literal["model"] = "model"


class ModelList(_Response):
    """``GET /v1/models``: every model, or (Anthropic's paging: ``limit``, ``after_id``,
    ``before_id``) a page of them with ``has_more``, ``first_id`` and ``last_id``."""

    data: list[Model]
    object: Literal["list"] = "list"
    has_more: bool | UnsetType = UNSET
    first_id: str | UnsetType | None = UNSET
    last_id: str | UnsetType | None = UNSET


class KeyUsage(_Response):
    """What one API key (by the label the operator gave it, never the key) spent on one
    model, since the server's state database began: ``GET /v1/usage`` (extension)."""

    key: str
    """The key's label; ``""`` on a server without keys."""
    model: str
    """The model named; ``""`` for requests that named none (refused before that)."""
    requests: int
    errors: int
    """Requests that ended with an error status (4xx or 5xx)."""
    input_tokens: int
    output_tokens: int


class KeyUsageList(_Response):
    """``GET /v1/usage`` (extension)."""

    data: list[KeyUsage]
    object: Literal["list"] = "list"


class TokenizeRequest(_Request):
    """``POST /v1/tokenize`` (extension): either ``prompt`` or chat ``messages`` (with the
    ``tools`` and ``chat_template_kwargs`` a chat request would send, as vLLM's takes them)."""

    model: str
    prompt: str | UnsetType = UNSET
    messages: list[ChatMessage] | UnsetType = UNSET
    tools: list[Tool] | UnsetType = UNSET
    add_generation_prompt: bool | UnsetType = UNSET
    """With ``messages``: end with the assistant turn's opening (the default), as a chat does."""
    chat_template_kwargs: dict[str, Any] | UnsetType | None = UNSET
    """More chat template variables (``{"enable_thinking": false}``), as in a chat request."""


class TokenizeResponse(_Response):
    """The token ids, their ``count`` and the model's context length. For a multimodal
    chat each image appears as negative ids, one per feature the model sees."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    """``POST /v1/detokenize`` (extension): token ids to text."""

    model: str
    tokens: list[int]


class DetokenizeResponse(_Response):
    """The decoded text."""

    prompt: str


class HealthModel(_Response):
    """One model's state in :class:`Health`."""

    id: str
    status: str
    """``unloaded`` (loads on first use), ``loading``, ``ready`` or ``error``."""
    provider: str | None = None
    engine: str | None = None


class Health(_Response):
    """``GET /health``: ``ok`` when every model is usable, else ``loading`` or ``error``."""

    status: str
    models: list[HealthModel]


class Transcription(_Response):
    """``POST /v1/audio/transcriptions`` with ``response_format`` ``json``."""

    text: str


class TranscriptionSegment(_Response):
    """A stretch of the transcript."""

    id: int
    start: float
    end: float
    text: str
    tokens: list[int]


class TranscriptionVerbose(_Response):
    """``response_format`` ``verbose_json``: the text and its segments, timed by the model."""

    text: str
    language: str
    duration: float | None
    segments: list[TranscriptionSegment]
    task: Literal["transcribe"] = "transcribe"


SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
"""OpenAI's formats; ``aac`` is refused by name (no encoder here)."""


class SpeechRequest(_Request):
    """``POST /v1/audio/speech``: ``input`` spoken by ``voice`` of a voice model."""

    model: str
    input: str
    voice: str | dict[str, Any] | UnsetType | None = UNSET
    """A voice of the model (``/v1/models`` lists them as ``voices``); absent: its first."""
    response_format: SpeechFormat = "mp3"
    speed: float = 1.0
    """0.25 to 4.0."""
    instructions: str | UnsetType | None = UNSET
    """Refused: no voice here follows instructions."""
    stream_format: Literal["audio", "sse"] = "audio"
    """``audio``: the file's bytes, sent as sentences are spoken; ``sse``:
    ``speech.audio.delta`` events with base64 chunks, then ``speech.audio.done``."""


class SpeechUsage(_Response):
    """``input_tokens``: the phonemes spoken; ``output_tokens``: the voice's audio frames
    (one per 256 samples)."""

    input_tokens: int
    output_tokens: int
    total_tokens: int


class SpeechAudioDeltaEvent(_Response, tag_field="type", tag="speech.audio.delta"):
    audio: str
    """Base64 of the next bytes of the audio file."""


class SpeechAudioDoneEvent(_Response, tag_field="type", tag="speech.audio.done"):
    usage: SpeechUsage


SpeechStreamEvent = SpeechAudioDeltaEvent | SpeechAudioDoneEvent


class ErrorDetail(_Response):
    """OpenAI's error object: ``type`` (``invalid_request_error``, ...), the ``param`` at
    fault and a machine-readable ``code`` (``model_not_found``, ...)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """The body of every error response: ``{"error": {...}}``; ortserve adds the
    ``request_id`` its ``x-request-id`` header carries (clients ignore fields they do not know)."""

    error: ErrorDetail
    request_id: str | msgspec.UnsetType = msgspec.UNSET
