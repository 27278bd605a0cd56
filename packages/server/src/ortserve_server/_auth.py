"""The API key guard of every route but health."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler

from ._errors import (
    AuthenticationError,
)
from ._plan import CALLER, Caller

__all__ = ["make_auth_guard"]


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

    def auth_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
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
