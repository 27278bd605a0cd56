"""Images and audio in chat messages: validation, and their places in the prompt text.

A message's ``content`` is a string or a list of parts: strings (text), :class:`ImageInput`
and :class:`AudioInput`. A multimodal model's chat template sees text only, so each media
part becomes the placeholder its model family expects (phi3v's ``<|image_1|>``...), in the
order the user sent the parts; the media go to onnxruntime-genai's processor beside it.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import InvalidRequestError
from ._template import Message

__all__ = ["AudioInput", "ImageInput", "Media", "Placeholders", "flatten_messages", "normalise_image"]


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


def normalise_image(image: ImageInput, *, max_pixels: int, param: str) -> bytes:
    """PNG bytes onnxruntime-genai can read safely, or :class:`InvalidRequestError`.

    onnxruntime-genai decodes PNG with libpng (errors come back as exceptions) and anything
    else with libjpeg, whose error handler exits the whole process (measured: a BMP or a
    few garbage bytes end the server). So Pillow decodes every image first: a PNG it reads
    whole goes on as it is; anything else (JPEG included: the exit lives in its decoder)
    goes on re-encoded as an uncompressed PNG (the fastest to write and to read back:
    0.5 s for a 12-megapixel photo here, against 1.3 s at compression level 1).
    """
    if not image.data:
        raise InvalidRequestError("the image is empty", param=param)
    import PIL.Image  # here, not at import: a text model's server starts without Pillow's 20 ms

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            with PIL.Image.open(io.BytesIO(image.data)) as opened:
                if opened.width * opened.height > max_pixels:
                    raise InvalidRequestError(
                        f"the image is {opened.width}x{opened.height} pixels, more than the "
                        f"{max_pixels} this server accepts",
                        param=param,
                    )
                opened.load()  # truncated or corrupt data fails here, not in onnxruntime-genai
                if opened.format == "PNG":
                    return image.data
                # convert() copies even an RGB image: one decoded copy less held at the peak
                rgb = opened if opened.mode == "RGB" else opened.convert("RGB")
                out = io.BytesIO()
                rgb.save(out, format="PNG", compress_level=0)
    except InvalidRequestError:
        raise
    except PIL.UnidentifiedImageError:
        raise InvalidRequestError(
            "the image could not be decoded: not an image format Pillow reads", param=param
        ) from None
    except (
        OSError,
        ValueError,
        SyntaxError,
        PIL.Image.DecompressionBombError,
        PIL.Image.DecompressionBombWarning,
    ) as exc:
        raise InvalidRequestError(f"the image could not be decoded: {exc}", param=param) from exc
    return out.getvalue()
