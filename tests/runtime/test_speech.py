"""The speech model (tiny random Whisper built from the real Whisper tokenizer)."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
import soundfile
from audio import TINY_WHISPER, tone_wav
from ortserve_runtime import InvalidRequestError, ModelConfig, ModelRegistry, SpeechModel, detect_model_kind
from serving import rss_growth

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # one event loop for the module, so that its tests share one loaded model


@pytest.fixture(scope="module")
async def whisper() -> AsyncIterator[SpeechModel]:
    """Loaded once for the module (0.8 s a load): every test leaves it idle, as it found it."""
    registry = ModelRegistry()
    registry.add("whisper", TINY_WHISPER)
    model: SpeechModel = await registry.get("whisper")
    yield model
    await registry.close()


def test_recognised_as_speech() -> None:
    assert detect_model_kind(TINY_WHISPER) == "speech"


async def test_transcribes_deterministically(whisper: SpeechModel) -> None:
    first = await whisper.transcribe(tone_wav(1.0), max_tokens=12)
    again = await whisper.transcribe(tone_wav(1.0), max_tokens=12)
    assert first == again
    assert first.text and first.tokens == 12 and first.duration == 1.0
    other = await whisper.transcribe(tone_wav(1.0, hertz=150.0), max_tokens=12)
    assert other.text != first.text  # the audio reaches the model


async def test_language_is_detected_when_not_given(whisper: SpeechModel) -> None:
    detected = await whisper.transcribe(tone_wav(1.0), max_tokens=8)
    assert len(detected.language) in (2, 3) and detected.language.isalpha()  # an ISO 639 code
    # Detection picks the language token; transcribing in that language gives the same.
    assert await whisper.transcribe(tone_wav(1.0), language=detected.language, max_tokens=8) == detected
    other = "de" if detected.language != "de" else "fr"
    assert (await whisper.transcribe(tone_wav(1.0), language=other, max_tokens=8)).language == other


async def test_concurrent_requests_all_complete(whisper: SpeechModel) -> None:
    alone = await whisper.transcribe(tone_wav(0.5), max_tokens=6)
    together = await asyncio.gather(*(whisper.transcribe(tone_wav(0.5), max_tokens=6) for _ in range(4)))
    assert together == [alone] * 4


async def test_cancelled_request_leaves_the_queue(whisper: SpeechModel) -> None:
    tasks = [asyncio.create_task(whisper.transcribe(tone_wav(2.0))) for _ in range(3)]
    await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert (await whisper.transcribe(tone_wav(0.5), max_tokens=3)).tokens == 3


@pytest.mark.parametrize(
    ("audio", "options", "param"),
    [
        (b"", {}, "file"),
        (b"definitely not audio", {}, "file"),
        (b"RIFF\x00\x00\x00\x00WAVEfmt ", {}, "file"),
        (tone_wav(0.2), {"language": "xx"}, "language"),
        (tone_wav(0.2), {"temperature": 3.0}, "temperature"),
    ],
)
async def test_bad_input(whisper: SpeechModel, audio: bytes, options: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await whisper.transcribe(audio, **options)  # type: ignore[arg-type]
    assert info.value.param == param
    assert (await whisper.transcribe(tone_wav(0.2), max_tokens=2)).tokens == 2  # still serving


async def test_timestamp_rules_and_segments(whisper: SpeechModel) -> None:
    """Whisper's rules on the logits, and segments read from the tokens."""
    begin, end = whisper._timestamp_begin, whisper._end_of_text
    text_token, one_second = 400, begin + 50

    def allowed(tokens: list[int], text_logit: float = 10.0) -> set[int]:
        logits = np.zeros(whisper.tokenizer.get_vocab_size(), dtype=np.float32)
        logits[:begin] = text_logit  # text likelier than any one timestamp
        return {int(i) for i in np.flatnonzero(np.isfinite(whisper._allowed(logits, tokens, timestamps=True)))}

    assert allowed([]) == set(range(begin, one_second + 1))  # opens with a timestamp within 1 s
    assert allowed([begin + 10]) <= set(range(end + 1))  # then text (or the end)
    after_text = allowed([begin + 10, text_token])
    assert end in after_text and begin + 11 in after_text and begin + 10 not in after_text  # time moves on
    assert after_text <= set(range(begin + 11, begin + 1501)) | set(range(end + 1))  # or more text
    # When the timestamps together outweigh every text token, the segment ends.
    assert allowed([begin + 10, text_token], text_logit=0.0) == set(range(begin + 11, begin + 1501))
    closed = allowed([begin + 10, text_token, begin + 60])
    assert closed == set(range(begin + 60, begin + 1501)) | {end}  # the next opens, or the end
    assert allowed([begin + 10, text_token, begin + 60, begin + 60]) <= set(range(end + 1))
    no_times = np.zeros(whisper.tokenizer.get_vocab_size(), dtype=np.float32)
    assert not np.isfinite(whisper._allowed(no_times, [], timestamps=False)[begin:]).any()

    clamped = whisper._segments([begin, text_token, begin + 1000], 0.0, 2.5)  # 20 s into 2.5 s of audio
    assert [(s.start, s.end) for s in clamped] == [(0.0, 2.5)]
    tokens = [begin, text_token, begin + 60, begin + 60, text_token, text_token]
    first, last = whisper._segments(tokens, 30.0, 52.5)  # the second window of the audio
    assert (first.start, first.end, first.tokens) == (30.0, 31.2, [text_token])
    assert (last.start, last.end, last.tokens) == (31.2, 52.5, [text_token, text_token])  # unfinished: to the end


