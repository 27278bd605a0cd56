"""The typed async client for ortserve (and other OpenAI-compatible servers)."""

from __future__ import annotations

import asyncio
import base64
import os
import random
import struct
from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar, overload

import httpx
import msgspec

from ._errors import (
    APIConnectionError,
    OrtServeError,
    StreamError,
    status_error,
    translate_transport_errors,
)
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
    ErrorResponse,
    Health,
    Model,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = ["AsyncClient", "AsyncStream"]

T = TypeVar("T", bound=msgspec.Struct)
RETRY_STATUSES = frozenset({429, 503})
_encode = msgspec.json.Encoder().encode


class AsyncStream(Generic[T]):
    """Chunks of a streamed response. Leaving early (``break``, ``aclose``, the ``async
    with`` block) closes the HTTP response, which cancels the generation on the server."""

    def __init__(self, response: httpx.Response, chunk_type: type[T]) -> None:
        self.response = response
        self._decoder = msgspec.json.Decoder(chunk_type)
        self._error_decoder = msgspec.json.Decoder(ErrorResponse)
        self._iterator = self._chunks()

    def __aiter__(self) -> AsyncIterator[T]:
        return self._iterator

    async def __anext__(self) -> T:
        return await self._iterator.__anext__()

    async def _chunks(self) -> AsyncIterator[T]:
        try:
            with translate_transport_errors(str(self.response.request.url)):
                async for line in self.response.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # comments, event names, keep-alives
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    payload = data.encode()
                    if payload.startswith(b'{"error"'):
                        body = self._error_decoder.decode(payload)
                        raise StreamError(f"the server reported an error mid-stream: {body.error.message}", body=body)
                    yield self._decoder.decode(payload)
        finally:
            await self.response.aclose()

    async def aclose(self) -> None:
        await self._iterator.aclose()  # type: ignore[attr-defined]
        await self.response.aclose()

    async def __aenter__(self) -> AsyncStream[T]:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()


def _request(struct_type: type[T], fields: Mapping[str, Any]) -> T:
    """Build a request Struct from keyword arguments, with a clear error for bad ones."""
    try:
        return msgspec.convert({k: v for k, v in fields.items() if v is not msgspec.UNSET}, struct_type)
    except msgspec.ValidationError as exc:
        raise TypeError(f"invalid arguments for {struct_type.__name__}: {exc}") from exc


class AsyncClient:
    """Async client for an OpenAI-compatible API (ortserve's by default).

    ``base_url`` ends with the API prefix (``http://127.0.0.1:8000/v1``); ``health()``
    goes to the server root. The API key comes from the argument or ``ORTSERVE_API_KEY``.
    Retries (``max_retries``) happen only for connection errors, 429 and 503, with
    exponential backoff that honours ``Retry-After``.
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
        all_headers = {"content-type": "application/json", **(headers or {})}
        if key:
            all_headers["authorization"] = f"Bearer {key}"
        self._http = httpx.AsyncClient(timeout=timeout, transport=transport, headers=all_headers)
        self.chat = _Chat(self)
        self.completions = _Completions(self)
        self.embeddings = _Embeddings(self)
        self.models = _Models(self)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @property
    def root_url(self) -> str:
        """The server root (``base_url`` without its API prefix)."""
        return httpx.URL(self.base_url).copy_with(path="/").__str__().rstrip("/")

    async def tokenize(
        self,
        *,
        model: str,
        prompt: str | None = None,
        messages: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> TokenizeResponse:
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
        body = DetokenizeRequest(model=model, tokens=list(tokens))
        return await self._send("POST", f"{self.base_url}/detokenize", body, DetokenizeResponse)

    async def health(self) -> Health:
        """``GET /health``; a 503 while models load is returned, not raised."""
        url = f"{self.root_url}/health"
        response = await self._response("GET", url, None, stream=False, ok_statuses=frozenset({503}))
        return msgspec.json.decode(response.content, type=Health)

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
    ) -> httpx.Response:
        content = _encode(body) if body is not None else None
        attempt = 0
        while True:
            try:
                with translate_transport_errors(url):
                    request = self._http.build_request(method, url, content=content)
                    response = await self._http.send(request, stream=stream)
            except APIConnectionError:
                if attempt >= self.max_retries:
                    raise
                await asyncio.sleep(_backoff(attempt, None))
                attempt += 1
                continue
            if response.is_success or response.status_code in ok_statuses:
                return response
            raw = await response.aread()
            await response.aclose()
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                await asyncio.sleep(_backoff(attempt, response.headers.get("retry-after")))
                attempt += 1
                continue
            raise status_error(response, raw)


def _backoff(attempt: int, retry_after: str | None) -> float:
    if retry_after is not None:
        try:
            return min(max(float(retry_after), 0.0), 60.0)
        except ValueError:
            pass
    return float(min(0.25 * 2**attempt, 8.0) * (0.75 + random.random() / 2))


class _ChatCompletions:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    @overload
    async def create(
        self, *, model: str, messages: Sequence[Any], stream: Literal[False] = False, **options: Any
    ) -> ChatCompletion: ...

    @overload
    async def create(
        self, *, model: str, messages: Sequence[Any], stream: Literal[True], **options: Any
    ) -> AsyncStream[ChatCompletionChunk]: ...

    async def create(
        self, *, model: str, messages: Sequence[Any], stream: bool = False, **options: Any
    ) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """``POST /chat/completions``; ``options`` are the request's other fields
        (``max_tokens``, ``temperature``, ``stop``, ``seed``, ``stream_options``, ...)."""
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
        self, *, model: str, prompt: str | Sequence[Any], stream: Literal[False] = False, **options: Any
    ) -> Completion: ...

    @overload
    async def create(
        self, *, model: str, prompt: str | Sequence[Any], stream: Literal[True], **options: Any
    ) -> AsyncStream[Completion]: ...

    async def create(
        self, *, model: str, prompt: str | Sequence[Any], stream: bool = False, **options: Any
    ) -> Completion | AsyncStream[Completion]:
        """``POST /completions`` (legacy): prompt as text, texts, token ids or lists of ids."""
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
        input: str | Sequence[Any],
        encoding_format: Literal["float", "base64"] = "float",
        **options: Any,
    ) -> CreateEmbeddingResponse:
        """``POST /embeddings``. With ``encoding_format="base64"`` the vectors travel as
        little-endian float32 and are returned decoded, as lists of floats."""
        body = _request(
            EmbeddingRequest, {"model": model, "input": input, "encoding_format": encoding_format, **options}
        )
        result = await self._client._send("POST", f"{self._client.base_url}/embeddings", body, CreateEmbeddingResponse)
        for item in result.data:
            if isinstance(item.embedding, str):
                raw = base64.b64decode(item.embedding)
                item.embedding = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        return result


class _Models:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> ModelList:
        return await self._client._send("GET", f"{self._client.base_url}/models", None, ModelList)

    async def retrieve(self, model: str) -> Model:
        return await self._client._send("GET", f"{self._client.base_url}/models/{model}", None, Model)
