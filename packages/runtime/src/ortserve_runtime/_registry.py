"""Names to models: what folder a name points at, whether it is loaded, and loading it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from ._config import EngineName, ModelConfig
from ._embeddings import EmbeddingModel
from ._errors import AdapterNotFoundError, ModelCapacityError, ModelLoadError, ModelNotFoundError
from ._folder import GenaiFolder, check_og_runs, load_og_model
from ._rerank import RerankModel
from ._speech import SpeechModel
from ._threads import OwnerThread
from ._voice import VoiceModel, find_voice_files
from .chat import MULTIMODAL_TYPES, ChatModel, MediaProcessor
from .engines import Engine, NotDrivableError, OgEngine, OgGeneratorEngine, OrtCpuEngine
from .engines._adapters import check_adapters
from .engines._og_process import OgProcess

logger = logging.getLogger(__name__)

__all__ = [
    "ModelKind",
    "ModelLease",
    "ModelRegistry",
    "ModelState",
    "ModelStatus",
    "detect_model_kind",
    "load_chat_model",
    "pick_engine",
]

ModelKind = Literal["generative", "embedding", "rerank", "speech", "voice"]
ModelState = Literal["unloaded", "loading", "ready", "unloading", "error"]
Model = ChatModel | EmbeddingModel | RerankModel | SpeechModel | VoiceModel


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
    engine_reason: str | None = None
    """Why the loaded generative model runs on ``engine`` (what was asked for, what ``auto``
    chose from the provider and the folder, or what the ort-cpu engine could not drive)."""
    prefill_int8: bool | None = None
    """A loaded ort-cpu model: whether prompts prefill through its int8 copy
    (``ModelConfig.prefill_int8``; with ``None``, where the CPU and model allow); ``None``
    for other engines and unloaded models."""
    kv_cache_dtype: str | None = None
    """A loaded ort-cpu model: what its key/value cache stores (``float32``, ``float16`` or
    ``int8``: the graph's own type, or ``ModelConfig.kv_cache_dtype``'s); ``None`` for other
    engines and unloaded models."""
    reproducible: bool | None = None
    """A loaded generative model: whether its engine promises the same tokens for the same
    request whatever else it runs or holds (:attr:`EngineCapabilities.reproducible`);
    ``None`` for other kinds and unloaded models."""
    voices: tuple[str, ...] | None = None
    """A loaded voice model: the voices a request may pick; ``None`` for other kinds and
    unloaded models."""
    input_modalities: tuple[str, ...] | None = None
    """A loaded generative model: what its prompts may hold (``text``, and ``image`` and
    ``audio`` where its folder takes them); ``None`` for other kinds and unloaded models."""
    tool_format: str | None = None
    """A loaded generative model: how it writes tool calls (``hermes``, ``llama3``,
    ``mistral``, ``phi4``...), from its chat template or, where that knows no tools, the
    system-prompt fallback's ``hermes``; ``None`` where tool requests are a 400 (the
    fallback off) and for other kinds and unloaded models."""
    tools_in_system_prompt: bool | None = None
    """A loaded generative model: whether its tools go into the system prompt because its
    template knows none (:attr:`ModelConfig.tools_in_system_prompt`)."""
    speculative: str | None = None
    """A loaded generative model's :attr:`ModelConfig.speculative`."""
    draft_tokens: int | None = None
    """Draft tokens its engine checked since the load (engines that speculate)."""
    accepted_draft_tokens: int | None = None
    """Those that became output tokens."""
    in_flight: int = 0
    """Requests holding the model now (streams until their last event)."""
    last_used: float | None = None
    """When a request last let go of the model (or it loaded), as a Unix time."""
    resident_bytes: int | None = None
    """Growth of the process's resident memory (RSS) measured around the load: weights,
    sessions, tokenizer. Approximate: the allocator may keep or return pages meanwhile."""
    kv_cache_bytes: int | None = None
    """The full capacity of the engine's KV cache where it reports one (ort-cpu: zeroed
    buffers whose pages become resident as tokens are cached, so this is the most it grows
    to, beyond ``resident_bytes``)."""
    expires_at: float | None = None
    """When an idle model will be unloaded (Unix time); ``None``: not scheduled."""


