"""Prompts with images and audio (Phi-3-vision, Phi-4-multimodal, Qwen2.5-VL, Qwen3-VL, Gemma 3 and 4):
each family's placeholders in the chat text, and onnxruntime-genai's multimodal processor.

The processor turns the rendered text and the media (images decoded safely first, see
``_images``) into the inputs an ``og.Generator`` takes; both run in the model's og process
(see ``_og_process``), which keeps the inputs until the ``og-generator`` engine runs them.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .._audio import audio_header, og_samples
from .._config import ModelConfig
from .._errors import ContextLengthError, InvalidRequestError, ModelLoadError
from .._folder import GenaiFolder
from ._image_tokens import ImageTokenRule, calibrate, image_size, probe_images
from ._media import AudioInput, ImageInput, Media, Placeholders
from ._stream import Prompt

if TYPE_CHECKING:
    from .._og_process import OgProcess

__all__ = ["MULTIMODAL_TYPES", "MediaProcessor", "media_of"]

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


def _served(model: Mapping[str, Any]) -> Placeholders:
    """The placeholders of ``model``'s family (genai_config's ``model``) for the media its
    folder has the graphs for (``vision``, ``speech``)."""
    family = _FAMILIES.get(str(model.get("type")), {})
    return {kind: place for kind, place in family.items() if ("vision" if kind is ImageInput else "speech") in model}


def media_of(model: Mapping[str, Any]) -> frozenset[str]:
    """What a model (genai_config's ``model``) takes in its chats besides text: ``image``,
    ``audio``; nothing for a type not served here."""
    return frozenset("image" if kind is ImageInput else "audio" for kind in _served(model))


_DECODING_AT_ONCE = 2
"""Requests of a model whose media are handed to its og process at once: the process decodes
and processes one request's at a time (its media lane), so a second one waits ready, and a
third would only wait too, holding a worker thread. Decoded in the server's process before,
twelve 25-megapixel images at once took it +1.6 GB without this bound."""


class MediaProcessor:
    """Turns a rendered chat and its media into a :class:`Prompt` for one model."""

    def __init__(self, folder: GenaiFolder, og: OgProcess, config: ModelConfig) -> None:
        if folder.model_type not in _FAMILIES:
            raise ModelLoadError(
                f"{folder.path} is a {folder.model_type!r} model; the multimodal types served are {sorted(_FAMILIES)}",
                path=folder.path,
            )
        sections = folder.model
        self.placeholders = _served(sections)
        self.modalities = media_of(sections)
        self.placeholder_text = _placeholder_pattern(_FAMILIES[folder.model_type].values())
        """The family's media placeholders as a caller might type them (``<|image_7|>``):
        the processor would take typed ones for media of the request's."""
        self.config = config
        self.model_type = folder.model_type
        self.fed_tokens = frozenset(
            int(sections[key])
            for key in ("image_token_id", "video_token_id", "audio_token_id")
            if isinstance(sections.get(key), int)
        )
        """Tokens og's processor puts where media go, whose embeddings the model takes from
        the media: fed to it without them (a prompt's ids, or sampled), its graph fails (a 500:
        twenty-seventh probe, issue 45). They are never sampled (the og process masks them)
        and a request may not give them."""
        self.max_sequence_length = folder.max_sequence_length(config)
        self._og = og
        self._decoding = threading.BoundedSemaphore(_DECODING_AT_ONCE)
        self.held = threading.BoundedSemaphore(config.multimodal_concurrency + _DECODING_AT_ONCE)
        """Room for the processed images and audio the og process keeps, one a prompt until
        the prompt is gone: the engine's running requests' and the next few. Kept for every
        queued request, twelve 25-megapixel images' inputs grew the og process +720 MiB
        while they waited for the engine. (A caller of :meth:`prepare` that keeps more such
        prompts alive waits for room.)"""
        self.preparing = ThreadPoolExecutor(_DECODING_AT_ONCE, thread_name_prefix="ortserve-media")
        """Where asyncio callers prepare this model's prompts (:meth:`ChatModel.aprepare_chat`):
        waiting in the shared pool, twelve requests' large images held its six threads and
        queued work of every other model behind them (a text chat waited 7.5 s)."""
        try:
            og.call("media", "load_processor", sorted(self.fed_tokens))
            self.image_tokens = self._image_token_rule(folder) if ImageInput in self.placeholders else None
        except RuntimeError as exc:  # onnxruntime-genai raises plain RuntimeError for broken folders
            raise ModelLoadError(
                f"{folder.path} could not be loaded by onnxruntime-genai: {exc}", path=folder.path
            ) from exc

    def _image_token_rule(self, folder: GenaiFolder) -> ImageTokenRule | None:
        """How many tokens an image of a size makes here (see ``_image_tokens``), if a rule
        reproduces og's counts on the probe images."""
        try:
            processor = json.loads((folder.path / "processor_config.json").read_text())
        except (OSError, ValueError):
            return None
        placeholder = self.placeholders[ImageInput](1)
        counts = self._og.call("media", "image_tokens", f"Look: {placeholder} ok", "Look:  ok", probe_images())
        return calibrate(self.model_type, processor, counts)

    def prepare(self, text: str, media: Media) -> Prompt:
        images = [(where, part) for where, part in media if isinstance(part, ImageInput)]
        audios = [(where, part.data) for where, part in media if isinstance(part, AudioInput)]
        if len(images) > self.config.max_images:
            raise InvalidRequestError(
                f"the messages hold {len(images)} images; this server takes at most {self.config.max_images}",
                param="messages",
            )
        sizes = [image_size(image.data) for _, image in images]  # from their headers
        self._check_image_tokens(sizes)  # the context's bound first: the more telling one
        self._check_image_pixels(sizes, [where for where, _ in images])
        self._check_audio_samples(audios)
        room = self.held if images or audios else None
        if room is not None:
            room.acquire()  # given back with the processed inputs, when the prompt is gone
        try:
            with self._decoding:  # a worker thread waits here holding only the encoded images
                ids, inputs = self._og.process(
                    text,
                    [(where, image.data) for where, image in images],
                    audios,
                    self.model_type,
                    max_image_pixels=self.config.max_image_pixels,
                    room=room,
                )
        except BaseException:
            if room is not None:
                room.release()
            raise
        return Prompt(ids, inputs)

    def _check_image_pixels(self, sizes: list[tuple[int, int] | None], places: list[str]) -> None:
        """Refuse, before any pixel is decoded, images whose pixels together pass the bound
        (one whose header cannot be read, or past ``max_image_pixels``, is refused on its
        own, naming it)."""
        each = [size[0] * size[1] for size in sizes if size is not None]
        pixels = sum(count for count in each if count <= self.config.max_image_pixels)
        if pixels > self.config.max_request_image_pixels:
            raise InvalidRequestError(
                f"the image{'s' if len(sizes) > 1 else ''} hold{'' if len(sizes) > 1 else 's'} {pixels} pixels"
                " in all, more than the "
                f"{self.config.max_request_image_pixels} this server decodes for one request: send them smaller",
                param="messages" if len(places) > 1 else places[0],  # one image: its part, as audio
            )

    def _check_audio_samples(self, audios: list[tuple[str, bytes]]) -> None:
        """Refuse, before any sample is decoded, clips whose headers cannot be read (each
        named) or whose samples together pass the bound (see ``_audio``)."""
        samples = 0
        for where, data in audios:
            if not data:
                raise InvalidRequestError("the audio is empty", param=where)
            samples += og_samples(*audio_header(data, where))
        bound = self.config.max_request_audio_samples
        if samples > bound:
            raise InvalidRequestError(
                f"the audio clip{'s' if len(audios) > 1 else ''} hold{'' if len(audios) > 1 else 's'} {samples} "
                f"samples (frames x channels; below 16 kHz, at 16 kHz) in all, more than the {bound} this server decodes for one request "
                f"({bound / 16_000:.0f} s of 16 kHz mono): send them shorter",
                param="messages" if len(audios) > 1 else audios[0][0],
            )

    def _check_image_tokens(self, sizes: list[tuple[int, int] | None]) -> None:
        """Refuse, before any pixel is decoded, images whose tokens alone pass the context
        (each counted the way up it makes fewer: a photo's EXIF orientation, which the
        header read here does not say, may turn it; og's count of the prompt decides)."""
        rule = self.image_tokens
        if rule is None or not sizes:
            return
        tokens = sum(min(rule(w, h), rule(h, w)) for w, h in filter(None, sizes))
        if tokens >= self.max_sequence_length:
            raise ContextLengthError(
                f"the {len(sizes)} image{'s' if len(sizes) > 1 else ''} alone make {tokens} tokens, more than "
                f"this model's limit of {self.max_sequence_length} tokens",
                param="messages",
            )


def _placeholder_pattern(placeholders: Iterable[Callable[[int], str]]) -> re.Pattern[str]:
    """What matches each placeholder as made for any media number."""
    alternatives = []
    for placeholder in placeholders:
        first, second = placeholder(1).strip(), placeholder(2).strip()
        if first != second and first.count("1") == 1:
            before, after = first.split("1")
            alternatives.append(f"{re.escape(before)}[0-9]+{re.escape(after)}")
        else:
            alternatives.append(re.escape(first))
    return re.compile("|".join(alternatives))
