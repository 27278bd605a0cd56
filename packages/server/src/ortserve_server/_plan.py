"""Mapping from OpenAI request Structs to runtime calls, and the checks on the way.

A parameter this server cannot honour is refused with a 400 naming it, never ignored.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from litestar.connection import ASGIConnection
from ortserve_client import protocol as p
from ortserve_runtime import (
    AdapterNotFoundError,
    AudioInput,
    ChatModel,
    EmbeddingModel,
    GenerationOptions,
    GenerationStream,
    Grammar,
    ImageInput,
    InvalidRequestError,
    ModelKind,
    Prompt,
    RerankModel,
    SpeechModel,
    ToolCallFormat,
    forced_tool_grammar,
)

from ._config import ServerConfig
from ._errors import BadRequestError, ModelNotFoundHTTPError, OverloadedError, UnsupportedParameterError
from ._leases import hold_model, keep_alive_by_admin, parse_keep_alive
from ._state import OrtServe

logger = logging.getLogger("ortserve.server")

__all__ = [
    "CALLER",
    "Caller",
    "GenerationPlan",
    "caller_of",
    "chat_messages",
    "check_chat_request",
    "check_room",
    "completion_prompts",
    "decode_base64",
    "model_adapters",
    "plan_chat",
    "plan_completion",
    "require_embedding_model",
    "require_model",
    "require_rerank_model",
    "require_speech_model",
    "split_adapter",
    "template_kwargs",
]

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on chat ``top_logprobs``."""
MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's limit on the legacy completions' ``logprobs``."""
T = TypeVar("T")
D = TypeVar("D")
KeepAlive = float | str | msgspec.UnsetType | None
"""A request's ``keep_alive`` as sent."""


def _given(value: Any) -> bool:
    return not isinstance(value, msgspec.UnsetType) and value is not None


def _or(value: T | msgspec.UnsetType | None, default: D) -> T | D:
    """``value`` unless the request left it out or sent null."""
    return default if value is None or isinstance(value, msgspec.UnsetType) else value


def split_adapter(state: OrtServe, model_id: str) -> tuple[str, str | None]:
    """A model id as (model name, LoRA adapter name or ``None``): ``MODEL:ADAPTER`` names an
    adapter of a served model, the way vLLM and llama-server list theirs, unless the whole
    id is itself a model's name."""
    names = state.registry.names()
    base, sep, adapter = model_id.rpartition(":")
    if model_id in names or not sep or base not in names:
        return model_id, None
    return base, adapter


def model_adapters(state: OrtServe, name: str) -> tuple[str, ...]:
    """The LoRA adapters model ``name`` serves (before it loads too; those added over HTTP included)."""
    return state.registry.adapters(name)


async def require_model(state: OrtServe, name: str, keep_alive: KeepAlive = msgspec.UNSET) -> ChatModel:
    """The loaded generative model called ``name`` (``MODEL:ADAPTER``: through that LoRA
    adapter), or a 404/400/503 that says why not; held for this request (see ``_leases``),
    then kept loaded ``keep_alive``."""
    base, adapter = split_adapter(state, name)
    if adapter is not None and adapter not in model_adapters(state, base):
        raise AdapterNotFoundError(base, adapter, model_adapters(state, base))
    loaded: ChatModel = await _loaded(state, base, "generative", keep_alive)
    model = loaded.with_adapter(adapter)
    if model.queued >= state.config.max_queued:
        raise OverloadedError(
            f"model {name!r} has {model.queued} requests waiting; try again shortly", headers={"Retry-After": "1"}
        )
    return model


def check_room(
    state: OrtServe, model: ChatModel | EmbeddingModel | RerankModel, wanted: int, param: str, unit: str
) -> None:
    """Refuse, before any work starts, a request that fans out into ``wanted`` queue
    entries (prompts x ``n``, or an embedding or rerank request's batches) the queue has no room for:
    400 naming ``param`` when no queue could ever take it, else 503 + Retry-After. One
    request of 20,000 prompts queued 19,992 generations past ``max_queued`` of 64."""
    limit = state.config.max_queued
    if wanted > limit:
        raise BadRequestError(
            f"this request makes {wanted} {unit}; this server queues at most {limit} per model",
            param=param,
        )
    queued = model.queued
    if queued + wanted > limit:
        raise OverloadedError(
            f"model {model.name!r} has {queued} {unit} waiting, no room for {wanted} more; try again shortly",
            headers={"Retry-After": "1"},
        )


