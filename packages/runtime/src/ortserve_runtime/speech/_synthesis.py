"""Text-to-speech voices: Piper's VITS voices (``*.onnx`` with its ``*.onnx.json``) on
onnxruntime.

Text becomes phonemes through espeak-ng, the phonemizer Piper voices were trained with
(the bridge that ``piper-tts`` ships, the ``voice`` extra: GPL-3.0-or-later, so it is
optional), sentence by sentence; each sentence's phoneme ids run through the voice's
graph and its audio is handed back as soon as it is ready, so the first audio of a long
text leaves after its first sentence.

One call of the graph takes memory in proportion to the frames it speaks (its decoder's
activations, some 0.25 MiB a frame), and espeak makes tens of thousands of phonemes of
4,096 characters with no sentence break (emoji, long numbers, Arabic spelled out: 30,000
ids in one call took the process past 22 GB). So a sentence longer than
:data:`MAX_CALL_IDS` (fewer at slower speeds) is spoken in pieces, cut after a clause pause
or between words where it can be, and the pieces take turns as sentences do; a sentence
under it is spoken whole, as piper-tts speaks it. A long piece's call gives back what it
took (the arena shrinks, the C heap is trimmed), so a request leaves no more behind than
the working set of short sentences.

One worker thread runs the voice's session. The graph returns one waveform per batch with
no per-row lengths, so sentences run one at a time; concurrent requests take turns a
sentence each, so that a short request is not stuck behind a long one. A caller that
stops listening (a client gone) has its remaining sentences dropped; one that reads slowly
holds its request back, two pieces ahead of what it has taken. espeak-ng runs in a child
process of each voice (:mod:`._espeak`): it crashes on some text, and a crash there fails
that request, not the server. A voice phonemizes on a thread of its own too, one text at
a time: a request waiting for espeak (behind a crash text, or a hung child until its
timeout) holds no thread of the event loop's shared pool, which prepares every other
model's prompts and loads models (seventeenth probe, issue 45); it counts in
:attr:`VoiceModel.queued` from its arrival, so the server's per-model queue bound covers it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import unicodedata
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import onnxruntime as ort

from .._config import ModelConfig
from .._errors import EngineClosedError, InvalidRequestError, ModelLoadError
from .._memory import release_freed_memory
from ..embeddings._encoder import create_session, read_json
from ._espeak import Phonemizer

__all__ = ["SpeechChunk", "VoiceModel", "find_voice_files"]

MAX_INPUT_CHARS = 4096
"""Characters a request may hold (OpenAI's limit for ``/v1/audio/speech``)."""
MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range
MAX_CALL_IDS = 400
"""Phoneme ids one call of a voice's graph takes at length_scale 1: a sentence of about 200
phonemes, some 230 characters of English. An id lasts 1 to 3.3 frames (Arabic spelled out
2.7, numbers between commas 3.3) and a frame costs the decoder some 0.25 MiB, so a call
peaks at +150 to +300 MiB (measured with en_US-joe-medium). At a larger length_scale (a
slower speed) proportionally fewer, as each id then lasts more frames."""
_MIN_CALL_IDS = 64
_CLAUSE_PAUSES = frozenset(",:;")
_SHRINK_ABOVE_IDS = 200
"""Calls of more phoneme ids than this (at length_scale 1; proportionally fewer at a larger
one) give back the memory they took; the arena keeps what shorter sentences need, some
100 MiB, as a working set."""
_AHEAD = 2
"""Pieces the worker speaks for a request beyond those its caller has taken."""
_WAKE: Literal["wake"] = "wake"
"""Put in the worker's queue when a request it may have skipped can go on."""
_BOS, _EOS, _PAD = "^", "$", "_"  # the markers of Piper's phoneme id maps


def find_voice_files(folder: Path) -> tuple[Path, Path] | None:
    """The voice graph and its config (``x.onnx`` and ``x.onnx.json``) in ``folder``, if
    it holds exactly one such pair."""
    pairs = [(p, p.with_name(p.name + ".json")) for p in sorted(folder.glob("*.onnx"))]
    pairs = [(graph, config) for graph, config in pairs if config.exists()]
    return pairs[0] if len(pairs) == 1 else None


@dataclass(frozen=True, slots=True)
class SpeechChunk:
    """One sentence's audio (or one piece's of a sentence too long for one call): float
    samples in [-1, 1] at the voice's ``sample_rate``."""

    samples: npt.NDArray[np.float32]
    phonemes: int
    """Phoneme ids the sentence ran as (the input side of ``usage``)."""


@dataclass(eq=False)
class _Job:
    pieces: list[list[int]]
    speaker: int | None
    scales: npt.NDArray[np.float32]
    loop: asyncio.AbstractEventLoop
    chunks: asyncio.Queue[SpeechChunk | BaseException | None]
    cancelled: bool = False
    started: bool = field(default=False)
    handed: int = 0
    """Chunks the worker has handed over (written by the worker only)."""
    taken: int = 0
    """Chunks the caller has taken (written by the caller only)."""

    @property
    def ahead(self) -> bool:
        """Whether the caller has not taken enough of what it was handed for the worker to
        speak more: a caller that stops reading holds :data:`_AHEAD` pieces' audio, not
        its whole text's (up to 80 MB of float samples for 4,096 characters)."""
        return self.handed - self.taken >= _AHEAD


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
        self._phonemizer = Phonemizer(folder)
        try:
            self.session = create_session(self.model_path, folder, config)
        except BaseException:
            self._phonemizer.close()
            raise
        self._has_sid = any(i.name == "sid" for i in self.session.get_inputs())
        # The arena keeps what the largest call needed (200 emoji left +1.5 GiB behind): a
        # long piece's call hands it back. Not every call's: that made short sentences 15%
        # slower and doubled the peaks (+500 MiB: a region stayed until the next call);
        # without the arena calls were 10% slower.
        self._shrink: ort.RunOptions | None = None
        if self.session.get_session_options().enable_cpu_mem_arena:
            self._shrink = ort.RunOptions()
            self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        self._queue: queue.Queue[_Job | Literal["wake"] | None] = queue.Queue()
        # espeak's calls take turns on the phonemizer's lock: waiting for it here, not on
        # a thread of the loop's shared pool.
        self._phonemizing = ThreadPoolExecutor(1, thread_name_prefix=f"ortserve-espeak-{name}")
        self._arriving = 0
        """Requests phonemizing or waiting to (changed on the event loop only)."""
        self._waiting = 0
        self._serving = 0
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"ortserve-voice-{name}", daemon=True)
        self._worker.start()

    # -- public API ------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests waiting for their first sentence (for espeak, or for the voice's thread)."""
        return self._arriving + self._waiting

    @property
    def active(self) -> int:
        return self._serving

    def call_ids(self, speed: float = 1.0) -> int:
        """Phoneme ids one call of the graph takes at ``speed`` (see :data:`MAX_CALL_IDS`)."""
        length_scale = self.length_scale / speed
        return max(_MIN_CALL_IDS, int(MAX_CALL_IDS / max(1.0, length_scale)))

    def phonemize(self, text: str, max_ids: int = MAX_CALL_IDS) -> list[list[int]]:
        """The phoneme ids of each sentence of ``text`` (empty sentences left out), a
        sentence longer than ``max_ids`` ids cut into pieces that are not.
        ``InvalidRequestError`` naming ``input`` when espeak-ng crashes on ``text`` (in its
        child process: the voice goes on)."""
        clauses = self._phonemizer.clauses(self.espeak_voice, text)
        sentences: list[list[int]] = []
        current: list[str] = []
        for phonemes, terminator, end_of_sentence in clauses:
            # Words from another language come wrapped in "(lang)" flags: not phonemes.
            phonemes = _strip_language_flags(phonemes) + terminator
            if terminator in (",", ":", ";"):
                phonemes += " "  # a pause within the sentence
            current.extend(unicodedata.normalize("NFD", phonemes))
            if end_of_sentence:
                sentences += self._ids(current, max_ids)
                current = []
        if current:
            sentences += self._ids(current, max_ids)
        return sentences

    def _ids(self, phonemes: list[str], max_ids: int) -> list[list[int]]:
        """Piper's id layout: BOS, then each phoneme followed by PAD, then EOS; phonemes
        the voice does not know are left out (none known: no piece). More than ``max_ids``
        ids are cut into pieces, each with its markers: after the window's last clause pause
        if it lies in the window's later half, else after its last word, else at the limit."""
        pad = self.id_map.get(_PAD, [])
        head = [*self.id_map.get(_BOS, []), *pad]
        tail = self.id_map.get(_EOS, [])
        room = max(max_ids - len(head) - len(tail), 1)
        steps = [(phoneme, [*known, *pad]) for phoneme in phonemes if (known := self.id_map.get(phoneme)) is not None]
        pieces: list[list[int]] = []
        start = 0
        while start < len(steps):
            end, size, word, clause = start, 0, 0, 0
            while end < len(steps) and (end == start or size + len(steps[end][1]) <= room):
                size += len(steps[end][1])
                if steps[end][0] == " " and end > start:
                    word = end + 1
                    if steps[end - 1][0] in _CLAUSE_PAUSES:
                        clause = end + 1
                end += 1
            if end < len(steps):  # cut: a clause's end late in the window, else a word's
                if clause > start + (end - start) // 2:
                    end = clause
                elif word:
                    end = word
            pieces.append([*head, *(i for _, ids in steps[start:end] for i in ids), *tail])
            start = end
        return pieces

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
        loop = asyncio.get_running_loop()
        self._arriving += 1
        try:
            pieces = await loop.run_in_executor(self._phonemizing, self.phonemize, text, self.call_ids(speed))
        finally:
            self._arriving -= 1
        if not pieces:
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
        job = _Job(pieces, speaker, scales, loop, asyncio.Queue())
        self._waiting += 1
        self._queue.put(job)
        try:
            while True:
                item = await job.chunks.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                job.taken += 1
                if job.handed - job.taken == _AHEAD - 1:
                    self._queue.put(_WAKE)  # the worker may have skipped this request
                yield item
        finally:
            job.cancelled = True
            self._queue.put(_WAKE)  # dropped at once, even while the worker waits

    async def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        await asyncio.to_thread(self._worker.join)
        await asyncio.to_thread(self._phonemizer.close)  # texts still queued for it: EngineClosedError
        await asyncio.to_thread(self._phonemizing.shutdown)

    # -- worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        active: list[_Job] = []
        while True:
            try:
                # Wait while no request can go on (none, or all ahead of their callers).
                arrived = self._queue.get(block=all(job.ahead and not job.cancelled for job in active))
            except queue.Empty:
                pass
            else:
                if arrived is None:
                    break
                if isinstance(arrived, _Job):
                    active.append(arrived)
                continue  # take all that arrived before the next round
            for job in list(active):
                if not self._step(job, len(active)):
                    active.remove(job)
            self._serving = 0
        for job in active:
            self._leave(job)
            self._hand(job, EngineClosedError(f"model {self.name!r} was closed"))
        while not self._queue.empty():
            late = self._queue.get_nowait()
            if isinstance(late, _Job):
                self._leave(late)
                self._hand(late, EngineClosedError(f"model {self.name!r} was closed"))

    def _step(self, job: _Job, serving: int) -> bool:
        """Speak ``job``'s next piece unless it is ahead of its caller; whether it goes on."""
        if job.cancelled:
            self._leave(job)
            return False
        if job.ahead:
            return True
        if not job.started:
            job.started = True
            self._waiting -= 1
        self._serving = serving
        try:
            chunk = self._speak(job, job.pieces.pop(0))
        except Exception as exc:  # noqa: BLE001  # an onnxruntime failure fails this request only
            job.pieces.clear()
            self._hand(job, exc)
        else:
            job.handed += 1
            self._hand(job, chunk)
        if not job.pieces:
            self._hand(job, None)
            return False
        return True

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
        long = len(ids) * float(job.scales[1]) > _SHRINK_ABOVE_IDS  # frames, as at length_scale 1
        (audio, *_) = self.session.run(None, feeds, self._shrink if long else None)
        samples = np.clip(np.asarray(audio, dtype=np.float32).reshape(-1), -1.0, 1.0)
        del audio
        if long:
            release_freed_memory()  # what the arena handed back stays in the C heap otherwise (2-4 ms a call)
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
