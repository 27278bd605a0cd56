"""``POST /v1/audio/speech``: text to speech with a voice model, as OpenAI defines it.

The audio is encoded as the voice speaks it, a sentence at a time, and its bytes leave as
each sentence is encoded (chunked, as OpenAI's do, whatever ``stream_format``): a WAV
declares an unknown length, as OpenAI's WAV does, and what is sent is not kept, so a long
text's audio is never held whole; with ``"sse"`` the same bytes travel as base64
``speech.audio.delta`` events, then ``speech.audio.done`` with the usage.

Formats are what libsndfile encodes: ``wav`` (16-bit), ``flac``, ``mp3``, ``opus`` (in
Ogg, at 24 kHz, a rate Opus takes) and ``pcm`` (raw 16-bit little-endian mono at 24 kHz,
OpenAI's contract for it); ``aac`` is refused by name. Streamed, FLAC is sent when
complete (its header holds the length, which readers trust) and an MP3 without the Info
frame LAME fills in at the end. Resampling (to 24 kHz) is
band-limited, by FFT, per sentence. Encoding runs in a worker thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import logging
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import numpy.typing as npt
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from litestar.response import Stream
from ortserve_client import protocol as p
from ortserve_runtime import InvalidRequestError, VoiceModel

from .._connection import while_connected
from .._errors import (
    BadRequestError,
    OverloadedError,
    ServerError,
    ShuttingDownError,
    UnsupportedParameterError,
    unavailable_detail,
)
from .._generation import error_detail, sse_event, stream_response
from .._leases import require_voice_model
from .._openapi import POST_ERRORS, sends_files, with_error_responses
from .._record import current, note
from .._state import OrtServe

__all__ = ["speech_route_handlers"]
logger = logging.getLogger("ortserve.server")

_MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
_SOUNDFILE = {"mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS"), "flac": ("FLAC", "PCM_16")}
_RESAMPLED = {"pcm": 24_000, "opus": 24_000}
"""Formats sent at a fixed rate (OpenAI's pcm is 24 kHz; Opus takes 8, 12, 16, 24, 48 kHz)."""
_HOP = 256
"""Samples per frame of Piper's VITS voices: ``output_tokens`` counts frames."""


def _resample(samples: npt.NDArray[np.float32], rate: int, to: int) -> npt.NDArray[np.float32]:
    if rate == to or not len(samples):
        return samples
    count = round(len(samples) * to / rate)
    spectrum = np.fft.rfft(samples)
    return (np.fft.irfft(spectrum, n=count) * (count / len(samples))).astype(np.float32)


def _pcm16(samples: npt.NDArray[np.float32]) -> bytes:
    return (np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def _wav_header(rate: int) -> bytes:
    """A 16-bit mono WAV header for a stream: RIFF and data sizes 0xFFFFFFFF (a length not
    known yet), as OpenAI's WAV declares; readers take the data to the end of the file."""
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


_MP3_KBPS = {
    3: (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),  # MPEG-1
    2: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # MPEG-2
    0: (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),  # MPEG-2.5
}
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}


def _mp3_frame_length(data: bytes) -> int | None:
    """The length of the Layer III frame ``data`` starts with (``None``: not all there yet)."""
    if len(data) < 4 or data[0] != 0xFF or data[1] & 0xE0 != 0xE0:
        return None if len(data) < 4 else 0
    version = (data[1] >> 3) & 3
    kbps = _MP3_KBPS.get(version, _MP3_KBPS[2])[data[2] >> 4]
    rate = _MP3_RATES.get(version, _MP3_RATES[2])[min((data[2] >> 2) & 3, 2)]
    padding = (data[2] >> 1) & 1
    length = (144 if version == 3 else 72) * kbps * 1000 // rate + padding
    return length if len(data) >= length else None


class _Unsent:
    """The file libsndfile writes a streamed MP3 or Opus into, holding only the bytes not
    sent yet: :meth:`take` hands them out and forgets them. A write into what was already
    sent (LAME's Info frame, filled in at the end) is dropped, as it could not be sent again."""

    def __init__(self) -> None:
        self.start = 0
        """The file offset of ``kept[0]``: everything before it was taken."""
        self.kept = bytearray()
        self.position = 0

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.start + len(self.kept)}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, count: int) -> bytes:
        begin = max(self.position - self.start, 0)
        data = bytes(self.kept[begin : begin + count]) if self.position >= self.start else b""
        self.position += len(data)
        return data

    def write(self, data: bytes) -> int:
        skip = max(self.start - self.position, 0)
        if skip < len(data):
            begin = self.position + skip - self.start
            if begin > len(self.kept):
                self.kept.extend(bytes(begin - len(self.kept)))
            self.kept[begin : begin + len(data) - skip] = data[skip:]
        self.position += len(data)
        return len(data)

    def peek(self) -> bytes:
        return bytes(self.kept)

    def take(self, count: int | None = None) -> bytes:
        """The first ``count`` unsent bytes (all of them: ``None``), now sent."""
        count = len(self.kept) if count is None else count
        data = bytes(self.kept[:count])
        del self.kept[:count]
        self.start += count
        return data


