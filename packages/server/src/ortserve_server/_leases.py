"""Requests hold the models they use until their response is over, streams included.

A route takes a model with :func:`hold_model`; :func:`release_leases` (ASGI middleware on
our routers) lets go of it once the response has been sent, the last SSE event of a
stream included, or the request failed. While a model is held, an unload waits for it
(up to its grace period) and eviction passes it by.
"""

from __future__ import annotations

import contextvars
import hmac
import math
import re
from collections.abc import Callable

import msgspec
from litestar.types import ASGIApp, Receive, Scope, Send
from ortserve_runtime import ModelLease, ModelRegistry

from ._errors import BadRequestError, ForbiddenError

__all__ = ["hold_model", "keep_alive_by_admin", "mark_admin_callers", "parse_keep_alive", "release_leases"]

_held: contextvars.ContextVar[list[ModelLease] | None] = contextvars.ContextVar("ortserve_leases", default=None)


async def hold_model(registry: ModelRegistry, name: str, keep_alive: float | None = None) -> object:
    """The model ``name``, loaded if need be, held until the current response is over;
    then it stays loaded ``keep_alive`` seconds once idle (``None``: the server default)."""
    lease = await registry.acquire(name)
    lease.keep_alive = keep_alive
    held = _held.get()
    if held is None:  # outside our routers (no middleware to let go later): no hold
        lease.release()
    else:
        held.append(lease)
    return lease.model


_admin: contextvars.ContextVar[bool] = contextvars.ContextVar("ortserve_admin_caller", default=False)


def mark_admin_callers(admin_key: str) -> Callable[[ASGIApp], ASGIApp]:
    """Middleware factory: remember whether a request presents the admin key
    (``Authorization: Bearer`` or ``x-api-key``), for :func:`keep_alive_by_admin`."""
    expected = admin_key.encode()

    def factory(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            headers = dict(scope.get("headers", []))
            bearer = headers.get(b"authorization", b"").partition(b" ")
            given = [headers.get(b"x-api-key", b"").strip()]
            if bearer[0].lower() == b"bearer":
                given.append(bearer[2].strip())
            token = _admin.set(any(hmac.compare_digest(key, expected) for key in given if key))
            try:
                await app(scope, receive, send)
            finally:
                _admin.reset(token)

        return middleware

    return factory


def keep_alive_by_admin(seconds: float | None, admin_key: str | None) -> None:
    """Refuse (403 naming ``keep_alive``) a request's ``keep_alive`` of 0 (unload now) or
    negative (keep loaded for ever) unless it comes with the admin key, where one is set:
    unloading and pinning models are the control routes' to do, not any API caller's."""
    if admin_key is None or seconds is None or seconds > 0 or _admin.get():
        return
    raise ForbiddenError(
        "keep_alive 0 (unload) or negative (keep loaded) needs the admin key on this server: send it "
        "(Authorization: Bearer <admin key>), use the control routes (/v1/models/load, /v1/models/unload), "
        "or give a positive duration",
        param="keep_alive",
    )


def release_leases(app: ASGIApp) -> ASGIApp:
    """Middleware: release the models a request held once its response is over."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        held: list[ModelLease] = []
        token = _held.set(held)
        try:
            await app(scope, receive, send)
        finally:
            _held.reset(token)
            for lease in held:
                lease.release()

    return middleware


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")
_NUMBER = re.compile(r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_FOREVER = 100 * 365 * 86400.0
"""Longer than this is as good as forever (and keeps expiry times finite)."""


def parse_keep_alive(value: float | str | msgspec.UnsetType | None) -> float | None:
    """``keep_alive`` as seconds (Ollama's forms: a number of seconds, or a duration such
    as ``"90s"``, ``"5m"``, ``"1h30m"``; negative keeps the model loaded), ``None`` when
    absent; a 400 naming the field otherwise."""
    if value is None or isinstance(value, msgspec.UnsetType):
        return None
    if isinstance(value, bool):
        raise _bad_keep_alive(value)
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        parts = _DURATION.findall(body)
        if body and "".join(number + unit for number, unit in parts) == body:
            seconds = sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
        elif _NUMBER.fullmatch(body):
            seconds = sign * float(body)
        else:
            raise _bad_keep_alive(value)
    if math.isnan(seconds):
        raise _bad_keep_alive(value)
    return -1.0 if seconds > _FOREVER else seconds


def _bad_keep_alive(value: object) -> BadRequestError:
    return BadRequestError(
        f"keep_alive must be seconds or a duration such as '90s', '5m' or '1h' (negative: keep loaded), got {value!r}",
        param="keep_alive",
    )
