"""What keeps a web page from driving the server through a visitor's browser.

A server on 127.0.0.1 is what a malicious page targets (Ollama's CVE-2024-28224): with
DNS rebinding its own name resolves to 127.0.0.1, so the browser sends ``Host: evil.example``;
without it, a cross-site form or ``fetch`` with a "simple" content type (``text/plain``,
form-encoded, multipart) reaches the server with no CORS preflight. The guards here refuse
both before any handler runs:

- ``Host`` must be a loopback name or a configured one (``ServerConfig.host_check`` says on
  which connections);
- ``Origin``, when a browser sends one, must be loopback, the server's own origin, or
  configured; requests without ``Origin`` (SDKs, curl) pass;
- a body must have the route's own content type (``application/json``, or
  ``multipart/form-data`` on the one multipart route), which no simple request can forge,
  and no content coding (none is undone);
- a body that cannot be decoded (invalid UTF-8, JSON nested past msgspec's limit) is a 400
  here rather than an unhandled error inside Litestar's decoder, and so is one with more
  keys or items than a request needs (``_json_bounds``), before it is decoded.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

from litestar.connection import ASGIConnection, Request
from litestar.constants import RESERVED_KWARGS
from litestar.enums import RequestEncodingType
from litestar.exceptions import SerializationException
from litestar.handlers import BaseRouteHandler
from litestar.params import CookieParameter, HeaderParameter, PathParameter

from ._config import ServerConfig
from ._errors import BadRequestError, ForbiddenError, ShuttingDownError, UnsupportedMediaTypeError
from ._json_bounds import DEEPER_BY, check_json_counts, deepest_field, one_at_a_time
from ._settings_fields import check_settings_fields

if TYPE_CHECKING:
    from ._state import OrtServe

__all__ = ["SiteGuard", "body_guard", "check_known_fields", "make_body_guard"]

T = TypeVar("T")

_JSON = "application/json"
_MULTIPART = "multipart/form-data"


def _is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: browsers resolve these to loopback
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def _hostname(authority: str) -> str | None:
    """The lower-cased host of ``host[:port]`` or ``[v6][:port]``; ``None`` when malformed."""
    try:
        parts = urlsplit(f"//{authority}")
        return (parts.hostname or "").rstrip(".") or None
    except ValueError:
        return None


def _origin(value: str) -> str:
    """``scheme://host[:port]`` lower-cased, so configured and sent origins compare equal."""
    return value.strip().rstrip("/").lower()


