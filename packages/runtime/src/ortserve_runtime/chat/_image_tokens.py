"""An image's prompt tokens counted from its size, before any pixel is decoded.

Eight 5000x5000 PNGs sent to Phi-3-vision were decoded, resized and run through the
processor (6 s, 2.4 GB) only to learn that they made 20,096 tokens for a 4,096-token
model. Each family's processor turns an image's width and height into a number of tokens
by a known rule (Phi-3-vision's HD crops, Qwen's ``smart_resize``...), with parameters from
its ``processor_config.json`` that onnxruntime-genai does not always read as written (it
crops Phi-3-vision images 16 ways where the file says 4). So a rule is kept for a model only
when it reproduces og's own counts on probe images at load; the sizes then come from the
image headers (Pillow reads no pixel for them), and a request whose images alone cannot fit
is refused at once.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from .._images import image_header

__all__ = ["PROBE_SIZES", "ImageTokenRule", "calibrate", "image_size", "probe_images"]

ImageTokenRule = Callable[[int, int], int]
"""Tokens of an image of (width, height), its placeholder's own text excluded."""

PROBE_SIZES = ((64, 32), (40, 120), (333, 201), (1000, 10), (450, 700))
"""Widths and heights og's processor counts at load: both orientations, extreme and odd ratios."""


def probe_images() -> list[bytes]:
    """One small PNG per :data:`PROBE_SIZES`."""
    import PIL.Image  # on first use (multimodal models only), as in _media

    images = []
    for width, height in PROBE_SIZES:
        out = io.BytesIO()
        PIL.Image.new("RGB", (width, height), (90, 120, 150)).save(out, format="PNG", compress_level=0)
        images.append(out.getvalue())
    return images


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from an image's header (read without Pillow: some formats' headers
    cost it a decode, see ``_images``), or ``None`` when it cannot be told."""
    header = image_header(data)
    return None if header is None else header[1:]


def calibrate(model_type: str, processor: Mapping[str, Any], counts: Sequence[int]) -> ImageTokenRule | None:
    """The rule among ``model_type``'s candidates that gives og's ``counts`` for
    :data:`PROBE_SIZES` (up to one constant, the text og adds around every image), or
    ``None`` when none does (the images are then counted by processing them)."""
    for rule in _candidates(model_type, _attrs(processor)):
        offsets = {count - rule(w, h) for count, (w, h) in zip(counts, PROBE_SIZES, strict=True)}
        if len(offsets) == 1:
            offset = offsets.pop()
            return lambda width, height, rule=rule: rule(width, height) + offset  # type: ignore[misc]
    return None


def _attrs(processor: Mapping[str, Any]) -> dict[str, Any]:
    """The processor's transforms' attributes, by transform type."""
    transforms = processor.get("processor", {}).get("transforms", [])
    found: dict[str, Any] = {}
    for transform in transforms if isinstance(transforms, list) else []:
        operation = transform.get("operation", {}) if isinstance(transform, dict) else {}
        found[str(operation.get("type"))] = operation.get("attrs") or {}
    return found


def _candidates(model_type: str, attrs: Mapping[str, Any]) -> Iterator[ImageTokenRule]:
    if model_type == "phi3v":
        given = attrs.get("Phi3ImageTransform", {})
        per_crop = int(given.get("num_img_tokens", 144))
        for crops in dict.fromkeys([int(given.get("num_crops", 16)), 16, *range(1, 65)]):
            yield lambda w, h, crops=crops: _phi3v(w, h, crops, per_crop)  # type: ignore[misc]
    resize = attrs.get("Resize", {})
    if resize.get("smart_resize"):
        patch, merge = int(resize.get("patch_size", 14)), int(resize.get("merge_size", 2))
        low, high = int(resize.get("min_pixels", 0)), int(resize.get("max_pixels", 1 << 40))
        for layout in (_grid, _grid_with_row_breaks):
            yield lambda w, h, layout=layout: layout(*_smart_resize(w, h, patch * merge, low, high), patch * merge)  # type: ignore[misc]
    yield lambda w, h: 0  # a fixed number per image (Gemma 3: every image is resized to one size)


def _phi3v(width: int, height: int, crops: int, per_crop: int) -> int:
    """Phi-3-vision's HD transform: the image, turned landscape, is scaled to the most
    336-pixel crops that fit ``crops``, padded to whole crops and turned back; each crop
    and the global view take ``per_crop`` tokens, and each crop row ends with a newline's
    ``per_crop // 12`` tokens."""
    transposed = width < height
    if transposed:
        width, height = height, width
    ratio = width / height
    scale = 1
    while scale * math.ceil(scale / ratio) <= crops:
        scale += 1
    scale -= 1
    new_width = scale * 336
    padded_height = math.ceil(int(new_width / ratio) / 336) * 336
    rows, columns = padded_height // 336, new_width // 336
    if transposed:
        rows, columns = columns, rows
    return (rows * columns + 1) * per_crop + 1 + (rows + 1) * (per_crop // 12)


def _smart_resize(width: int, height: int, factor: int, low: int, high: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize``: sides rounded to ``factor``, the area kept within
    ``low`` and ``high`` pixels, the aspect ratio nearly kept."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > high:
        beta = math.sqrt(height * width / high)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < low:
        beta = math.sqrt(low / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return w, h


def _grid(width: int, height: int, cell: int) -> int:
    return (width // cell) * (height // cell)


def _grid_with_row_breaks(width: int, height: int, cell: int) -> int:
    """Pixtral: a break token after every row of cells."""
    return (width // cell + 1) * (height // cell)
