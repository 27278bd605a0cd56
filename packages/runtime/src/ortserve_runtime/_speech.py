"""Speech-to-text models (Whisper) on onnxruntime-genai's ``og.Generator``.

Encoder-decoder models do not run on ``og.Engine`` ("Expected a decoder-only model"), so
requests queue for one worker thread that owns the model and runs one generator at a
time; a cancelled request leaves the queue at once, or stops at its next token.
"""

from __future__ import annotations

import asyncio
import io
import json
import queue
import threading
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
import onnxruntime_genai as og
from tokenizers import Tokenizer

from ._config import ModelConfig
from ._errors import EngineClosedError, EngineError, InvalidRequestError, ModelLoadError
from ._sampling import GenerationOptions, Sampler
from ._threads import resolve_future

__all__ = ["Segment", "SpeechModel", "Transcription"]

MAX_NEW_TOKENS = 440  # Whisper's decoder holds 448 positions, the prompt takes a few


@dataclass(frozen=True, slots=True)
class Segment:
    """A stretch of speech between two of Whisper's timestamps (seconds from the start)."""

    start: float
    end: float
    text: str
    tokens: list[int]


@dataclass(frozen=True, slots=True)
class Transcription:
    text: str
    language: str
    duration: float | None
    """Seconds of audio, when the container says (WAV); ``None`` otherwise."""
    tokens: int
    segments: list[Segment]
    """With ``timestamps=True``: the segments the model marked; else one for the whole text."""


@dataclass(eq=False)
class _Job:
    audio: bytes
    prompt: str
    """Up to and including ``<|startoftranscript|>``; the language and task tokens follow."""
    language_id: int | None
    """The language token, or ``None`` to detect it."""
    max_tokens: int
    temperature: float
    timestamps: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[tuple[int, list[int]]]
    cancelled: bool = field(default=False)


