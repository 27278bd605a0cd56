"""The back of a generative model: the :class:`Engine` protocol, what an engine can do,
and the owner-thread bridge every engine is built on.

onnxruntime-genai requires Engine calls from the thread that owns the engine, and a
session run must never block the event loop; so each engine owns one thread, asyncio
callers only append to its inbox (``submit``/``cancel``), and events go back through
``request.deliver`` (see :class:`~ortserve_runtime.chat.GenerationStream`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from .._errors import EngineClosedError
from ..chat._request import Request

__all__ = ["Engine", "EngineCapabilities", "ThreadedEngine"]


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What an engine does, so the front validates and prepares requests to match."""

    host_sampling: bool
    """Logits come back to the host: sampling, grammar masks and per-request seeds run
    in NumPy (else the engine samples and takes the grammar itself)."""
    seeds: bool
    """Per-request seeds are honoured."""
    media: bool
    """Takes a multimodal processor's inputs (images, audio)."""
    batching: Literal["continuous", "dynamic", "static", "interleaved"]
    """continuous: a request joins/leaves the batch at any step (ort-cpu); dynamic:
    og.Engine with paged attention; static: og.Engine batches that newcomers wait for;
    interleaved: one og.Generator per request, stepped in turn."""


@runtime_checkable
class Engine(Protocol):
    """Runs :class:`Request` objects; all that the front and the streams know of an engine."""

    name: str
    """``ort-cpu``, ``og-engine`` or ``og-generator``."""
    provider: str
    capabilities: EngineCapabilities

    def submit(self, request: Request) -> None:
        """Queue ``request``; its events arrive through ``request.deliver``. Any thread."""

    def cancel(self, request: Request) -> None:
        """End ``request`` with a ``"cancelled"`` event at the engine's next step. Any thread."""

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called (new requests are refused)."""

    async def close(self) -> None:
        """Stop: pending requests get :class:`EngineClosedError`; the thread exits."""

    @property
    def active(self) -> int:
        """Requests being generated now."""

    @property
    def queued(self) -> int:
        """Requests waiting to start."""


class ThreadedEngine:
    """The owner-thread bridge: an inbox, cancellations and closing, guarded by one
    condition; subclasses implement :meth:`_run` (started by :meth:`_start_thread`)."""

    name: str
    provider: str
    capabilities: EngineCapabilities

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._closing = False
        self._cond = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._cancels: set[Request] = set()
        self._thread = threading.Thread(target=self._run, name=f"ortserve-{model_name}", daemon=True)

    def _start_thread(self) -> None:
        self._thread.start()

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def queued(self) -> int:
        return len(self._inbox)

    @property
    def active(self) -> int:
        raise NotImplementedError

    def submit(self, request: Request) -> None:
        with self._cond:
            if self._closing:
                request.deliver(EngineClosedError(f"model {self.model_name!r} is closed"))
                return
            self._inbox.append(request)
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        with self._cond:
            request.cancelled = True
            self._cancels.add(request)
            self._cond.notify()

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """:meth:`close` for synchronous callers (a load that fails after the engine started)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _closed_error(self) -> EngineClosedError:
        return EngineClosedError(f"model {self.model_name!r} was closed")

    def _run(self) -> None:
        raise NotImplementedError
