"""Images and audio through the typed client: ask about a picture, subtitle a recording.

Starts (or attaches to) a local server with an image chat model and a Whisper model, then
sends a PNG made here with Pillow and a WAV tone made with the standard library.

    uv run python examples/media.py [IMAGE] [AUDIO]
"""

from __future__ import annotations

import asyncio
import io
import math
import os
import struct
import sys
import wave
from pathlib import Path

from _common import SPEECH_MODEL_DIR, VISION_MODEL_DIR
from ortserve_client import LocalServer
from ortserve_client import protocol as p
from PIL import Image


def made_up_image() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (30, 120, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def made_up_audio(seconds: float = 2.0, rate: int = 16000) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        samples = (int(8000 * math.sin(2 * math.pi * 330 * i / rate)) for i in range(int(rate * seconds)))
        writer.writeframes(b"".join(struct.pack("<h", s) for s in samples))
    return buffer.getvalue()


async def main() -> None:
    image = Path(sys.argv[1]).read_bytes() if len(sys.argv) > 1 else made_up_image()
    audio = Path(sys.argv[2]).read_bytes() if len(sys.argv) > 2 else made_up_audio()
    models = {"vision": VISION_MODEL_DIR, "whisper": SPEECH_MODEL_DIR}
    port = int(os.environ.get("PORT", "8000"))
    async with LocalServer(models, port=port) as server, server.client() as client:
        question = p.UserMessage(
            content=[p.ImageContentPart.from_bytes(image, "image/png"), p.TextContentPart(text="What is this?")]
        )
        reply = await client.chat.completions.create(model="vision", messages=[question], max_tokens=24)
        assert reply.usage is not None
        print(f"image answer ({reply.usage.prompt_tokens} prompt tokens): {reply.choices[0].message.content}")
        subtitles = await client.audio.transcriptions.create(
            model="whisper", file=("recording.wav", audio), response_format="srt"
        )
        print("subtitles:")
        print(subtitles)


if __name__ == "__main__":
    asyncio.run(main())
