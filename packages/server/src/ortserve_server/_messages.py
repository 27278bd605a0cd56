"""Chat messages as the runtime takes them: content parts checked and decoded (text,
images by data URL or allowed remote URL, audio), remote images fetched within a time
limit once the request's other checks passed."""

from __future__ import annotations

import asyncio
import binascii
import functools
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from ortserve_client import protocol as p
from ortserve_runtime import AudioInput, ChatModel, ImageInput

from ._config import ServerConfig
from ._errors import BadRequestError
from ._inflate import ACCEPT_ENCODING, CodingError, Inflater
from ._json_bounds import one_at_a_time

if TYPE_CHECKING:
    import ssl

    import httpcore

logger = logging.getLogger("ortserve.server")

__all__ = ["IMAGE_FETCH_SECONDS", "adecode_base64", "chat_messages", "decode_base64"]


IMAGE_FETCH_SECONDS = 30.0
"""Every remote image of a request is fetched within this (a host dripping a byte every few
seconds would otherwise hold the request open as long as it likes)."""

_OFF_LOOP_CHARS = 1 << 20
"""Characters of inline media (data URLs, audio's base64) past which a request's messages
are converted in a worker thread, in :func:`one_at_a_time`'s turn: decoding 16 MB of base64 took 40-60 ms on the event loop
(twenty-seventh probe, issue 45: six such requests held /health 208-449 ms)."""

_PIECE = 1 << 20
"""Base64 characters decoded in one call (a multiple of 4). binascii holds the GIL for the
whole of a call, so a worker thread decoding 16 MB at once held the event loop out as long
as decoding on it; a piece is 2-3 ms, and the loop has its turn between two."""


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
    if _inline_chars(messages) > _OFF_LOOP_CHARS:
        # In the large bodies' turn: four decoding threads at once kept the loop waiting
        # for the GIL behind each other.
        converting = functools.partial(_converted, messages, config)
        result, remote, images = await anyio.to_thread.run_sync(converting, limiter=one_at_a_time())
    else:  # the shared worker threads are not waited for when there is little to decode
        result, remote, images = _converted(messages, config)
    if model is not None and images:
        _check_images(model, images)
    if remote:
        fetching = _fetch_remote(remote, config)
        await (while_connected(fetching) if while_connected is not None else fetching)
    return result


def _inline_chars(messages: Sequence[p.ChatMessage]) -> int:
    """Characters of the media ``messages`` hold inline (each a length read, nothing scanned)."""
    total = 0
    for message in messages:
        if isinstance(message.content, list):
            for part in message.content:
                if isinstance(part, p.InputAudioContentPart):
                    total += len(part.input_audio.data)
                elif isinstance(part, p.ImageContentPart):
                    total += len(part.image_url.url)
    return total


def _converted(
    messages: Sequence[p.ChatMessage], config: ServerConfig
) -> tuple[list[dict[str, Any]], list[tuple[list[Any], int, _RemoteImage]], list[str]]:
    """The messages as templates take them (inline media decoded), the remote images to
    fetch (each with the parts list and place it goes in) and where each image is. All of
    one request's checks in one place, in order: the first fault found is the one told."""
    result: list[dict[str, Any]] = []
    remote: list[tuple[list[Any], int, _RemoteImage]] = []
    images: list[str] = []
    _check_tool_results(messages)
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
        if isinstance(tool_calls, list) and tool_calls:
            item["tool_calls"] = [msgspec.to_builtins(call) for call in tool_calls]
        thought = getattr(message, "reasoning_content", None)
        thought = thought if isinstance(thought, str) else getattr(message, "reasoning", None)
        if isinstance(thought, str):
            item["reasoning_content"] = thought  # the name Qwen3's and DeepSeek's templates read
        for key in ("tool_call_id", "name"):
            value = getattr(message, key, None)
            if isinstance(value, str):
                item[key] = value
        result.append(item)
    return result, remote, images


def _check_tool_results(messages: Sequence[p.ChatMessage]) -> None:
    """Each tool message answers a call of the assistant message before it (tool messages
    between them), as OpenAI's and Anthropic's APIs require: a result for no call was
    rendered as if answering one, and the model read a conversation that never happened."""
    calls: set[str] = set()  # the ids the results that follow may answer
    for index, message in enumerate(messages):
        role = message.__struct_config__.tag
        if role == "tool":
            answered = getattr(message, "tool_call_id", None)
            if answered not in calls:
                raise BadRequestError(
                    f"a tool result for call {answered!r}, which the assistant message before it did not make "
                    "(a tool result follows the message with its tool call)",
                    param=f"messages[{index}].tool_call_id",
                )
            continue
        made = getattr(message, "tool_calls", None) if role == "assistant" else None
        calls = {call.id for call in made} if isinstance(made, list) else set()


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
    for (parts, position, image), data in zip(remote, fetched, strict=True):
        if not await asyncio.to_thread(_looks_like_an_image, data):
            # The same answer as a failed fetch: "not an image" would tell the caller that the
            # allowed host answered 200 there (which paths and ports serve what: the log's).
            logger.info("image fetch %s: not an image format Pillow reads", image.url)
            raise BadRequestError("the image could not be fetched", param=image.where)
        parts[position] = ImageInput(data)


