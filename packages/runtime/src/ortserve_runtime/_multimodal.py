"""Multimodal chat models (Phi-3-vision, Phi-4-multimodal, Qwen2.5-VL, Gemma 3) on onnxruntime-genai.

These models do not run on ``og.Engine`` ("Expected a decoder-only model") nor on the text
engine of :mod:`._generation` (their decoder takes embeddings that the vision and speech
graphs produce), so each request gets its own ``og.Generator``:

* ``prepare_chat`` renders the chat with the family's media placeholders, decodes the media
  safely (see :func:`normalise_image`) and runs onnxruntime-genai's multimodal processor;
* one owner thread runs up to ``multimodal_concurrency`` generators, one token each in
  turn, so concurrent streams all advance; a new request's prompt (thousands of tokens
  with an image) goes in on a second thread meanwhile, so it does not stall them; more
  requests wait in a queue, and a cancelled one leaves the queue at once or stops at its
  next token, freeing its cache;
* sampling, grammars, stop strings and token accounting are the text engine's own (the
  logits come back to the host), so both kinds of model behave the same.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import onnxruntime_genai as og

from ._config import ModelConfig
from ._errors import EngineClosedError, EngineError, InvalidRequestError, ModelLoadError
from ._generation import ChatModel, Prompt, _read_json, _Request
from ._media import AudioInput, ImageInput, Media, Placeholders, normalise_image

__all__ = ["MULTIMODAL_TYPES", "MultimodalModel"]

_FAMILIES: dict[str, Placeholders] = {
    # What each family's prompt format (and so onnxruntime-genai's processor) expects where
    # a media part sits. phi3v is tested here (tests/fixtures/tiny-phi3v); the others follow
    # their models' published chat templates.
    "phi3v": {ImageInput: lambda n: f"<|image_{n}|>\n"},
    "phi4mm": {ImageInput: lambda n: f"<|image_{n}|>", AudioInput: lambda n: f"<|audio_{n}|>"},
    "qwen2_5_vl": {ImageInput: lambda n: "<|vision_start|><|image_pad|><|vision_end|>"},
    "gemma3": {ImageInput: lambda n: "<start_of_image>"},
}
MULTIMODAL_TYPES = frozenset(_FAMILIES)
"""``model.type`` values of genai_config.json this module serves."""


class MultimodalModel(ChatModel):
    """A chat model that also reads images (and audio, where the model has a speech encoder)."""

    def __init__(self, name: str, folder: Path, config: ModelConfig) -> None:
        genai = _read_json(folder / "genai_config.json")
        model_type = str(genai.get("model", {}).get("type", ""))
        if model_type not in _FAMILIES:
            raise ModelLoadError(
                f"{folder} is a {model_type!r} model; the multimodal types served are {sorted(_FAMILIES)}",
                path=folder,
            )
        super().__init__(name, folder, config, genai)
        sections = genai["model"]
        self._placeholders = {
            kind: placeholder
            for kind, placeholder in _FAMILIES[model_type].items()
            if ("vision" in sections if kind is ImageInput else "speech" in sections)
        }
        self.modalities = frozenset("image" if kind is ImageInput else "audio" for kind in self._placeholders)
        try:
            self._model = og.Model(str(folder))
            self._processor = self._model.create_multimodal_processor()
        except Exception as exc:  # onnxruntime-genai raises plain RuntimeError for broken folders
            raise ModelLoadError(f"{folder} could not be loaded by onnxruntime-genai: {exc}", path=folder) from exc
        self._processor_lock = threading.Lock()
        self.concurrency = config.multimodal_concurrency
        self._running: dict[_Request, Any] = {}
        """Requests being generated, each with its og.Generator."""
        self._starting: dict[_Request, concurrent.futures.Future[Any]] = {}
        """Requests whose prompt goes in on the prefill thread (an image prompt takes long;
        the running streams keep stepping meanwhile: og generators run side by side)."""
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._running) + len(self._starting)

    # -- prompts ---------------------------------------------------------------------------

    def _prepare(self, text: str, media: Media) -> Prompt:
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
            with self._processor_lock:
                inputs = self._processor(
                    text,
                    images=og.Images.open_bytes(*pngs) if pngs else None,
                    audios=og.Audios.open_bytes(*audios) if audios else None,
                )
            ids = [int(t) for t in inputs["input_ids"].as_numpy().reshape(-1)]
        except RuntimeError as exc:  # og reports undecodable audio and placeholder mismatches so
            raise InvalidRequestError(f"the media could not be processed: {exc}", param="messages") from exc
        return Prompt(ids, inputs)

    # -- owner thread ----------------------------------------------------------------------

    def _run(self) -> None:
        prefill = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"ortserve-prefill-{self.name}")
        starting = self._starting
        while True:
            with self._cond:
                while not (
                    self._inbox
                    or self._running
                    or self._closing
                    or self._cancels
                    or any(f.done() for f in starting.values())
                ):
                    self._cond.wait()
                if self._closing:
                    break
                cancels, self._cancels = self._cancels, set()
                ended = [r for r in cancels if r in self._inbox or r in self._running]
                for request in ended:
                    if request in self._inbox:
                        self._inbox.remove(request)
                    self._running.pop(request, None)
                if self._inbox and not starting and len(self._running) < self.concurrency:
                    admitted = self._inbox.popleft()
                    starting[admitted] = prefill.submit(self._start, admitted)
                    starting[admitted].add_done_callback(lambda _: self._wake())
            for request in ended:
                request.deliver(request.final("cancelled"))
            for request, future in [(r, f) for r, f in starting.items() if f.done()]:
                del starting[request]
                self._started(request, future)
            for request, generator in list(self._running.items()):
                self._guarded(request, self._step, request, generator)
        prefill.shutdown(wait=True)
        error = EngineClosedError(f"model {self.name!r} was closed")
        for request in [*self._inbox, *self._running, *starting]:
            request.deliver(error)
        self._inbox.clear()
        self._running.clear()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _guarded(self, request: _Request, action: Any, *args: Any) -> None:
        """Run one request's step; an onnxruntime failure fails that request only."""
        try:
            action(*args)
        except Exception as exc:  # noqa: BLE001
            self._running.pop(request, None)
            request.deliver(EngineError(f"generation failed: {exc}"))

    def _start(self, request: _Request) -> Any:
        """On the prefill thread: a generator with the prompt in its cache."""
        params = og.GeneratorParams(self._model)
        params.set_search_options(max_length=len(request.prompt) + request.max_tokens)
        generator = og.Generator(self._model, params)
        if request.media is not None:
            generator.set_inputs(request.media)
        else:
            generator.append_tokens(request.prompt)
        return generator

    def _started(self, request: _Request, future: concurrent.futures.Future[Any]) -> None:
        if request.cancelled:
            request.deliver(request.final("cancelled"))
            return
        error = future.exception()
        if error is not None:
            request.deliver(EngineError(f"generation failed: {error}"))
            return
        self._running[request] = future.result()
        self._guarded(request, self._accept, request, self._running[request])

    def _step(self, request: _Request, generator: Any) -> None:
        generator.append_tokens([request.tokens[-1]])
        self._accept(request, generator)

    def _accept(self, request: _Request, generator: Any) -> None:
        event = request.advance(generator.get_logits().reshape(-1), self.tokenizer, self.eos_token_ids)
        if event.finish_reason is not None:
            del self._running[request]
        request.deliver(event)