def _prefill_int8(engine: Any) -> bool | None:
    """Whether an ort-cpu engine prefills through its int8 copy (``None``: another engine, or none)."""
    if engine is None or not hasattr(engine, "prefill_session"):
        return None
    return engine.prefill_session is not None


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
    if find_voice_files(folder) is not None:
        return "voice"
    raise ModelLoadError(
        f"{folder} is not a model folder: expected genai_config.json (generative or speech model), "
        "an ONNX encoder with tokenizer.json (embedding model; a *ForSequenceClassification "
        "config.json makes it a rerank model) or a Piper voice (x.onnx with x.onnx.json)",
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
    og.Engine takes no adapter per request. A text folder the ort-cpu engine finds it cannot
    drive when it loads (see :class:`NotDrivableError`) falls back to og-generator then.
    """
    return _pick_engine(folder, config)[0]


def _pick_engine(folder: GenaiFolder, config: ModelConfig) -> tuple[EngineName, str]:
    """:func:`pick_engine`'s choice and why (the model status's ``engine_reason``)."""
    if config.engine != "auto":
        return config.engine, f"engine {config.engine} was asked for"
    if folder.model_type in MULTIMODAL_TYPES:
        return "og-generator", f"auto: a multimodal model ({folder.model_type}) runs on og-generator"
    if config.provider == "cpu":
        return "ort-cpu", "auto: a text model on the CPU runs on ort-cpu (continuous batching)"
    if folder.paged_attention and not config.adapters:
        return "og-engine", f"auto: built for paged attention on {config.provider} (og.Engine's dynamic batching)"
    why = "LoRA adapters (og.Engine takes none per request)" if config.adapters else "no paged attention"
    return "og-generator", f"auto: {why} on {config.provider}"


def load_chat_model(name: str, path: Path, config: ModelConfig) -> ChatModel:
    """A generative model: the front (:class:`ChatModel`) over the engine :func:`pick_engine` chose."""
    folder = GenaiFolder.read(path)
    multimodal = folder.model_type in MULTIMODAL_TYPES
    choice, reason = _pick_engine(folder, config)
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
    if choice != "ort-cpu":
        _check_ort_cpu_settings(path, config, choice)
    adapters = check_adapters(folder, config.adapters)
    engine: Engine | None = None
    media = None
    refusal = None
    """Why ort-cpu refused the folder, when auto falls back to og-generator."""
    if choice == "ort-cpu":
        try:
            engine = OrtCpuEngine(name, folder, config, folder.max_sequence_length(config), adapters)
        except NotDrivableError as exc:
            if config.engine != "auto" or _asks_for_ort_cpu(config):
                raise
            refusal = str(exc)
            choice, reason = "og-generator", f"auto: {refusal}; og-generator runs it"
            logger.info("model %r: %s", name, reason)
    if engine is None:
        _check_og_speculation(folder, config, choice, refusal)
        speculative = config.speculative is not None
        if choice == "og-engine":  # og.Engine.run releases the GIL: it stays in this process
            og_model = load_og_model(path, config)
            _checked_og(
                lambda: check_og_runs(og_model, folder, config.provider, speculative=speculative), refusal, path
            )
            engine = OgEngine(
                name,
                og_model,
                config,
                folder=path,
                dynamic=folder.paged_attention,
                shortest_sequence=folder.shortest_sequence,
            )
        else:
            og = OgProcess(path, config)
            try:
                if not multimodal:
                    _checked_og(lambda: og.call("step", "check_runs", speculative), refusal, path)
                media = MediaProcessor(folder, og, config) if multimodal else None
                engine = OgGeneratorEngine(
                    name,
                    og,
                    config,
                    concurrency=config.multimodal_concurrency if multimodal else config.max_batch_size,
                    shortest_sequence=folder.shortest_sequence,
                    adapters=adapters,
                )
            except BaseException:
                og.close()
                raise
    try:
        model = ChatModel(name, folder, config, engine, media)
    except BaseException:
        if isinstance(engine, OwnerThread):
            engine.shutdown()
        raise
    model.engine_reason = reason
    return model


def _checked_og(check: Callable[[], None], refusal: str | None, path: Path) -> None:
    """``check`` (og runs the folder), its failure also naming why ort-cpu refused it
    when ``auto`` fell back to og."""
    try:
        check()
    except ModelLoadError as exc:
        if refusal is None:
            raise
        raise ModelLoadError(f"no engine runs it: {refusal}; {exc}", path=path) from exc


def _asks_for_ort_cpu(config: ModelConfig) -> bool:
    """Whether ``config`` sets what only the ort-cpu engine reads (``auto`` then does not
    fall back to og for a model ort-cpu cannot drive: the setting would go unread)."""
    return bool(config.prefill_int8) or config.prefix_cache_mb is not None or config.kv_cache_dtype != "auto"


def _check_ort_cpu_settings(path: Path, config: ModelConfig, choice: str) -> None:
    """Refuse, naming them, the settings only the ort-cpu engine reads, for a model that
    runs on ``choice`` (an og engine)."""
    if config.prefix_cache_mb is not None:
        raise ModelLoadError(
            f"{path}: prefix_cache_mb (--prefix-cache-mb) sizes the ort-cpu engine's prefix cache, and this model "
            f"runs on {choice}, which keeps none of ortserve's; set it per model for ort-cpu models "
            "(--model-option NAME:prefix-cache-mb=MIB)",
            path=path,
        )
    if config.kv_cache_dtype != "auto":
        raise ModelLoadError(
            f"{path}: kv_cache_dtype={config.kv_cache_dtype} (--kv-cache-dtype) applies to the ort-cpu engine's "
            f"key/value cache, and this model runs on {choice}, which keeps its own; set it per model for ort-cpu "
            "models (--model-option NAME:kv-cache-dtype=fp16)",
            path=path,
        )
    if config.prefill_int8:
        raise ModelLoadError(
            f"{path}: prefill_int8 (--prefill-int8 on) applies to the ort-cpu engine only, and this model runs on "
            f"{choice}; turn it off for this model (--model-option NAME:prefill-int8=off)",
            path=path,
        )


def _check_og_speculation(folder: GenaiFolder, config: ModelConfig, choice: str, refusal: str | None) -> None:
    """Refuse ``speculative`` where onnxruntime-genai cannot do it (measured with og 0.18,
    its errors quoted): og.Engine takes no n-gram option, and og.Generator's n-gram decoding
    "requires a plain decoder-only text model" (multimodal models; others are probed by
    :func:`check_og_runs`) and "cannot rewind" a sliding-window cache once it is full."""
    decoder = folder.genai.get("model", {}).get("decoder", {})
    if config.speculative is None:
        return
    if config.draft_folder is not None:
        why = "draft models (draft:FOLDER) run on ort-cpu only"
    elif choice == "og-engine":
        why = "og.Engine takes no n-gram speculation (only drafts a caller gives, on paged attention)"
    elif folder.is_multimodal or refusal is not None:
        why = "onnxruntime-genai's n-gram decoding requires a plain decoder-only text model" + (
            f" ({refusal})" if refusal else ""
        )
    elif isinstance(decoder.get("sliding_window"), dict):
        why = "onnxruntime-genai cannot rewind its sliding-window cache after a rejected draft"
    else:
        return
    raise ModelLoadError(
        f"{folder.path}: speculative ({config.speculative}) on the {choice} engine: {why}; serve this model with "
        "--model-option NAME:speculative=off, or on ort-cpu",
        path=folder.path,
    )


def resident_memory() -> int:
    """This process's resident set size in bytes (Linux ``/proc/self/statm``; 0 where
    there is none, and then resident sizes read 0)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def folder_bytes(folder: Path) -> int:
    """The size of the files in ``folder`` (what a first load is expected to cost)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


class _Entry:
    def __init__(self, name: str, path: Path, kind: ModelKind, config: ModelConfig) -> None:
        self.name = name
        self.path = path
        self.kind = kind
        self.config = config
        self.model: Any = None
        self.error: str | None = None
        self.loading: asyncio.Task[Any] | None = None
        self.unloading: asyncio.Task[None] | None = None
        self.in_flight = 0
        self.idle = asyncio.Event()
        """Set while no request holds the model (what an unload waits for)."""
        self.idle.set()
        self.last_used: float | None = None
        self.resident_bytes: int | None = None
        """RSS growth measured around the last load (kept after unloading: the next load's estimate)."""
        self.kv_cache_bytes: int | None = None
        """The engine's KV cache capacity, where it reports one (kept like ``resident_bytes``)."""
        self.expires_at: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.preloaded: concurrent.futures.Future[tuple[Any, int]] | None = None
        """A load started by :meth:`ModelRegistry.preload` (the model and its RSS growth),
        until :meth:`ModelRegistry.load` takes it over."""
        self.kept: bool = False
        """Its last request asked to keep it loaded (a negative ``keep_alive``): unloaded to
        make room only when no other idle model can be."""

    @property
    def cost(self) -> int:
        """Bytes this model holds (or is expected to) against the memory budget: the RSS
        growth of its load plus its KV cache's full capacity."""
        return (self.resident_bytes or 0) + (self.kv_cache_bytes or 0)


class ModelLease:
    """A request's hold on a loaded model (:meth:`ModelRegistry.acquire`): while any lease
    is held the model is never unloaded under it (an unload waits, up to its grace
    period). :meth:`release` once the request is over, streams included."""

    def __init__(self, registry: ModelRegistry, entry: _Entry, model: Any) -> None:
        self.model = model
        self.keep_alive: float | None = None
        """Seconds the model stays loaded once idle after this request (0: unload at once,
        negative: keep forever; ``None``: the registry's ``idle_unload``)."""
        self._registry = registry
        self._entry = entry
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._registry._release(self._entry, self.model, self.keep_alive)


class ModelRegistry:
    """Models by name. Loading runs in a worker thread so the event loop keeps serving.

    ``add`` only checks that the folder is a model; ``acquire`` (or ``get``) loads on
    first use (or call ``load`` up front); ``unload`` closes a model and frees its memory,
    waiting for the requests that hold it; ``status`` reports.

    Residency: ``idle_unload`` seconds after its last request a model is unloaded (``None``:
    never); loading past ``max_loaded`` models or ``memory_budget`` bytes first unloads the
    least recently used idle models (those kept with a negative ``keep_alive`` last), and
    raises :class:`ModelCapacityError` when no idle model is left to unload.
    ``unload_grace`` is how long an unload waits for requests that hold the model before it
    closes the model under them (they end with :class:`EngineClosedError`).
    """

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        idle_unload: float | None = None,
        max_loaded: int | None = None,
        memory_budget: int | None = None,
        unload_grace: float = 10.0,
    ) -> None:
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {max_loaded}")
        if memory_budget is not None and memory_budget < 1:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
        self.config = config or ModelConfig()
        self.idle_unload = idle_unload
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.unload_grace = unload_grace
        self._entries: dict[str, _Entry] = {}
        # One load at a time: the RSS growth measured around a load is that model's alone,
        # and each budget decision sees the sizes of the loads before it.
        self._load_lock = anyio.Lock()

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
        if config is not None and kind != "generative" and config.prefill_int8:
            raise ValueError(f"model {name!r} is a {kind} model: prefill_int8 applies to generative models only")
        if config is not None and kind != "generative":
            # Set for this model rather than inherited from the registry's config (which
            # covers every kind): a key/value cache setting on a model that keeps none.
            for field in ("kv_cache_dtype", "prefix_cache_mb"):
                if getattr(config, field) != getattr(self.config, field):
                    raise ValueError(f"model {name!r} is a {kind} model: {field} applies to generative models only")
        self._entries[name] = _Entry(name, folder, kind, config or self.config)
        return kind

    def names(self) -> list[str]:
        return list(self._entries)

    def kind(self, name: str) -> ModelKind:
        return self._entry(name).kind

    def status(self) -> list[ModelStatus]:
        return [self._status(entry) for entry in self._entries.values()]

    def status_of(self, name: str) -> ModelStatus:
        return self._status(self._entry(name))

    def _status(self, entry: _Entry) -> ModelStatus:
        state: ModelState
        if entry.unloading is not None:
            state = "unloading"
        elif entry.model is not None:
            state = "ready"
        elif entry.loading is not None and not entry.loading.done():
            state = "loading"
        elif entry.error is not None:
            state = "error"
        else:
            state = "unloaded"
        engine = getattr(entry.model, "engine", None)
        loaded = entry.model is not None
        return ModelStatus(
            entry.name,
            entry.path,
            entry.kind,
            state,
            entry.error,
            provider=entry.config.provider,
            engine=engine.name if engine is not None else None,
            engine_reason=getattr(entry.model, "engine_reason", None) if engine is not None else None,
            prefill_int8=_prefill_int8(engine),
            kv_cache_dtype=getattr(engine, "kv_cache_dtype", None),
            reproducible=engine.capabilities.reproducible if engine is not None else None,
            input_modalities=("text", *sorted(entry.model.modalities)) if isinstance(entry.model, ChatModel) else None,
            voices=tuple(entry.model.voices) if isinstance(entry.model, VoiceModel) else None,
            tool_format=entry.model.tool_format if isinstance(entry.model, ChatModel) else None,
            tools_in_system_prompt=entry.model.tools_in_system_prompt if isinstance(entry.model, ChatModel) else None,
            speculative=entry.config.speculative if isinstance(entry.model, ChatModel) else None,
            draft_tokens=getattr(engine, "draft_tokens", None),
            accepted_draft_tokens=getattr(engine, "accepted_draft_tokens", None),
            in_flight=entry.in_flight,
            last_used=entry.last_used,
            resident_bytes=entry.resident_bytes if loaded else None,
            kv_cache_bytes=entry.kv_cache_bytes if loaded else None,
            expires_at=entry.expires_at if loaded else None,
        )

    def loaded(self, name: str) -> Any:
        """The model if it is loaded now, else ``None`` (never loads)."""
        return self._entry(name).model

    async def load(self, name: str, *, keep_alive: float | None = None) -> Any:
        """Load ``name`` (once, however many callers wait) and return the model; an
        unload under way finishes first. Unless a request holds it, the model then stays
        ``keep_alive`` seconds (``None``: ``idle_unload``; negative: forever)."""
        entry = self._entry(name)
        while True:
            if entry.unloading is not None:
                await asyncio.shield(entry.unloading)
            failed = getattr(entry.model, "failed", None)
            if failed is not None:  # its engine's process ended: this load replaces it
                logger.warning("model %r: %s; loading it again", name, failed)
                await asyncio.shield(self._start_unload(entry, 0))
                continue
            if entry.model is None:
                if entry.loading is None or entry.loading.done():
                    entry.loading = asyncio.create_task(self._load(entry))
                model = await asyncio.shield(entry.loading)
            else:
                model = entry.model
            if entry.unloading is None and entry.model is model:
                break  # not unloaded again while this caller waited
        if keep_alive is not None and entry.in_flight == 0:
            self._arm(entry, keep_alive)
        return model

    async def get(self, name: str) -> Any:
        """The loaded model called ``name``, loading it on first use."""
        return await self.load(name)

    async def acquire(self, name: str) -> ModelLease:
        """Load ``name`` if need be and hold it for one request (see :class:`ModelLease`)."""
        entry = self._entry(name)
        model = await self.load(name)
        # No await since load() saw the model loaded and not unloading: the hold is safe.
        entry.in_flight += 1
        entry.idle.clear()
        entry.last_used = time.time()
        self._disarm(entry)
        return ModelLease(self, entry, model)

    async def unload(self, name: str, *, grace: float | None = None) -> None:
        """Unload ``name``: wait up to ``grace`` seconds (``None``: ``unload_grace``) for
        the requests that hold it, then close it (requests still running end with
        :class:`EngineClosedError`). Requests that arrive meanwhile wait, then load it
        again. A load under way finishes first."""
        entry = self._entry(name)
        if entry.loading is not None and not entry.loading.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(entry.loading)
        if entry.model is None:
            return
        await asyncio.shield(self._start_unload(entry, self.unload_grace if grace is None else grace))

    def adapters(self, name: str) -> tuple[str, ...]:
        """The LoRA adapters model ``name`` serves: its config's and those added since."""
        entry = self._entry(name)
        return tuple(entry.config.adapters) if entry.kind == "generative" else ()

    async def add_adapter(self, name: str, adapter: str, path: str | Path) -> None:
        """Serve LoRA adapter ``adapter`` of model ``name`` (as ``name:adapter``) from the
        ``.onnx_adapter`` file ``path``: at once where the model is loaded, and at every
        later load. Raises ``ValueError`` for a name in use or not allowed, a model that
        is not generative or an engine without adapters per request, and
        :class:`ModelLoadError` naming a file that is no adapter of this model."""
        entry = self._entry(name)
        if entry.kind != "generative":
            raise ValueError(f"model {name!r} is a {entry.kind} model: LoRA adapters apply to generative models only")
        if entry.config.engine == "og-engine":
            raise ValueError(f"model {name!r} runs on og-engine, which takes no LoRA adapter per request")
        async with self._load_lock:  # no load picks up half of the change
            if adapter in entry.config.adapters:
                raise ValueError(f"model {name!r} already has a LoRA adapter {adapter!r}")
            dataclasses.replace(entry.config, adapters={adapter: Path(path)})  # ModelConfig's check of the name
            checked = await asyncio.to_thread(check_adapters, GenaiFolder.read(entry.path), {adapter: Path(path)})
            model = entry.model
            if model is not None and entry.unloading is None:
                try:
                    await asyncio.to_thread(model.add_adapter, adapter, checked[adapter])
                except RuntimeError as exc:  # og's own check of the file
                    raise ModelLoadError(
                        f"adapter {adapter!r}: onnxruntime-genai cannot load {checked[adapter]}: {exc}",
                        path=checked[adapter],
                    ) from exc
            entry.config = dataclasses.replace(entry.config, adapters={**entry.config.adapters, **checked})

    async def remove_adapter(self, name: str, adapter: str) -> None:
        """Stop serving LoRA adapter ``adapter`` of model ``name``: requests naming it are
        refused from now on (404), those running finish with it. Raises
        :class:`AdapterNotFoundError` for an adapter the model does not have."""
        entry = self._entry(name)
        async with self._load_lock:
            if adapter not in entry.config.adapters:
                raise AdapterNotFoundError(name, adapter, self.adapters(name))
            kept = {key: path for key, path in entry.config.adapters.items() if key != adapter}
            entry.config = dataclasses.replace(entry.config, adapters=kept)
            model = entry.model
            if model is not None and entry.unloading is None:
                model.remove_adapter(adapter)

    def preload(self, names: Sequence[str]) -> None:
        """Start loading ``names`` now, one after another on a thread of their own, with no
        event loop needed: ``ortserve serve`` loads its models while the web framework
        imports (onnxruntime builds a session without holding the GIL). :meth:`load` takes
        each load over; a failure is raised there. The RSS growth measured meanwhile also
        counts what the other thread imported (approximate, as always)."""
        pending = [self._entry(name) for name in names]
        pending = [entry for entry in pending if entry.model is None and entry.preloaded is None]
        if not pending:
            return
        executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ortserve-preload")
        for entry in pending:
            entry.preloaded = executor.submit(self._measured_load, entry)
        executor.shutdown(wait=False)

    def _measured_load(self, entry: _Entry) -> tuple[Any, int]:
        """The model of ``entry`` and the growth of the resident set around its load (plus
        the resident set of a process the model runs in).

        Garbage is collected first: objects of an earlier model freed during this load made
        the growth read 0 (seen in a test process that had served other models)."""
        gc.collect()
        before = resident_memory()
        model = self._factory(entry.kind)(entry.name, entry.path, entry.config)
        elsewhere = getattr(model, "process_resident_bytes", 0)  # og's own process
        return model, max(0, resident_memory() - before) + elsewhere

    async def close(self) -> None:
        """Unload everything at once (the server's shutdown drained requests already)."""
        for entry in self._entries.values():
            preloaded, entry.preloaded = entry.preloaded, None
            if preloaded is not None:  # started, never taken over (a startup that failed)
                with contextlib.suppress(Exception):
                    model, _ = await asyncio.wrap_future(preloaded)
                    await model.close()
        for name in list(self._entries):
            await self.unload(name, grace=0)

    # -- internals -------------------------------------------------------------------------

    async def _load(self, entry: _Entry) -> Any:
        async with self._load_lock:
            await self._make_room(entry)
            preloaded, entry.preloaded = entry.preloaded, None
            try:
                if preloaded is not None:
                    model, grew = await asyncio.wrap_future(preloaded)
                    await self._follow_adapters(entry, model)
                else:
                    model, grew = await asyncio.to_thread(self._measured_load, entry)
            except ModelLoadError as exc:
                entry.error = str(exc)
                raise
            except Exception as exc:  # anything else a broken folder provokes, still named by path
                entry.error = f"{entry.path} could not be loaded: {exc}"
                raise ModelLoadError(entry.error, path=entry.path) from exc
            entry.resident_bytes = grew
            entry.kv_cache_bytes = getattr(getattr(model, "engine", None), "kv_cache_bytes", None)
            entry.error = None
            budget = self.memory_budget
            if budget is not None and self._loaded_cost() + entry.cost > budget:
                # A first load is only estimated beforehand (its folder's size); measured,
                # the model may need more. Idle models make room; if busy ones leave none,
                # this model goes again, before anyone could use it (its next load is
                # estimated from this measurement).
                for victim in self._idle_by_age(exclude=entry):
                    await self._start_unload(victim, 0)
                    if self._loaded_cost() + entry.cost <= budget:
                        break
                if self._loaded_cost() + entry.cost > budget:
                    await model.close()
                    used = self._loaded_cost()
                    held = (
                        f"{_size(used)} of the memory budget of {_size(budget)} is held by models serving requests"
                        if used
                        else f"that is more than the whole memory budget of {_size(budget)}"
                    )
                    raise ModelCapacityError(
                        f"model {entry.name!r} cannot be loaded now: it needs {_size(entry.cost)} (measured), and {held}",
                        name=entry.name,
                    )
            entry.model = model
            entry.last_used = time.time()
        if entry.in_flight == 0:
            self._arm(entry, self.idle_unload)
        return model

    async def _follow_adapters(self, entry: _Entry, model: Any) -> None:
        """Give a preloaded model the adapters added or removed while it loaded (it was made
        with the config of the moment its load started)."""
        if entry.kind != "generative":
            return
        for name in set(model.adapters) - set(entry.config.adapters):
            model.remove_adapter(name)
        for name in set(entry.config.adapters) - set(model.adapters):
            await asyncio.to_thread(model.add_adapter, name, entry.config.adapters[name])

    async def _make_room(self, entry: _Entry) -> None:
        """Unload least recently used idle models until ``entry`` fits the limits, or
        raise :class:`ModelCapacityError`."""
        need = entry.cost if entry.resident_bytes is not None else folder_bytes(entry.path)
        while True:
            loaded = [e for e in self._entries.values() if e is not entry and e.model is not None]
            over_count = self.max_loaded is not None and len(loaded) + 1 > self.max_loaded
            used = sum(e.cost for e in loaded)
            over_bytes = self.memory_budget is not None and used + need > self.memory_budget
            if not (over_count or over_bytes):
                return
            idle = self._idle_by_age(exclude=entry)
            if not idle:
                busy = ", ".join(f"{e.name} ({e.in_flight} in flight)" for e in loaded)
                if not loaded:
                    raise ModelCapacityError(
                        f"model {entry.name!r} needs about {_size(need)}, more than the whole memory budget "
                        f"of {_size(self.memory_budget or 0)}",
                        name=entry.name,
                    )
                if over_count:
                    why = f"{len(loaded)} models are loaded (--max-loaded-models {self.max_loaded})"
                else:
                    why = (
                        f"loading it needs about {_size(need)} and {_size(used)} of the memory budget "
                        f"of {_size(self.memory_budget or 0)} is in use"
                    )
                raise ModelCapacityError(
                    f"model {entry.name!r} cannot be loaded now: {why}, and none can be unloaded "
                    f"because every loaded model is serving requests ({busy})",
                    name=entry.name,
                )
            await self._start_unload(idle[0], 0)

    def _idle_by_age(self, *, exclude: _Entry) -> list[_Entry]:
        idle = [
            e
            for e in self._entries.values()
            if e is not exclude and e.model is not None and e.in_flight == 0 and e.unloading is None
        ]
        # Kept models last, as Ollama orders them (by keep-alive); least recently used first.
        return sorted(idle, key=lambda e: (e.kept, e.last_used or 0.0))

    def _loaded_cost(self) -> int:
        return sum(e.cost for e in self._entries.values() if e.model is not None)

    def _start_unload(self, entry: _Entry, grace: float) -> asyncio.Task[None]:
        if entry.unloading is None:
            entry.unloading = asyncio.create_task(self._unload(entry, grace))
        return entry.unloading

    async def _unload(self, entry: _Entry, grace: float) -> None:
        try:
            if entry.in_flight and grace > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(entry.idle.wait(), grace)
            model, entry.model = entry.model, None
            self._disarm(entry)
            if model is not None:
                await model.close()
        finally:
            entry.unloading = None

    def _release(self, entry: _Entry, model: Any, keep_alive: float | None) -> None:
        entry.in_flight -= 1
        entry.last_used = time.time()
        if entry.in_flight == 0:
            entry.idle.set()
            if entry.model is model and entry.unloading is None:
                self._arm(entry, self.idle_unload if keep_alive is None else keep_alive)

    def _arm(self, entry: _Entry, seconds: float | None) -> None:
        """Unload ``entry`` once it has been idle ``seconds`` (``None`` or negative: never)."""
        self._disarm(entry)
        entry.kept = seconds is not None and seconds < 0
        if seconds is None or seconds < 0:
            return
        loop = asyncio.get_running_loop()
        entry.expires_at = time.time() + seconds
        entry.timer = loop.call_later(seconds, self._expire, entry)

    def _disarm(self, entry: _Entry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        entry.timer = None
        entry.expires_at = None

    def _expire(self, entry: _Entry) -> None:
        entry.timer = None
        # Idle now, and marked unloading at once: a request that comes next waits for the
        # unload and loads the model again, never holds the model being closed.
        if entry.in_flight == 0 and entry.model is not None and entry.unloading is None:
            self._start_unload(entry, 0)

    @staticmethod
    def _factory(kind: ModelKind) -> Callable[[str, Path, ModelConfig], Model]:
        factories: dict[ModelKind, Callable[[str, Path, ModelConfig], Model]]
        factories = {
            "generative": load_chat_model,
            "embedding": EmbeddingModel,
            "rerank": RerankModel,
            "speech": SpeechModel,
            "voice": VoiceModel,
        }
        return factories[kind]

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ModelNotFoundError(name) from None


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"
