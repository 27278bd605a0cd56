"""A few threads that take queued calls one lane at a time, in turn."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

__all__ = ["FairThreads"]

T = TypeVar("T")


class FairThreads:
    """``threads`` threads (started at the first call) for calls submitted under a *lane*
    (whose call it is: the server gives a caller's owner and whether a batch line): a free thread takes the oldest call of the lane whose
    turn it is, then that lane goes to the back. One lane's backlog so delays another's
    call by at most the calls already running, where a first-in-first-out pool made it
    wait for the whole backlog (six slow grammars of one key, 2 s each, held another key's
    grammar 14-19 s). A call whose future is cancelled before it starts does not run."""

    def __init__(self, threads: int, name: str) -> None:
        self._threads = threads
        self._name = name
        self._lanes: collections.OrderedDict[
            Hashable, collections.deque[tuple[concurrent.futures.Future[Any], Callable[[], Any]]]
        ]
        self._lanes = collections.OrderedDict()
        self._ready = threading.Condition()
        self._started = False

    def submit(self, lane: Hashable, call: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._ready:
            if not self._started:
                self._started = True
                for index in range(self._threads):
                    threading.Thread(target=self._work, name=f"{self._name}_{index}", daemon=True).start()
            self._lanes.setdefault(lane, collections.deque()).append((future, call))
            self._ready.notify()
        return future

    def _next(self) -> tuple[concurrent.futures.Future[Any], Callable[[], Any]]:
        with self._ready:
            while not self._lanes:
                self._ready.wait()
            lane, calls = self._lanes.popitem(last=False)
            taken = calls.popleft()
            if calls:
                self._lanes[lane] = calls  # at the back: the other lanes go first
            return taken

    def _work(self) -> None:
        while True:
            future, call = self._next()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = call()
            except BaseException as exc:  # noqa: BLE001  # the caller's to handle
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, call  # not held while waiting for the next
