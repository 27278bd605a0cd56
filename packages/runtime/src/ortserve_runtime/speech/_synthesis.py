"""Text-to-speech voices: Piper's VITS voices (``*.onnx`` with its ``*.onnx.json``) on
onnxruntime.

Text becomes phonemes through espeak-ng, the phonemizer Piper voices were trained with
(the bridge that ``piper-tts`` ships, the ``voice`` extra: GPL-3.0-or-later, so it is
optional), sentence by sentence; each sentence's phoneme ids run through the voice's
graph and its audio is handed back as soon as it is ready, so the first audio of a long
text leaves after its first sentence.

One worker thread runs the voice's session. The graph returns one waveform per batch with
no per-row lengths, so sentences run one at a time; concurrent requests take turns a
sentence each, so that a short request is not stuck behind a long one. A caller that
stops listening (a client gone) has its remaining sentences dropped. espeak-ng keeps
global state, so phonemizing is serialized across voices by one lock.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import unicodedata
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from .._config import ModelConfig
from .._errors import EngineClosedError, InvalidRequestError, ModelLoadError
from ..embeddings._encoder import create_session, read_json

__all__ = ["SpeechChunk", "VoiceModel", "find_voice_files"]

MAX_INPUT_CHARS = 4096
"""Characters a request may hold (OpenAI's limit for ``/v1/audio/speech``)."""
MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range
_BOS, _EOS, _PAD = "^", "$", "_"  # the markers of Piper's phoneme id maps
_ESPEAK_LOCK = threading.Lock()


def find_voice_files(folder: Path) -> tuple[Path, Path] | None:
    """The voice graph and its config (``x.onnx`` and ``x.onnx.json``) in ``folder``, if
    it holds exactly one such pair."""
    pairs = [(p, p.with_name(p.name + ".json")) for p in sorted(folder.glob("*.onnx"))]
    pairs = [(graph, config) for graph, config in pairs if config.exists()]
    return pairs[0] if len(pairs) == 1 else None


@dataclass(frozen=True, slots=True)
class SpeechChunk:
    """One sentence's audio: float samples in [-1, 1] at the voice's ``sample_rate``."""

    samples: npt.NDArray[np.float32]
    phonemes: int
    """Phoneme ids the sentence ran as (the input side of ``usage``)."""


@dataclass(eq=False)
class _Job:
    sentences: list[list[int]]
    speaker: int | None
    scales: npt.NDArray[np.float32]
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue[SpeechChunk | BaseException | None]
    cancelled: bool = False
    started: bool = field(default=False)


class VoiceModel:
    """A Piper voice (see the module docstring). ``voices`` names the speakers a request
    may pick: a multi-speaker voice's speaker names, else the voice's own name."""

    kind = "voice"

    def __init__(self, name: str, folder: Path, config: ModelConfig) -> None:
        self.name = name
        self.folder = folder
        found = find_voice_files(folder)
        if found is None:
            raise ModelLoadError(f"{folder} has no single voice (a *.onnx with its *.onnx.json)", path=folder)
        self.model_path, config_path = found
        settings = read_json(config_path)
        phoneme_type = settings.get("phoneme_type", "espeak")
        if phoneme_type != "espeak":
            raise ModelLoadError(
                f"{config_path}: phoneme_type {phoneme_type!r} is not served (espeak voices only)", path=config_path
            )
        try:
            self.sample_rate = int(settings["audio"]["sample_rate"])
            self.espeak_voice = str(settings["espeak"]["voice"])
            self.id_map: dict[str, list[int]] = {k: list(v) for k, v in settings["phoneme_id_map"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{config_path} is not a Piper voice config: {exc}", path=config_path) from exc
        inference = settings.get("inference", {})
        self.noise_scale = float(inference.get("noise_scale", 0.667))
        self.length_scale = float(inference.get("length_scale", 1.0))
        self.noise_w = float(inference.get("noise_w", 0.8))
        speakers = settings.get("speaker_id_map") or {}
        self.speakers: dict[str, int] = {str(k): int(v) for k, v in speakers.items()}
        self.default_voice = str(settings.get("dataset") or name)
        self.voices = sorted(self.speakers) if int(settings.get("num_speakers", 1)) > 1 else [self.default_voice]
        self.max_input_chars = MAX_INPUT_CHARS
        self._bridge = _espeak_bridge(folder)
        self.session = create_session(self.model_path, folder, config)
        self._has_sid = any(i.name == "sid" for i in self.session.get_inputs())
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._waiting = 0
        self._serving = 0
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"ortserve-voice-{name}", daemon=True)
        self._worker.start()

    # -- public API ------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests waiting for their first sentence."""
        return self._waiting

    @property
    def active(self) -> int:
        return self._serving

    def phonemize(self, text: str) -> list[list[int]]:
        """The phoneme ids of each sentence of ``text`` (empty sentences left out)."""
        with _ESPEAK_LOCK:
            self._bridge.set_voice(self.espeak_voice)
            clauses = self._bridge.get_phonemes(text)
        sentences: list[list[int]] = []
        current: list[str] = []
        for phonemes, terminator, end_of_sentence in clauses:
            # Words from another language come wrapped in "(lang)" flags: not phonemes.
            phonemes = _strip_language_flags(phonemes) + terminator
            if terminator in (",", ":", ";"):
                phonemes += " "  # a pause within the sentence
            current.extend(unicodedata.normalize("NFD", phonemes))
            if end_of_sentence:
                sentences.append(self._ids(current))
                current = []
        if current:
            sentences.append(self._ids(current))
        return [ids for ids in sentences if len(ids) > 3]  # more than the markers alone

    def _ids(self, phonemes: list[str]) -> list[int]:
        """Piper's id layout: BOS, then each phoneme followed by PAD, then EOS; phonemes
        the voice does not know are left out."""
        pad = self.id_map.get(_PAD, [])
        ids = [*self.id_map.get(_BOS, []), *pad]
        for phoneme in phonemes:
            known = self.id_map.get(phoneme)
            if known is not None:
                ids += [*known, *pad]
        return ids + self.id_map.get(_EOS, [])

    def check(self, text: str, voice: str | None, speed: float) -> int | None:
        """Refuse what cannot be spoken, naming the field; the speaker id of ``voice``."""
        if not text.strip():
            raise InvalidRequestError("input is empty", param="input")
        if "\x00" in text:  # the phonemizer takes C strings
            raise InvalidRequestError("input holds a NUL character (U+0000)", param="input")
        if len(text) > self.max_input_chars:
            raise InvalidRequestError(
                f"input has {len(text)} characters, more than the {self.max_input_chars} allowed", param="input"
            )
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise InvalidRequestError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}", param="speed")
        if voice is None or (voice == self.default_voice and not self.speakers):
            return None
        if voice in self.speakers:
            return self.speakers[voice]
        raise InvalidRequestError(
            f"voice {voice!r} is not one of model {self.name!r}'s: {', '.join(self.voices)}", param="voice"
        )

    async def synthesize(
        self,
        text: str,
        *,
        voice: str | None = None,
        speed: float = 1.0,
        noise_scale: float | None = None,
        noise_w: float | None = None,
    ) -> AsyncGenerator[SpeechChunk, None]:
        """The audio of ``text``, a sentence at a time. ``noise_scale``/``noise_w``: the
        voice's own unless given (0 makes the output deterministic)."""
        speaker = self.check(text, voice, speed)
        if self._closed:
            raise EngineClosedError(f"model {self.name!r} is closed")
        sentences = await asyncio.to_thread(self.phonemize, text)
        if not sentences:
            raise InvalidRequestError("input has nothing to speak", param="input")
        scales = np.array(
            [
                self.noise_scale if noise_scale is None else noise_scale,
                self.length_scale / speed,
                self.noise_w if noise_w is None else noise_w,
            ],
            dtype=np.float32,
        )
        if speaker is None and self.speakers:
            speaker = 0
        loop = asyncio.get_running_loop()
        job = _Job(sentences, speaker, scales, loop, asyncio.Queue())
        self._waiting += 1
        self._queue.put(job)
        try:
            while True:
                item = await job.chunks.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            job.cancelled = True

    async def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        await asyncio.to_thread(self._worker.join)

    # -- worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        active: list[_Job] = []
        while True:
            try:
                arrived = self._queue.get(block=not active)
            except queue.Empty:
                arrived = None
            else:
                if arrived is None:
                    break
                active.append(arrived)
                continue  # take all that arrived before the next round
            for job in list(active):
                if job.cancelled:
                    active.remove(job)
                    self._leave(job)
                    continue
                if not job.started:
                    job.started = True
                    self._waiting -= 1
                self._serving = len(active)
                try:
                    chunk = self._speak(job, job.sentences.pop(0))
                except Exception as exc:  # noqa: BLE001  # an onnxruntime failure fails this request only
                    job.sentences.clear()
                    self._hand(job, exc)
                else:
                    self._hand(job, chunk)
                if not job.sentences:
                    self._hand(job, None)
                    active.remove(job)
            self._serving = 0
        for job in active:
            self._leave(job)
            self._hand(job, EngineClosedError(f"model {self.name!r} was closed"))
        while not self._queue.empty():
            late = self._queue.get_nowait()
            if late is not None:
                self._leave(late)
                self._hand(late, EngineClosedError(f"model {self.name!r} was closed"))

    def _leave(self, job: _Job) -> None:
        if not job.started:
            job.started = True
            self._waiting -= 1

    def _speak(self, job: _Job, ids: list[int]) -> SpeechChunk:
        feeds: dict[str, Any] = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": job.scales,
        }
        if self._has_sid:
            feeds["sid"] = np.array([job.speaker or 0], dtype=np.int64)
        (audio, *_) = self.session.run(None, feeds)
        samples = np.clip(np.asarray(audio, dtype=np.float32).reshape(-1), -1.0, 1.0)
        return SpeechChunk(samples=samples, phonemes=len(ids))

    @staticmethod
    def _hand(job: _Job, item: SpeechChunk | BaseException | None) -> None:
        try:
            job.loop.call_soon_threadsafe(job.chunks.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody listens
            job.cancelled = True


def _strip_language_flags(phonemes: str) -> str:
    out, depth = [], 0
    for char in phonemes:
        if char == "(":
            depth += 1
        elif char == ")" and depth:
            depth -= 1
        elif not depth:
            out.append(char)
    return "".join(out)


def _espeak_bridge(folder: Path) -> Any:
    """piper-tts's espeak-ng bridge, started on its bundled data (``ModelLoadError`` when
    the ``voice`` extra is not installed)."""
    try:
        from piper import espeakbridge  # type: ignore[import-not-found, unused-ignore]
        from piper.phonemize_espeak import ESPEAK_DATA_DIR  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        raise ModelLoadError(
            f"{folder} is a Piper voice; speaking needs the espeak-ng phonemizer of piper-tts "
            f"(GPL-3.0-or-later): pip install 'ortserve-runtime[voice]' ({exc})",
            path=folder,
        ) from exc
    with _ESPEAK_LOCK:
        espeakbridge.initialize(str(ESPEAK_DATA_DIR))
    return espeakbridge
