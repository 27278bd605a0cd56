"""The owner-thread bridge: work handed from asyncio to the thread that owns a model, and
results handed back.

onnxruntime-genai requires Engine calls from the thread that owns the engine, and a
session run must never block the event loop; so each engine owns one thread, asyncio
callers only append to its inbox (``submit``/``cancel``), and events go back through
``request.deliver`` (see :class:`~ortserve_runtime.chat.GenerationStream`); speech and
embeddings hand results back with :func:`resolve_future`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

from ._errors import EngineClosedError

if TYPE_CHECKING:
    from .chat._request import Request

__all__ = ["OwnerThread", "resolve_future"]


def resolve_future(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: object) -> None:
    """Set ``future`` (an exception if ``result`` is one) on its own loop, from any thread.

    A future that is already done (its caller was cancelled) or whose loop is gone is
    left alone: nobody is waiting for it any more.
    """

    def apply() -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(apply)


class OwnerThread:
    """The owner-thread bridge: an inbox, cancellations and closing, guarded by one
    condition; subclasses implement :meth:`_run` (started by :meth:`_start_thread`)."""

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
