"""Residency: which loaded models stay in memory.

The limits (``max_loaded`` models, ``memory_budget`` bytes), unloading a model once it has
been idle for its keep-alive, and making room for a load by unloading the least recently
used idle models. The registry asks before a load (:meth:`Residency.make_room`), after it
measured one (:meth:`Residency.fit`), and as requests take and let go of a model
(:meth:`Residency.hold`, :meth:`Residency.release`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import time
import weakref
from pathlib import Path
from typing import Any

from ._config import ModelConfig
from ._errors import ModelCapacityError
from ._loading import ModelKind
from .sources._names import GgufError, split_parts

__all__ = ["Entry", "Residency"]


class Entry:
    """One registered model: its name and folder, its state, and what residency tracks of it."""

    def __init__(self, name: str, path: Path, kind: ModelKind, config: ModelConfig) -> None:
        self.name = name
        self.path = path
        self.kind = kind
        self.config = config
        self.model: Any = None
        self.error: str | None = None
        self.error_passes = False
        """``error`` is a full disk's (or a converter killed): the model is ``unloaded``, tried
        again at its next request, not ``error`` (which fails /health)."""
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
        """A load started by :meth:`~ortserve_runtime.ModelRegistry.preload` (the model and its RSS growth),
        until :meth:`~ortserve_runtime.ModelRegistry.load` takes it over."""
        self.converting: float | None = None
        """A model file being turned into its folder: the fraction done (else ``None``)."""
        self.closing = False
        """The registry is closing: a conversion in progress stops at its next progress report."""
        self.folder: Path | None = None
        """The folder that runs: ``path`` itself, or a model file's converted folder once made."""
        self.kept: bool = False
        """Its last request asked to keep it loaded (a negative ``keep_alive``): unloaded to
        make room only when no other idle model can be."""

    @property
    def cost(self) -> int:
        """Bytes this model holds (or is expected to) against the memory budget: the RSS
        growth of its load plus its KV cache's full capacity."""
        return (self.resident_bytes or 0) + (self.kv_cache_bytes or 0)


class Residency:
    """The limits and timers over the registry's entries (the same dict, shared).

    ``idle_unload`` seconds after its last request a model is unloaded (``None``: never);
    loading past ``max_loaded`` models or ``memory_budget`` bytes first unloads the least
    recently used idle models (those kept with a negative ``keep_alive`` last), and raises
    :class:`ModelCapacityError` when no idle model is left to unload.
    """

    def __init__(
        self,
        entries: dict[str, Entry],
        *,
        idle_unload: float | None,
        max_loaded: int | None,
        memory_budget: int | None,
    ) -> None:
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {max_loaded}")
        if memory_budget is not None and memory_budget < 1:
            raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget}")
        self._entries = entries
        self.idle_unload = idle_unload
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget

    async def make_room(self, entry: Entry) -> None:
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
            idle = self.idle_by_age(exclude=entry)
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
            await self.start_unload(idle[0], 0)

    def idle_by_age(self, *, exclude: Entry) -> list[Entry]:
        idle = [
            e
            for e in self._entries.values()
            if e is not exclude and e.model is not None and e.in_flight == 0 and e.unloading is None
        ]
        # Kept models last, as Ollama orders them (by keep-alive); least recently used first.
        return sorted(idle, key=lambda e: (e.kept, e.last_used or 0.0))

    def loaded_cost(self) -> int:
        return sum(e.cost for e in self._entries.values() if e.model is not None)

    def start_unload(self, entry: Entry, grace: float) -> asyncio.Task[None]:
        if entry.unloading is None:
            entry.unloading = asyncio.create_task(self._unload(entry, grace))
        return entry.unloading

    async def _unload(self, entry: Entry, grace: float) -> None:
        try:
            if entry.in_flight and grace > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(entry.idle.wait(), grace)
            model, entry.model = entry.model, None
            # The finished load's task keeps its result: left there, the closed model (its
            # session, weights and KV cache) stayed in memory until the next load.
            entry.loading = None
            self.disarm(entry)
            if model is not None:
                await model.close()
                left = _weak(model)
                del model
                # A closed model frees itself (its objects were frozen at its load, see
                # Registry._load; reference counting frees frozen objects too). One still
                # alive is held by a request ending or by a cycle: then everything goes back
                # to the collector, whose next full collection walks the whole heap (110-200
                # ms of GIL on a server of six models), so that its cycles are found.
                if left is None or left() is not None:
                    gc.unfreeze()
        finally:
            entry.unloading = None

    def release(self, entry: Entry, model: Any, keep_alive: float | None) -> None:
        entry.in_flight -= 1
        entry.last_used = time.time()
        if entry.in_flight == 0:
            entry.idle.set()
            if entry.model is model and entry.unloading is None:
                self.arm(entry, self.idle_unload if keep_alive is None else keep_alive)

    def arm(self, entry: Entry, seconds: float | None) -> None:
        """Unload ``entry`` once it has been idle ``seconds`` (``None`` or negative: never)."""
        self.disarm(entry)
        entry.kept = seconds is not None and seconds < 0
        if seconds is None or seconds < 0:
            return
        loop = asyncio.get_running_loop()
        entry.expires_at = time.time() + seconds
        entry.timer = loop.call_later(seconds, self._expire, entry)

    def disarm(self, entry: Entry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
        entry.timer = None
        entry.expires_at = None

    def _expire(self, entry: Entry) -> None:
        entry.timer = None
        # Idle now, and marked unloading at once: a request that comes next waits for the
        # unload and loads the model again, never holds the model being closed.
        if entry.in_flight == 0 and entry.model is not None and entry.unloading is None:
            self.start_unload(entry, 0)

    async def fit(self, entry: Entry, model: Any) -> None:
        """After ``entry``'s load measured what ``model`` costs: unload idle models until it
        fits the memory budget, or close ``model`` and raise :class:`ModelCapacityError`.

        A first load is only estimated beforehand (its folder's size); measured, the model
        may need more. Idle models make room; if busy ones leave none, this model goes
        again, before anyone could use it (its next load is estimated from this measurement).
        """
        budget = self.memory_budget
        if budget is None or self.loaded_cost() + entry.cost <= budget:
            return
        for victim in self.idle_by_age(exclude=entry):
            await self.start_unload(victim, 0)
            if self.loaded_cost() + entry.cost <= budget:
                return
        await model.close()
        used = self.loaded_cost()
        held = (
            f"{_size(used)} of the memory budget of {_size(budget)} is held by models serving requests"
            if used
            else f"that is more than the whole memory budget of {_size(budget)}"
        )
        raise ModelCapacityError(
            f"model {entry.name!r} cannot be loaded now: it needs {_size(entry.cost)} (measured), and {held}",
            name=entry.name,
        )

    def hold(self, entry: Entry) -> None:
        """A request holds ``entry``'s loaded model: no unload, no idle timer, until :meth:`release`."""
        entry.in_flight += 1
        entry.idle.clear()
        entry.last_used = time.time()
        self.disarm(entry)


def folder_bytes(folder: Path) -> int:
    """The size of the files in ``folder`` (what a first load is expected to cost); for a
    model file (GGUF), the size of its parts (its converted folder is about as large)."""
    if folder.is_file():
        try:
            return sum(part.stat().st_size for part in split_parts(folder))
        except GgufError:  # a part is missing: the load says so
            return folder.stat().st_size
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _size(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


def _weak(model: Any) -> weakref.ref[Any] | None:
    try:
        return weakref.ref(model)
    except TypeError:  # a model class without weak references: taken as alive
        return None