def _looks_like_an_image(data: bytes) -> bool:
    """Whether Pillow recognises ``data``'s header (nothing is decoded here)."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)):
            return True
    except (OSError, ValueError, Image.DecompressionBombError):
        return False


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
        comma = url.find(",", 5)  # not partition: that copies the whole text after it
        media_type = url[5:comma] if comma >= 0 else ""
        if not media_type.endswith(";base64"):
            raise BadRequestError("an image data URL must look like data:image/png;base64,...", param=where)
        if media_type.split(";")[0] not in ("", "image") and not media_type.startswith("image/"):
            raise BadRequestError(f"the data URL holds {media_type.split(';')[0]!r}, not an image", param=where)
        return ImageInput(decode_base64(url, where, comma + 1))
    try:
        parsed = urllib.parse.urlsplit(url)
        hostname = parsed.hostname
    except ValueError as exc:  # a malformed host or port
        raise BadRequestError(f"the image URL is malformed: {exc}", param=where) from exc
    if parsed.scheme not in ("http", "https"):
        raise BadRequestError("an image URL must be a data: URL (or http(s) where allowed)", param=where)
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError as exc:  # a port out of range
        raise BadRequestError(f"the image URL is malformed: {exc}", param=where) from exc
    if not any(_allows(entry, hostname, port) for entry in config.image_url_hosts):
        raise BadRequestError(
            f"this server does not fetch images from {hostname!r}: send the image inline as a data: URL "
            "(remote hosts must be allowed with image_url_hosts / --allow-image-host)",
            param=where,
        )
    return _RemoteImage(url, where)


def _allows(entry: str, hostname: str | None, port: int) -> bool:
    """Whether an ``image_url_hosts`` entry allows ``hostname`` at ``port``: ``HOST`` any
    port of it, ``HOST:PORT`` (``[IPV6]:PORT``) that port only."""
    allowed = urllib.parse.urlsplit(f"//{entry}")
    return allowed.hostname == (hostname or "").lower() and allowed.port in (None, port)


def decode_base64(data: str, where: str, start: int = 0) -> bytes:
    """``data[start:]`` decoded as ``base64.b64decode(..., validate=True)`` would (only the
    alphabet, padding only at the end), :data:`_PIECE` characters a call: in a worker
    thread, the event loop has the GIL between two. A 400 naming ``where`` if it is not
    base64."""
    end = len(data)  # where the padding at the end starts, found a piece at a time
    while end > start and data[end - 1] == "=":
        low = max(start, end - _PIECE)
        kept = data[low:end].rstrip("=")
        end = low + len(kept)
        if kept:
            break
    # Strict mode takes any padding after a whole group, so that is left out; otherwise the
    # last piece holds it, for binascii to judge (past four, refused here without a copy).
    stop = end if end > start and (end - start) % 4 == 0 else len(data)
    pieces: list[bytes] = []
    try:
        if stop - end > 4:
            raise binascii.Error("too much padding")
        for at in range(start, stop, _PIECE):
            piece = data[at : min(at + _PIECE, stop)]
            if piece.endswith("=") and at + _PIECE < stop:  # padding, then more of the text
                raise binascii.Error("padding before the end")
            pieces.append(binascii.a2b_base64(piece, strict_mode=True))
    except (binascii.Error, ValueError):  # ValueError: a character outside ASCII
        raise BadRequestError("not valid base64", param=where) from None
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


async def adecode_base64(data: str, where: str) -> bytes:
    """:func:`decode_base64`, in a worker thread when ``data`` is long."""
    if len(data) > _OFF_LOOP_CHARS:
        return await anyio.to_thread.run_sync(decode_base64, data, where, limiter=one_at_a_time())
    return decode_base64(data, where)


@functools.cache
def _tls_context() -> ssl.SSLContext:
    import httpx

    return httpx.create_ssl_context()


_READ_BYTES = 4 << 10
"""Bytes one network read of an image fetch takes at most: h11 parses all a read brought
before the event loop has its turn again (64 KiB of interim ``102`` answers: 56 ms)."""

_HEAD_BYTES = 1 << 20
"""Bytes a fetch may read beyond the image's limit: its status line and headers."""