async def test_timestamps_give_ordered_segments(whisper: SpeechModel) -> None:
    timed = await whisper.transcribe(tone_wav(2.0), timestamps=True, max_tokens=40)
    assert timed.segments and timed.segments[0].start <= 1.0
    assert timed.text == " ".join(s.text for s in timed.segments)
    for segment, after in zip(timed.segments, timed.segments[1:], strict=False):
        assert segment.start <= segment.end <= after.start


async def test_long_audio_goes_window_by_window(whisper: SpeechModel) -> None:
    audio = tone_wav(70.0, rate=8000)  # three of Whisper's 30-second windows
    plain = await whisper.transcribe(audio)
    assert plain.duration == 70.0
    assert [(s.start, s.end) for s in plain.segments] == [(0.0, 30.0), (30.0, 60.0), (60.0, 70.0)]
    assert plain.text == " ".join(s.text for s in plain.segments)
    capped = await whisper.transcribe(audio, max_tokens=30)  # max_tokens counts across windows
    assert capped.tokens == 30 and len(capped.segments) == 1
    timed = await whisper.transcribe(audio, timestamps=True)
    starts = [s.start for s in timed.segments]
    assert starts == sorted(starts) and any(60.0 <= start <= 61.0 for start in starts)  # the third window opens


async def test_other_containers_report_their_duration(whisper: SpeechModel) -> None:
    samples, rate = soundfile.read(io.BytesIO(tone_wav(1.5)), dtype="int16")
    flac = io.BytesIO()
    soundfile.write(flac, samples, rate, format="FLAC")
    result = await whisper.transcribe(flac.getvalue(), max_tokens=4)
    assert result.duration == 1.5 and result.tokens == 4


async def test_a_short_clip_is_not_stuck_behind_a_long_recording(whisper: SpeechModel) -> None:
    recording = asyncio.create_task(whisper.transcribe(tone_wav(95.0, rate=8000)))  # four windows
    await asyncio.sleep(0.05)
    clip = await whisper.transcribe(tone_wav(1.0), max_tokens=4)
    assert clip.tokens == 4 and not recording.done()  # it took its turn between the recording's windows
    assert len((await recording).segments) == 4


def _stereo_wav(seconds: float, rate: int) -> bytes:
    mono, _ = soundfile.read(io.BytesIO(tone_wav(seconds, rate=rate)), dtype="int16")
    buffer = io.BytesIO()
    soundfile.write(buffer, np.stack([mono, mono // 2], axis=1), rate, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


@pytest.mark.parametrize(
    "audio", [tone_wav(31.0, rate=8000), tone_wav(31.0), tone_wav(31.0, rate=44100), _stereo_wav(31.0, 44100)]
)
async def test_speech_rates_go_window_by_window(whisper: SpeechModel, audio: bytes) -> None:
    """Telephone, Whisper's own and CD rates, mono and stereo: read a window at a time."""
    result = await whisper.transcribe(audio)
    assert result.duration == 31.0
    assert [(s.start, s.end) for s in result.segments] == [(0.0, 30.0), (30.0, 31.0)]
    assert all(s.tokens for s in result.segments)


@pytest.mark.timing  # a wall-clock bound: run apart (see the README's test command)
@pytest.mark.parametrize(
    ("audio", "words"), [(tone_wav(16_000.0, rate=1), "1 Hz"), (tone_wav(0.5, rate=3999), "3999 Hz")]
)
async def test_sample_rates_speech_is_never_recorded_at_are_refused(
    whisper: SpeechModel, audio: bytes, words: str
) -> None:
    """A 32 KB WAV whose header says 1 Hz was 4.4 hours of audio brought up to 16 kHz in
    float64 (8.7 GB, 104 s); it is refused from its header, at once and in little memory."""
    with rss_growth() as grown:
        started = time.perf_counter()
        with pytest.raises(InvalidRequestError) as info:
            await whisper.transcribe(audio)
        took = time.perf_counter() - started
    assert info.value.param == "file" and words in str(info.value)
    assert took < 1.0 and grown[0] < 100 * 2**20


async def test_audio_longer_than_the_limit_is_refused() -> None:
    registry = ModelRegistry(ModelConfig(max_audio_seconds=60))
    registry.add("whisper", TINY_WHISPER)
    model: SpeechModel = await registry.get("whisper")
    try:
        with pytest.raises(InvalidRequestError) as info:
            await model.transcribe(tone_wav(61.0, rate=8000))
        assert info.value.param == "file" and "at most 60 s" in str(info.value)
        assert (await model.transcribe(tone_wav(59.0, rate=8000), max_tokens=2)).duration == 59.0
    finally:
        await registry.close()


def test_threads_and_session_options_reach_whisper() -> None:
    """--threads and session options apply to Whisper's encoder and decoder (they were
    ignored): a malformed entry shows they arrive, since onnxruntime refuses it."""
    from ortserve_runtime import ModelLoadError

    asyncio.run(SpeechModel("whisper", TINY_WHISPER, ModelConfig(intra_op_threads=1)).close())  # loads
    with pytest.raises(ModelLoadError):
        SpeechModel("whisper", TINY_WHISPER, ModelConfig(session_options={"session.dynamic_block_base": "abc"}))
