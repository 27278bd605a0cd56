"""Prompts with images and audio (Phi-3-vision, Phi-4-multimodal, Qwen2.5-VL, Qwen3-VL, Gemma 3 and 4):
each family's placeholders in the chat text, and onnxruntime-genai's multimodal processor.

The processor turns the rendered text and the media (decoded safely first, see
:func:`normalise_image`) into the inputs an ``og.Generator`` takes; the ``og-generator``
engine runs them.
"""

from __future__ import annotations

import threading
from typing import Any

import onnxruntime_genai as og

from .._config import ModelConfig
from .._errors import InvalidRequestError, ModelLoadError
from .._folder import GenaiFolder
from ._media import AudioInput, ImageInput, Media, Placeholders, normalise_image
from ._request import Prompt

__all__ = ["MULTIMODAL_TYPES", "MediaProcessor"]

_FAMILIES: dict[str, Placeholders] = {
    # What each family's prompt format (and so onnxruntime-genai's processor) expects where
    # a media part sits, all tested (tests/fixtures) but phi4mm, which follows its model's
    # published chat template. og's Qwen processor repeats
    # the <|image_pad|> once per image feature; its Gemma 4 one expands each <|image> and
    # <|audio> marker into the soft tokens between it and its end marker.
    "phi3v": {ImageInput: lambda n: f"<|image_{n}|>\n"},
    "phi4mm": {ImageInput: lambda n: f"<|image_{n}|>", AudioInput: lambda n: f"<|audio_{n}|>"},
    "qwen2_5_vl": {ImageInput: lambda n: "<|vision_start|><|image_pad|><|vision_end|>"},
    "qwen3_vl": {ImageInput: lambda n: "<|vision_start|><|image_pad|><|vision_end|>"},
    "gemma3": {ImageInput: lambda n: "<start_of_image>"},
    "gemma4": {ImageInput: lambda n: "<|image>", AudioInput: lambda n: "<|audio>"},
    "mistral3": {ImageInput: lambda n: "[IMG]"},
    "lfm2_vl": {ImageInput: lambda n: "<image>"},
}
MULTIMODAL_TYPES = frozenset(_FAMILIES)
"""``model.type`` values of genai_config.json served with images/audio."""


class MediaProcessor:
    """Turns a rendered chat and its media into a :class:`Prompt` for one model."""

    def __init__(self, folder: GenaiFolder, og_model: Any, config: ModelConfig) -> None:
        if folder.model_type not in _FAMILIES:
            raise ModelLoadError(
                f"{folder.path} is a {folder.model_type!r} model; the multimodal types served are {sorted(_FAMILIES)}",
                path=folder.path,
            )
        sections = folder.model
        self.placeholders: Placeholders = {
            kind: placeholder
            for kind, placeholder in _FAMILIES[folder.model_type].items()
            if ("vision" in sections if kind is ImageInput else "speech" in sections)
        }
        self.modalities = frozenset("image" if kind is ImageInput else "audio" for kind in self.placeholders)
        self.config = config
        self.model_type = folder.model_type
        try:
            self._processor = og_model.create_multimodal_processor()
        except Exception as exc:  # onnxruntime-genai raises plain RuntimeError for broken folders
            raise ModelLoadError(
                f"{folder.path} could not be loaded by onnxruntime-genai: {exc}", path=folder.path
            ) from exc
        self._lock = threading.Lock()

    def prepare(self, text: str, media: Media) -> Prompt:
        images = [(where, part) for where, part in media if isinstance(part, ImageInput)]
        audios = [part.data for _, part in media if isinstance(part, AudioInput)]
        if len(images) > self.config.max_images:
            raise InvalidRequestError(
                f"the messages hold {len(images)} images; this server takes at most {self.config.max_images}",
                param="messages",
            )
        pngs = [normalise_image(image, max_pixels=self.config.max_image_pixels, param=where) for where, image in images]
        for where, part in media:
            if isinstance(part, AudioInput) and not part.data:
                raise InvalidRequestError("the audio is empty", param=where)
        try:
            with self._lock:
                inputs = self._processor(
                    text,
                    images=og.Images.open_bytes(*pngs) if pngs else None,
                    audios=og.Audios.open_bytes(*audios) if audios else None,
                )
            ids = [int(t) for t in inputs["input_ids"].as_numpy().reshape(-1)]
        except RuntimeError as exc:  # og reports undecodable audio and placeholder mismatches so
            raise InvalidRequestError(f"the media could not be processed: {exc}", param="messages") from exc
        if len(pngs) > 1:
            _check_padding(inputs, self.model_type)
        return Prompt(ids, inputs)


def _check_padding(inputs: Any, model_type: str) -> None:
    """Refuse images og's processor batched wrongly, before the model runs them.

    og 0.18's Pixtral processor (mistral3) pads several images to the tallest one's height
    but the last one's width, and then fails inside generation; a request whose images fit
    their padded tensor is fine.
    """
    try:
        pixels = inputs["pixel_values"].as_numpy().shape
        sizes = inputs["image_sizes"].as_numpy()
    except RuntimeError:  # a family without image_sizes
        return
    if len(pixels) != 4:  # phi3v's image_sizes describe crops, not padding
        return
    if (sizes[:, 0] > pixels[2]).any() or (sizes[:, 1] > pixels[3]).any():
        raise InvalidRequestError(
            f"onnxruntime-genai cannot batch these images for a {model_type} model: images of different "
            "sizes must go in separate requests (or be given the same size)",
            param="messages",
        )
