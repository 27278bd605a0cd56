"""Handing results from a worker thread back to the asyncio caller that waits for them."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

__all__ = ["resolve_future"]


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