class _Encoder:
    """An audio file in ``fmt``, written a sentence at a time: :meth:`feed` returns the
    bytes ready to send, :meth:`close` the rest. Nothing is kept once a piece's bytes are
    returned (a WAV's header, sent first, declares an unknown length), so a long text's
    audio is never held whole; only FLAC is, compressed, as it goes out at the end."""

    def __init__(self, fmt: str, rate: int) -> None:
        self.fmt = fmt
        self.source_rate = rate
        self.rate = _RESAMPLED.get(fmt, rate)
        self.buffer: io.BytesIO | _Unsent = io.BytesIO() if fmt == "flac" else _Unsent()
        self.sent = 0
        self.file: Any = None
        if fmt in _SOUNDFILE:
            import soundfile

            container, subtype = _SOUNDFILE[fmt]
            # MP3 at a constant bitrate: a streamed one lacks the Info frame (see
            # _new_bytes), and readers then reckon its length from the first frame's rate.
            self.file = soundfile.SoundFile(
                self.buffer,
                "w",
                samplerate=self.rate,
                channels=1,
                format=container,
                subtype=subtype,
                compression_level=0.5 if fmt == "mp3" else None,  # soundfile sets the mode only with a level
                bitrate_mode="CONSTANT" if fmt == "mp3" else None,
            )

    def feed(self, samples: npt.NDArray[np.float32]) -> bytes:
        samples = _resample(samples, self.source_rate, self.rate)
        if self.file is None:  # wav, pcm
            data = _pcm16(samples)
            if self.fmt == "wav" and not self.sent:
                data = _wav_header(self.rate) + data
            self.sent += len(data)
            return data
        self.file.write(samples)
        return self._new_bytes()

    def _new_bytes(self) -> bytes:
        if isinstance(self.buffer, io.BytesIO):  # FLAC
            return b""  # sent whole at the end: its header holds the length, which readers trust
        if self.sent == 0 and self.fmt == "mp3":
            # LAME's first frame is a placeholder that the end fills with the Info tag (the
            # frame count); sent early it would stay empty, and readers would trust it. A
            # streamed MP3 goes without it: readers count its frames.
            skip = _mp3_frame_length(self.buffer.peek())
            if skip is None:
                return b""  # not all of the first frame yet
            self.sent = len(self.buffer.take(skip))
        new: bytes = self.buffer.take()
        self.sent += len(new)
        return new

    def close(self) -> bytes:
        """The last bytes of a streamed file (an MP3's header, filled in at the end, is not
        sent again); a FLAC file whole."""
        if self.file is None:
            return b""
        self.file.close()
        if isinstance(self.buffer, io.BytesIO):  # FLAC
            return self.buffer.getvalue()
        return self._new_bytes()


def _check(data: p.SpeechRequest, model: VoiceModel) -> str | None:
    """Refuse what cannot be honoured, naming the field; the voice asked for."""
    if isinstance(data.instructions, str) and data.instructions:
        raise UnsupportedParameterError(
            "'instructions' is not supported: the voices here do not follow instructions", param="instructions"
        )
    if data.response_format == "aac":
        raise UnsupportedParameterError(
            "response_format 'aac' cannot be encoded by this server (libsndfile has no AAC encoder); "
            "use mp3, opus, flac, wav or pcm",
            param="response_format",
        )
    voice = data.voice
    if isinstance(voice, dict):  # OpenAI's custom voice object: {"id": "voice_..."}
        voice = voice.get("id") if isinstance(voice.get("id"), str) else None
        if voice is None:
            raise BadRequestError('voice must be a voice name or {"id": name}', param="voice")
    voice = voice if isinstance(voice, str) else None
    model.check(data.input, voice, data.speed)
    return voice


