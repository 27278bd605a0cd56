"""The typed async client for ortserve (and other OpenAI-compatible servers)."""

from __future__ import annotations

import asyncio
import base64
import math
import os
import random
import struct
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, Unpack, overload

import httpx
import msgspec

from ._batches import Batches, Files
from ._errors import (
    APIConnectionError,
    OrtServeError,
    status_error,
    translate_transport_errors,
)
from ._params import ChatCompletionParams, CompletionParams, EmbeddingParams, MessageParam, PromptParam
from ._responses import Responses
from ._streaming import AsyncStream
from .protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    CreateEmbeddingResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingRequest,
    Health,
    LoraAdapterLoadRequest,
    LoraAdapterUnloadRequest,
    Model,
    ModelDeleted,
    ModelList,
    ModelLoadRequest,
    ModelUnloadRequest,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
    SpeechFormat,
    SpeechRequest,
    TokenizeRequest,
    TokenizeResponse,
    Transcription,
    TranscriptionVerbose,
)

__all__ = ["AsyncClient"]

T = TypeVar("T", bound=msgspec.Struct)
RETRY_STATUSES = frozenset({429, 503})
"""Statuses worth another try: the server asks the caller to come back later."""
_NOT_RETRIED = (httpx.ReadTimeout, httpx.WriteTimeout)
"""Transport errors after which the request may be running already: a retry would repeat it."""
_encode = msgspec.json.Encoder().encode
_sleep = asyncio.sleep  # a seam for the tests


def _request(struct_type: type[T], fields: Mapping[str, Any]) -> T:
    """Build a request Struct from keyword arguments (nested values may be Structs or
    dicts), with a clear ``TypeError`` for unknown or ill-typed ones."""
    unknown = sorted(set(fields) - set(struct_type.__struct_fields__))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) for {struct_type.__name__}: {', '.join(unknown)}")
    try:
        return msgspec.convert({k: v for k, v in fields.items() if v is not msgspec.UNSET}, struct_type)
    except msgspec.ValidationError as exc:
        raise TypeError(f"invalid arguments for {struct_type.__name__}: {exc}") from exc