async def require_embedding_model(state: OrtServe, name: str, keep_alive: KeepAlive = msgspec.UNSET) -> EmbeddingModel:
    """The loaded embedding model called ``name``, or a 404/400 that says why not."""
    model: EmbeddingModel = await _loaded(state, name, "embedding", keep_alive)
    return model


async def require_rerank_model(state: OrtServe, name: str, keep_alive: KeepAlive = msgspec.UNSET) -> RerankModel:
    """The loaded rerank (cross-encoder) model called ``name``, or a 404/400 that says why not."""
    model: RerankModel = await _loaded(state, name, "rerank", keep_alive)
    return model


async def require_speech_model(state: OrtServe, name: str, keep_alive: KeepAlive = msgspec.UNSET) -> SpeechModel:
    """The loaded speech-to-text model called ``name``, or a 404/400/503 that says why not."""
    model: SpeechModel = await _loaded(state, name, "speech", keep_alive)
    # A speech model takes in every request at once and serves them by turns, so all it
    # holds count against the limit, not only those not taken in yet.
    held = model.queued + model.active
    if held >= state.config.max_queued:
        raise OverloadedError(f"model {name!r} has {held} requests waiting", headers={"Retry-After": "1"})
    return model


async def _loaded(state: OrtServe, name: str, kind: ModelKind, keep_alive: KeepAlive = msgspec.UNSET) -> Any:
    seconds = parse_keep_alive(keep_alive)
    keep_alive_by_admin(seconds, state.config.admin_key)
    registry = state.registry
    if name not in registry.names():
        raise ModelNotFoundHTTPError(f"model {name!r} does not exist", param="model")
    actual = registry.kind(name)
    if actual != kind:
        use = {
            "generative": "/v1/chat/completions or /v1/completions",
            "embedding": "/v1/embeddings",
            "rerank": "/v1/rerank or /v1/score",
            "speech": "/v1/audio/transcriptions",
            "voice": "/v1/audio/speech",
        }[actual]
        raise BadRequestError(f"model {name!r} is a {actual} model; use {use}", param="model")
    return await hold_model(registry, name, seconds)


def _refuse(param: str, why: str = "is not supported by this server") -> UnsupportedParameterError:
    return UnsupportedParameterError(f"'{param}' {why}", param=param)


def _check_common(data: p.ChatCompletionRequest | p.CompletionRequest, config: ServerConfig) -> None:
    if _given(data.stream_options) and data.stream is not True:
        # As OpenAI: the options of a stream make no sense without one.
        raise BadRequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    n = data.n if _given(data.n) else 1
    if not isinstance(n, int) or n < 1 or n > config.max_n:
        raise BadRequestError(f"'n' must be between 1 and {config.max_n}", param="n")
    if _given(data.lora):
        # llama-server mixes adapters by scale; onnxruntime's adapters have their scale
        # baked in and og activates one per generator, so a silent ignore would be wrong.
        raise _refuse(
            "lora",
            "is not supported: pick a LoRA adapter with the model id MODEL:ADAPTER (listed in /v1/models)",
        )
    stop = data.stop
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise BadRequestError(f"'stop' allows at most {MAX_STOP} strings", param="stop")


