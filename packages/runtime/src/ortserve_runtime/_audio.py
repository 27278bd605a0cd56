"""Audio as the models hear it: read by libsndfile (``soundfile``), its length from its
header before anything is decoded, then block by block into the WAV onnxruntime-genai's
decoder is given.

og's decoder reads a clip whole into 32-bit floats and then resamples it: an hour of
16 kHz silence, a 180 KB FLAC, took a multimodal model's og process +416 MiB; half an
hour of 48 kHz stereo, 335 KB, +1.6 GiB and 35 s of a core (issue 45). So a request's
clips are held to a bound from their headers, and og gets only the frames a header said.
It also resamples only down ("only down-sampling supported"): audio below 16 kHz
(telephone audio at 8 kHz) is brought up to it here, by linear interpolation. Speech
models (Whisper) are given their audio a 30-second mono window at a time.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ._errors import InvalidRequestError

if TYPE_CHECKING:
    import soundfile

__all__ = ["audio_header", "og_samples", "og_wav", "read_mono", "wav"]

MODEL_RATE = 16_000
"""Samples per second Whisper's, Gemma's and Phi-4's audio features are computed at."""
MIN_SAMPLE_RATE = 4_000
"""Below this no speech survives (telephone audio is 8 kHz). A header claiming less is
broken or hostile: brought up to 16 kHz, a 32 KB WAV "at 1 Hz" becomes 4.4 hours of audio."""
MAX_SAMPLE_RATE = 384_000  # the highest rate audio interfaces record at
BLOCK_FRAMES = 16_384
"""Frames read at a time: with libsndfile's 1024 channels at most, a block stays ~64 MB
in float32 even for a hostile header, and is mixed down to mono at once."""
_UNKNOWN_LENGTH = 2**63 - 1
"""libsndfile's frame count for a clip whose header leaves its length open (SF_COUNT_MAX)."""


def unreadable(exc: Exception, param: str) -> InvalidRequestError:
    """The 400 for audio libsndfile fails on, with its reason."""
    reason = getattr(exc, "error_string", None) or str(exc)
    if "not a regular file" in reason:  # libsndfile's words for bytes it found no format in
        reason = "not audio libsndfile reads (WAV, FLAC, MP3, OGG and some twenty more), or cut short"
    return InvalidRequestError(f"the audio could not be decoded: {reason}", param=param)


def audio_header(audio: bytes, param: str) -> tuple[int, int, int]:
    """The clip's sample rate, frames and channels from its header. Audio libsndfile cannot read (it
    reads WAV, FLAC, MP3, OGG and some twenty more), or at a sample rate outside what speech
    is recorded at, is an :class:`InvalidRequestError` naming ``param``."""
    import soundfile  # on first use: a server without audio models starts without it

    try:
        with soundfile.SoundFile(io.BytesIO(audio)) as file:
            rate, frames, channels = int(file.samplerate), int(file.frames), int(file.channels)
    except (soundfile.SoundFileError, RuntimeError, ValueError, TypeError) as exc:
        raise unreadable(exc, param) from None
    if frames == _UNKNOWN_LENGTH:
        # Not read through to count them: soundfile fails at the end of such a FLAC (its seek
        # past the last frame, "Internal psf_fseek() failed"), losing the last block. It was
        # refused as lasting 576,460,752,303,424 s (twenty-seventh probe, issue 45).
        raise InvalidRequestError(
            "the audio's header does not give its length (as in a FLAC written to a pipe); send it as a file "
            "whose header says how long it is",
            param=param,
        )
    if not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise InvalidRequestError(
            f"the audio's sample rate is {rate} Hz; this server takes {MIN_SAMPLE_RATE} to {MAX_SAMPLE_RATE} Hz",
            param=param,
        )
    return rate, frames, channels


def blocks(file: soundfile.SoundFile, frames: int, param: str) -> Iterator[npt.NDArray[np.float32]]:
    """Up to ``frames`` frames from ``file``, a block (frames x channels) at a time; frames
    the header promised and the file does not hold are a 400 (twenty-third probe, issue 45:
    a FLAC header claiming frames it lacks was a 500, libsndfile's "psf_fseek() failed")."""
    import soundfile  # imported already by the caller: the name, for its error

    read = 0
    while read < frames:
        try:
            block = file.read(min(BLOCK_FRAMES, frames - read), dtype="float32", always_2d=True)
        except (soundfile.SoundFileError, RuntimeError) as exc:
            raise unreadable(exc, param) from None
        if not len(block):
            return
        read += len(block)
        yield block


