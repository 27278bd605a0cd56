"""The typed async client for ortserve (and other OpenAI-compatible servers)."""

from __future__ import annotations

import base64
import os
import struct
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, Unpack, overload

import httpx
import msgspec

from ._batches import Batches, Files
from ._errors import (
    OrtServeError,
    status_error,
)
from ._params import ChatCompletionParams, CompletionParams, EmbeddingParams, MessageParam, PromptParam
from ._responses import Responses
from ._streaming import AsyncStream
from ._transport import Transport, request_struct
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
        key = api_key if api_key is not None else os.environ.get("ORTSERVE_API_KEY")
        all_headers = dict(headers or {})
        if key:
            all_headers["authorization"] = f"Bearer {key}"
        http = httpx.AsyncClient(timeout=timeout, transport=transport, headers=all_headers)
        self._transport = Transport(base_url.rstrip("/"), http, max_retries)
        self.chat = _Chat(self._transport)
        self.completions = _Completions(self._transport)
        self.embeddings = _Embeddings(self._transport)
        self.models = _Models(self._transport)
        self.audio = _Audio(self._transport)
        self.responses = Responses(self._transport)
        self.files = Files(self._transport)
        self.batches = Batches(self._transport)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections (open streams should be closed first)."""
        await self._transport.http.aclose()

    @property
    def base_url(self) -> str:
        """Where the API's paths start (``http://127.0.0.1:8000/v1``)."""
        return self._transport.base_url

    @property
    def max_retries(self) -> int:
        return self._transport.max_retries

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
        add_generation_prompt: bool | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> TokenizeResponse:
        """``POST /tokenize`` (extension): the token ids of ``prompt``, or of ``messages``
        formatted by the model's chat template (with ``chat_template_kwargs``, and the
        assistant turn's opening unless ``add_generation_prompt`` is False)."""
        body = request_struct(
            TokenizeRequest,
            {
                "model": model,
                "prompt": msgspec.UNSET if prompt is None else prompt,
                "messages": msgspec.UNSET if messages is None else messages,
                "add_generation_prompt": msgspec.UNSET if add_generation_prompt is None else add_generation_prompt,
                "chat_template_kwargs": msgspec.UNSET if chat_template_kwargs is None else dict(chat_template_kwargs),
            },
        )
        return await self._transport.send("POST", f"{self.base_url}/tokenize", body, TokenizeResponse)

    async def detokenize(self, *, model: str, tokens: Sequence[int]) -> DetokenizeResponse:
        """``POST /detokenize`` (extension): the text of ``tokens``."""
        body = DetokenizeRequest(model=model, tokens=list(tokens))
        return await self._transport.send("POST", f"{self.base_url}/detokenize", body, DetokenizeResponse)

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
        body = request_struct(
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
        return await self._transport.send("POST", f"{self.base_url}/rerank", body, RerankResponse)

    async def score(
        self, *, model: str, text_1: str | Sequence[str], text_2: str | Sequence[str], truncate: bool | None = None
    ) -> ScoreResponse:
        """``POST /score`` (a rerank model; vLLM's API): the score of ``text_1`` with each
        ``text_2`` (one ``text_1``), or of each pair (lists of equal length), in input order."""
        body = request_struct(
            ScoreRequest,
            {
                "model": model,
                "text_1": text_1 if isinstance(text_1, str) else list(text_1),
                "text_2": text_2 if isinstance(text_2, str) else list(text_2),
                "truncate": msgspec.UNSET if truncate is None else truncate,
            },
        )
        return await self._transport.send("POST", f"{self.base_url}/score", body, ScoreResponse)

    async def health(self) -> Health:
        """``GET /health`` at the server root; a 503 with a health body (models still
        loading) is returned, not raised, and not retried."""
        url = f"{self.root_url}/health"
        response = await self._transport.response("GET", url, None, stream=False, ok_statuses=frozenset({503}))
        try:
            return msgspec.json.decode(response.content, type=Health)
        except msgspec.DecodeError as exc:
            if response.is_success:
                raise OrtServeError(f"unexpected response from {url}: {exc}") from exc
            raise status_error(response, response.content) from None


class _ChatCompletions:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

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
        body = request_struct(
            ChatCompletionRequest, {"model": model, "messages": messages, "stream": stream, **options}
        )
        url = f"{self._transport.base_url}/chat/completions"
        if stream:
            return await self._transport.stream(url, body, ChatCompletionChunk)
        return await self._transport.send("POST", url, body, ChatCompletion)


class _Chat:
    def __init__(self, transport: Transport) -> None:
        self.completions = _ChatCompletions(transport)


class _Completions:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

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
        body = request_struct(CompletionRequest, {"model": model, "prompt": prompt, "stream": stream, **options})
        url = f"{self._transport.base_url}/completions"
        if stream:
            return await self._transport.stream(url, body, Completion)
        return await self._transport.send("POST", url, body, Completion)


class _Embeddings:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

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
        body = request_struct(
            EmbeddingRequest, {"model": model, "input": input, "encoding_format": encoding_format, **options}
        )
        result = await self._transport.send(
            "POST", f"{self._transport.base_url}/embeddings", body, CreateEmbeddingResponse
        )
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
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

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
        url = f"{self._transport.base_url}/audio/transcriptions"
        response = await self._transport.response(
            "POST", url, None, stream=False, form=(fields, {"file": (filename, data)})
        )
        if response_format in ("text", "srt", "vtt"):
            return response.text
        if response_format == "verbose_json":
            return msgspec.json.decode(response.content, type=TranscriptionVerbose)
        return msgspec.json.decode(response.content, type=Transcription)


class _Speech:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

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
        response = await self._transport.response(
            "POST", f"{self._transport.base_url}/audio/speech", body, stream=False
        )
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
        response = await self._transport.response("POST", f"{self._transport.base_url}/audio/speech", body, stream=True)
        try:
            async for chunk in response.aiter_bytes():
                yield chunk
        finally:
            await response.aclose()


class _Audio:
    def __init__(self, transport: Transport) -> None:
        self.transcriptions = _Transcriptions(transport)
        self.speech = _Speech(transport)


class _Models:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def list(self) -> ModelList:
        return await self._transport.send("GET", f"{self._transport.base_url}/models", None, ModelList)

    async def retrieve(self, model: str) -> Model:
        """One model; on ortserve with its status (``status``, ``resident_bytes``, ``in_flight``...)."""
        return await self._transport.send("GET", f"{self._transport.base_url}/models/{model}", None, Model)

    async def load(self, model: str, *, keep_alive: float | str | None = None) -> Model:
        """``POST /models/load`` (extension): load a model the server was configured with
        and return its status; ``keep_alive`` (seconds, or ``"5m"``; negative: forever) is
        how long it then stays loaded while idle."""
        body = ModelLoadRequest(model=model, keep_alive=msgspec.UNSET if keep_alive is None else keep_alive)
        return await self._transport.send("POST", f"{self._transport.base_url}/models/load", body, Model)

    async def unload(self, model: str) -> Model:
        """``POST /models/unload`` (extension): free a model once the requests using it
        end (the server ends them after its grace period); returns its status."""
        body = ModelUnloadRequest(model=model)
        return await self._transport.send("POST", f"{self._transport.base_url}/models/unload", body, Model)

    async def load_adapter(self, lora_name: str, lora_path: str, *, model: str | None = None) -> Model:
        """``POST /load_lora_adapter`` (vLLM's route; the server needs
        ``--allow-runtime-adapters``): serve the ``.onnx_adapter`` file ``lora_path`` (on the
        server's machine) as model ``MODEL:NAME``; ``lora_name`` is ``MODEL:NAME``, or
        ``NAME`` with ``model``. Returns the adapter's card."""
        body = LoraAdapterLoadRequest(lora_name=lora_name, lora_path=lora_path, model=model)
        return await self._transport.send("POST", f"{self._transport.base_url}/load_lora_adapter", body, Model)

    async def unload_adapter(self, lora_name: str, *, model: str | None = None) -> ModelDeleted:
        """``POST /unload_lora_adapter``: stop serving an adapter (requests running finish with it)."""
        body = LoraAdapterUnloadRequest(lora_name=lora_name, model=model)
        return await self._transport.send("POST", f"{self._transport.base_url}/unload_lora_adapter", body, ModelDeleted)