class SiteGuard:
    """Host, Origin and content type checks (a Litestar guard; see the module docstring)."""

    def __init__(self, config: ServerConfig) -> None:
        self.host_check = config.host_check
        self.hosts = frozenset(h.lower().rstrip(".") for h in config.allowed_hosts)
        origins = {_origin(o) for o in (*config.allowed_origins, *config.cors_origins)}
        self.any_origin = "*" in origins
        self.origins = frozenset(origins - {"*"})

    async def __call__(self, connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
        # async, though it awaits nothing: Litestar runs a sync guard on a worker thread,
        # a thread hop on every request for a few dictionary lookups.
        host = connection.headers.get("host")
        if host is not None and self._checks_host(connection) and not self._host_allowed(host):
            raise ForbiddenError(
                f"Host {host!r} is not served: this server answers loopback names"
                " (allow more with --allow-host or ServerConfig.allowed_hosts)"
            )
        origin = connection.headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            raise ForbiddenError(
                f"Origin {origin!r} may not call this server: web pages from other sites are refused"
                " (allow one with --allow-origin or ServerConfig.allowed_origins)"
            )
        expected = _body_media_type(handler)
        if expected is not None:
            given = connection.headers.get("content-type", "")
            media = given.partition(";")[0].strip().lower()
            if media != expected:
                what = f"Content-Type {given!r}" if given else "a request without Content-Type"
                raise UnsupportedMediaTypeError(f"{what} is not accepted here: send the body as {expected!r}")
            # No route undoes a content coding: a gzipped body was read as it came ("JSON is
            # malformed: invalid character (byte 0)"), and one labelled gzip but sent plain
            # was served. RFC 9110 (8.4.1) answers a coding the server does not take with 415.
            coding = connection.headers.get("content-encoding", "").strip().lower()
            if coding not in ("", "identity"):
                raise UnsupportedMediaTypeError(
                    f"Content-Encoding {coding!r} is not accepted here: send the body uncompressed"
                )

    def _checks_host(self, connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
        if self.host_check is not None:
            return self.host_check
        # The address the connection arrived on: loopback means a local browser may be the
        # client, whatever name the page used to get here.
        server = connection.scope.get("server")
        return server is not None and isinstance(server[0], str) and _is_loopback(server[0])

    def _host_allowed(self, authority: str) -> bool:
        name = _hostname(authority)
        return name is not None and (_is_loopback(name) or name in self.hosts)

    def _origin_allowed(self, origin: str, host: str | None) -> bool:
        normal = _origin(origin)
        if self.any_origin or normal in self.origins:
            return True
        try:
            parts = urlsplit(normal)
            hostname = parts.hostname
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not hostname:
            return False  # "null" (sandboxed frames, file:), browser extensions...
        if _is_loopback(hostname):
            return True
        # Same-origin: a page of the host app this server is mounted in. Where the Host
        # check is on, a rebinding page never gets this far.
        return host is not None and parts.netloc == host.lower()


def _body_media_type(handler: BaseRouteHandler) -> str | None:
    """The content type a route's body must have, or ``None`` for a route without one."""
    field = handler.parsed_fn_signature.parameters.get("data")
    if field is None:
        return None
    kwarg = field.kwarg_definition
    if getattr(kwarg, "media_type", None) == RequestEncodingType.MULTI_PART:
        return _MULTIPART
    return _JSON


def make_body_guard(
    *, lenient: bool, state: OrtServe | None = None
) -> Callable[[ASGIConnection[Any, Any, Any, Any], BaseRouteHandler], Any]:
    """:func:`body_guard`, and (unless ``lenient``) a 400 naming the fields of a JSON body
    that its request Struct does not have: ignored, they would be settings that do nothing
    (vLLM's ``guided_json`` once gave unconstrained output here). ``state``: the server's,
    whose shutdown cut ends a body still coming in with a 503."""

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
        if not lenient and connection.scope.get("query_string"):
            check_known_query(connection, handler)
        decoded = await body_guard(connection, handler, state)
        if lenient or not isinstance(decoded, dict):
            return
        field = handler.parsed_fn_signature.parameters.get("data")
        body_type = getattr(field, "annotation", None)
        check_known_fields(decoded, body_type)
        body = await connection.body() if isinstance(connection, Request) else b""
        if body.count(b"{") <= _WALKED_ON_THE_LOOP and body.count(b",") <= _VALUES_WALKED_ON_THE_LOOP:
            check_settings_fields(decoded, body_type)
        else:  # a walk of as many values as the body holds: off the loop, one at a time
            async with one_at_a_time():
                await asyncio.to_thread(check_settings_fields, decoded, body_type)

    return guard


def check_known_query(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """A 400 naming the query parameters the handler does not take (twenty-first probe,
    issue 45: ``GET /v1/responses/{id}?stream=true`` answered plain JSON, ``include[]``,
    ``starting_after`` and made-up keys were ignored alike)."""
    # What Litestar reads from the query: the handler's parameters but the body, the request
    # and the like, its dependencies and its path's (twenty-third probe: ?ortserve=, ?data= and
    # ?request= were taken and ignored).
    not_query = RESERVED_KWARGS | handler.resolve_dependencies().keys() | connection.scope.get("path_params", {}).keys()
    taken = {
        getattr(parameter.kwarg_definition, "query", None) or name
        for name, parameter in handler.parsed_fn_signature.parameters.items()
        if name not in not_query
        and not isinstance(parameter.kwarg_definition, PathParameter | HeaderParameter | CookieParameter)
    }
    query = connection.query_params
    unknown = sorted(key for key in query if key not in taken)
    if unknown:
        raise BadRequestError(
            f"unknown query parameter{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: this "
            "route does not take it (start the server with --lenient to ignore what it does not know)",
            param=unknown[0],
        )
    # None of them takes a list: a second value was dropped without a word (twenty-second probe).
    for key in query:
        if len(given := query.getall(key)) > 1:
            raise BadRequestError(f"query parameter {key!r} is given {len(given)} times; give it once", param=key)


def check_known_fields(body: dict[str, Any], body_type: Any, *, where: str = "", param: str | None = None) -> None:
    """A 400 naming the fields of ``body`` that ``body_type`` (a request Struct; anything
    else is not checked) does not have; ``where`` begins the message and ``param`` names
    the field the body came in (a batch line's: the file), else the first unknown one."""
    fields = getattr(body_type, "__struct_encode_fields__", None)
    unknown = sorted(key for key in body if key not in fields) if fields is not None else []
    if unknown:
        # At most ten named: 49,990 of them made a 640 KB answer (twenty-seventh probe).
        named = ", ".join(map(repr, unknown[:10])) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        raise BadRequestError(
            f"{where}unknown field{'s' if len(unknown) > 1 else ''} {named}: this server "
            "does not take it (start it with --lenient to ignore fields it does not know)",
            param=param or unknown[0],
        )


_WALKED_ON_THE_LOOP = 1000
"""Objects a body may hold (counted as its ``{``, strings' too: an upper bound) for its
settings to be walked on the event loop, a millisecond or two; past them on a worker thread
(twenty-fifth probe, issue 45: 21,000 empty tools, a 64 KiB body, held the loop 25-40 ms)."""
_VALUES_WALKED_ON_THE_LOOP = 20_000
"""Values (counted as the body's ``,``, strings' too) past which the walk runs on a worker
thread: a list where objects belong may hold plain values, each looked at (twenty-seventh
probe, issue 45: ``tools`` of 499,000 zeros held the loop 215-560 ms)."""
_PACED_DECODE = 64 * 1024
"""Bodies past this size are decoded one per turn of the event loop (:func:`one_at_a_time`):
decoding holds the loop (msgspec keeps the GIL; some 10-20 ms for a 460 KB schema)."""


async def body_guard(
    connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler, state: OrtServe | None = None
) -> Any:
    """Decode the body now, so that what Litestar's decoders raise on undecodable input
    (``UnicodeDecodeError``, ``RecursionError``) is a 400; Litestar keeps the decoded body
    for the handler, and the JSON one is returned. Runs after the API key check: no decoding
    for strangers. A body still coming in when a shutdown cuts work off (``state``'s) is
    a 503 in the API's shape: cancelled at the end, an upload got uvicorn's plain-text 500."""
    kind = _body_media_type(handler)
    if kind is None or not isinstance(connection, Request):
        return
    try:
        if kind == _MULTIPART:
            await _unless_cut(connection.form(), state)
            return
        body = await _unless_cut(connection.body(), state)
        if not body.strip():
            raise BadRequestError("the request has no body: send a JSON object")
        await check_json_counts(body, handler.opt.get(DEEPER_BY, 0))  # before decoding, which holds the event loop
        if len(body) <= _PACED_DECODE:
            decoded = await connection.json()
        else:
            async with one_at_a_time():
                decoded = await connection.json()
                await asyncio.sleep(0)  # the loop's other work runs before the next one
    except UnicodeDecodeError:
        where = "a multipart text field" if kind == _MULTIPART else "the JSON body"
        raise BadRequestError(f"{where} is not valid UTF-8") from None
    except RecursionError:
        field = await deepest_field(body)
        raise BadRequestError(
            "the JSON body is nested too deeply" + (f" in {field!r}" if field else ""), param=field
        ) from None
    except SerializationException as exc:  # malformed JSON, as Litestar itself reports it
        raise BadRequestError(_decode_error_message(str(exc), body)) from None
    if not isinstance(decoded, dict):
        raise BadRequestError(
            f"the request body must be a JSON object, not {_JSON_KINDS.get(type(decoded), 'a value')}"
        )
    return decoded


async def _unless_cut(reading: Awaitable[T], state: OrtServe | None) -> T:
    """``reading``, or :class:`ShuttingDownError` once ``state``'s shutdown cuts work off.

    The read stays in the request's own task (the body budget's refusal and the slow-body
    cut are raised inside it): the cut cancels this task, and the cancellation it caused
    becomes the 503. A read raced in a task of its own lost the body budget's 503."""
    task = asyncio.current_task()
    if state is None or task is None:
        return await reading
    reading_now = True

    def on_cut(cut: asyncio.Future[None]) -> None:
        if reading_now and not cut.cancelled():
            task.cancel()

    with state.cut_signal() as cut:
        cut.add_done_callback(on_cut)
        try:
            return await reading
        except asyncio.CancelledError:
            if cut.done() and not cut.cancelled() and task.uncancel() == 0:
                state.cut_requests += 1
                raise ShuttingDownError("the server is shutting down; the request body was still coming in") from None
            raise
        finally:
            reading_now = False


_LONE_HIGH_SURROGATE_AT_END = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}[^\\]{0,5}$")
"""A ``\\ud800``-``\\udbff`` escape near the end of a body, no escape after it: msgspec,
reading on for its low surrogate, says the input was truncated."""


def _decode_error_message(message: str, body: bytes) -> str:
    """msgspec's message for an undecodable body, with its misleading case said plainly: a
    lone high surrogate close to the end (``{"a": "\\ud800"}``) reads as truncated input
    (elsewhere msgspec names the unpaired surrogate itself)."""
    if message == "Input data was truncated" and _LONE_HIGH_SURROGATE_AT_END.search(body[-16:]):
        return "JSON is malformed: a \\ud800-\\udbff escape without the low surrogate that must follow it"
    return message


_JSON_KINDS = {
    type(None): "null",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
}
