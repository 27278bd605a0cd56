"""What the server records of each request: its id (``x-request-id``), one log line (plain
or JSON), its usage under the caller's key label, and, where OpenTelemetry is configured,
its span and the spans of its phases (``_tracing``, imported only then).

One ASGI middleware (:func:`observe_requests`) opens a :class:`~._record.RequestRecord`
per request and keeps it for the code below it (``_record``); when the response is over it
writes the log line, counts the usage and ends the span. Nothing here costs more than a few
attribute writes per request while tracing is off.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import os
import sys
import time
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from litestar.types import ASGIApp, Receive, Send

from ._record import CURRENT, RECORD, REQUEST_ID_HEADER, RequestRecord, request_id_from, request_id_of

if TYPE_CHECKING:
    from ._config import ServerConfig
    from ._tracing import Tracing

__all__ = ["JsonLogFormatter", "Observer", "add_request_id", "observe_requests", "tracing_source"]

_REQUEST_ID_BYTES = REQUEST_ID_HEADER.encode()
_PATH_SAFE = "/:@!$&'()*+,;="
"""What a path segment may hold unencoded besides letters, digits and ``-._~`` (RFC 3986's pchar)."""

logger = logging.getLogger("ortserve.server")
access_log = logging.getLogger("ortserve.access")
"""One line per request: ``ortserve.access``."""


def observe_requests(observer: Observer, *, usage: bool = True) -> Callable[[ASGIApp], ASGIApp]:
    """Middleware factory: a :class:`RequestRecord` per request (one only, where an outer
    ortserve middleware already opened it), ``x-request-id`` on every response. ``usage``:
    count it in the usage per key (the API's routes; not health or metrics)."""
    from ._auth import CALLER, Caller  # here: the auth guard's errors import this module

    keep_prompts = observer.log_prompts

    def factory(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Any, receive: Receive, send: Send) -> None:  # Any: http scopes only
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            outer = scope.get(RECORD)
            if isinstance(outer, RequestRecord):  # opened further out (a batch line's app): one record
                outer.counted = usage
                await app(scope, receive, send)
                return
            headers = scope["headers"]
            record = RequestRecord(id=request_id_from(headers), method=scope["method"], path=scope["path"])
            record.counted = usage
            record.keep_prompt = keep_prompts
            scope[RECORD] = record
            header = (_REQUEST_ID_BYTES, record.id.encode())
            tracing = observer.tracing()
            trace_token = tracing.begin(record, headers) if tracing is not None else None

            async def sending(message: Any) -> None:
                if message["type"] == "http.response.start":
                    record.status = message["status"]
                    message["headers"] = [*message.get("headers", ()), header]
                await send(message)

            token = CURRENT.set(record)
            error: BaseException | None = None
            try:
                await app(scope, receive, sending)
            except BaseException as exc:
                error = exc
                raise
            finally:
                CURRENT.reset(token)
                record.route = scope.get("path_template") or record.route
                caller = scope.get(CALLER)
                record.key = caller.key if isinstance(caller, Caller) else None
                if error is not None and not record.status:
                    # Cancelled (a batch line when the server stops, a caller gone): nobody
                    # got an answer, and no error happened: ClientDisconnectedError's 499.
                    record.status = 499 if isinstance(error, asyncio.CancelledError) else 500
                observer.finished(record)
                if tracing is not None:
                    tracing.end(record, trace_token, error)

        return middleware

    return factory


async def add_request_id(message: Any, scope: Any) -> None:
    """A ``before_send`` hook for the standalone app: ``x-request-id`` on the answers that
    no route's middleware saw (a path no route matches)."""
    if message["type"] == "http.response.start" and RECORD not in scope:
        headers = message.get("headers") or []
        if not any(name.lower() == _REQUEST_ID_BYTES for name, _ in headers):
            message["headers"] = [*headers, (_REQUEST_ID_BYTES, request_id_of(scope).encode())]


class Observer:
    """What a mounted ortserve records of its requests: the access log line, the usage per
    key, and the tracing that :func:`observe_requests` starts (decided on first use)."""

    def __init__(self, config: ServerConfig, count_usage: Callable[[RequestRecord], None]) -> None:
        self._config = config
        self.log_prompts = config.log_prompts
        """The prompt goes into each request's log line (``ServerConfig.log_prompts``)."""
        self._count_usage = count_usage
        self._tracing: Tracing | None = None
        self._decided = config.tracing == "off"
        if config.otlp_endpoint and not self._decided:
            self.tracing()  # asked for by name: a missing extra fails the start, not a request

    def tracing(self) -> Tracing | None:
        """The request spans' maker, or ``None`` (off). Decided at the first request, not
        before: a host may set its global tracer provider after it built the app."""
        if not self._decided:
            self._decided = True
            source = tracing_source(self._config)
            if source == "env" and importlib.util.find_spec("opentelemetry.sdk") is None:
                logger.warning(
                    "OTEL_EXPORTER_OTLP_ENDPOINT is set, but ortserve-server[otel] is not installed: no traces"
                )
            elif source is not None:
                from ._tracing import Tracing

                self._tracing = Tracing(self._config, source)
        return self._tracing

    def finished(self, record: RequestRecord) -> None:
        if record.counted:
            self._count_usage(record)
        if not access_log.isEnabledFor(logging.INFO):
            return
        duration = time.perf_counter() - record.start
        extra = {
            "request_id": record.id,
            "method": record.method,
            "route": record.route or record.path,
            "status": record.status,
            "model": record.model,
            "key": record.key,
            "input_tokens": record.input_tokens,
            "output_tokens": record.output_tokens,
            "cached_tokens": record.cached_tokens,
            "duration_ms": round(duration * 1000, 2),
            "ttft_ms": round((record.first_token - record.start) * 1000, 2) if record.first_token else None,
        }
        if record.phases[2] or record.phases[1]:  # a generation ran: where its time went
            for name, seconds in zip(("queue_ms", "prefill_ms", "decode_ms"), record.phases, strict=True):
                extra[name] = round(seconds * 1000, 2)
        if self._config.log_prompts and record.prompt is not None:
            extra["prompt"] = record.prompt
        message = "%s %s %s %s model=%s tokens=%d/%d %.0fms"
        access_log.info(
            message,
            record.id,
            record.method,
            # Percent-encoded, as uvicorn's access log writes it: the path is decoded, and a
            # %0A in it wrote a line of the client's own into a plain log.
            urllib.parse.quote(record.path, safe=_PATH_SAFE),
            record.status,
            record.model or "-",
            record.input_tokens,
            record.output_tokens,
            duration * 1000,
            extra={"ortserve": extra},
        )

    async def close(self) -> None:
        if self._tracing is not None:
            await self._tracing.close()


def tracing_source(config: ServerConfig) -> str | None:
    """Where spans go, or ``None`` (tracing off): ``"endpoint"`` (``otlp_endpoint``: an
    exporter of ortserve's own), ``"host"`` (the global tracer provider the host process set),
    ``"env"`` (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``..._TRACES_ENDPOINT``: ortserve's own
    exporter, configured by the ``OTEL_*`` variables). Looks without importing OpenTelemetry:
    a host that set a provider has imported it already."""
    if config.tracing == "off" or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if config.otlp_endpoint:
        return "endpoint"
    trace = sys.modules.get("opentelemetry.trace")
    if trace is not None:
        provider = trace.get_tracer_provider()
        if not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return "host"
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return "env"
    return None


class JsonLogFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message``,
    and for access lines the request's fields (``request_id``, ``route``, ``model``,
    ``status``, tokens, durations). Never the API key: access lines name its label."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "ortserve", None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)
