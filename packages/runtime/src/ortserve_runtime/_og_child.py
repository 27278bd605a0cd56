"""The child side of :mod:`._og_process`: serves the parent's calls on the lanes it was
given, one thread per lane (the first lane's end ends the process). It imports only the
modules that load and check a model: the packages' ``__init__`` do not run here."""

from __future__ import annotations

import os
import pickle
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ._config import ModelConfig
from ._errors import InvalidRequestError, ModelLoadError
from ._memory import release_freed_memory
from ._og_process import LANES, TOKEN_VARIABLE

__all__: list[str] = []


class _Child:
    """What the child holds: the model, its adapters, generators and processed media."""

    def __init__(self) -> None:
        self.model: Any = None
        self.folder: Path | None = None
        self.config: ModelConfig | None = None
        self.adapters: Any = None
        self.processor: Any = None
        self.generators: dict[int, Any] = {}
        self.media: dict[int, Any] = {}
        self.next_media = 0
        self.fed_tokens: list[int] = []
        """A multimodal model's media tokens (``MediaProcessor.fed_tokens``)."""

    # Each op runs on the lane it was sent on; ops of different lanes run side by side.

    def load(self, folder: str, config: ModelConfig, every_core: bool) -> None:
        from ._folder import load_og_model

        self.folder, self.config = Path(folder), config
        self.model = load_og_model(self.folder, config, every_core=every_core)

    def check_runs(self, speculative: bool) -> None:
        from ._folder import GenaiFolder, check_og_runs

        assert self.folder is not None and self.config is not None
        check_og_runs(self.model, GenaiFolder.read(self.folder), self.config.provider, speculative=speculative)

    def load_adapter(self, name: str, path: str) -> None:
        import onnxruntime_genai as og

        if self.adapters is None:
            self.adapters = og.Adapters(self.model)
        self.adapters.load(path, name)

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)

    def load_processor(self, fed_tokens: Sequence[int]) -> None:
        self.processor = self.model.create_multimodal_processor()
        self.fed_tokens = list(fed_tokens)

    def image_tokens(self, with_image: str, without: str, pngs: Sequence[bytes]) -> list[int]:
        """The tokens each image adds to a prompt (for the rules in ``chat._image_tokens``)."""
        import onnxruntime_genai as og

        base = len(self.processor(without)["input_ids"].as_numpy().reshape(-1))
        return [
            len(self.processor(with_image, images=og.Images.open_bytes(png))["input_ids"].as_numpy().reshape(-1)) - base
            for png in pngs
        ]

    def process(
        self,
        text: str,
        images: Sequence[bytes],
        audios: Sequence[bytes],
        image_fields: Sequence[str],
        audio_fields: Sequence[str],
        max_image_pixels: int,
        model_type: str,
        param: str,
    ) -> tuple[list[int], int]:
        """The processor's inputs for a rendered chat and its media, kept under a new key;
        the prompt's ids go back. Images and a chat's audio are decoded here, each refused
        naming its field (Whisper's windows come as the WAVs og is given)."""
        import onnxruntime_genai as og

        from ._audio import og_wav
        from ._images import png_for_og

        if model_type != "whisper":
            audios = [og_wav(data, field) for data, field in zip(audios, audio_fields, strict=True)]

        def processed(rewrite_png: bool) -> tuple[list[bytes], Any]:
            pngs = [
                png_for_og(data, max_pixels=max_image_pixels, param=field, rewrite_png=rewrite_png)
                for data, field in zip(images, image_fields, strict=True)
            ]
            return pngs, self.processor(
                text,
                images=og.Images.open_bytes(*pngs) if pngs else None,
                audios=og.Audios.open_bytes(*audios) if audios else None,
            )

        try:
            try:
                pngs, inputs = processed(rewrite_png=False)
            except RuntimeError:
                # A PNG Pillow read whole may still be one libpng refuses (a chunk's checksum,
                # a chunk it does not know): once more with every image as Pillow writes it.
                if not any(data.startswith(b"\x89PNG") for data in images):
                    raise
                pngs, inputs = processed(rewrite_png=True)
            ids = [int(t) for t in inputs["input_ids"].as_numpy().reshape(-1)] if model_type != "whisper" else []
        except RuntimeError as exc:  # og reports undecodable audio and placeholder mismatches so
            what = "the audio could not be decoded" if model_type == "whisper" else "the media could not be processed"
            raise InvalidRequestError(f"{what}: {exc}", param=param) from exc
        if len(pngs) > 1:
            _check_padding(inputs, model_type)
        self.next_media += 1
        self.media[self.next_media] = inputs
        if images or audios:
            # The decoded media's memory, freed, stays in this thread's C heap otherwise:
            # thirty 1-25 megapixel images grew the process 216 -> 608 MiB (twenty-fourth probe).
            del pngs, audios
            release_freed_memory()
        return ids, self.next_media

    def start(
        self,
        key: int,
        max_length: int,
        speculates: bool,
        draft_tokens: int,
        adapter: str | None,
        media: int | None,
        prompt: Sequence[int],
    ) -> None:
        import onnxruntime_genai as og

        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=max_length)
        if speculates:
            params.set_search_options(do_sample=False)
            params.set_speculative_options(ngram_size=3, max_draft_tokens=draft_tokens, min_adaptive_k=1)
        generator = og.Generator(self.model, params)
        if adapter is not None:
            generator.set_active_adapter(self.adapters, adapter)
        if media is not None:
            generator.set_inputs(self.media[media])
        else:
            generator.append_tokens(list(prompt))
        self.generators[key] = generator

    def logits(self, key: int, tokens: Sequence[int]) -> Any:
        """The logits after appending ``tokens`` (none: where the generator stands)."""
        generator = self.generators[key]
        if tokens:
            generator.append_tokens(list(tokens))
        logits = generator.get_logits().reshape(-1)
        if self.fed_tokens:  # never sampled: fed back without media, the model's graph fails
            logits[self.fed_tokens] = float("-inf")
        return logits

    def og_step(self, key: int, known: int) -> tuple[list[int], int, int, bool, int]:
        """og generates the next tokens itself: those past the first ``known``, its draft
        counts, whether it is done and the sequence's length."""
        generator = self.generators[key]
        generator.generate_next_token()
        stats = generator.get_speculative_stats()
        sequence = generator.get_sequence(0)
        new = [int(t) for t in sequence[known:]]
        proposed, accepted = int(stats["draft_tokens_evaluated"]), int(stats["draft_tokens_accepted"])
        return new, proposed, accepted, bool(generator.is_done()), len(sequence)

    def forget(self, forgotten: list[tuple[str, int]]) -> None:
        for kind, key in forgotten:
            (self.media if kind == "media" else self.generators).pop(key, None)


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