class AsyncClient:
    """Async client for an OpenAI-compatible API (ortserve's by default).

    ``base_url`` ends with the API prefix (``http://127.0.0.1:8000/v1``); ``health()``
    goes to the server root (:attr:`root_url`). The API key comes from the argument or
    ``ORTSERVE_API_KEY``. Retries (``max_retries``; 0 disables them) happen only after a
    connection error (not after a read or write timeout, when the request may be running
    already) or a 429 or 503 answer; the backoff is exponential with jitter and honours
    ``Retry-After``. Use it as ``async with AsyncClient(...) as client:`` or call
    :meth:`aclose`.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = 600.0,
        max_retries: int = 2,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        key = api_key if api_key is not None else os.environ.get("ORTSERVE_API_KEY")
        all_headers = dict(headers or {})
        if key:
            all_headers["authorization"] = f"Bearer {key}"
        self._http = httpx.AsyncClient(timeout=timeout, transport=transport, headers=all_headers)
        self.chat = _Chat(self)
        self.completions = _Completions(self)
        self.embeddings = _Embeddings(self)
        self.models = _Models(self)
        self.audio = _Audio(self)
        self.responses = Responses(self)
        self.files = Files(self)
        self.batches = Batches(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections (open streams should be closed first)."""
        await self._http.aclose()

    @property
    def root_url(self) -> str:
        """The server root: ``base_url`` without its last path segment, the API prefix
        (``http://h:8000/v1`` -> ``http://h:8000``; mounted: ``http://h/llm/v1`` -> ``http://h/llm``)."""
        url = httpx.URL(self.base_url)
        return str(url.copy_with(path=url.path.rstrip("/").rpartition("/")[0] or "/")).rstrip("/")

    async def tokenize(
        self,
        *,
        model: str,
        prompt: str | None = None,
        messages: Sequence[MessageParam] | None = None,
        add_generation_prompt: bool = True,
    ) -> TokenizeResponse:
        """``POST /tokenize`` (extension): the token ids of ``prompt``, or of ``messages``
        formatted by the model's chat template."""
        body = _request(
            TokenizeRequest,
            {
                "model": model,
                "prompt": msgspec.UNSET if prompt is None else prompt,
                "messages": msgspec.UNSET if messages is None else messages,
                "add_generation_prompt": add_generation_prompt,
            },
        )
        return await self._send("POST", f"{self.base_url}/tokenize", body, TokenizeResponse)

    async def detokenize(self, *, model: str, tokens: Sequence[int]) -> DetokenizeResponse:
        """``POST /detokenize`` (extension): the text of ``tokens``."""
        body = DetokenizeRequest(model=model, tokens=list(tokens))
        return await self._send("POST", f"{self.base_url}/detokenize", body, DetokenizeResponse)

    async def rerank(
        self,
        *,
        model: str,
        query: str,
        documents: Sequence[str | RerankDocument | Mapping[str, Any]],
        top_n: int | None = None,
        return_documents: bool | None = None,
        truncate: bool | None = None,
    ) -> RerankResponse:
        """``POST /rerank`` (a rerank model): ``documents`` (strings, or ``{"text": ...}``)
        ordered by relevance to ``query``, best first; ``top_n`` keeps the best ones (all
        when ``None``); the server sends each document back unless ``return_documents`` is
        false; ``truncate`` (extension) cuts pairs longer than the model takes."""
        body = _request(
            RerankRequest,
            {
                "model": model,
                "query": query,
                "documents": list(documents),
                "top_n": msgspec.UNSET if top_n is None else top_n,
                "return_documents": msgspec.UNSET if return_documents is None else return_documents,
                "truncate": msgspec.UNSET if truncate is None else truncate,
            },
        )
        return await self._send("POST", f"{self.base_url}/rerank", body, RerankResponse)

    async def score(
        self, *, model: str, text_1: str | Sequence[str], text_2: str | Sequence[str], truncate: bool | None = None
    ) -> ScoreResponse:
        """``POST /score`` (a rerank model; vLLM's API): the score of ``text_1`` with each
        ``text_2`` (one ``text_1``), or of each pair (lists of equal length), in input order."""
        body = _request(
            ScoreRequest,
            {
                "model": model,
                "text_1": text_1 if isinstance(text_1, str) else list(text_1),
                "text_2": text_2 if isinstance(text_2, str) else list(text_2),
                "truncate": msgspec.UNSET if truncate is None else truncate,
            },
        )
        return await self._send("POST", f"{self.base_url}/score", body, ScoreResponse)

    async def health(self) -> Health:
        """``GET /health`` at the server root; a 503 with a health body (models still
        loading) is returned, not raised, and not retried."""
        url = f"{self.root_url}/health"
        response = await self._response("GET", url, None, stream=False, ok_statuses=frozenset({503}))
        try:
            return msgspec.json.decode(response.content, type=Health)
        except msgspec.DecodeError as exc:
            if response.is_success:
                raise OrtServeError(f"unexpected response from {url}: {exc}") from exc
            raise status_error(response, response.content) from None

    # -- transport -------------------------------------------------------------------------

    async def _send(self, method: str, url: str, body: msgspec.Struct | None, result: type[T]) -> T:
        response = await self._response(method, url, body, stream=False)
        try:
            return msgspec.json.decode(response.content, type=result)
        except msgspec.DecodeError as exc:
            raise OrtServeError(f"unexpected response from {url}: {exc}") from exc

    async def _stream(self, url: str, body: msgspec.Struct, chunk: type[T]) -> AsyncStream[T]:
        response = await self._response("POST", url, body, stream=True)
        return AsyncStream(response, chunk)

    async def _response(
        self,
        method: str,
        url: str,
        body: msgspec.Struct | None,
        *,
        stream: bool,
        ok_statuses: frozenset[int] = frozenset(),
        form: tuple[dict[str, str], dict[str, tuple[str, bytes]]] | None = None,
    ) -> httpx.Response:
        """Send with retries; ``form`` (fields, files) sends multipart instead of JSON."""
        content = _encode(body) if body is not None else None
        attempt = 0
        while True:
            try:
                with translate_transport_errors(url):
                    if form is not None:
                        request = self._http.build_request(method, url, data=form[0], files=form[1])
                    else:
                        headers = {"content-type": "application/json"} if content is not None else None
                        request = self._http.build_request(method, url, content=content, headers=headers)
                    response = await self._http.send(request, stream=stream)
            except APIConnectionError as exc:
                if attempt >= self.max_retries or isinstance(exc.__cause__, _NOT_RETRIED):
                    raise
                await _sleep(_backoff(attempt, None))
                attempt += 1
                continue
            if response.is_success or response.status_code in ok_statuses:
                return response
            raw = await response.aread()
            await response.aclose()
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                await _sleep(_backoff(attempt, response.headers.get("retry-after")))
                attempt += 1
                continue
            raise status_error(response, raw)


def _backoff(attempt: int, retry_after: str | None) -> float:
    """Seconds to wait: ``Retry-After`` (seconds, at most a minute) when the server sent
    it, else 0.25 s doubling per attempt up to 8 s, with ±25 % jitter."""
    if retry_after is not None:
        try:
            seconds = float(retry_after)
        except ValueError:
            seconds = math.nan  # an HTTP date: fall back to the backoff
        if math.isfinite(seconds):
            return min(max(seconds, 0.0), 60.0)
    return float(min(0.25 * 2**attempt, 8.0) * (0.75 + random.random() / 2))


