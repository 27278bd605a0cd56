"""`POST /v1/audio/transcriptions` through a real server, with the openai SDK and ours."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import soundfile
from audio import TINY_WHISPER, tone_wav
from ortserve_client import AsyncClient, BadRequestError
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, rss_growth, running, watched


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = ServerConfig(models={"whisper": TINY_WHISPER, "tiny": TINY_MODEL}, max_body_size=200_000)
    with running(create_app(config)) as base:
        yield base


def test_each_response_format(client: openai.OpenAI) -> None:
    audio = ("tone.wav", tone_wav(1.0))
    as_json = client.audio.transcriptions.create(model="whisper", file=audio)
    assert as_json.text
    as_text = client.audio.transcriptions.create(model="whisper", file=audio, response_format="text")
    assert as_text.strip() == as_json.text
    # No language given: the model detects one, and names it.
    verbose = client.audio.transcriptions.create(model="whisper", file=audio, response_format="verbose_json")
    named = client.audio.transcriptions.create(model="whisper", file=audio, language=verbose.language)
    assert named.text == as_json.text
    # verbose_json, srt and vtt decode with Whisper's timestamps: timed segments.
    assert verbose.duration == 1.0 and verbose.segments
    assert verbose.text == " ".join(s.text for s in verbose.segments)
    assert verbose.segments[0].start <= 1.0
    for segment, after in zip(verbose.segments, verbose.segments[1:], strict=False):
        assert segment.start <= segment.end <= after.start
    cues = [s for s in verbose.segments if s.text]
    srt = client.audio.transcriptions.create(model="whisper", file=audio, response_format="srt")
    assert srt == "\n".join(
        f"{n}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n" for n, s in enumerate(cues, start=1)
    )
    vtt = client.audio.transcriptions.create(model="whisper", file=audio, response_format="vtt")
    vtt_cues = "".join(f"\n{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n" for s in cues)
    assert vtt == "WEBVTT\n" + vtt_cues


def _clock(seconds: float, separator: str) -> str:
    millis = round(seconds * 1000)
    hours, minutes, secs = millis // 3_600_000, millis // 60_000 % 60, millis // 1000 % 60
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis % 1000:03d}"


def test_language_and_prompt_are_used(client: openai.OpenAI) -> None:
    audio = ("tone.wav", tone_wav(1.0))
    plain = client.audio.transcriptions.create(model="whisper", file=audio).text
    prompted = client.audio.transcriptions.create(model="whisper", file=audio, prompt="Earlier words").text
    german = client.audio.transcriptions.create(model="whisper", file=audio, language="de").text
    assert len({plain, prompted, german}) > 1
    # Text that spells a special token would be that token to og's processor (sixteenth probe).
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.transcriptions.create(model="whisper", file=audio, prompt="say <|en|> then <|0.00|>")
    assert refused.value.body["param"] == "prompt" and "<|en|>" in refused.value.body["message"]  # type: ignore[index]
    client.audio.transcriptions.create(model="whisper", file=audio, prompt="a <|plain|> text")  # no such token


@pytest.mark.timing  # /health's latency meanwhile: run apart (see the README's test command)
def test_a_prompt_too_long_for_the_decoder_is_refused_untokenized(url: str, client: openai.OpenAI) -> None:
    # Issue 45, seventh probe: a 1 MB prompt was tokenized (the worker, holding the GIL, and
    # og's processor) before "the prompt leaves no room": /health 443-616 ms. Now refused by
    # its length (448 positions, tokens of at most 33 characters) before any tokenizer sees it.
    audio = ("tone.wav", tone_wav(0.3))
    with watched(url) as seen, pytest.raises(openai.BadRequestError) as refused:
        client.audio.transcriptions.create(model="whisper", file=audio, prompt="hello " * 30_000)
    assert refused.value.body is not None
    assert refused.value.body["param"] == "prompt"  # type: ignore[index]
    assert "180000 characters, more than this model's 448 tokens" in refused.value.message
    seen.assert_within()
    # A prompt that fits is still taken, and one just over the decoder's room is told so.
    assert client.audio.transcriptions.create(model="whisper", file=audio, prompt="hello " * 50).text
    with pytest.raises(openai.BadRequestError, match="leaves no room"):
        client.audio.transcriptions.create(model="whisper", file=audio, prompt="hello " * 500)


def _wav_of_unknown_subformat(seconds: float) -> bytes:
    """8-bit 16 kHz silence in WAVE_FORMAT_EXTENSIBLE with a subformat GUID libsndfile does
    not know (onnxruntime-genai's decoder reads it: 1,000 s of it were transcribed for their
    first 30 s, answered 200; twenty-first probe, issue 45)."""
    data = b"\x80" * int(16_000 * seconds)
    extension = struct.pack("<HHI", 22, 8, 4) + bytes.fromhex("01000000000010008000000000000000")
    fmt = struct.pack("<HHIIHH", 0xFFFE, 1, 16_000, 16_000, 1, 8) + extension
    body = b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _flac_without_its_frames(frames: int) -> bytes:
    """A FLAC header (STREAMINFO: 16 kHz mono 16-bit, ``frames`` frames) and no frames: its
    read was libsndfile's "psf_fseek() failed", a 500 (twenty-third probe, issue 45)."""
    packed = (16_000 << 44) | (0 << 41) | (15 << 36) | frames
    info = struct.pack(">HH", 4096, 4096) + b"\0" * 6 + packed.to_bytes(8, "big") + b"\0" * 16
    return b"fLaC\x80" + len(info).to_bytes(3, "big") + info