class SpeechModel:
    """A Whisper-style model: ``await transcribe(audio_bytes, language=...)``."""

    kind: Literal["speech"] = "speech"

    def __init__(self, name: str, folder: Path, config: ModelConfig) -> None:
        self.name = name
        self.folder = folder
        if config.provider != "cpu":
            raise ModelLoadError(f"cannot load {folder} on provider {config.provider!r}: CPU only", path=folder)
        try:
            self._model = og.Model(str(folder))
            self._processor = self._model.create_multimodal_processor()
            self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
            genai = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
            self.context_length = int(genai["model"]["context_length"])
            special = {
                name: self.tokenizer.token_to_id(f"<|{name}|>")
                for name in ("endoftext", "startoftranscript", "translate", "transcribe", "notimestamps", "0.00")
            }
            missing = [name for name, token in special.items() if token is None]
            if missing:
                raise ModelLoadError(f"{folder}'s tokenizer lacks Whisper's <|{missing[0]}|> token", path=folder)
            # Whisper's language tokens sit between <|startoftranscript|> and <|translate|>.
            first, end = int(special["startoftranscript"] or 0) + 1, int(special["translate"] or 0)
            self._languages = {i: str(self.tokenizer.id_to_token(i))[2:-2] for i in range(first, end)}
            self._transcribe, self._no_timestamps = int(special["transcribe"] or 0), int(special["notimestamps"] or 0)
            # Text tokens sit below <|endoftext|>; timestamps (0.02 s apart) from <|0.00|> on.
            self._end_of_text, self._timestamp_begin = int(special["endoftext"] or 0), int(special["0.00"] or 0)
        except ModelLoadError:
            raise
        except Exception as exc:  # onnxruntime-genai raises plain RuntimeError for broken folders
            raise ModelLoadError(f"{folder} could not be loaded as a speech model: {exc}", path=folder) from exc
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"ortserve-speech-{name}", daemon=True)
        self._worker.start()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    async def transcribe(
        self,
        audio: bytes,
        *,
        language: str | None = None,
        prompt: str | None = None,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        timestamps: bool = False,
    ) -> Transcription:
        """Text of ``audio`` (any container og.Audios reads: WAV, MP3, FLAC...).

        ``timestamps=True`` has the model mark segments with its timestamp tokens, kept to
        Whisper's rules while decoding (a segment opens with a timestamp, at most 1 s into
        the audio first; closes with a later one; then text or the end).

        ``language`` as an ISO-639-1 code; ``None`` lets the model say which language it
        hears (Whisper's own detection: the most likely language token after
        ``<|startoftranscript|>``). ``prompt`` is earlier text that guides spelling and
        style, as in OpenAI's API.
        """
        if not audio:
            raise InvalidRequestError("the audio file is empty", param="file")
        if not 0.0 <= temperature <= 1.0:
            raise InvalidRequestError("temperature must be in [0, 1]", param="temperature")
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        language_id = None
        if language is not None:
            language_id = self.tokenizer.token_to_id(f"<|{language.lower()}|>")
            if language_id not in self._languages:
                raise InvalidRequestError(f"language {language!r} is not one this model knows", param="language")
        if self._closed:
            raise EngineClosedError(f"model {self.name!r} is closed")
        loop = asyncio.get_running_loop()
        job = _Job(
            audio,
            f"<|startofprev|>{prompt}<|startoftranscript|>" if prompt else "<|startoftranscript|>",
            language_id,
            min(max_tokens or MAX_NEW_TOKENS, MAX_NEW_TOKENS),
            temperature,
            timestamps,
            loop,
            loop.create_future(),
        )
        self._queue.put(job)
        try:
            language_id, tokens = await job.future
        except asyncio.CancelledError:
            job.cancelled = True
            raise
        duration = _wav_duration(audio)
        segments = self._segments(tokens, duration) if timestamps else []
        text = " ".join(segment.text for segment in segments) if timestamps else self._text(tokens)
        if not timestamps:
            segments = [Segment(0.0, duration or 0.0, text, tokens)]
        code = self._languages[language_id]
        return Transcription(text, code, duration, len(tokens), segments)

    async def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        await asyncio.to_thread(self._worker.join)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            if job.cancelled:
                continue
            try:
                result: tuple[int, list[int]] | BaseException = self._generate(job)
            except (InvalidRequestError, EngineClosedError) as exc:
                result = exc
            except Exception as exc:  # noqa: BLE001  # any other failure fails this request only
                result = EngineError(f"transcription failed: {exc}")
            resolve_future(job.loop, job.future, result)
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if pending is not None:
                resolve_future(pending.loop, pending.future, EngineClosedError(f"model {self.name!r} was closed"))

    def _generate(self, job: _Job) -> tuple[int, list[int]]:
        try:
            inputs = self._processor(job.prompt, audios=og.Audios.open_bytes(job.audio))
        except RuntimeError as exc:  # og reports undecodable or empty audio as RuntimeError
            raise InvalidRequestError(f"the audio could not be decoded: {exc}", param="file") from exc
        task = [self._transcribe] if job.timestamps else [self._transcribe, self._no_timestamps]
        prompt_length = len(self.tokenizer.encode(job.prompt, add_special_tokens=False).ids) + 1 + len(task)
        if prompt_length >= self.context_length:
            raise InvalidRequestError("the prompt leaves no room to transcribe", param="prompt")
        max_tokens = min(job.max_tokens, self.context_length - prompt_length)
        params = og.GeneratorParams(self._model)
        params.set_search_options(max_length=prompt_length + max_tokens)
        generator = og.Generator(self._model, params)
        generator.set_inputs(inputs)
        language_id = job.language_id
        if language_id is None:
            logits = generator.get_logits().reshape(-1)
            language_id = max(self._languages, key=lambda i: float(logits[i]))
        generator.append_tokens([language_id, *task])
        # Sampled here rather than by og, so that the timestamp rules can shape the logits.
        sampler = Sampler(GenerationOptions(temperature=job.temperature), frozenset({self._end_of_text}))
        tokens: list[int] = []
        while not job.cancelled and len(tokens) < max_tokens:
            logits = self._allowed(
                np.array(generator.get_logits().reshape(-1), dtype=np.float32), tokens, job.timestamps
            )
            token = sampler.choose(logits, [], len(tokens))
            if token == self._end_of_text:
                break
            tokens.append(token)
            if len(tokens) < max_tokens:
                generator.append_tokens([token])
        return language_id, tokens

    def _allowed(self, logits: npt.NDArray[np.float32], tokens: list[int], timestamps: bool) -> npt.NDArray[np.float32]:
        """``logits`` with what may not come next at minus infinity: special tokens always;
        timestamps without ``timestamps``; with it, Whisper's timestamp rules."""
        begin = self._timestamp_begin
        logits[self._end_of_text + 1 : begin] = -np.inf  # <|startoftranscript|>, languages, tasks...
        logits[self.tokenizer.get_vocab_size(with_added_tokens=True) :] = -np.inf
        if not timestamps:
            logits[begin:] = -np.inf
            return logits
        if not tokens:  # a segment opens first, within the first second
            logits[:begin] = -np.inf
            logits[begin + 51 :] = -np.inf
            return logits
        last_is_time = tokens[-1] >= begin
        before_last_is_time = len(tokens) < 2 or tokens[-2] >= begin
        if last_is_time and before_last_is_time:  # a segment just opened: text follows
            logits[begin:] = -np.inf
        elif last_is_time:  # a segment just closed: another opens, or the end
            logits[: self._end_of_text] = -np.inf
        times = [t for t in tokens if t >= begin]
        # Time never goes back; a segment closes strictly after it opens.
        floor = times[-1] if last_is_time and not before_last_is_time else times[-1] + 1
        logits[begin:floor] = -np.inf
        if not last_is_time or before_last_is_time:
            # As Whisper decodes: when the timestamps together outweigh every text token, a
            # timestamp comes next (this is what makes segments end).
            shifted = logits - logits.max()
            mass = np.exp(shifted)
            if mass[begin:].sum() > mass[:begin].max(initial=0.0):
                logits[:begin] = -np.inf
        return logits

    def _text(self, tokens: list[int]) -> str:
        return str(
            self.tokenizer.decode([t for t in tokens if t < self._end_of_text], skip_special_tokens=True)
        ).strip()

    def _segments(self, tokens: list[int], duration: float | None) -> list[Segment]:
        """Text between timestamp pairs; an unfinished last segment ends with the audio."""
        segments: list[Segment] = []
        start: float | None = None
        text: list[int] = []
        for token in tokens:
            if token < self._timestamp_begin:
                text.append(token)
                continue
            time = round((token - self._timestamp_begin) * 0.02, 2)
            if start is None:
                start = time
            else:
                segments.append(Segment(start, time, self._text(text), text))
                start, text = None, []
        if text:  # cut off by max_tokens, or ended without its closing timestamp
            begin = start if start is not None else (segments[-1].end if segments else 0.0)
            segments.append(Segment(begin, max(begin, duration or begin), self._text(text), text))
        return segments


def _wav_duration(audio: bytes) -> float | None:
    try:
        with wave.open(io.BytesIO(audio)) as reader:
            return round(float(reader.getnframes()) / float(reader.getframerate()), 3)
    except (wave.Error, EOFError, ZeroDivisionError):
        return None