def _image_pool(limit: int) -> httpcore.AsyncConnectionPool:
    """A connection pool for one image fetch, made on a worker thread (the TLS context loads
    the certificate authorities' bundle once, 30-70 ms of the GIL; the imports and the first
    pool's set-up another 30-90 ms). Its connections read a paced, counted piece at a time
    (see :func:`_paced_backend`)."""
    import httpcore

    return httpcore.AsyncConnectionPool(ssl_context=_tls_context(), network_backend=_paced_backend()(limit))


@functools.cache
def _paced_backend() -> Callable[[int], httpcore.AsyncNetworkBackend]:
    """httpcore's network backend whose connections read at most ``_READ_BYTES`` at a time,
    give the event loop its turn after each read, and stop past ``limit`` plus ``_HEAD_BYTES``
    bytes in all (status line, headers, interim answers and body; a TLS stream shares its
    connection's count). A host answering a million interim ``102 Processing`` responses
    (fourteenth probe of issue 45) had httpcore parse them in one go: /health 1.4-1.6 s with
    eight such images. Made at the first remote fetch: httpcore stays out of start-up."""
    import httpcore

    class PacedStream(httpcore.AsyncNetworkStream):
        def __init__(self, stream: httpcore.AsyncNetworkStream, left: list[int]) -> None:
            self._stream, self._left = stream, left

        async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            data = await self._stream.read(min(max_bytes, _READ_BYTES), timeout)
            self._left[0] -= len(data)
            if self._left[0] < 0:
                raise httpcore.ReadError("the host sent more bytes than an image may have")
            await asyncio.sleep(0)
            return data

        async def write(self, buffer: bytes, timeout: float | None = None) -> None:
            await self._stream.write(buffer, timeout)

        async def aclose(self) -> None:
            await self._stream.aclose()

        async def start_tls(
            self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
        ) -> httpcore.AsyncNetworkStream:
            return PacedStream(await self._stream.start_tls(ssl_context, server_hostname, timeout), self._left)

        def get_extra_info(self, info: str) -> Any:
            return self._stream.get_extra_info(info)

    class PacedBackend(httpcore.AsyncNetworkBackend):
        def __init__(self, limit: int) -> None:
            self._backend, self._limit = httpcore.AnyIOBackend(), limit

        async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
            return PacedStream(await self._backend.connect_tcp(*args, **kwargs), [self._limit + _HEAD_BYTES])

        async def sleep(self, seconds: float) -> None:
            await self._backend.sleep(seconds)

    return PacedBackend


async def _fetch_image(url: str, where: str, limit: int) -> bytes:
    """An allowed remote image, at most ``limit`` bytes, without following redirects (a
    redirect could lead anywhere, defeating the allow-list). Every failure is one answer:
    which ports are open and which paths exist is no caller's business (the log says why).
    A content coding is undone here, a piece at a time, each counted (:mod:`._inflate`):
    httpx's own decoding made 2 GiB of a 32 KB zstd answer before the size check."""
    pool = await asyncio.to_thread(_image_pool, limit)
    import httpcore  # imported by _image_pool, off the event loop (only for --allow-image-host)

    timeouts = {"connect": 10.0, "read": 10.0, "write": 10.0, "pool": 10.0}
    headers: list[tuple[bytes | str, bytes | str]] = [("Accept-Encoding", ACCEPT_ENCODING)]
    try:
        async with pool, pool.stream("GET", url, headers=headers, extensions={"timeout": timeouts}) as response:
            if response.status != 200:
                logger.info("image fetch %s: HTTP %d", url, response.status)
                raise BadRequestError("the image could not be fetched", param=where)
            codings = [value for name, value in response.headers if name.lower() == b"content-encoding"]
            inflater = Inflater(b", ".join(codings).decode("latin-1"))
            body = bytearray()
            async for chunk in response.aiter_stream():
                for piece in inflater.pieces(chunk):
                    body += piece
                    if len(body) > limit:
                        raise BadRequestError(f"the image is larger than {limit} bytes", param=where)
            return bytes(body)
    except (
        httpcore.TimeoutException,
        httpcore.NetworkError,
        httpcore.ProtocolError,
        httpcore.UnsupportedProtocol,
        CodingError,
    ) as exc:
        logger.info("image fetch %s: %s", url, exc)
        raise BadRequestError("the image could not be fetched", param=where) from exc