def check_chat_request(data: p.ChatCompletionRequest, config: ServerConfig) -> None:
    """Refuse what we cannot honour, naming the parameter."""
    _check_common(data, config)
    top = data.top_logprobs
    if _given(top) and not (isinstance(top, int) and 0 <= top <= MAX_TOP_LOGPROBS):
        raise BadRequestError(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if isinstance(top, int) and top > 0 and data.logprobs is not True:
        raise BadRequestError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    if not data.messages:
        raise BadRequestError("'messages' must not be empty", param="messages")
    if isinstance(data.modalities, list) and set(data.modalities) - {"text"}:
        raise _refuse("modalities", "asks for output this server does not make: it writes text only")
    if _given(data.audio):
        raise _refuse("audio", "(audio output) is not supported: models here write text only")


def check_completion_request(data: p.CompletionRequest, config: ServerConfig) -> None:
    _check_common(data, config)
    logprobs = data.logprobs
    if _given(logprobs) and not (isinstance(logprobs, int) and 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
        raise BadRequestError(f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}", param="logprobs")
    if data.echo is True:
        raise _refuse("echo")
    if _given(data.suffix) and data.suffix:
        raise _refuse("suffix")
    if _given(data.best_of) and data.best_of != 1:
        raise _refuse("best_of")


IMAGE_FETCH_SECONDS = 30.0
"""Every remote image of a request is fetched within this (a host dripping a byte every few
seconds would otherwise hold the request open as long as it likes)."""


@dataclass(frozen=True, slots=True)
class _RemoteImage:
    """An allowed http(s) image URL, fetched once the request's other checks passed."""

    url: str
    where: str


async def chat_messages(
    messages: Sequence[p.ChatMessage],
    config: ServerConfig,
    model: ChatModel | None = None,
    while_connected: Callable[[Awaitable[None]], Awaitable[None]] | None = None,
) -> list[dict[str, Any]]:
    """Protocol messages as the plain dicts chat templates expect; content parts become
    text, :class:`ImageInput` and :class:`AudioInput`. With ``model``, what it cannot take
    (images at all, or more of them than it takes) is refused before any remote image is
    fetched; remote images are fetched together, within :data:`IMAGE_FETCH_SECONDS`, and
    through ``while_connected`` (the route's: fetches stop when the client leaves)."""
    result: list[dict[str, Any]] = []
    remote: list[tuple[list[Any], int, _RemoteImage]] = []
    images: list[str] = []
    for index, message in enumerate(messages):
        content = message.content
        parts: str | list[Any] = content if isinstance(content, str) else ""
        if isinstance(content, list):
            parts = []
            for number, part in enumerate(content):
                converted = _content_part(part, f"messages[{index}].content[{number}]", config)
                if isinstance(converted, _RemoteImage):
                    remote.append((parts, len(parts), converted))
                if isinstance(converted, ImageInput | _RemoteImage):
                    images.append(f"messages[{index}].content[{number}]")
                parts.append(converted)
        role = message.__struct_config__.tag
        # "developer" is OpenAI's newer name for the system role; templates know "system".
        item: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": parts}
        tool_calls = getattr(message, "tool_calls", None)
        if _given(tool_calls) and tool_calls:
            item["tool_calls"] = [msgspec.to_builtins(call) for call in tool_calls]
        thought = getattr(message, "reasoning_content", None)
        thought = thought if isinstance(thought, str) else getattr(message, "reasoning", None)
        if isinstance(thought, str):
            item["reasoning_content"] = thought  # the name Qwen3's and DeepSeek's templates read
        for key in ("tool_call_id", "name"):
            value = getattr(message, key, None)
            if _given(value):
                item[key] = value
        result.append(item)
    if model is not None and images:
        _check_images(model, images)
    if remote:
        fetching = _fetch_remote(remote, config)
        await (while_connected(fetching) if while_connected is not None else fetching)
    return result


def _check_images(model: ChatModel, images: list[str]) -> None:
    """Refuse images ``model`` cannot take (``images``: where each is), before any is fetched."""
    if "image" not in model.modalities:
        raise BadRequestError(f"model {model.name!r} does not take images", param=images[0])
    if len(images) > model.config.max_images:
        raise BadRequestError(
            f"the messages hold {len(images)} images; this server takes at most {model.config.max_images}",
            param="messages",
        )


async def _fetch_remote(remote: list[tuple[list[Any], int, _RemoteImage]], config: ServerConfig) -> None:
    """Fetch every remote image together, each into its place in its message's parts."""
    try:
        async with asyncio.timeout(IMAGE_FETCH_SECONDS):
            fetched = await asyncio.gather(
                *(_fetch_image(image.url, image.where, config.max_body_size) for _, _, image in remote)
            )
    except TimeoutError:
        raise BadRequestError(
            f"the images could not be fetched within {IMAGE_FETCH_SECONDS:g} s", param=remote[0][2].where
        ) from None
    for (parts, position, _), data in zip(remote, fetched, strict=True):
        parts[position] = ImageInput(data)


def _content_part(
    part: p.ContentPart, where: str, config: ServerConfig
) -> str | ImageInput | AudioInput | _RemoteImage:
    if isinstance(part, p.TextContentPart):
        return part.text
    if isinstance(part, p.InputAudioContentPart):
        return AudioInput(decode_base64(part.input_audio.data, f"{where}.input_audio.data"), part.input_audio.format)
    if part.image_url.detail == "low":
        # onnxruntime-genai's processors choose the crops themselves (phi3v: up to 16, even
        # for a small image), so there is no cheaper way to look at an image to offer.
        raise BadRequestError(
            "detail 'low' is not supported: images are always seen in full detail", param=f"{where}.image_url.detail"
        )
    url = part.image_url.url
    where = f"{where}.image_url.url"
    if url.startswith("data:"):
        media_type, _sep, rest = url[5:].partition(",")
        if not _sep or not media_type.endswith(";base64"):
            raise BadRequestError("an image data URL must look like data:image/png;base64,...", param=where)
        if media_type.split(";")[0] not in ("", "image") and not media_type.startswith("image/"):
            raise BadRequestError(f"the data URL holds {media_type.split(';')[0]!r}, not an image", param=where)
        return ImageInput(decode_base64(rest, where))
    try:
        parsed = urllib.parse.urlsplit(url)
        hostname = parsed.hostname
    except ValueError as exc:  # a malformed host or port
        raise BadRequestError(f"the image URL is malformed: {exc}", param=where) from exc
    if parsed.scheme not in ("http", "https"):
        raise BadRequestError("an image URL must be a data: URL (or http(s) where allowed)", param=where)
    if hostname not in config.image_url_hosts:
        raise BadRequestError(
            f"this server does not fetch images from {hostname!r}: send the image inline as a data: URL "
            "(remote hosts must be allowed with image_url_hosts / --allow-image-host)",
            param=where,
        )
    return _RemoteImage(url, where)


def decode_base64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError("not valid base64", param=where) from None


async def _fetch_image(url: str, where: str, limit: int) -> bytes:
    """An allowed remote image, at most ``limit`` bytes, without following redirects (a
    redirect could lead anywhere, defeating the allow-list). Every failure is one answer:
    which ports are open and which paths exist is no caller's business (the log says why)."""
    import httpx  # only for remote images (--allow-image-host): kept out of start-up

    try:
        async with (
            httpx.AsyncClient(timeout=10.0, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                logger.info("image fetch %s: HTTP %d", url, response.status_code)
                raise BadRequestError("the image could not be fetched", param=where)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > limit:
                    raise BadRequestError(f"the image is larger than {limit} bytes", param=where)
            return bytes(body)
    except httpx.HTTPError as exc:
        logger.info("image fetch %s: %s", url, exc)
        raise BadRequestError("the image could not be fetched", param=where) from exc


def completion_prompts(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """The four prompt forms of the completions API as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("'prompt' must not be empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [[int(x) for x in prompt]]  # type: ignore[arg-type]
    if all(isinstance(x, str) for x in prompt):
        return [str(x) for x in prompt]
    if all(isinstance(x, list) for x in prompt):
        return [list(x) for x in prompt]  # type: ignore[arg-type]
    raise BadRequestError(
        "'prompt' must be a string, strings, token ids or lists of token ids, not a mix", param="prompt"
    )


def _check_grammar_size(grammar: Grammar, field: str, config: ServerConfig) -> None:
    """Compiling a grammar takes time in proportion to its size (50,000 guided_choice
    options took 6 s): larger ones are refused before they reach the compiler."""
    source = grammar.source
    size = len(source.encode()) if isinstance(source, str) else len(msgspec.json.encode(source))
    if size > config.max_grammar_bytes:
        raise BadRequestError(
            f"the {field} grammar is {size} bytes; this server compiles at most {config.max_grammar_bytes}",
            param=field,
        )


def _grammar_of(
    data: p.ChatCompletionRequest | p.CompletionRequest, config: ServerConfig
) -> tuple[Grammar, str] | None:
    """The output constraint a request asks for, with the field that asked for it."""
    asked: list[tuple[Grammar, str]] = []
    response_format = data.response_format
    if isinstance(response_format, p.ResponseFormatJSONObject):
        asked.append((Grammar("json_schema", {"type": "object"}), "response_format"))
    elif isinstance(response_format, p.ResponseFormatJSONSchema):
        schema = response_format.json_schema.schema
        if not isinstance(schema, dict):
            raise BadRequestError("response_format.json_schema.schema is required", param="response_format")
        asked.append((Grammar("json_schema", schema), "response_format"))
    if _given(data.guided_json):
        guided: Any = data.guided_json
        if isinstance(guided, str):
            try:
                guided = json.loads(guided)
            except ValueError:
                raise BadRequestError(
                    "guided_json must be a JSON schema (an object or its JSON text)", param="guided_json"
                ) from None
        if not isinstance(guided, dict):
            raise BadRequestError("guided_json must be a JSON schema object", param="guided_json")
        asked.append((Grammar("json_schema", guided), "guided_json"))
    if _given(data.guided_regex):
        asked.append((Grammar("regex", str(data.guided_regex)), "guided_regex"))
    if _given(data.guided_grammar):
        asked.append((Grammar("lark", str(data.guided_grammar)), "guided_grammar"))
    if isinstance(data.guided_choice, list):
        if not data.guided_choice or not all(data.guided_choice):
            raise BadRequestError("guided_choice needs non-empty strings", param="guided_choice")
        if len(data.guided_choice) > config.max_guided_choices:
            raise BadRequestError(
                f"guided_choice has {len(data.guided_choice)} options; this server takes at most "
                f"{config.max_guided_choices}",
                param="guided_choice",
            )
        # Lark string literals share JSON's escapes, so json.dumps quotes each choice.
        lark = "start: " + " | ".join(json.dumps(choice) for choice in data.guided_choice)
        asked.append((Grammar("lark", lark), "guided_choice"))
    if len(asked) > 1:
        raise BadRequestError(
            f"ask for one output constraint, not {' and '.join(field for _, field in asked)}", param=asked[1][1]
        )
    for grammar, field in asked:
        _check_grammar_size(grammar, field, config)
    return asked[0] if asked else None


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's ``tools``/``tool_choice`` mean for this model."""

    definitions: list[dict[str, Any]] | None = None
    """Tool schemas for the chat template (``None``: no tools in the prompt)."""
    format: ToolCallFormat | None = None
    """Parse the output for calls in this format (``None``: plain content)."""
    grammar: Grammar | None = None
    """Force a call (``required`` or a named function), or let the output be a call or an
    answer in the response format (``auto`` with a JSON schema format)."""
    forced: str | None = None
    """The name of the function a forced call must call (``""``: any of several), else ``None``."""


def _tool_plan(
    data: p.ChatCompletionRequest, model: ChatModel, constraint: tuple[Grammar, str] | None, config: ServerConfig
) -> ToolPlan:
    tools = data.tools if isinstance(data.tools, list) and data.tools else None
    choice = data.tool_choice if _given(data.tool_choice) else ("auto" if tools else "none")
    if tools is None:
        if choice not in ("none", "auto"):
            raise BadRequestError("tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    definitions = [msgspec.to_builtins(tool) for tool in tools]
    if choice == "none":
        return ToolPlan(definitions=definitions)
    if model.tool_format is None:
        raise BadRequestError(f"model {model.name!r} has no known tool-call format in its chat template", param="tools")
    if choice == "auto":
        if constraint is not None and constraint[0].kind == "json_schema" and isinstance(constraint[0].source, dict):
            # A call, or an answer in the response format: the format must not rule calls out.
            either = forced_tool_grammar(
                model.tool_format, definitions, token_id=model.tokenizer.token_to_id, or_answer=constraint[0].source
            )
            if either is not None:
                _check_grammar_size(either, "tools", config)
                return ToolPlan(definitions, model.tool_format, either)
        return ToolPlan(definitions, model.tool_format)
    name = choice.function.name if isinstance(choice, p.NamedToolChoice) else None
    if name is not None and name not in {t.function.name for t in tools}:
        raise BadRequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    # A response format given with a forced call shapes later text turns; this turn is the
    # call (as OpenAI does). The format was checked above all the same.
    grammar = forced_tool_grammar(model.tool_format, definitions, name, model.tokenizer.token_to_id)
    assert grammar is not None  # the named tool is among them (checked above)
    _check_grammar_size(grammar, "tools", config)
    # "required" with one tool forces that one: a call cut before its name still names it.
    only = tools[0].function.name if len(tools) == 1 else ""
    return ToolPlan(definitions, model.tool_format, grammar, name or only)


CALLER = "ortserve.caller"
"""Where the API key guard (or the batch runner) leaves the request's :class:`Caller` in
the ASGI scope."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as far as the server tells callers apart."""

    owner: str = ""
    """The digest of the API key it came with (``""`` on a server without keys): files
    and batches belong to it."""
    cache_scope: str | None = None
    """Its prefix-cache scope: the key's digest where the cache is scoped by key
    (``ServerConfig.prefix_cache_scope``), ``None`` where it is shared."""
    background: bool = False
    """A batch's line: runs behind interactive requests (``GenerationOptions.background``)."""


def caller_of(request: ASGIConnection[Any, Any, Any, Any] | None) -> Caller:
    """The request's :class:`Caller` (anonymous and interactive when nothing says otherwise)."""
    found = None if request is None else request.scope.get(CALLER)
    return found if isinstance(found, Caller) else Caller()


def _scoped_salt(salt: str | None, scope: str | None) -> str | None:
    """The salt the engine keys cached rows by: the request's own within its caller's scope."""
    return salt if scope is None else f"key:{scope}:{salt or ''}"


def _generation_options(
    data: p.ChatCompletionRequest | p.CompletionRequest,
    config: ServerConfig,
    n: int,
    grammar: Grammar | None,
    caller: Caller,
) -> list[GenerationOptions]:
    """Runtime options for each of the ``n`` choices (seeds differ per choice)."""
    max_tokens = _or(getattr(data, "max_completion_tokens", None), None)
    if max_tokens is None:
        max_tokens = _or(data.max_tokens, None)
    limit = config.max_tokens_limit
    if max_tokens is not None and limit is not None and max_tokens > limit:
        raise BadRequestError(f"max_tokens may be at most {limit} on this server", param="max_tokens")
    if max_tokens is None:
        max_tokens = limit
    stop = data.stop
    stops: tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
    top_k = _or(data.top_k, 0)
    seed = _or(data.seed, None)
    bias = _logit_bias(data.logit_bias)
    if isinstance(data, p.ChatCompletionRequest):
        logprobs = _or(data.top_logprobs, 0) if data.logprobs is True else None
    else:
        logprobs = _or(data.logprobs, None)
    options = [
        GenerationOptions(
            max_tokens=max_tokens,
            temperature=_or(data.temperature, 1.0),
            top_p=_or(data.top_p, 1.0),
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "disabled" as -1
            repetition_penalty=_or(data.repetition_penalty, 1.0),
            min_tokens=_or(data.min_tokens, 0),
            seed=None if seed is None else seed + i,
            stop=stops,
            grammar=grammar,
            logit_bias=bias,
            min_p=_or(data.min_p, 0.0),
            cache_salt=_scoped_salt(_or(data.cache_salt, None), caller.cache_scope),
            background=caller.background,
            prediction=_prediction(data.prediction),
            presence_penalty=_or(data.presence_penalty, 0.0),
            frequency_penalty=_or(data.frequency_penalty, 0.0),
            logprobs=logprobs,
        )
        for i in range(n)
    ]
    for o in options:
        o.validate()
    return options


def _prediction(given: p.PredictionContent | msgspec.UnsetType | None) -> str | None:
    """The text of a ``prediction`` (a string, or text parts joined as OpenAI joins them)."""
    if not isinstance(given, p.PredictionContent):
        return None
    content = given.content
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _logit_bias(given: dict[str, float] | msgspec.UnsetType | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON's string keys) with integer keys; the model
    checks that each id is in its vocabulary, the options that each bias is in range."""
    if not isinstance(given, dict):
        return {}
    bias: dict[int, float] = {}
    for key, value in given.items():
        try:
            bias[int(key)] = float(value)
        except ValueError:
            raise BadRequestError(f"logit_bias keys must be token ids, not {key!r}", param="logit_bias") from None
    return bias


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """A chat or completion request mapped once: the options of each of its ``n`` choices,
    its tools, and which request field each runtime parameter came from."""

    n: int
    options: list[GenerationOptions]
    tools: ToolPlan
    fields: Mapping[str, str]
    """The runtime's ``param`` of an error -> the request's field (``prompt`` -> ``messages``,
    ``grammar`` -> ``response_format``, ``guided_regex``, ``tool_choice``...)."""

    def start(self, model: ChatModel, prompts: Sequence[str | list[int] | Prompt]) -> list[GenerationStream]:
        """One stream per prompt and choice; a refusal names the request's field."""
        try:
            return [model.generate(prompt, options=o) for prompt in prompts for o in self.options]
        except InvalidRequestError as exc:
            raise self.named(exc) from exc

    def fitted(self, model: ChatModel, prompt: Prompt) -> GenerationPlan:
        """This plan with ``max_tokens`` cut to what ``model``'s context leaves after
        ``prompt``: for a tool loop's later turns, whose prompts grew with calls and
        results the caller did not size ``max_tokens`` for."""
        room = model.max_sequence_length - len(prompt)
        if room < 1:
            return self  # the prompt alone does not fit: the model's refusal says so
        options = [
            o if o.max_tokens is None or o.max_tokens <= room else dataclasses.replace(o, max_tokens=room)
            for o in self.options
        ]
        return dataclasses.replace(self, options=options)

    def named(self, exc: InvalidRequestError) -> InvalidRequestError:
        """``exc`` naming the request's field (``grammar`` -> ``response_format``...)."""
        if exc.param is not None and exc.param in self.fields:
            return type(exc)(str(exc), param=self.fields[exc.param])
        return exc

    async def astart(
        self, state: OrtServe, model: ChatModel, prompts: Sequence[str | list[int] | Prompt]
    ) -> list[GenerationStream]:
        """:meth:`start` for the server: every generation the request fans out into counts
        against ``max_queued``, and tokenizing and grammar compiling run in a worker thread
        (a 15 MB prompt froze every stream for 13 s on the event loop)."""
        wanted = len(prompts) * self.n
        param = "prompt" if len(prompts) > 1 else "n"
        check_room(state, model, wanted, param, "generations")
        streams = await asyncio.to_thread(self.start, model, prompts)
        # Others may have queued while this one was prepared: looked at again, with no
        # await between this check and handing the streams back to be read.
        check_room(state, model, wanted, param, "generations")
        return streams


def plan_chat(
    data: p.ChatCompletionRequest, model: ChatModel, config: ServerConfig, caller: Caller = Caller()
) -> GenerationPlan:
    """Check a chat request (a 400 naming any parameter it cannot honour) and map it;
    ``caller``: who sent it (:func:`caller_of`), for its prefix-cache scope and priority."""
    check_chat_request(data, config)
    constraint = _grammar_of(data, config)
    tools = _tool_plan(data, model, constraint, config)
    grammar, field = (tools.grammar, "tool_choice") if tools.grammar else constraint or (None, "grammar")
    n = data.n if isinstance(data.n, int) else 1
    return GenerationPlan(
        n, _generation_options(data, config, n, grammar, caller), tools, {"prompt": "messages", "grammar": field}
    )


def template_kwargs(data: p.ChatCompletionRequest) -> dict[str, Any]:
    """The chat template variables a request adds: ``chat_template_kwargs`` and
    ``reasoning_effort`` (the render never lets them replace the messages or tools)."""
    kwargs = dict(data.chat_template_kwargs) if isinstance(data.chat_template_kwargs, dict) else {}
    if isinstance(data.reasoning_effort, str):
        kwargs.setdefault("reasoning_effort", data.reasoning_effort)
    return kwargs


def plan_completion(data: p.CompletionRequest, config: ServerConfig, caller: Caller = Caller()) -> GenerationPlan:
    """Check a completion request (a 400 naming any parameter it cannot honour) and map it
    (``caller`` as for :func:`plan_chat`)."""
    check_completion_request(data, config)
    grammar, field = _grammar_of(data, config) or (None, "grammar")
    n = data.n if isinstance(data.n, int) else 1
    return GenerationPlan(n, _generation_options(data, config, n, grammar, caller), ToolPlan(), {"grammar": field})
