"""Names to models: the folder and config each name stands for, its state, and the calls
that load, hold and unload it.

What a folder is and how a model is made is :mod:`._loading`'s; which models stay loaded
(limits, keep-alive, eviction) is :mod:`._residency`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import gc
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from ._config import ModelConfig
from ._errors import AdapterNotFoundError, ModelLoadError, ModelNotFoundError
from ._folder import GenaiFolder
from ._loading import ModelKind, detect_model_kind, measured_load
from ._residency import Entry, Residency
from .chat import ChatModel
from .engines._adapters import check_adapters
from .sources import SourceError, converted_folder, is_model_file, source_kind
from .speech import VoiceModel

logger = logging.getLogger(__name__)

__all__ = ["ModelLease", "ModelRegistry", "ModelState", "ModelStatus"]

ModelState = Literal["unloaded", "converting", "loading", "ready", "unloading", "error"]


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
    reasoning: bool | None = None
    """A loaded generative model: whether it writes its reasoning in a think block (its chat
    template teaches the markers; replies carry it apart as ``reasoning_content``)."""
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
    progress: float | None = None
    """A model file (GGUF) being converted into its folder (state ``converting``): the
    fraction done, 0 to 1; ``None`` otherwise."""
    folder: Path | None = None
    """The folder that runs: ``path`` itself, or a model file's converted folder (in
    ``$ORTSERVE_CACHE/converted``) once it is made."""


def _prefill_int8(engine: Any) -> bool | None:
    """Whether an ort-cpu engine prefills through its int8 copy (``None``: another engine, or none)."""
    if engine is None or not hasattr(engine, "prefill_session"):
        return None
    return engine.prefill_session is not None


class ModelLease:
    """A request's hold on a loaded model (:meth:`ModelRegistry.acquire`): while any lease
    is held the model is never unloaded under it (an unload waits, up to its grace
    period). :meth:`release` once the request is over, streams included."""

    def __init__(self, residency: Residency, entry: Entry, model: Any) -> None:
        self.model = model
        self.keep_alive: float | None = None
        """Seconds the model stays loaded once idle after this request (0: unload at once,
        negative: keep forever; ``None``: the registry's ``idle_unload``)."""
        self._residency = residency
        self._entry = entry
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._residency.release(self._entry, self.model, self.keep_alive)


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
        self.config = config or ModelConfig()
        self.unload_grace = unload_grace
        self._entries: dict[str, Entry] = {}
        self.residency = Residency(
            self._entries, idle_unload=idle_unload, max_loaded=max_loaded, memory_budget=memory_budget
        )
        """The limits and timers (the properties below read and set its limits)."""
        # One load at a time: the RSS growth measured around a load is that model's alone,
        # and each budget decision sees the sizes of the loads before it.
        self._load_lock = anyio.Lock()

    @property
    def idle_unload(self) -> float | None:
        """Seconds an idle model stays loaded (``None``: forever)."""
        return self.residency.idle_unload

    @idle_unload.setter
    def idle_unload(self, seconds: float | None) -> None:
        self.residency.idle_unload = seconds

    @property
    def max_loaded(self) -> int | None:
        """Models loaded at once, at most (``None``: no limit)."""
        return self.residency.max_loaded

    @max_loaded.setter
    def max_loaded(self, count: int | None) -> None:
        self.residency.max_loaded = count

    @property
    def memory_budget(self) -> int | None:
        """Bytes the loaded models may hold (``None``: no limit)."""
        return self.residency.memory_budget

    @memory_budget.setter
    def memory_budget(self, size: int | None) -> None:
        self.residency.memory_budget = size

    def add(
        self, name: str, path: str | Path, config: ModelConfig | None = None, *, kind: ModelKind | None = None
    ) -> ModelKind:
        """Register a folder under ``name`` (run with ``config``, else the registry's);
        raises :class:`ModelLoadError` if it is no model. ``kind`` overrides what the folder
        says between the two kinds an ONNX encoder folder can be (``embedding``, ``rerank``)."""
        given = Path(path).expanduser()
        # A model file keeps the name it was given: resolving a link (the Hugging Face cache
        # links each file to a blob named by its hash) would lose its suffix and the names
        # of a split file's other parts, which are found beside it.
        folder = Path(os.path.abspath(given)) if is_model_file(given) else given.resolve()
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
        if config is not None and config.quantize is not None and source_kind(folder) != "checkpoint":
            raise ValueError(
                f"model {name!r}: quantize applies to transformers checkpoints (config.json and safetensors) only; "
                f"{folder} is not one"
            )
        if config is not None and kind != "generative" and config.prefill_int8:
            raise ValueError(f"model {name!r} is a {kind} model: prefill_int8 applies to generative models only")
        if config is not None and kind != "generative":
            # Set for this model rather than inherited from the registry's config (which
            # covers every kind): a key/value cache setting on a model that keeps none.
            for field in ("kv_cache_dtype", "prefix_cache_mb", "reproducible"):
                if getattr(config, field) != getattr(self.config, field):
                    raise ValueError(f"model {name!r} is a {kind} model: {field} applies to generative models only")
        self._entries[name] = Entry(name, folder, kind, config or self.config)
        return kind

    def names(self) -> list[str]:
        return list(self._entries)

    def kind(self, name: str) -> ModelKind:
        return self._entry(name).kind

    def status(self) -> list[ModelStatus]:
        return [self._status(entry) for entry in self._entries.values()]

    def status_of(self, name: str) -> ModelStatus:
        return self._status(self._entry(name))

    def _status(self, entry: Entry) -> ModelStatus:
        state: ModelState
        if entry.unloading is not None:
            state = "unloading"
        elif entry.model is not None:
            state = "ready"
        elif entry.loading is not None and not entry.loading.done():
            state = "converting" if entry.converting is not None else "loading"
        elif entry.error is not None and not entry.error_passes:
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
            reasoning=entry.model.reasoning is not None if isinstance(entry.model, ChatModel) else None,
            tools_in_system_prompt=entry.model.tools_in_system_prompt if isinstance(entry.model, ChatModel) else None,
            speculative=entry.config.speculative if isinstance(entry.model, ChatModel) else None,
            draft_tokens=getattr(engine, "draft_tokens", None),
            accepted_draft_tokens=getattr(engine, "accepted_draft_tokens", None),
            in_flight=entry.in_flight,
            last_used=entry.last_used,
            resident_bytes=entry.resident_bytes if loaded else None,
            kv_cache_bytes=entry.kv_cache_bytes if loaded else None,
            expires_at=entry.expires_at if loaded else None,
            progress=entry.converting,
            folder=entry.folder,
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
                await asyncio.shield(self.residency.start_unload(entry, 0))
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
            self.residency.arm(entry, keep_alive)
        return model

    async def get(self, name: str) -> Any:
        """The loaded model called ``name``, loading it on first use."""
        return await self.load(name)

    async def acquire(self, name: str) -> ModelLease:
        """Load ``name`` if need be and hold it for one request (see :class:`ModelLease`)."""
        entry = self._entry(name)
        model = await self.load(name)
        # No await since load() saw the model loaded and not unloading: the hold is safe.
        self.residency.hold(entry)
        return ModelLease(self.residency, entry, model)

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
        await asyncio.shield(self.residency.start_unload(entry, self.unload_grace if grace is None else grace))

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
            checked = await asyncio.to_thread(
                check_adapters, GenaiFolder.read(entry.folder or entry.path), {adapter: Path(path)}
            )
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
            entry.preloaded = executor.submit(self._converted_and_loaded, entry)
        executor.shutdown(wait=False)

    async def close(self) -> None:
        """Unload everything at once (the server's shutdown drained requests already); a
        conversion still running (a start-up that was stopped) is ended, its child killed
        and its partial folder removed, rather than waited for."""
        for entry in self._entries.values():
            entry.closing = True
        for entry in self._entries.values():
            preloaded, entry.preloaded = entry.preloaded, None
            if preloaded is not None:  # started, never taken over (a startup that failed)
                with contextlib.suppress(Exception):
                    model, _ = await asyncio.wrap_future(preloaded)
                    await model.close()
        for name in list(self._entries):
            await self.unload(name, grace=0)

    # -- internals -------------------------------------------------------------------------

    async def _load(self, entry: Entry) -> Any:
        async with self._load_lock:
            await self.residency.make_room(entry)
            preloaded, entry.preloaded = entry.preloaded, None
            try:
                if preloaded is not None:
                    model, grew = await asyncio.wrap_future(preloaded)
                    await self._follow_adapters(entry, model)
                else:
                    model, grew = await asyncio.to_thread(self._converted_and_loaded, entry)
            except ModelLoadError as exc:
                entry.error, entry.error_passes = str(exc), _passes(exc)
                raise
            except Exception as exc:  # anything else a broken folder provokes, still named by path
                entry.error, entry.error_passes = f"{entry.path} could not be loaded: {exc}", _passes(exc)
                raise ModelLoadError(entry.error, path=entry.path) from exc
            entry.resident_bytes = grew
            entry.kv_cache_bytes = getattr(getattr(model, "engine", None), "kv_cache_bytes", None)
            entry.error, entry.error_passes = None, False
            await self.residency.fit(entry, model)
            entry.model = model
            entry.last_used = time.time()
            # What is alive now (the modules, the models) lives as long as the process or
            # the model, so the collector stops walking it: a full collection walks only what
            # requests made since. Walking it took 40-74 ms of the event loop every 0.7 s
            # while a batch built answers of prompt logprobs. An unload gives it back
            # (Residency), so that a closed model's cycles are found.
            gc.freeze()
        if entry.in_flight == 0:
            self.residency.arm(entry, self.residency.idle_unload)
        return model

    @staticmethod
    def _converted_and_loaded(entry: Entry) -> tuple[Any, int]:
        """:func:`measured_load` of the entry's folder: for a model file (GGUF) or a
        checkpoint, the cache's converted folder, made first where there is none (state
        ``converting``)."""
        if entry.folder is None:
            kind = source_kind(entry.path)
            if kind is not None:
                entry.converting = 0.0
                try:
                    entry.folder = converted_folder(
                        entry.path,
                        lambda fraction: _report_progress(entry, fraction),
                        precision=entry.config.quantize if kind == "checkpoint" else None,
                        provider=entry.config.provider,
                    )
                except SourceError as exc:
                    raise ModelLoadError(f"{entry.path}: {exc}", path=entry.path) from exc
                finally:
                    entry.converting = None
            else:
                entry.folder = entry.path
        return measured_load(entry.kind, entry.name, entry.folder, entry.config)

    async def _follow_adapters(self, entry: Entry, model: Any) -> None:
        """Give a preloaded model the adapters added or removed while it loaded (it was made
        with the config of the moment its load started)."""
        if entry.kind != "generative":
            return
        for name in set(model.adapters) - set(entry.config.adapters):
            model.remove_adapter(name)
        for name in set(entry.config.adapters) - set(model.adapters):
            await asyncio.to_thread(model.add_adapter, name, entry.config.adapters[name])

    def _entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise ModelNotFoundError(name) from None


_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _passes(exc: BaseException) -> bool:
    """Whether a load failed for a reason of the moment, not of the model: a full disk (a
    conversion's, or its lock file's) or a converter that was killed. Such a failure made
    /health 503 for every model until the next request for that one (seventeenth probe)."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain of causes, not a loop
        if seen is None:
            return False
        if (isinstance(seen, SourceError) and seen.transient) or (
            isinstance(seen, OSError) and seen.errno in _DISK_FULL
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _report_progress(entry: Entry, fraction: float) -> None:
    """A conversion's progress; raising here (the registry is closing) kills its child."""
    if entry.closing:
        raise SourceError("stopped: the server is shutting down")
    entry.converting = fraction
