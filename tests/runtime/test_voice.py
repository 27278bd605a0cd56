"""Piper voices on onnxruntime against piper-tts's own synthesis, on a real voice."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from ortserve_runtime import InvalidRequestError, ModelConfig, ModelRegistry, VoiceModel
from voices import JOE, TEXT, quiet_voice

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def joe() -> VoiceModel:
    return VoiceModel("joe", JOE, ModelConfig())


async def _speak(model: VoiceModel, text: str, **options: object) -> list[np.ndarray]:
    return [chunk.samples async for chunk in model.synthesize(text, **options)]  # type: ignore[arg-type]


async def test_the_same_samples_as_piper_at_the_same_settings(joe: VoiceModel) -> None:
    from piper import PiperVoice, SynthesisConfig

    ours = await _speak(joe, TEXT, noise_scale=0.0, noise_w=0.0)
    reference = PiperVoice.load(next(JOE.glob("*.onnx")))
    settings = SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0, normalize_audio=False)
    theirs = [chunk.audio_float_array for chunk in reference.synthesize(TEXT, settings)]
    assert len(ours) == len(theirs) == 5  # a chunk per sentence
    for mine, piper in zip(ours, theirs, strict=True):
        assert mine.shape == piper.shape
        np.testing.assert_allclose(mine, piper, atol=1e-5)
    # At a slower speed the same sentences last longer (length_scale / speed).
    slower = await _speak(joe, "One sentence.", noise_scale=0.0, noise_w=0.0, speed=0.5)
    normal = await _speak(joe, "One sentence.", noise_scale=0.0, noise_w=0.0)
    assert 1.6 < len(slower[0]) / len(normal[0]) < 2.2  # durations round up to whole frames


async def test_noise_varies_the_audio_unless_switched_off(joe: VoiceModel, tmp_path: Path) -> None:
    first, second = await _speak(joe, "Same words."), await _speak(joe, "Same words.")
    assert first[0].shape != second[0].shape or not np.array_equal(first[0], second[0])
    quiet = VoiceModel("quiet", quiet_voice(tmp_path / "quiet"), ModelConfig())
    try:
        a, b = await _speak(quiet, "Same words."), await _speak(quiet, "Same words.")
        assert np.array_equal(a[0], b[0])
    finally:
        await quiet.close()


@pytest.mark.parametrize(
    ("text", "options", "param"),
    [
        ("   ", {}, "input"),
        ("x" * 4097, {}, "input"),
        ("Hi.", {"voice": "alloy"}, "voice"),
        ("Hi.", {"speed": 4.5}, "speed"),
        ("Hi.", {"speed": 0.1}, "speed"),
    ],
)
async def test_bad_input_names_the_field(joe: VoiceModel, text: str, options: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        await _speak(joe, text, **options)
    assert caught.value.param == param
    if param == "voice":
        assert "joe" in str(caught.value)


async def test_a_short_request_is_not_stuck_behind_a_long_one(joe: VoiceModel) -> None:
    """Requests take turns a sentence each: one sentence asked after twelve is done first."""
    done: list[str] = []

    async def speak(name: str, text: str) -> None:
        await _speak(joe, text)
        done.append(name)

    long = asyncio.create_task(speak("long", " ".join(["This sentence is one of many."] * 12)))
    await asyncio.sleep(0.05)
    await speak("short", "Short.")
    await long
    assert done == ["short", "long"]


async def test_a_listener_that_leaves_drops_the_rest(joe: VoiceModel) -> None:
    stream = joe.synthesize(" ".join(["This sentence is one of many."] * 40))
    await anext(stream)
    await stream.aclose()
    for _ in range(100):  # the worker finishes the sentence under way, then drops the rest
        if joe.active == 0:
            break
        await asyncio.sleep(0.05)
    assert joe.active == 0 and joe.queued == 0


async def test_a_listener_that_stops_reading_holds_the_voice_back(
    joe: VoiceModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker speaks at most two pieces beyond those its caller has taken: a client that
    stops reading holds those, not its whole text's audio (80 MB of samples for 4,096
    characters), and the voice's time goes to others."""
    spoken: list[int] = []
    speak = joe._speak

    def counted(job: Any, ids: list[int]) -> Any:
        spoken.append(len(ids))
        return speak(job, ids)

    monkeypatch.setattr(joe, "_speak", counted)
    stream = joe.synthesize(" ".join(["This sentence is one of many."] * 12))
    await anext(stream)
    for expected in (3, 4):  # the one taken and two ahead; then one more per piece taken
        await asyncio.sleep(1.5)  # 12 such sentences are spoken in about 2 s
        assert len(spoken) == expected
        await anext(stream)
    await stream.aclose()


