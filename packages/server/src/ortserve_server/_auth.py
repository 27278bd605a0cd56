"""The API key guard of every route but health, and who sent a request (:class:`Caller`)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from ._errors import AuthenticationError, ForbiddenError

__all__ = ["CALLER", "Caller", "caller_of", "key_digest", "make_auth_guard"]


CALLER = "ortserve.caller"
"""Where the API key guard (or the batch runner) leaves the request's :class:`Caller` in
the ASGI scope."""


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request, as far as the server tells callers apart."""

    owner: str = ""
    """The digest of the API key it came with (``""`` on a server without keys): files
    and batches belong to it."""
    cache_scope: str | None = None
    """Its prefix-cache scope: the key's digest where the cache is scoped by key
    (``ServerConfig.prefix_cache_scope``), ``None`` where it is shared."""
    background: bool = False
    """A batch's line: runs behind interactive requests (``GenerationOptions.background``)."""
    key: str = ""
    """The label of its API key (``ServerConfig.api_key``): what usage, logs and traces
    name it by (``""`` on a server without keys)."""


def caller_of(request: ASGIConnection[Any, Any, Any, Any] | None) -> Caller:
    """The request's :class:`Caller` (anonymous and interactive when nothing says otherwise)."""
    found = None if request is None else request.scope.get(CALLER)
    return found if isinstance(found, Caller) else Caller()


def key_digest(key: str) -> str:
    """What files and batches record as their owner: the key's SHA-256, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()


def make_auth_guard(
    api_keys: Mapping[str, str],
    *,
    x_api_key: bool = False,
    scoped: bool = False,
    not_enough: tuple[str, Mapping[str, str]] | None = None,
) -> Any:
    """A guard that wants ``Authorization: Bearer <key>`` for one of ``api_keys`` (each key
    with its label; or, with ``x_api_key``, the ``x-api-key`` header Anthropic's clients
    send), compared in constant time. It records which key came (:data:`CALLER`): files and
    batches belong to it, usage is counted under its label, and with ``scoped`` it is the
    prefix cache's scope too. ``not_enough``: what the route needs, and keys that are good
    elsewhere but not here: those get a 403 that says so, not the 401 of a wrong key."""
    expected = [(key.encode(), key_digest(key), label) for key, label in api_keys.items()]
    lesser = [(key.encode(), "", label) for key, label in (not_enough[1] if not_enough else {}).items()]
    ask = "'x-api-key: <key>' or 'Authorization: Bearer <key>'" if x_api_key else "'Authorization: Bearer <key>'"

    def matching(given: str, keys: list[tuple[bytes, str, str]] = expected) -> tuple[str, str] | None:
        found = None
        for key, digest, label in keys:  # every key compared: the time does not tell which matched
            if hmac.compare_digest(given.strip().encode(), key):
                found = digest, label
        return found

    async def auth_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        # async (see SiteGuard.__call__): comparing a few keys needs no worker thread.
        given = list(connection.headers.getall("x-api-key", [])) if x_api_key else []
        for authorization in connection.headers.getall("authorization", []):
            scheme, *bearer = authorization.split(None, 1)  # a tab separates as a space does
            if scheme.lower() == "bearer" and bearer:
                given.append(bearer[0])
        if len({key.strip() for key in given}) > 1:
            # Which would win is no rule a caller can know: one key's caller must not pass
            # as another because a wrong header came first (x-api-key and Authorization, or
            # either twice).
            raise AuthenticationError("the request's key headers name different API keys: send one")
        found = next((match for key in given if (match := matching(key)) is not None), None)
        if found is None and not_enough is not None and any(matching(key, lesser) for key in given):
            raise ForbiddenError(f"this route needs {not_enough[0]}: this API key is not enough")
        if found is None:
            raise AuthenticationError(f"missing or wrong API key: send {ask}")
        digest, label = found
        caller = Caller(owner=digest, cache_scope=digest if scoped else None, key=label)
        connection.scope[CALLER] = caller  # type: ignore[literal-required]

    return auth_guard
