"""``POST /v1/audio/speech`` through the openai SDK on a real voice (Piper's en_US-joe-medium,
without noise so that every request speaks the same samples)."""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running
from voices import TEXT, quiet_voice


@pytest.fixture(scope="module")
def voice_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quiet_voice(tmp_path_factory.mktemp("voice") / "joe")


@pytest.fixture(scope="module")
def url(voice_folder: Path) -> Iterator[str]:
    with running(create_app(ServerConfig(models={"joe": voice_folder, "tiny": TINY_MODEL}))) as base:
        yield base


@pytest.fixture(scope="module")
def reference(voice_folder: Path) -> np.ndarray:
    """piper-tts's own synthesis of TEXT with the same voice and settings, as 16-bit samples."""
    from piper import PiperVoice, SynthesisConfig

    voice = PiperVoice.load(next(voice_folder.glob("*.onnx")))
    settings = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0, normalize_audio=False)
    return np.concatenate([chunk.audio_int16_array for chunk in voice.synthesize(TEXT, settings)])


def _decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768, 24_000
    samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    return samples, rate


def test_wav_holds_the_samples_piper_speaks(client: openai.OpenAI, reference: np.ndarray) -> None:
    audio = client.audio.speech.create(model="joe", input=TEXT, voice="joe", response_format="wav")
    samples, rate = soundfile.read(io.BytesIO(audio.content), dtype="int16")
    assert rate == 22_050 and samples.shape == reference.shape
    assert int(np.abs(samples.astype(np.int32) - reference.astype(np.int32)).max()) <= 1  # rounding


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "pcm"])
def test_every_format_decodes_to_the_same_duration(client: openai.OpenAI, reference: np.ndarray, fmt: str) -> None:
    with client.audio.speech.with_streaming_response.create(
        model="joe", input=TEXT, voice="joe", response_format=fmt
    ) as response:
        assert response.headers["content-type"].startswith("audio/")
        data = response.read()
    samples, rate = _decode(data, fmt)
    expected = len(reference) / 22_050
    # MP3 adds the encoder's delay and padding (no Info frame in a stream to take them off).
    assert abs(len(samples) / rate - expected) < (0.1 if fmt == "mp3" else 0.01), fmt
    assert float(np.abs(samples).max()) > 0.1  # speech, not silence


def test_sse_events_carry_the_same_file_and_the_usage(client: openai.OpenAI, url: str) -> None:
    body = {"model": "joe", "input": TEXT, "voice": "joe", "response_format": "wav", "stream_format": "sse"}
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert {event["type"] for event in events[:-1]} == {"speech.audio.delta"} and len(events) > 3
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] > 50 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    data = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
    whole = client.audio.speech.create(model="joe", input=TEXT, voice="joe", response_format="wav").content
    assert data == whole
    samples, _ = soundfile.read(io.BytesIO(data))
    assert usage["output_tokens"] * 256 == len(samples)  # frames of 256 samples


@pytest.mark.timing
@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_the_first_bytes_leave_before_the_whole_text_is_spoken(url: str, stream_format: str) -> None:
    text = " ".join(f"This is sentence number {n}, spoken on its own." for n in range(8))
    body = {"model": "joe", "input": text, "response_format": "pcm", "stream_format": stream_format}
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=120) as response:
        for chunk in response.iter_bytes():
            if chunk and first is None:
                first = time.perf_counter() - started
    total = time.perf_counter() - started
    assert first is not None and first < total / 3, (first, total)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"response_format": "aac"}, "response_format", "cannot be encoded"),
        ({"response_format": "ogg"}, "response_format", "Invalid enum value 'ogg'"),
        ({"instructions": "Speak like a pirate"}, "instructions", "do not follow instructions"),
        ({"voice": "alloy"}, "voice", "voice 'alloy' is not one of model 'joe''s: joe"),
        ({"speed": 5}, "speed", "between 0.25 and 4.0"),
        ({"input": "x" * 4097}, "input", "more than the 4096 allowed"),
        ({"input": "  "}, "input", "input is empty"),
        ({"input": "Hi\u0000there."}, "input", "NUL character"),  # was a 500
        ({"stream_format": "chunks"}, "stream_format", "Invalid enum value 'chunks'"),
        ({"model": "tiny"}, "model", "is a generative model; use /v1/chat/completions"),
        ({"model": "nope"}, "model", "does not exist"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(url: str, body: dict[str, object], param: str, says: str) -> None:
    response = httpx.post(f"{url}/v1/audio/speech", json={"model": "joe", "input": "Hi.", **body}, timeout=30)
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_models_list_the_voices_and_chat_routes_send_voices_here(client: openai.OpenAI) -> None:
    joe = next(model for model in client.models.list().data if model.id == "joe")
    assert joe.kind == "voice" and joe.voices == ["joe"]  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="joe", messages=[{"role": "user", "content": "Hi"}])
    assert "is a voice model; use /v1/audio/speech" in caught.value.message
