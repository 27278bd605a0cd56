"""Images and audio in chat messages: validation, and their places in the prompt text.

A message's ``content`` is a string or a list of parts: strings (text), :class:`ImageInput`
and :class:`AudioInput`. A multimodal model's chat template sees text only, so each media
part becomes the placeholder its model family expects (phi3v's ``<|image_1|>``...), in the
order the user sent the parts; the media go to onnxruntime-genai's processor beside it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidRequestError
from ._template import Message

__all__ = ["AudioInput", "ImageInput", "Media", "Placeholders", "flatten_messages"]


@dataclass(frozen=True, slots=True)
class ImageInput:
    """Image bytes in any format Pillow reads (PNG, JPEG, WebP, GIF, BMP...)."""

    data: bytes


@dataclass(frozen=True, slots=True)
class AudioInput:
    """Audio bytes (WAV, MP3, FLAC...); ``format`` as the client named it."""

    data: bytes
    format: str | None = None


Placeholders = Mapping[type[ImageInput] | type[AudioInput], Callable[[int], str]]
"""Per media type, the prompt text for its n-th occurrence (counted from 1)."""


Media = list[tuple[str, ImageInput | AudioInput]]
"""Media parts in prompt order, each with where it was (``messages[0].content[1]``)."""


def flatten_messages(
    messages: Sequence[Message], placeholders: Placeholders, model_name: str
) -> tuple[list[dict[str, Any]], Media]:
    """Messages with text-only content, and the media in prompt order.

    A media type without a placeholder is refused, naming the part: the model cannot see it.
    """
    flat: list[dict[str, Any]] = []
    media: Media = []
    counts: dict[type, int] = {}
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            flat.append(dict(message))
            continue
        text: list[str] = []
        for number, part in enumerate(content):
            if isinstance(part, str):
                text.append(part)
                continue
            where = f"messages[{index}].content[{number}]"
            placeholder = placeholders.get(type(part))
            if placeholder is None:
                what = "images" if isinstance(part, ImageInput) else "audio"
                raise InvalidRequestError(f"model {model_name!r} does not take {what}", param=where)
            media.append((where, part))
            counts[type(part)] = counts.get(type(part), 0) + 1
            text.append(placeholder(counts[type(part)]))
        flat.append({**message, "content": "".join(text)})
    return flat, media
