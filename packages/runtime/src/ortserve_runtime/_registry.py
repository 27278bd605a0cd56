"""Names to models: what folder a name points at, whether it is loaded, and loading it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ._config import ModelConfig
from ._embeddings import EmbeddingModel
from ._errors import ModelLoadError, ModelNotFoundError
from ._generation import ChatModel, GenerativeModel
from ._multimodal import MULTIMODAL_TYPES, MultimodalModel
from ._speech import SpeechModel

__all__ = ["ModelKind", "ModelRegistry", "ModelState", "ModelStatus", "detect_model_kind", "load_chat_model"]

ModelKind = Literal["generative", "embedding", "speech"]
ModelState = Literal["unloaded", "loading", "ready", "error"]


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """What :meth:`ModelRegistry.status` reports for one model."""

    name: str
    path: Path
    kind: ModelKind
    state: ModelState
    error: str | None = None


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
        return "embedding"
    raise ModelLoadError(
        f"{folder} is not a model folder: expected genai_config.json (generative or speech model) "
        "or an ONNX encoder with tokenizer.json (embedding model)",
        path=folder,
    )


def load_chat_model(name: str, folder: Path, config: ModelConfig) -> ChatModel:
    """A generative model: the text engine, or the multimodal one for vision/audio types."""
    try:
        model_type = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError):
        model_type = None  # the text engine reports what is wrong, naming the file
    if model_type in MULTIMODAL_TYPES:
        return MultimodalModel(name, folder, config)
    return GenerativeModel(name, folder, config)


class _Entry:
    def __init__(self, name: str, path: Path, kind: ModelKind) -> None:
        self.name = name
        self.path = path
        self.kind = kind
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

    def add(self, name: str, path: str | Path) -> ModelKind:
        """Register a folder under ``name``; raises :class:`ModelLoadError` if it is no model."""
        folder = Path(path).expanduser().resolve()
        kind = detect_model_kind(folder)
        if name in self._entries:
            raise ValueError(f"a model named {name!r} is already registered")
        self._entries[name] = _Entry(name, folder, kind)
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
            result.append(ModelStatus(entry.name, entry.path, entry.kind, state, entry.error))
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
            model = await asyncio.to_thread(factory, entry.name, entry.path, self.config)
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
    def _factory(kind: ModelKind) -> Callable[[str, Path, ModelConfig], ChatModel | EmbeddingModel | SpeechModel]:
        factories: dict[ModelKind, Callable[[str, Path, ModelConfig], ChatModel | EmbeddingModel | SpeechModel]]
        factories = {"generative": load_chat_model, "embedding": EmbeddingModel, "speech": SpeechModel}
        return factories[kind]

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ModelNotFoundError(name) from None