@post(
    "/audio/speech",
    status_code=200,
    summary="Speak text (voice models)",
    responses=with_error_responses(bytes, "The audio file, in response_format", *POST_ERRORS),
    operation_class=sends_files(
        tuple(_MEDIA_TYPES.values()),
        "with stream_format sse: `data: <event JSON>` lines, speech.audio.delta events then speech.audio.done",
    ),
)
async def create_speech(
    data: JSONBody[p.SpeechRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[Any]:
    model = await require_voice_model(ortserve, data.model)
    if model.queued >= ortserve.config.max_queued:
        raise OverloadedError(
            f"model {data.model!r} has {model.queued} requests waiting; try again shortly", headers={"Retry-After": "1"}
        )
    record = current()
    sentence = 0

    def synthesized(chunk: Any, since: float) -> None:
        """A sentence's span (tracing only): the voice's time on it, its phonemes and audio."""
        nonlocal sentence
        sentence += 1
        if record is not None:
            seconds = len(chunk.samples) / model.sample_rate
            attributes = {"ortserve.sentence": sentence, "ortserve.phonemes": chunk.phonemes}
            record.timed("speech_sentence", since, {**attributes, "ortserve.audio_seconds": round(seconds, 3)})

    try:
        voice = _check(data, model)
        chunks = model.synthesize(data.input, voice=voice, speed=data.speed)
        since = time.perf_counter()
        # The phonemizer's refusals are HTTP errors. A client that leaves meanwhile gives its
        # place in the queue back at once (twenty-third probe, issue 45: it held it until its
        # first sentence was spoken, and others were refused as over the queue's bound).
        first = await while_connected(request, ortserve, anext(chunks))
        synthesized(first, since)
    except InvalidRequestError as exc:
        raise BadRequestError(str(exc), param=exc.param) from exc
    encoder = _Encoder(data.response_format, model.sample_rate)
    endpoint = f"{ortserve.config.path}/audio/speech"
    usage = [first.phonemes, len(first.samples) // _HOP]
    failed: list[Exception] = []

    async def encoded() -> AsyncIterator[bytes]:
        """The audio as it is made; a failure once it has begun (the voice unloaded or its
        process gone, a shutdown's grace period over: twenty-third and twenty-fourth probes,
        an unhandled error that cut the connection) ends it early, in ``failed``, logged and
        counted."""
        try:
            yield await asyncio.to_thread(encoder.feed, first.samples)
            with ortserve.cut_signal() as cut:
                while True:
                    since = time.perf_counter()
                    try:
                        chunk = await _next_unless_cut(chunks, cut)
                    except StopAsyncIteration:
                        break
                    synthesized(chunk, since)
                    usage[0] += chunk.phonemes
                    usage[1] += len(chunk.samples) // _HOP
                    yield await asyncio.to_thread(encoder.feed, chunk.samples)
            yield await asyncio.to_thread(encoder.close)
            ortserve.metrics.count_request(endpoint, data.model, 200)
            note(model=data.model)
        except Exception as exc:  # after the status was sent: ended here, said below
            failed.append(exc)
            with contextlib.suppress(Exception):  # its file closed here, not by a finalizer (that logs)
                await asyncio.to_thread(encoder.close)
            known = isinstance(exc, ServerError) or unavailable_detail(exc) is not None
            logger.log(
                logging.WARNING if known else logging.ERROR,
                "speech from model %r ended early: %s",
                data.model,
                exc,
                exc_info=not known,
            )
            if isinstance(exc, ShuttingDownError):
                ortserve.cut_requests += 1
            status = exc.status_code if isinstance(exc, ServerError) else 503 if known else 500
            ortserve.metrics.count_request(endpoint, data.model, status)
        finally:
            await chunks.aclose()

    if data.stream_format == "sse":

        async def events() -> AsyncIterator[bytes]:
            async for piece in encoded():
                if piece:
                    delta = p.SpeechAudioDeltaEvent(audio=base64.b64encode(piece).decode())
                    yield sse_event(delta)
            if failed:  # in band, as a chat stream's error
                yield sse_event(p.ErrorResponse(error=error_detail(failed[0])))
                return
            done = p.SpeechAudioDoneEvent(usage=p.SpeechUsage(usage[0], usage[1], usage[0] + usage[1]))
            yield sse_event(done)

        return stream_response(events())
    # As OpenAI, the audio goes out as it is made (chunked), whatever the format.
    return Stream(encoded(), media_type=_MEDIA_TYPES[data.response_format])


async def _next_unless_cut(chunks: AsyncIterator[Any], cut: asyncio.Future[None]) -> Any:
    """The next piece of ``chunks``, or :class:`ShuttingDownError` once ``cut`` resolves."""
    piece = asyncio.ensure_future(anext(chunks))
    await asyncio.wait((piece, cut), return_when=asyncio.FIRST_COMPLETED)
    if not piece.done():
        piece.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await piece
        raise ShuttingDownError("the server is shutting down; the speech was cut off")
    return piece.result()


speech_route_handlers = [create_speech]