@pytest.mark.parametrize(
    ("files", "data", "status", "param"),
    [
        ({"file": ("x.wav", b"not audio at all")}, {"model": "whisper"}, 400, "file"),
        ({"file": ("x.flac", _flac_without_its_frames(100))}, {"model": "whisper"}, 400, "file"),
        (
            {"file": ("x.flac", _flac_without_its_frames(16_000) + bytes(range(256)) * 4)},
            {"model": "whisper"},
            400,
            "file",
        ),
        ({"file": ("x.wav", _wav_of_unknown_subformat(5))}, {"model": "whisper"}, 400, "file"),
        ({"file": ("x.wav", tone_wav(0.3))}, {"model": "whisper", "language": "xx"}, 400, "language"),
        ({"file": ("x.wav", tone_wav(0.3))}, {"model": "whisper", "response_format": "xml"}, 400, "response_format"),
        ({"file": ("x.wav", tone_wav(0.3))}, {"model": "tiny"}, 400, "model"),
        ({"file": ("x.wav", tone_wav(0.3))}, {"model": "nope"}, 404, "model"),
        ({"notes": ("notes.txt", b"no audio here")}, {"model": "whisper"}, 400, "file"),
    ],
)
def test_bad_requests(url: str, files: dict[str, object], data: dict[str, str], status: int, param: str) -> None:
    response = httpx.post(f"{url}/v1/audio/transcriptions", files=files, data=data)  # type: ignore[arg-type]
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param or param in error["message"]


def test_a_flac_whose_header_leaves_its_length_open_is_told_so(url: str) -> None:
    """Twenty-seventh probe, issue 45: a FLAC written to a pipe (STREAMINFO's total samples
    0) was refused as lasting 576,460,752,303,424 s (libsndfile counts it 2^63 - 1 frames)."""
    import numpy as np
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(16_000, np.int16), 16_000, format="FLAC")
    flac = bytearray(buffer.getvalue())
    flac[21] &= 0xF0  # the low 36 bits of STREAMINFO's bytes 10-17: the total samples
    flac[22:26] = bytes(4)
    response = httpx.post(
        f"{url}/v1/audio/transcriptions", files={"file": ("x.flac", bytes(flac))}, data={"model": "whisper"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "file" and "header does not give its length" in error["message"], error
    # An MP3 frame header before noise: libsndfile's own words were "File does not exist or
    # is not a regular file (possibly a pipe?)".
    noise = bytes.fromhex("fffb9064") + bytes((i * 7919) % 251 for i in range(100_000))
    response = httpx.post(f"{url}/v1/audio/transcriptions", files={"file": ("x.mp3", noise)}, data={"model": "whisper"})
    assert response.status_code == 400 and "not audio libsndfile reads" in response.json()["error"]["message"]


def test_oversize_file_is_413(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/audio/transcriptions", files={"file": ("big.wav", tone_wav(8.0))}, data={"model": "whisper"}
    )
    assert response.status_code == 413


def test_audio_to_a_chat_model_is_refused(url: str) -> None:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}]}
        ],
    }
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "messages[0].content[0]"
    assert error["message"] == "model 'tiny' does not take audio"


def test_our_client_and_concurrency(url: str) -> None:
    async def run() -> list[str]:
        async with AsyncClient(f"{url}/v1") as client:
            results = await asyncio.gather(
                *(client.audio.transcriptions.create(model="whisper", file=tone_wav(0.5)) for _ in range(4))
            )
            text = await client.audio.transcriptions.create(model="whisper", file=tone_wav(0.5), response_format="text")
            verbose = await client.audio.transcriptions.create(
                model="whisper", file=("a.wav", tone_wav(0.5)), response_format="verbose_json"
            )
            assert verbose.duration == 0.5 and verbose.segments and text.strip() == results[0].text
            with pytest.raises(BadRequestError):
                await client.audio.transcriptions.create(model="whisper", file=b"garbage")
            return [r.text for r in results]

    texts = asyncio.run(run())
    assert len(set(texts)) == 1 and texts[0]


def _audio_part(seconds: float = 1.0) -> dict[str, object]:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(tone_wav(seconds)).decode(), "format": "wav"},
    }


def test_a_chat_with_audio_is_answered_with_its_transcription(client: openai.OpenAI) -> None:
    expected = client.audio.transcriptions.create(model="whisper", file=("tone.wav", tone_wav(1.0))).text
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "Transcribe this:"}, _audio_part()]}]
    reply = client.chat.completions.create(model="whisper", messages=messages)
    assert reply.choices[0].message.content == expected and reply.choices[0].finish_reason == "stop"
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="whisper", messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