class _ChatCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(
        self,
        *,
        model: str,
        messages: Sequence[MessageParam],
        stream: Literal[False] = False,
        **options: Unpack[ChatCompletionParams],
    ) -> ChatCompletion: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        messages: Sequence[MessageParam],
        stream: Literal[True],
        **options: Unpack[ChatCompletionParams],
    ) -> AsyncStream[ChatCompletionChunk]: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        messages: Sequence[MessageParam],
        stream: bool,
        **options: Unpack[ChatCompletionParams],
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]: ...

    async def create(
        self,
        *,
        model: str,
        messages: Sequence[MessageParam],
        stream: bool = False,
        **options: Unpack[ChatCompletionParams],
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """``POST /chat/completions``. ``options`` are the request's other fields
        (``max_tokens``, ``temperature``, ``stop``, ``tools``, ``response_format``, ...).
        With ``stream=True``, an :class:`AsyncStream` of chunks."""
        body = _request(ChatCompletionRequest, {"model": model, "messages": messages, "stream": stream, **options})
        url = f"{self._client.base_url}/chat/completions"
        if stream:
            return await self._client._stream(url, body, ChatCompletionChunk)
        return await self._client._send("POST", url, body, ChatCompletion)


class _Chat:
    def __init__(self, client: AsyncClient) -> None:
        self.completions = _ChatCompletions(client)


class _Completions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(
        self,
        *,
        model: str,
        prompt: PromptParam,
        stream: Literal[False] = False,
        **options: Unpack[CompletionParams],
    ) -> Completion: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        prompt: PromptParam,
        stream: Literal[True],
        **options: Unpack[CompletionParams],
    ) -> AsyncStream[Completion]: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        prompt: PromptParam,
        stream: bool,
        **options: Unpack[CompletionParams],
    ) -> Completion | AsyncStream[Completion]: ...

    async def create(
        self,
        *,
        model: str,
        prompt: PromptParam,
        stream: bool = False,
        **options: Unpack[CompletionParams],
    ) -> Completion | AsyncStream[Completion]:
        """``POST /completions`` (legacy): prompt as text, texts, token ids or lists of ids.
        Streamed chunks have the shape of :class:`~ortserve_client.protocol.Completion`."""
        body = _request(CompletionRequest, {"model": model, "prompt": prompt, "stream": stream, **options})
        url = f"{self._client.base_url}/completions"
        if stream:
            return await self._client._stream(url, body, Completion)
        return await self._client._send("POST", url, body, Completion)


class _Embeddings:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self,
        *,
        model: str,
        input: PromptParam,
        encoding_format: Literal["float", "base64"] = "float",
        **options: Unpack[EmbeddingParams],
    ) -> CreateEmbeddingResponse:
        """``POST /embeddings``. With ``encoding_format="base64"`` the vectors travel as
        base64 little-endian float32 (a third of the JSON) and are returned decoded, as
        lists of floats."""
        body = _request(
            EmbeddingRequest, {"model": model, "input": input, "encoding_format": encoding_format, **options}
        )
        result = await self._client._send("POST", f"{self._client.base_url}/embeddings", body, CreateEmbeddingResponse)
        for item in result.data:
            if isinstance(item.embedding, str):
                item.embedding = _decode_base64_floats(item.embedding)
        return result


def _decode_base64_floats(data: str) -> list[float]:
    raw = base64.b64decode(data)
    if len(raw) % 4:
        raise OrtServeError(f"a base64 embedding of {len(raw)} bytes is not a whole number of float32 values")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