_OPS: dict[str, Callable[..., Any]] = {
    "load": _Child.load,
    "check_runs": _Child.check_runs,
    "load_adapter": _Child.load_adapter,
    "unload_adapter": _Child.unload_adapter,
    "load_processor": _Child.load_processor,
    "image_tokens": _Child.image_tokens,
    "process": _Child.process,
    "start": _Child.start,
    "logits": _Child.logits,
    "og_step": _Child.og_step,
}


def _received(connection: Connection) -> Iterator[bytes]:
    """The out-of-band buffers that follow a call's message (its media files), each read
    when the unpickling reaches it."""
    while True:
        yield connection.recv_bytes()


def _serve(child: _Child, connection: Connection) -> None:
    while True:
        try:
            forgotten, op, args = pickle.loads(connection.recv_bytes(), buffers=_received(connection))
        except (EOFError, OSError):
            return
        child.forget(forgotten)
        try:
            answer: tuple[str, Any] = ("ok", _OPS[op](child, *args))
        except InvalidRequestError as exc:
            answer = ("err", ("invalid", (str(exc), exc.param)))
        except ModelLoadError as exc:
            answer = ("err", ("load", str(exc)))
        except ValueError as exc:  # a setting og refuses (provider options...)
            answer = ("err", ("value", str(exc)))
        except Exception as exc:  # noqa: BLE001  # og's RuntimeError (any failure) goes back to the caller
            answer = ("err", ("other", str(exc)))
        try:
            value = answer[1]
            if answer[0] == "ok" and type(value).__name__ == "ndarray":  # logits: their bytes as they are
                connection.send_bytes(pickle.dumps(("array", (value.dtype.str, value.shape))))
                connection.send_bytes(memoryview(value.reshape(-1)).cast("B"))
            else:
                connection.send_bytes(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            return


def main(host: str, port: int) -> None:
    """Connect the lanes to the parent at ``host``:``port`` (each opens with the token in
    the environment) and serve them."""
    # og imports NumPy on its first call (0.3 s): meanwhile, while the model loads.
    threading.Thread(target=__import__, args=("numpy",), daemon=True).start()
    child = _Child()
    token = os.environ.pop(TOKEN_VARIABLE).encode()
    lanes = []
    for _ in LANES:
        sock = socket.create_connection((host, port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see OgProcess._accept
        lane = Connection(sock.detach())
        lane.send_bytes(token)
        lanes.append(lane)
    threads = [threading.Thread(target=_serve, args=(child, lane), daemon=True) for lane in lanes[1:]]
    for thread in threads:
        thread.start()
    _serve(child, lanes[0])  # the step lane; the parent closing it (or dying) ends the child
    os._exit(0)  # og's objects are not torn down: the process ends here
