"""Names to models: what folder a name points at, whether it is loaded, and loading it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ._config import EngineName, ModelConfig
from ._embeddings import EmbeddingModel
from ._errors import ModelLoadError, ModelNotFoundError
from ._folder import GenaiFolder, load_og_model
from ._rerank import RerankModel
from ._speech import SpeechModel
from ._threads import OwnerThread
from .chat import MULTIMODAL_TYPES, ChatModel, MediaProcessor
from .engines import Engine, OgEngine, OgGeneratorEngine, OrtCpuEngine
from .engines._adapters import check_adapters

__all__ = [
    "ModelKind",
    "ModelRegistry",
    "ModelState",
    "ModelStatus",
    "detect_model_kind",
    "load_chat_model",
    "pick_engine",
]

ModelKind = Literal["generative", "embedding", "rerank", "speech"]
ModelState = Literal["unloaded", "loading", "ready", "error"]
Model = ChatModel | EmbeddingModel | RerankModel | SpeechModel


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """What :meth:`ModelRegistry.status` reports for one model."""

    name: str
    path: Path
    kind: ModelKind
    state: ModelState
    error: str | None = None
    provider: str = "cpu"
    """The execution provider the model runs (or will run) on."""
    engine: str | None = None
    """The engine of a loaded generative model (``ort-cpu``, ``og-engine``, ``og-generator``)."""


def detect_model_kind(folder: Path) -> ModelKind:
    """Recognise a model folder, or raise :class:`ModelLoadError` naming the path."""
    if not folder.exists():
        raise ModelLoadError(f"model folder {folder} does not exist", path=folder)
    if not folder.is_dir():
        raise ModelLoadError(f"{folder} is not a folder", path=folder)
    config_path = folder / "genai_config.json"
    if config_path.exists():
        try:
            model_type = json.loads(config_path.read_text(encoding="utf-8")).get("model", {}).get("type")
        except (OSError, ValueError, AttributeError):
            return "generative"  # loading it reports what is wrong, naming the file
        return "speech" if model_type == "whisper" else "generative"
    has_onnx = (folder / "model.onnx").exists() or (folder / "onnx" / "model.onnx").exists()
    if has_onnx and ((folder / "tokenizer.json").exists() or (folder / "tokenizer.model").exists()):
        return "rerank" if _is_sequence_classifier(folder) else "embedding"
    raise ModelLoadError(
        f"{folder} is not a model folder: expected genai_config.json (generative or speech model) "
        "or an ONNX encoder with tokenizer.json (embedding model; a *ForSequenceClassification "
        "config.json makes it a rerank model)",
        path=folder,
    )


def _is_sequence_classifier(folder: Path) -> bool:
    """config.json's architectures name a ``*ForSequenceClassification`` (a cross-encoder)."""
    try:
        architectures = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        return False  # no config.json, or not one of transformers': an embedding model
    return isinstance(architectures, list) and any(
        isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures
    )


def pick_engine(folder: GenaiFolder, config: ModelConfig) -> EngineName:
    """The engine for ``folder`` on ``config.provider`` (``config.engine`` unless ``auto``).

    auto: multimodal folders run on og-generator (og.Engine takes decoder-only models);
    text on the CPU provider on ort-cpu (continuous batching, measured faster than og
    there); text on another provider on og-engine where the folder was built for paged
    attention (dynamic batching), else og-generator (og.Engine's static batches make a
    newcomer wait for a whole batch to finish). With LoRA adapters, og-generator there too:
    og.Engine takes no adapter per request.
    """
    if config.engine != "auto":
        return config.engine
    if folder.model_type in MULTIMODAL_TYPES:
        return "og-generator"
    if config.provider == "cpu":
        return "ort-cpu"
    return "og-engine" if folder.paged_attention and not config.adapters else "og-generator"


def load_chat_model(name: str, path: Path, config: ModelConfig) -> ChatModel:
    """A generative model: the front (:class:`ChatModel`) over the engine :func:`pick_engine` chose."""
    folder = GenaiFolder.read(path)
    multimodal = folder.model_type in MULTIMODAL_TYPES
    choice = pick_engine(folder, config)
    folder.tokenizer_path  # noqa: B018  # a missing tokenizer is named before an engine loads
    if (folder.is_multimodal and not multimodal) or folder.is_encoder_decoder:
        raise ModelLoadError(
            f"{path} is a multimodal or encoder-decoder model ({folder.model_type}); the multimodal types served "
            f"are {sorted(MULTIMODAL_TYPES)}, and decoder-only text models",
            path=path,
        )
    if multimodal and choice != "og-generator":
        raise ModelLoadError(
            f"{path} is a multimodal model ({folder.model_type}); it runs on the og-generator engine only, "
            f"not {choice}",
            path=path,
        )
    if config.adapters and choice == "og-engine":
        raise ModelLoadError(
            f"{path}: the og-engine engine cannot serve LoRA adapters (onnxruntime-genai's og.Engine takes no "
            "adapter per request); use --engine og-generator or auto",
            path=path,
        )
    adapters = check_adapters(folder, config.adapters)
    engine: Engine
    media = None
    if choice == "ort-cpu":
        engine = OrtCpuEngine(name, folder, config, folder.max_sequence_length(config), adapters)
    else:
        og_model = load_og_model(path, config)
        media = MediaProcessor(folder, og_model, config) if multimodal else None
        if choice == "og-engine":
            engine = OgEngine(
                name,
                og_model,
                config,
                folder=path,
                dynamic=folder.paged_attention,
                shortest_sequence=folder.shortest_sequence,
            )
        else:
            concurrency = config.multimodal_concurrency if multimodal else config.max_batch_size
            engine = OgGeneratorEngine(
                name,
                og_model,
                config,
                concurrency=concurrency,
                shortest_sequence=folder.shortest_sequence,
                adapters=adapters,
            )
    try:
        return ChatModel(name, folder, config, engine, media)
    except BaseException:
        if isinstance(engine, OwnerThread):
            engine.shutdown()
        raise


