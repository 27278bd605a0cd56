"""``POST /v1/audio/transcriptions``: speech to text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar import Request, Response, post
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency
from litestar.params import MultipartBody
from ortserve_client import protocol as p
from ortserve_runtime import (
    Segment,
)

from .._connection import while_connected
from .._errors import (
    BadRequestError,
)
from .._leases import require_speech_model
from .._openapi import POST_ERRORS, also_sends, with_error_responses
from .._record import note
from .._state import OrtServe

__all__ = ["transcriptions"]


@dataclass
class TranscriptionForm:
    """The multipart form of ``POST /v1/audio/transcriptions``."""

    model: str
    file: UploadFile | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0


_TRANSCRIPTION_FIELDS = {*TranscriptionForm.__dataclass_fields__, "timestamp_granularities[]"}


@post(
    "/audio/transcriptions",
    status_code=200,
    summary="Transcribe audio (speech-to-text models)",
    responses=with_error_responses(
        p.Transcription, "The transcript (verbose_json adds language, duration, segments)", *POST_ERRORS
    ),
    operation_class=also_sends("text/plain", "response_format text, srt or vtt"),
)
async def transcriptions(
    data: MultipartBody[TranscriptionForm], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[Any]:
    model = await require_speech_model(ortserve, data.model)
    if data.file is None:
        raise BadRequestError("'file' is required: the audio to transcribe, as a multipart file", param="file")
    form = await request.form()
    unknown = sorted(set(form) - _TRANSCRIPTION_FIELDS)
    if unknown:  # stream, chunking_strategy, include[]...: refused rather than ignored
        raise BadRequestError(f"'{unknown[0]}' is not supported by this server", param=unknown[0].removesuffix("[]"))
    # A list field in a form: the SDKs send "timestamp_granularities[]" once per value.
    granularities = form.getall("timestamp_granularities[]", [])
    if "word" in granularities:
        raise BadRequestError("word timestamps are not supported; segments are", param="timestamp_granularities")
    for granularity in granularities:  # another value was taken and ignored (sixteenth probe)
        if granularity != "segment":
            raise BadRequestError(
                f"timestamp_granularities: {str(granularity)[:40]!r} is not 'segment' or 'word'",
                param="timestamp_granularities",
            )
    if data.response_format not in ("json", "text", "verbose_json", "srt", "vtt"):
        raise BadRequestError(
            f"response_format {data.response_format!r} is not supported; use json, text, verbose_json, srt or vtt",
            param="response_format",
        )
    if granularities and data.response_format in ("json", "text"):
        # Their answer has no timestamps: taken and ignored (seventeenth probe, issue 45).
        raise BadRequestError(
            f"timestamp_granularities needs response_format verbose_json (or srt, vtt), not {data.response_format!r}",
            param="timestamp_granularities",
        )
    audio = await data.file.read()
    timed = data.response_format in ("verbose_json", "srt", "vtt")
    result = await while_connected(
        request,
        ortserve,
        model.transcribe(
            audio, language=data.language, prompt=data.prompt, temperature=data.temperature, timestamps=timed
        ),
    )
    ortserve.metrics.count_request(f"{ortserve.config.path}/audio/transcriptions", data.model, 200)
    ortserve.metrics.completion_tokens.labels(data.model).inc(result.tokens)
    note(model=data.model, output_tokens=result.tokens)
    if data.response_format == "text":
        return Response(result.text, media_type="text/plain")
    if data.response_format in ("srt", "vtt"):
        return Response(_subtitles(result.segments, data.response_format), media_type="text/plain")
    if data.response_format == "verbose_json":
        segments = [
            p.TranscriptionSegment(id=i, start=s.start, end=s.end, text=s.text, tokens=s.tokens)
            for i, s in enumerate(result.segments)
        ]
        verbose = p.TranscriptionVerbose(
            text=result.text, language=result.language, duration=result.duration, segments=segments
        )
        return Response(verbose)
    return Response(p.Transcription(text=result.text))


def _subtitles(segments: list[Segment], kind: str) -> str:
    """SubRip (numbered cues, ``00:00:01,500``) or WebVTT (``WEBVTT`` header, ``00:00:01.500``)."""

    def clock(seconds: float) -> str:
        millis = round(seconds * 1000)
        hours, millis = divmod(millis, 3_600_000)
        minutes, millis = divmod(millis, 60_000)
        secs, millis = divmod(millis, 1000)
        return f"{hours:02d}:{minutes:02d}:{secs:02d}{',' if kind == 'srt' else '.'}{millis:03d}"

    cues = [f"{clock(s.start)} --> {clock(s.end)}\n{s.text}\n" for s in segments if s.text]
    if kind == "srt":
        return "\n".join(f"{number}\n{cue}" for number, cue in enumerate(cues, start=1))
    return "WEBVTT\n\n" + "\n".join(cues)
