"""Test audio made in the tests themselves: WAV tones, no files from anywhere."""

from __future__ import annotations

import io
import math
import struct
import wave
from pathlib import Path

TINY_WHISPER = Path(__file__).resolve().parent / "fixtures" / "tiny-whisper"


def tone_wav(seconds: float = 1.0, hertz: float = 440.0, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        frames = (int(8000 * math.sin(2 * math.pi * hertz * i / rate)) for i in range(int(rate * seconds)))
        writer.writeframes(b"".join(struct.pack("<h", f) for f in frames))
    return buffer.getvalue()
