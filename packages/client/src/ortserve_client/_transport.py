"""The client's HTTP layer: JSON or multipart requests with retries and backoff, and
answers decoded into the protocol's Structs or streamed.

:class:`AsyncClient` and each of its resources (``client.chat``, ``client.responses``,
``client.files``...) send through one :class:`Transport`.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Mapping
from typing import Any, TypeVar

import httpx
import msgspec

from ._errors import APIConnectionError, OrtServeError, status_error, translate_transport_errors
from ._streaming import AsyncStream

__all__ = ["RETRY_STATUSES", "Transport", "request_struct"]

T = TypeVar("T", bound=msgspec.Struct)
RETRY_STATUSES = frozenset({429, 503})
"""Statuses worth another try: the server asks the caller to come back later."""
_NOT_RETRIED = (httpx.ReadTimeout, httpx.WriteTimeout)
"""Transport errors after which the request may be running already: a retry would repeat it."""
_encode = msgspec.json.Encoder().encode
_sleep = asyncio.sleep  # a seam for the tests


def request_struct(struct_type: type[T], fields: Mapping[str, Any]) -> T:
    """Build a request Struct from keyword arguments (nested values may be Structs or
    dicts), with a clear ``TypeError`` for unknown or ill-typed ones."""
    unknown = sorted(set(fields) - set(struct_type.__struct_fields__))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) for {struct_type.__name__}: {', '.join(unknown)}")
    try:
        return msgspec.convert({k: v for k, v in fields.items() if v is not msgspec.UNSET}, struct_type)
    except msgspec.ValidationError as exc:
        raise TypeError(f"invalid arguments for {struct_type.__name__}: {exc}") from exc


class Transport:
    """Sends to the API at ``base_url`` over ``http``, retrying ``max_retries`` times."""

    def __init__(self, base_url: str, http: httpx.AsyncClient, max_retries: int) -> None:
        self.base_url = base_url
        self.http = http
        self.max_retries = max_retries

    async def send(self, method: str, url: str, body: msgspec.Struct | None, result: type[T]) -> T:
        response = await self.response(method, url, body, stream=False)
        try:
            return msgspec.json.decode(response.content, type=result)
        except msgspec.DecodeError as exc:
            raise OrtServeError(f"unexpected response from {url}: {exc}") from exc

    async def stream(self, url: str, body: msgspec.Struct, chunk: type[T]) -> AsyncStream[T]:
        response = await self.response("POST", url, body, stream=True)
        return AsyncStream(response, chunk)

    async def response(
        self,
        method: str,
        url: str,
        body: msgspec.Struct | None,
        *,
        stream: bool,
        ok_statuses: frozenset[int] = frozenset(),
        form: tuple[dict[str, str], dict[str, tuple[str, bytes]]] | None = None,
    ) -> httpx.Response:
        """Send with retries; ``form`` (fields, files) sends multipart instead of JSON."""
        content = _encode(body) if body is not None else None
        attempt = 0
        while True:
            try:
                with translate_transport_errors(url):
                    if form is not None:
                        request = self.http.build_request(method, url, data=form[0], files=form[1])
                    else:
                        headers = {"content-type": "application/json"} if content is not None else None
                        request = self.http.build_request(method, url, content=content, headers=headers)
                    response = await self.http.send(request, stream=stream)
            except APIConnectionError as exc:
                if attempt >= self.max_retries or isinstance(exc.__cause__, _NOT_RETRIED):
                    raise
                await _sleep(_backoff(attempt, None))
                attempt += 1
                continue
            if response.is_success or response.status_code in ok_statuses:
                return response
            raw = await response.aread()
            await response.aclose()
            if response.status_code in RETRY_STATUSES and attempt < self.max_retries:
                await _sleep(_backoff(attempt, response.headers.get("retry-after")))
                attempt += 1
                continue
            raise status_error(response, raw)


def _backoff(attempt: int, retry_after: str | None) -> float:
    """Seconds to wait: ``Retry-After`` (seconds, at most a minute) when the server sent
    it, else 0.25 s doubling per attempt up to 8 s, with ±25 % jitter."""
    if retry_after is not None:
        try:
            seconds = float(retry_after)
        except ValueError:
            seconds = math.nan  # an HTTP date: fall back to the backoff
        if math.isfinite(seconds):
            return min(max(seconds, 0.0), 60.0)
    return float(min(0.25 * 2**attempt, 8.0) * (0.75 + random.random() / 2))