async def test_the_registry_recognises_a_voice_folder() -> None:
    registry = ModelRegistry(ModelConfig())
    registry.add("joe", JOE)
    assert registry.kind("joe") == "voice"
    model = await registry.load("joe")
    assert isinstance(model, VoiceModel) and registry.status_of("joe").voices == ("joe",)
    await registry.close()


def test_a_sentence_too_long_for_one_call_is_cut_between_words(joe: VoiceModel) -> None:
    """Issue 45: 200 ZWJ emoji with no sentence break were 4,425 ids in one call of the
    graph (+1.5 GiB). A sentence past the call's limit is cut into pieces that hold it,
    between words; one under it stays whole, as piper-tts speaks it."""
    assert joe.phonemize(TEXT) == joe.phonemize(TEXT, max_ids=10**9)
    bos, pad, eos, space = (joe.id_map[marker][0] for marker in ("^", "_", "$", " "))
    text = "\U0001f468\u200d\U0001f469" * 200
    (whole,) = joe.phonemize(text, max_ids=10**9)
    for speed, limit in ((1.0, 400), (0.25, 100)):
        assert joe.call_ids(speed) == limit
        pieces = joe.phonemize(text, joe.call_ids(speed))
        assert len(pieces) >= len(whole) // limit and all(len(piece) <= limit for piece in pieces)
        assert all(piece[:2] == [bos, pad] and piece[-1] == eos for piece in pieces)
        assert [i for piece in pieces for i in piece[2:-1]] == whole[2:-1]  # nothing lost, nothing added
        assert all(piece[-3:-1] == [space, pad] for piece in pieces[:-1])  # after a word
    # No word break at all (espeak reads 300 x's as one word): cut at the limit.
    (whole,) = joe.phonemize("x" * 300, max_ids=10**9)
    pieces = joe.phonemize("x" * 300, max_ids=64)
    assert [len(piece) for piece in pieces] == [63] * 5 + [15]  # markers and 30 phonemes a piece
    assert [i for piece in pieces for i in piece[2:-1]] == whole[2:-1]


async def test_espeak_crashes_in_a_child_that_the_voice_outlives() -> None:
    """Sixteenth probe, issue 45: espeak-ng segfaults on ``"a." * 100`` (most runs). It runs
    in the voice's child process: the input is refused naming ``input`` (or spoken, when
    espeak got through), the next call gets a fresh child, and close() ends it."""
    model = VoiceModel("joe", JOE, ModelConfig())
    try:
        expected = model.phonemize(TEXT)
        for text in ("a." * 100, "a.b." * 50):
            try:
                model.phonemize(text)
            except InvalidRequestError as exc:
                assert exc.param == "input" and "espeak-ng crashed on it (SIGSEGV)" in str(exc)
        with pytest.raises(InvalidRequestError) as caught:  # what espeak itself refuses
            model.phonemize("Hi \ud800 there.")
        assert caught.value.param == "input" and "UnicodeEncodeError" in str(caught.value)
        assert model.phonemize(TEXT) == expected
        pid = model._phonemizer.pid
        assert pid is not None and pid != os.getpid()
    finally:
        await model.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