class _Transcriptions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(
        self,
        *,
        model: str,
        file: bytes | str | os.PathLike[str] | tuple[str, bytes],
        response_format: Literal["json"] = "json",
        **options: Any,
    ) -> Transcription: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        file: bytes | str | os.PathLike[str] | tuple[str, bytes],
        response_format: Literal["verbose_json"],
        **options: Any,
    ) -> TranscriptionVerbose: ...

    @overload
    async def create(
        self,
        *,
        model: str,
        file: bytes | str | os.PathLike[str] | tuple[str, bytes],
        response_format: Literal["text", "srt", "vtt"],
        **options: Any,
    ) -> str: ...

    async def create(
        self,
        *,
        model: str,
        file: bytes | str | os.PathLike[str] | tuple[str, bytes],
        response_format: Literal["json", "verbose_json", "text", "srt", "vtt"] = "json",
        **options: Any,
    ) -> Transcription | TranscriptionVerbose | str:
        """``POST /audio/transcriptions``: ``file`` as bytes, a path, or (name, bytes);
        ``options``: ``language``, ``prompt``, ``temperature``. ``text``, ``srt`` and ``vtt``
        come back as the text the server sent."""
        if isinstance(file, tuple):
            filename, data = file
        elif isinstance(file, bytes):
            filename, data = "audio", file
        else:
            path = Path(file)
            filename, data = path.name, path.read_bytes()
        fields = {"model": model, "response_format": response_format}
        fields.update({k: str(v) for k, v in options.items() if v is not None})
        url = f"{self._client.base_url}/audio/transcriptions"
        response = await self._client._response(
            "POST", url, None, stream=False, form=(fields, {"file": (filename, data)})
        )
        if response_format in ("text", "srt", "vtt"):
            return response.text
        if response_format == "verbose_json":
            return msgspec.json.decode(response.content, type=TranscriptionVerbose)
        return msgspec.json.decode(response.content, type=Transcription)


class _Speech:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @staticmethod
    def _request(
        model: str, input: str, voice: str | None, response_format: SpeechFormat, speed: float
    ) -> SpeechRequest:
        request = SpeechRequest(model=model, input=input, response_format=response_format, speed=speed)
        if voice is not None:
            request.voice = voice
        return request

    async def create(
        self,
        *,
        model: str,
        input: str,
        voice: str | None = None,
        response_format: SpeechFormat = "mp3",
        speed: float = 1.0,
    ) -> bytes:
        """``POST /audio/speech``: the whole audio file (``voice``: one of the model's
        ``voices``; absent, its first)."""
        body = self._request(model, input, voice, response_format, speed)
        response = await self._client._response("POST", f"{self._client.base_url}/audio/speech", body, stream=False)
        return response.content

    async def stream(
        self,
        *,
        model: str,
        input: str,
        voice: str | None = None,
        response_format: SpeechFormat = "mp3",
        speed: float = 1.0,
    ) -> AsyncIterator[bytes]:
        """The audio file's bytes as the server sends them (a sentence at a time)."""
        body = self._request(model, input, voice, response_format, speed)
        response = await self._client._response("POST", f"{self._client.base_url}/audio/speech", body, stream=True)
        try:
            async for chunk in response.aiter_bytes():
                yield chunk
        finally:
            await response.aclose()


class _Audio:
    def __init__(self, client: AsyncClient) -> None:
        self.transcriptions = _Transcriptions(client)
        self.speech = _Speech(client)


class _Models:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> ModelList:
        return await self._client._send("GET", f"{self._client.base_url}/models", None, ModelList)

    async def retrieve(self, model: str) -> Model:
        """One model; on ortserve with its status (``status``, ``resident_bytes``, ``in_flight``...)."""
        return await self._client._send("GET", f"{self._client.base_url}/models/{model}", None, Model)

    async def load(self, model: str, *, keep_alive: float | str | None = None) -> Model:
        """``POST /models/load`` (extension): load a model the server was configured with
        and return its status; ``keep_alive`` (seconds, or ``"5m"``; negative: forever) is
        how long it then stays loaded while idle."""
        body = ModelLoadRequest(model=model, keep_alive=msgspec.UNSET if keep_alive is None else keep_alive)
        return await self._client._send("POST", f"{self._client.base_url}/models/load", body, Model)

    async def unload(self, model: str) -> Model:
        """``POST /models/unload`` (extension): free a model once the requests using it
        end (the server ends them after its grace period); returns its status."""
        body = ModelUnloadRequest(model=model)
        return await self._client._send("POST", f"{self._client.base_url}/models/unload", body, Model)

    async def load_adapter(self, lora_name: str, lora_path: str, *, model: str | None = None) -> Model:
        """``POST /load_lora_adapter`` (vLLM's route; the server needs
        ``--allow-runtime-adapters``): serve the ``.onnx_adapter`` file ``lora_path`` (on the
        server's machine) as model ``MODEL:NAME``; ``lora_name`` is ``MODEL:NAME``, or
        ``NAME`` with ``model``. Returns the adapter's card."""
        body = LoraAdapterLoadRequest(lora_name=lora_name, lora_path=lora_path, model=model)
        return await self._client._send("POST", f"{self._client.base_url}/load_lora_adapter", body, Model)

    async def unload_adapter(self, lora_name: str, *, model: str | None = None) -> ModelDeleted:
        """``POST /unload_lora_adapter``: stop serving an adapter (requests running finish with it)."""
        body = LoraAdapterUnloadRequest(lora_name=lora_name, model=model)
        return await self._client._send("POST", f"{self._client.base_url}/unload_lora_adapter", body, ModelDeleted)
