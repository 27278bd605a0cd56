"""Speech-to-text models (Whisper) on onnxruntime-genai's ``og.Generator``.

Encoder-decoder models do not run on ``og.Engine`` ("Expected a decoder-only model"), so
requests go to one worker thread that runs one generator at a time, in the model's own og
process (``engines._og_process``: og's calls hold the GIL, and a long recording held every
route of the server up to 0.14 s at a time with the tiny test model, longer with real ones).
Requests take turns by 30-second window, so a short clip is not stuck behind a long
recording; a cancelled request leaves at once, or stops at its next token.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import queue
import re
import threading
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from .._audio import audio_header, read_mono, wav
from .._config import ModelConfig
from .._contract import resolve_future
from .._errors import EngineClosedError, EngineError, InvalidRequestError, ModelCrashedError, ModelLoadError
from .._folder import GenaiFolder
from .._og_process import OgProcess
from .._text_bounds import TextLimit
from ..chat._sampling import GenerationOptions, Sampler

__all__ = ["Segment", "SpeechModel", "Transcription"]

MAX_NEW_TOKENS = 440  # Whisper's decoder holds 448 positions, the prompt takes a few
WINDOW_SECONDS = 30  # what Whisper hears at once
PREVIOUS_TEXT_TOKENS = 200  # of one window's text, to condition the next on (as Whisper does)


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
    """Seconds of audio (``None`` when libsndfile cannot read the container)."""
    tokens: int
    segments: list[Segment]
    """With ``timestamps=True``: the segments the model marked; else one for the whole text."""


@dataclass(eq=False)
class _Job:
    audio: bytes
    prompt: str | None
    """Earlier text to condition the first window on (``<|startofprev|>``)."""
    language_id: int | None
    """The language token, or ``None`` to detect it."""
    max_tokens: int | None
    """Across all windows; each window also stops at ``MAX_NEW_TOKENS``."""
    temperature: float
    timestamps: bool
    duration: float | None
    """Seconds of audio, from its header (``None``: libsndfile cannot read it)."""
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[tuple[int, list[_Window], float | None]]
    cancelled: bool = field(default=False)


@dataclass(frozen=True, slots=True)
class _Window:
    offset: float
    """Seconds into the audio where this window starts."""
    end: float | None
    tokens: list[int]


class SpeechModel:
    """A Whisper-style model: ``await transcribe(audio_bytes, language=...)``."""

    kind: Literal["speech"] = "speech"

    def __init__(self, name: str, folder: Path, config: ModelConfig) -> None:
        self.name = name
        self.folder = folder
        self.max_audio_seconds = config.max_audio_seconds
        # On the provider the config names, or a ModelLoadError that says what to install.
        # Whisper keeps og's own thread default unless intra_op_threads (--threads) is set,
        # which then reaches its encoder and decoder, as session_options do.
        files = GenaiFolder.read(folder)  # each file bounded (see _model_files), before og reads them
        tokenizer_path = files.tokenizer_path
        self._og = OgProcess(folder, config, every_core=False)
        try:
            self._og.call("step", "load_processor", [])
            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
            genai = files.genai
            self.context_length = int(genai["model"]["context_length"])
            self._prompt_limit = TextLimit(self.tokenizer, self.context_length)
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
        except BaseException as exc:
            self._og.close()
            if isinstance(exc, ModelLoadError) or not isinstance(exc, Exception):
                raise
            # onnxruntime-genai raises plain RuntimeError for broken folders
            raise ModelLoadError(f"{folder} could not be loaded as a speech model: {exc}", path=folder) from exc
        self._generators = itertools.count(1)
        """Keys of the generators made in og's process, one per window."""
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._turns: deque[tuple[_Job, Generator[None, None, tuple[int, list[_Window], float | None]]]] = deque()
        """Requests in hand, taking turns by window (worker thread only)."""
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=f"ortserve-speech-{name}", daemon=True)
        self._worker.start()

    @property
    def queued(self) -> int:
        """Requests not taken in yet (the worker takes in every waiting request before
        its next window, so this is rarely more than a moment's arrivals)."""
        return self._queue.qsize()

    @property
    def active(self) -> int:
        """Requests taken in, taking turns window by window."""
        return len(self._turns)

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
        """Text of ``audio`` (WAV, MP3, FLAC, OGG...). Audio longer than Whisper's 30-second
        window is transcribed window by window, each conditioned on the text before it.

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
        # Every token spans a character at least: a prompt this short needs no vocabulary scan.
        # A longer one past what the decoder's positions can spell is refused untokenized: the
        # worker tokenized a 1 MB prompt (and og's processor too) holding the GIL 0.5 s.
        # (The bound's first use scans the vocabulary: off the loop.)
        if (
            prompt
            and len(prompt) > 3 * self.context_length
            and len(prompt) > await asyncio.to_thread(self._prompt_limit.chars)
        ):
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} characters, more than this model's {self.context_length} "
                "tokens could hold",
                param="prompt",
            )
        if prompt and (spelt := _spelt_special(self.tokenizer, prompt)) is not None:
            # og's processor reads the prompt with special tokens matched: "<|en|>" was that
            # token, not text (sixteenth probe).
            raise InvalidRequestError(
                f"the prompt spells {spelt!r}, one of the model's special tokens, which its processor "
                "would read as that token, not as text",
                param="prompt",
            )
        language_id = None
        if language is not None:
            language_id = self.tokenizer.token_to_id(f"<|{language.lower()}|>")
            if language_id not in self._languages:
                raise InvalidRequestError(f"language {language!r} is not one this model knows", param="language")
        if self._closed:
            raise EngineClosedError(f"model {self.name!r} is closed")
        # The header is read off the event loop (libsndfile may scan an MP3 to count its
        # frames) and before the job queues, so bad audio is refused at once.
        duration: float | None = await asyncio.to_thread(_probe, audio, self.max_audio_seconds)
        loop = asyncio.get_running_loop()
        job = _Job(
            audio, prompt, language_id, max_tokens, temperature, timestamps, duration, loop, loop.create_future()
        )
        self._queue.put(job)
        try:
            language_id, windows, duration = await job.future
        except asyncio.CancelledError:
            job.cancelled = True
            raise
        segments: list[Segment] = []
        for window in windows:
            if timestamps:
                segments += self._segments(window.tokens, window.offset, window.end)
            else:
                end = window.end if window.end is not None else window.offset
                segments.append(Segment(window.offset, end, self._text(window.tokens), window.tokens))
        text = " ".join(segment.text for segment in segments if segment.text)
        tokens = sum(len(window.tokens) for window in windows)
        return Transcription(text, self._languages[language_id], duration, tokens, segments)

    @property
    def failed(self) -> str | None:
        """Why the model cannot serve any more (its og process ended), or ``None``."""
        return self._og.failure

    @property
    def process_resident_bytes(self) -> int:
        """The resident memory of the model's og process."""
        return self._og.resident_bytes()

    async def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        await asyncio.to_thread(self._worker.join)
        await asyncio.to_thread(self._og.close)

    def _run(self) -> None:
        turns = self._turns
        while True:
            try:  # wait for work only when there is none in hand
                job = self._queue.get(block=not turns)
            except queue.Empty:
                pass
            else:
                if job is None:
                    break
                turns.append((job, self._generate(job)))
                continue  # take in everything queued before the next turn
            job, steps = turns.popleft()
            if job.cancelled:
                continue
            try:
                next(steps)  # one window
            except StopIteration as done:
                resolve_future(job.loop, job.future, done.value)
            except (InvalidRequestError, EngineClosedError, ModelCrashedError) as exc:
                resolve_future(job.loop, job.future, exc)
            except Exception as exc:  # noqa: BLE001  # any other failure fails this request only
                resolve_future(job.loop, job.future, EngineError(f"transcription failed: {exc}"))
            else:
                turns.append((job, steps))
        closed = EngineClosedError(f"model {self.name!r} was closed")
        for job, _ in turns:
            resolve_future(job.loop, job.future, closed)
        while not self._queue.empty():
            pending = self._queue.get_nowait()
            if pending is not None:
                resolve_future(pending.loop, pending.future, closed)

    def _generate(self, job: _Job) -> Generator[None, None, tuple[int, list[_Window], float | None]]:
        """The job window by window: yields after each; returns language, windows, duration."""
        duration = job.duration
        chunks = _windows(job.audio)
        chunk: bytes | None = next(chunks)  # there is always one: the audio itself at least
        language_id = job.language_id
        windows: list[_Window] = []
        previous = job.prompt
        budget = job.max_tokens
        index = 0
        while chunk is not None:
            if job.cancelled or budget == 0:
                break
            offset = float(index * WINDOW_SECONDS)
            end = min(offset + WINDOW_SECONDS, duration) if duration is not None else None
            prompt = f"<|startofprev|>{previous}<|startoftranscript|>" if previous else "<|startoftranscript|>"
            limit = MAX_NEW_TOKENS if budget is None else min(budget, MAX_NEW_TOKENS)
            language_id, tokens = self._decode(chunk, prompt, language_id, limit, job)
            windows.append(_Window(offset, end, tokens))
            budget = None if budget is None else budget - len(tokens)
            text_tokens = [t for t in tokens if t < self._end_of_text]
            previous = self._text(text_tokens[-PREVIOUS_TEXT_TOKENS:]) or None
            chunk, index = next(chunks, None), index + 1
            if chunk is not None:
                yield
        assert language_id is not None  # chunks is never empty
        return language_id, windows, duration

    def _decode(
        self, audio: bytes, prompt: str, language_id: int | None, max_tokens: int, job: _Job
    ) -> tuple[int, list[int]]:
        """One window: the language (detected if not given) and the tokens up to <|endoftext|>."""
        _, inputs = self._og.process(
            prompt, [], [("file", audio)], "whisper", lane="step", param="file"
        )  # undecodable or empty audio: a 400 naming the file
        task = [self._transcribe] if job.timestamps else [self._transcribe, self._no_timestamps]
        prompt_length = len(self.tokenizer.encode(prompt, add_special_tokens=False).ids) + 1 + len(task)
        if prompt_length >= self.context_length:
            raise InvalidRequestError("the prompt leaves no room to transcribe", param="prompt")
        max_tokens = min(max_tokens, self.context_length - prompt_length)
        key = next(self._generators)
        self._og.call("step", "start", key, prompt_length + max_tokens, False, 0, None, inputs.key, [])
        try:
            if language_id is None:
                logits = self._og.call("step", "logits", key, [])
                language_id = max(self._languages, key=lambda i: float(logits[i]))
            logits = self._og.call("step", "logits", key, [language_id, *task])
            # Sampled here rather than by og, so that the timestamp rules can shape the logits.
            sampler = Sampler(GenerationOptions(temperature=job.temperature), frozenset({self._end_of_text}))
            tokens: list[int] = []
            while not job.cancelled and len(tokens) < max_tokens:
                token = sampler.choose(
                    self._allowed(np.array(logits, dtype=np.float32), tokens, job.timestamps), [], len(tokens)
                )
                if token == self._end_of_text:
                    break
                tokens.append(token)
                if len(tokens) < max_tokens:
                    logits = self._og.call("step", "logits", key, [token])
        finally:
            self._og.forget_generator(key)
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
            top_text, time_logits = float(logits[:begin].max()), logits[begin:]
            peak = max(top_text, float(time_logits.max()))
            if np.exp(time_logits - peak).sum() > np.exp(top_text - peak):
                logits[:begin] = -np.inf
        return logits

    def _text(self, tokens: list[int]) -> str:
        return str(
            self.tokenizer.decode([t for t in tokens if t < self._end_of_text], skip_special_tokens=True)
        ).strip()

    def _segments(self, tokens: list[int], offset: float, end: float | None) -> list[Segment]:
        """Text between timestamp pairs, in seconds from the start of the audio (never past
        the window's end); an unfinished last segment ends where the window does."""
        segments: list[Segment] = []
        start: float | None = None
        text: list[int] = []
        for token in tokens:
            if token < self._timestamp_begin:
                text.append(token)
                continue
            time = round(offset + (token - self._timestamp_begin) * 0.02, 2)
            if end is not None:
                time = min(time, end)  # a model may mark times past the end of short audio
            if start is None:
                start = time
            else:
                segments.append(Segment(start, time, self._text(text), text))
                start, text = None, []
        if text:  # cut off by max_tokens, or ended without its closing timestamp
            begin = start if start is not None else (segments[-1].end if segments else offset)
            segments.append(Segment(begin, max(begin, end if end is not None else begin), self._text(text), text))
        return segments


