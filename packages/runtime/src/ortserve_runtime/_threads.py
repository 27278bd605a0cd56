"""The owner-thread bridge: work handed from asyncio to the thread that owns a model, and
results handed back.

onnxruntime-genai requires Engine calls from the thread that owns the engine, and a
session run must never block the event loop; so each engine owns one thread, asyncio
callers only append to its inbox (``submit``/``cancel``), and events go back through
``request.deliver`` (see :class:`~ortserve_runtime.chat.GenerationStream`), which calls
:func:`hand_back`; speech and embeddings hand results back with :func:`resolve_future`.

Each hand-back wakes the event loop through its self-pipe, and the owner thread then
waits for the GIL while the loop runs (measured: about 2 ms a wake-up on 2 busy cores,
against a 17 ms decode step). An engine that produces many events at once (a decode step
of a batch) wraps them in :func:`batched_hand_backs`: one wake-up per loop for all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ._errors import EngineClosedError

if TYPE_CHECKING:
    from .chat._request import Request

__all__ = ["OwnerThread", "batched_hand_backs", "hand_back", "resolve_future"]

_HandBack = tuple[Callable[[Any], None], object, Callable[[], None]]
"""A callback, its argument, and what to do instead when the loop is gone."""
_batch = threading.local()
"""``pending``: while :func:`batched_hand_backs` runs on a thread, the hand-backs it collects."""


def hand_back(
    loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None], item: object, on_gone: Callable[[], None]
) -> None:
    """Call ``callback(item)`` on ``loop`` from any thread (later, within
    :func:`batched_hand_backs`); ``on_gone()`` instead, on this thread, if the loop is gone."""
    pending: dict[asyncio.AbstractEventLoop, list[_HandBack]] | None = getattr(_batch, "pending", None)
    if pending is not None:
        pending.setdefault(loop, []).append((callback, item, on_gone))
        return
    try:
        loop.call_soon_threadsafe(callback, item)
    except RuntimeError:
        on_gone()


@contextlib.contextmanager
def batched_hand_backs() -> Iterator[None]:
    """Collect the :func:`hand_back` calls of this thread and make them on leaving, one
    wake-up per event loop."""
    _batch.pending = {}
    try:
        yield
    finally:
        pending, _batch.pending = _batch.pending, None
        for loop, calls in pending.items():
            try:
                loop.call_soon_threadsafe(_call_each, calls)
            except RuntimeError:
                for _, _, on_gone in calls:
                    on_gone()


def _call_each(calls: list[_HandBack]) -> None:
    for callback, item, _ in calls:
        callback(item)


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
            if request.options.background or not self._inbox or not self._inbox[-1].options.background:
                self._inbox.append(request)
            else:  # an interactive request goes before the background ones
                first = next(i for i, queued in enumerate(self._inbox) if queued.options.background)
                self._inbox.insert(first, request)
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