def read_mono(file: soundfile.SoundFile, frames: int, param: str) -> npt.NDArray[np.float32]:
    """Up to ``frames`` frames from ``file`` (see :func:`blocks`), mixed down to mono block
    by block."""
    mono = np.empty(frames, dtype=np.float32)
    filled = 0
    for block in blocks(file, frames, param):
        mono[filled : filled + len(block)] = block[:, 0] if block.shape[1] == 1 else block.mean(axis=1)
        filled += len(block)
    return mono[:filled]


def upsample(samples: npt.NDArray[np.float32], rate: int, to: int) -> Iterator[npt.NDArray[np.float32]]:
    """Linear interpolation from ``rate`` up to ``to``, :data:`BLOCK_FRAMES` output samples
    at a time: its index arrays take some 40 bytes an output sample, and twenty minutes of
    4 kHz made whole took an og process +750-790 MiB (twenty-eighth probe, issue 45). A
    piece (a Whisper window) holds its own last sample past its end rather than reading
    ahead into the next: a step of 1/16,000 s, inaudible, and every window is heard on its
    own anyway."""
    count = round(len(samples) * to / rate)
    for start in range(0, count, BLOCK_FRAMES):
        positions = np.arange(start, min(start + BLOCK_FRAMES, count), dtype=np.float64) * (rate / to)  # exact
        left = np.minimum(positions.astype(np.int64), len(samples) - 1)
        right = np.minimum(left + 1, len(samples) - 1)
        fraction = (positions - left).astype(np.float32)
        yield samples[left] + (samples[right] - samples[left]) * fraction


def wav(samples: npt.NDArray[np.float32], rate: int) -> bytes:
    """``samples`` (mono) as a 16-bit WAV, at ``rate`` or brought up to :data:`MODEL_RATE`."""
    import soundfile  # on first use: a server without audio models starts without it

    buffer = io.BytesIO()
    if rate >= MODEL_RATE:
        soundfile.write(buffer, samples, rate, format="WAV", subtype="PCM_16")
        return buffer.getvalue()
    with soundfile.SoundFile(buffer, "w", MODEL_RATE, 1, "PCM_16", format="WAV") as target:
        for piece in upsample(samples, rate, MODEL_RATE):
            target.write(piece)
    return buffer.getvalue()


def og_samples(rate: int, frames: int, channels: int) -> int:
    """The samples a clip becomes in og's decoder as :func:`og_wav` hands it over: its
    frames x channels, or at 16 kHz in one channel when it comes at a lower rate."""
    return frames * channels if rate >= MODEL_RATE else -(-frames * MODEL_RATE // rate)


def og_wav(audio: bytes, param: str) -> bytes:
    """A whole clip as og is given it: the frames its header says (read by
    :func:`audio_header`, already held to the request's bound) as a 32-bit float WAV of
    its rate and one or two channels, from which og's decoder computes what it would from
    the clip itself (the same features, measured); a clip of more channels mixed down to
    mono, and one below 16 kHz mixed down and brought up to it. A clip of no frames is a
    400 naming ``param``."""
    import soundfile  # on first use: a server without audio models starts without it

    try:
        file = soundfile.SoundFile(io.BytesIO(audio))
    except (soundfile.SoundFileError, RuntimeError, ValueError, TypeError) as exc:
        raise unreadable(exc, param) from None
    with file:
        rate, frames = int(file.samplerate), int(file.frames)
        if rate < MODEL_RATE:  # og resamples down only
            samples = read_mono(file, frames, param)
            if not len(samples):
                raise InvalidRequestError("the audio holds no samples", param=param)
            return wav(samples, rate)
        # One or two channels as they are (og's own mix, exactly); more mixed down to one
        # here: og's processor dies of SIGFPE on 17 channels and more (twenty-eighth probe).
        kept = file.channels if file.channels <= 2 else 1
        buffer, written = io.BytesIO(), 0
        with soundfile.SoundFile(buffer, "w", rate, kept, "FLOAT", format="WAV") as target:
            for block in blocks(file, frames, param):
                target.write(block if kept == file.channels else block.mean(axis=1))
                written += len(block)
    if not written:
        raise InvalidRequestError("the audio holds no samples", param=param)
    return buffer.getvalue()