@pytest.mark.parametrize(
    ("extra", "content", "param"),
    [
        ({}, [{"type": "text", "text": "no audio here"}], "messages"),
        ({}, [_audio_part(0.2), _audio_part(0.2)], "messages"),
        ({"n": 2}, [_audio_part(0.2)], "n"),
        ({"max_tokens": -1}, [_audio_part(0.2)], "max_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, [_audio_part(0.2)], "tools"),
        ({"reasoning_effort": "high"}, [_audio_part(0.2)], "reasoning_effort"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, [_audio_part(0.2)], "chat_template_kwargs"),
        ({}, [{"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}], "input_audio.data"),
        ({}, [{"type": "input_audio", "input_audio": {"data": "bm90IGF1ZGlv", "format": "wav"}}], "input_audio.data"),
    ],
)
def test_bad_audio_chats(url: str, extra: dict[str, object], content: list[object], param: str) -> None:
    body = {"model": "whisper", "messages": [{"role": "user", "content": content}], **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert param in response.json()["error"]["param"]


def test_telephone_rate_and_flac_audio(client: openai.OpenAI) -> None:
    # onnxruntime-genai alone refuses audio below 16 kHz ("only down-sampling supported").
    narrowband = client.audio.transcriptions.create(
        model="whisper", file=("call.wav", tone_wav(1.0, rate=8000)), response_format="verbose_json"
    )
    assert narrowband.text and narrowband.duration == 1.0
    samples, rate = soundfile.read(io.BytesIO(tone_wav(1.0)), dtype="int16")
    flac = io.BytesIO()
    soundfile.write(flac, samples, rate, format="FLAC")
    as_flac = client.audio.transcriptions.create(model="whisper", file=("a.flac", flac.getvalue()))
    as_wav = client.audio.transcriptions.create(model="whisper", file=("a.wav", tone_wav(1.0)))
    assert as_flac.text == as_wav.text  # the same samples, another container


def test_timestamp_granularities(client: openai.OpenAI) -> None:
    audio = ("a.wav", tone_wav(1.0))
    timed = client.audio.transcriptions.create(
        model="whisper", file=audio, response_format="verbose_json", timestamp_granularities=["segment"]
    )
    assert timed.segments
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.transcriptions.create(
            model="whisper", file=audio, response_format="verbose_json", timestamp_granularities=["word", "segment"]
        )
    assert refused.value.body == {
        "message": "word timestamps are not supported; segments are",
        "type": "invalid_request_error",
        "param": "timestamp_granularities",
        "code": None,
    }
    with pytest.raises(openai.BadRequestError) as other:  # taken and ignored before (sixteenth probe)
        client.audio.transcriptions.create(
            model="whisper",
            file=audio,
            response_format="verbose_json",
            timestamp_granularities=["xxx"],  # type: ignore[list-item]
        )
    assert other.value.body["param"] == "timestamp_granularities"  # type: ignore[index]
    for response_format in ("json", "text"):  # no timestamps in them: ignored before (seventeenth probe)
        with pytest.raises(openai.BadRequestError) as untimed:
            client.audio.transcriptions.create(
                model="whisper", file=audio, response_format=response_format, timestamp_granularities=["segment"]
            )
        assert untimed.value.body["param"] == "timestamp_granularities"  # type: ignore[index]
        assert "verbose_json" in untimed.value.body["message"]  # type: ignore[index]
    subtitles = client.audio.transcriptions.create(
        model="whisper", file=audio, response_format="srt", timestamp_granularities=["segment"]
    )
    assert "-->" in subtitles


@pytest.mark.parametrize("field", ["stream", "chunking_strategy", "include[]"])
def test_fields_we_cannot_honour_are_refused(url: str, field: str) -> None:
    data = {"model": "whisper", field: "true" if field == "stream" else "auto"}
    response = httpx.post(f"{url}/v1/audio/transcriptions", files={"file": ("a.wav", tone_wav(0.3))}, data=data)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field.removesuffix("[]")


@pytest.mark.timing  # a wall-clock bound: run apart
def test_a_hostile_sample_rate_is_refused_at_once_in_little_memory(url: str) -> None:
    """Issue 14: a 32 KB WAV whose header says 1 Hz took 104 s and 8.7 GB to refuse."""
    hostile = tone_wav(16_000.0, rate=1)
    assert len(hostile) < 33_000
    with rss_growth() as grown:  # the server runs in this process
        started = time.perf_counter()
        response = httpx.post(
            f"{url}/v1/audio/transcriptions", files={"file": ("x.wav", hostile)}, data={"model": "whisper"}
        )
        took = time.perf_counter() - started
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"
    assert "1 Hz" in response.json()["error"]["message"]
    assert took < 1.0 and grown[0] < 100 * 2**20, (took, grown[0])
