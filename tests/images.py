"""Test images made in the tests themselves (Pillow), and the tiny Phi-3-vision fixture."""

from __future__ import annotations

import base64
import io
from pathlib import Path

from PIL import Image

TINY_PHI3V = Path(__file__).resolve().parent / "fixtures" / "tiny-phi3v"


def image_bytes(
    width: int = 48, height: int = 32, colour: tuple[int, int, int] = (200, 30, 30), fmt: str = "PNG"
) -> bytes:
    """A solid-colour image with a diagonal stripe, encoded as ``fmt``."""
    image = Image.new("RGB", (width, height), colour)
    for i in range(min(width, height)):
        image.putpixel((i, i), (255 - colour[0], 255 - colour[1], 255 - colour[2]))
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(data: bytes | None = None, media_type: str = "image/png") -> dict[str, object]:
    """An OpenAI ``image_url`` content part holding ``data`` inline."""
    return {"type": "image_url", "image_url": {"url": data_url(image_bytes() if data is None else data, media_type)}}