def _probe(audio: bytes, max_seconds: float) -> float:
    """The audio's duration in seconds from its header (see ``_audio.audio_header``), audio
    longer than ``max_seconds`` refused before anything is decoded: given whole to
    onnxruntime-genai's decoder, a WAV of a subformat libsndfile does not know lasting
    1,000 s was transcribed for its first 30 s only, answered 200 (twenty-first probe,
    issue 45), its length unchecked."""
    rate, frames, _ = audio_header(audio, "file")
    duration = frames / rate
    if duration > max_seconds:
        raise InvalidRequestError(
            f"the audio lasts {duration:.0f} s; this server transcribes at most {max_seconds:.0f} s per request",
            param="file",
        )
    return round(duration, 3)


def _windows(audio: bytes) -> Iterator[bytes]:
    """The audio in Whisper-sized windows, each a mono 16-bit WAV, read from the file one
    window at a time: memory stays that of a window however long the audio is.

    onnxruntime-genai's decoder resamples down only ("only down-sampling supported"), so
    audio below Whisper's 16 kHz (telephone audio at 8 kHz...) is brought up to it here,
    by linear interpolation in float32. What libsndfile cannot read, or audio with no
    frames, goes to onnxruntime-genai whole: its decoder says what is wrong with it.
    """
    import soundfile  # on first use: a server without speech models starts without it

    try:
        file = soundfile.SoundFile(io.BytesIO(audio))
    except (soundfile.SoundFileError, RuntimeError, ValueError, TypeError):
        yield audio
        return
    with file:
        rate = int(file.samplerate)
        step = WINDOW_SECONDS * rate
        first = True
        while True:
            samples = read_mono(file, step, "file")
            if not len(samples):
                break
            first = False
            yield wav(samples, rate)
            if len(samples) < step:
                break
        if first:
            yield audio


_SPECIAL_SHAPE = re.compile(r"<\|[^<>|]{1,40}\|>")
"""The shape of Whisper's special tokens (``<|en|>``, ``<|0.00|>``, ``<|startofprev|>``)."""


def _spelt_special(tokenizer: Tokenizer, text: str) -> str | None:
    """The first special token ``text`` spells, if any."""
    for found in _SPECIAL_SHAPE.finditer(text):
        token = tokenizer.token_to_id(found.group())
        if token is not None and tokenizer.id_to_token(token) == found.group():
            return found.group()
    return None