class _Entry:
    def __init__(self, name: str, path: Path, kind: ModelKind, config: ModelConfig) -> None:
        self.name = name
        self.path = path
        self.kind = kind
        self.config = config
        self.model: Any = None
        self.error: str | None = None
        self.loading: asyncio.Task[Any] | None = None


class ModelRegistry:
    """Models by name. Loading runs in a worker thread so the event loop keeps serving.

    ``add`` only checks that the folder is a model; ``get`` loads on first use (or call
    ``load`` up front); ``unload`` closes a model and frees its memory; ``status`` reports.
    """

    def __init__(self, config: ModelConfig | None = None) -> None:
        self.config = config or ModelConfig()
        self._entries: dict[str, _Entry] = {}

    def add(
        self, name: str, path: str | Path, config: ModelConfig | None = None, *, kind: ModelKind | None = None
    ) -> ModelKind:
        """Register a folder under ``name`` (run with ``config``, else the registry's);
        raises :class:`ModelLoadError` if it is no model. ``kind`` overrides what the folder
        says between the two kinds an ONNX encoder folder can be (``embedding``, ``rerank``)."""
        folder = Path(path).expanduser().resolve()
        detected = detect_model_kind(folder)
        encoders = ("embedding", "rerank")
        if kind is not None and kind != detected and not (kind in encoders and detected in encoders):
            raise ValueError(f"model {name!r}: {folder} is a {detected} model folder, it cannot be served as {kind}")
        kind = kind or detected
        if name in self._entries:
            raise ValueError(f"a model named {name!r} is already registered")
        if config is not None and kind != "generative" and config.engine != "auto":
            raise ValueError(
                f"model {name!r} is a {kind} model: the engine ({config.engine}) applies to generative models only"
            )
        if kind != "generative" and (config or self.config).adapters:
            raise ValueError(f"model {name!r} is a {kind} model: LoRA adapters apply to generative models only")
        self._entries[name] = _Entry(name, folder, kind, config or self.config)
        return kind

    def names(self) -> list[str]:
        return list(self._entries)

    def kind(self, name: str) -> ModelKind:
        return self._entry(name).kind

    def status(self) -> list[ModelStatus]:
        result = []
        for entry in self._entries.values():
            state: ModelState
            if entry.model is not None:
                state = "ready"
            elif entry.loading is not None and not entry.loading.done():
                state = "loading"
            elif entry.error is not None:
                state = "error"
            else:
                state = "unloaded"
            engine = getattr(entry.model, "engine", None)
            result.append(
                ModelStatus(
                    entry.name,
                    entry.path,
                    entry.kind,
                    state,
                    entry.error,
                    provider=entry.config.provider,
                    engine=engine.name if engine is not None else None,
                )
            )
        return result

    def loaded(self, name: str) -> Any:
        """The model if it is loaded now, else ``None`` (never loads)."""
        return self._entry(name).model

    async def load(self, name: str) -> Any:
        """Load ``name`` (once, however many callers wait) and return the model."""
        entry = self._entry(name)
        if entry.model is not None:
            return entry.model
        if entry.loading is None or entry.loading.done():
            entry.loading = asyncio.create_task(self._load(entry))
        return await asyncio.shield(entry.loading)

    async def get(self, name: str) -> Any:
        """The loaded model called ``name``, loading it on first use."""
        return await self.load(name)

    async def unload(self, name: str) -> None:
        entry = self._entry(name)
        model, entry.model = entry.model, None
        if model is not None:
            await model.close()

    async def close(self) -> None:
        """Unload everything."""
        for name in list(self._entries):
            await self.unload(name)

    async def _load(self, entry: _Entry) -> Any:
        factory = self._factory(entry.kind)
        try:
            model = await asyncio.to_thread(factory, entry.name, entry.path, entry.config)
        except ModelLoadError as exc:
            entry.error = str(exc)
            raise
        except Exception as exc:  # anything else a broken folder provokes, still named by path
            entry.error = f"{entry.path} could not be loaded: {exc}"
            raise ModelLoadError(entry.error, path=entry.path) from exc
        entry.error = None
        entry.model = model
        return model

    @staticmethod
    def _factory(kind: ModelKind) -> Callable[[str, Path, ModelConfig], Model]:
        factories: dict[ModelKind, Callable[[str, Path, ModelConfig], Model]]
        factories = {
            "generative": load_chat_model,
            "embedding": EmbeddingModel,
            "rerank": RerankModel,
            "speech": SpeechModel,
        }
        return factories[kind]

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ModelNotFoundError(name) from None
