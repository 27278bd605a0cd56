"""The API key guard of every route but health, and who sent a request (:class:`Caller`)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from ._errors import (
    AuthenticationError,
)

__all__ = ["CALLER", "Caller", "caller_of", "make_auth_guard"]


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


def caller_of(request: ASGIConnection[Any, Any, Any, Any] | None) -> Caller:
    """The request's :class:`Caller` (anonymous and interactive when nothing says otherwise)."""
    found = None if request is None else request.scope.get(CALLER)
    return found if isinstance(found, Caller) else Caller()


def make_auth_guard(api_keys: Sequence[str], *, x_api_key: bool = False, scoped: bool = False) -> Any:
    """A guard that wants ``Authorization: Bearer <key>`` for one of ``api_keys`` (or, with
    ``x_api_key``, the ``x-api-key`` header Anthropic's clients send), compared in constant
    time. It records which key came (:data:`CALLER`): files and batches belong to it, and
    with ``scoped`` it is the prefix cache's scope too."""
    expected = [(key.encode(), hashlib.sha256(key.encode()).hexdigest()) for key in api_keys]
    ask = "'x-api-key: <key>' or 'Authorization: Bearer <key>'" if x_api_key else "'Authorization: Bearer <key>'"

    def matching(given: str) -> str | None:
        found = None
        for key, digest in expected:  # every key compared: the time does not tell which matched
            if hmac.compare_digest(given.strip().encode(), key):
                found = digest
        return found

    async def auth_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        # async (see SiteGuard.__call__): comparing a few keys needs no worker thread.
        given_key = connection.headers.get("x-api-key") if x_api_key else None
        digest = matching(given_key) if given_key is not None else None
        if digest is None:
            scheme, _sep, given = connection.headers.get("authorization", "").partition(" ")
            digest = matching(given) if scheme.lower() == "bearer" else None
        if digest is None:
            raise AuthenticationError(f"missing or wrong API key: send {ask}")
        caller = Caller(owner=digest, cache_scope=digest if scoped else None)
        connection.scope[CALLER] = caller  # type: ignore[literal-required]

    return auth_guard
