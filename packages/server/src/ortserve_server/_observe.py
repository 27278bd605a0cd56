"""What the server records of each request: its id (``x-request-id``), one log line (plain
or JSON), its usage under the caller's key label, and, where OpenTelemetry is configured,
its span and the spans of its phases (``_tracing``, imported only then).

One ASGI middleware (:func:`observe_requests`) opens a :class:`RequestRecord` per request
and keeps it in a context variable for the code below it (the generation bridge notes the
model and tokens, the plan times the prompt's preparation, the tool loop its turns);
when the response is over it writes the log line, counts the usage and ends the span.
Nothing here costs more than a few attribute writes per request while tracing is off.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from litestar.types import ASGIApp, Receive, Send

if TYPE_CHECKING:
    from ortserve_runtime import Usage

    from ._config import ServerConfig
    from ._state import OrtServe
    from ._tracing import Tracing

__all__ = [
    "REQUEST_ID_HEADER",
    "JsonLogFormatter",
    "RequestRecord",
    "add_request_id",
    "current",
    "note",
    "observe_requests",
    "record_prompt",
    "request_id_of",
    "span",
    "traceparent",
]

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = REQUEST_ID_HEADER.encode()
_VALID_ID = re.compile(rb"[A-Za-z0-9._:@/+=-]{1,128}")
"""A client's own request id is kept when it is this: short, and nothing a log line or a
header could be broken by (else the server makes one)."""
RECORD = "ortserve.record"
"""Where the middleware leaves the :class:`RequestRecord` in the ASGI scope."""

logger = logging.getLogger("ortserve.server")
access_log = logging.getLogger("ortserve.access")
"""One line per request: ``ortserve.access``."""

_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("ortserve_record", default=None)


@dataclass(slots=True, eq=False)
class RequestRecord:
    """One request as the log line, the usage per key and the trace see it."""

    id: str
    method: str
    path: str
    start: float = field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when it arrived (the runtime's timings are on that clock)."""
    start_ns: int = field(default_factory=time.time_ns)
    route: str = ""
    """The route template that answered (``/v1/models/{model_id}``), once routed."""
    model: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    status: int = 0
    first_token: float | None = None
    """``perf_counter()`` of the first generated token, when there was one."""
    finish_reasons: list[str] = field(default_factory=list)
    response_id: str | None = None
    key: str | None = None
    """The label of the API key it came with (``None``: no key was needed or given)."""
    prompt: str | None = None
    """The prompt, for the log line only with ``log_prompts``."""
    trace: Any = None
    """The request's span while tracing (``_tracing.RequestSpan``), else ``None``."""
    counted: bool = True
    """Counted in the usage per key (API routes; not health and metrics)."""
    keep_prompt: bool = False
    """``ServerConfig.log_prompts``: :func:`record_prompt` keeps the prompt for the log line."""
    tool_loop: bool = False
    """The server runs the request's turns (MCP calls between them): each is a span."""
    turns: int = 0
    phases: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    """Seconds of queue wait, prefill and decode (the first choice's, summed over a tool
    loop's turns), as the runtime timed them: the log line's durations."""
    open_turns: list[Any] = field(default_factory=list)
    """Turn spans not ended yet (a turn that failed is ended with the request)."""

    def wall_ns(self, when: float) -> int:
        """``perf_counter()`` time ``when`` as nanoseconds since the epoch (span times)."""
        return self.start_ns + int((when - self.start) * 1e9)

    def generated(self, index: int, usage: Usage, model: str, turn: Any = None) -> None:
        """A stream (choice ``index``) of this request ended with ``usage``: its phases
        (queue wait, prefill, decode) become spans, as the runtime timed them, under the
        tool loop's ``turn`` where there is one (:meth:`open_turn`)."""
        if index == 0:
            self.phases[0] += usage.queued_seconds
            self.phases[1] += usage.prefill_seconds
            self.phases[2] += usage.decode_seconds
        if self.trace is not None:
            self.trace.phases(self, index, usage, model, time.perf_counter(), turn)

    def timed(self, name: str, since: float, attributes: Mapping[str, Any]) -> None:
        """A span ``name`` from ``since`` (``perf_counter()``) to now, once it is over (a
        speech sentence synthesized); nothing while tracing is off."""
        if self.trace is not None:
            self.trace.open(name, self, since, attributes).end(end_time=self.wall_ns(time.perf_counter()))

    def open_turn(self, model: str) -> Any:
        """A tool loop's turn starting now, as a span that :meth:`close_turn` ends; ``None``
        while tracing is off, or where the request runs no tool loop (one turn)."""
        if self.trace is None or not self.tool_loop:
            return None
        self.turns += 1
        attributes = {"gen_ai.request.model": model, "ortserve.turn": self.turns}
        turn = self.trace.open(f"turn {self.turns}", self, time.perf_counter(), attributes)
        self.open_turns.append(turn)
        return turn

    def close_turn(self, turn: Any) -> None:
        if turn is not None and turn in self.open_turns:
            self.open_turns.remove(turn)
            turn.end(end_time=self.wall_ns(time.perf_counter()))


def current() -> RequestRecord | None:
    """The record of the request being handled here, if any."""
    return _current.get()


def note(
    *,
    model: str | None = None,
    input_tokens: int = 0,
    output_tokens: int = 0,
    cached_tokens: int = 0,
    finish_reasons: list[str] | None = None,
    response_id: str | None = None,
) -> None:
    """Add to the current request's record (tokens add up over a tool loop's turns)."""
    record = _current.get()
    if record is None:
        return
    if model is not None:
        record.model = model
    record.input_tokens += input_tokens
    record.output_tokens += output_tokens
    record.cached_tokens += cached_tokens
    if finish_reasons:
        record.finish_reasons = finish_reasons
    if response_id is not None:
        record.response_id = response_id


def record_prompt(messages: Any) -> None:
    """Keep the prompt (a chat's last message, as text) for the log line, where the
    operator asked for prompts in logs (``log_prompts``); else nothing is kept."""
    record = _current.get()
    if record is None or not record.keep_prompt:
        return
    last = messages[-1] if isinstance(messages, list) and messages else messages
    content = getattr(last, "content", last)
    if isinstance(content, list):
        content = " ".join(str(getattr(part, "text", "")) for part in content)
    record.prompt = content if isinstance(content, str) else None


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current request's span around a block (a tool loop's turn, an
    MCP call, the prompt's preparation); nothing at all while tracing is off."""
    record = _current.get()
    if record is None or record.trace is None:
        return _NOTHING
    child: contextlib.AbstractContextManager[Any] = record.trace.child(name, attributes)
    return child


_NOTHING = contextlib.nullcontext()


def traceparent() -> str | None:
    """The W3C ``traceparent`` of the current request's span (work it starts for later, a
    batch's lines, continues it), or ``None`` while tracing is off."""
    record = _current.get()
    return None if record is None or record.trace is None else record.trace.traceparent()


def request_id_of(scope: Any) -> str:
    """The request's id: its record's, else (an answer no route's middleware saw: a path no
    route matches) one made now and kept in the scope, for the body and the header alike."""
    record = scope.get(RECORD)
    if isinstance(record, RequestRecord):
        return record.id
    found = scope.get(_LONE_ID)
    if not isinstance(found, str):
        found = scope[_LONE_ID] = _request_id(scope.get("headers", ()))
    return found


_LONE_ID = "ortserve.request_id"


def _request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == _REQUEST_ID:
            return value.decode() if _VALID_ID.fullmatch(value) else _new_request_id()
    return _new_request_id()


def _new_request_id() -> str:
    return "req_" + uuid.uuid4().hex


def observe_requests(state: OrtServe, *, usage: bool = True) -> Callable[[ASGIApp], ASGIApp]:
    """Middleware factory: a :class:`RequestRecord` per request (one only, where an outer
    ortserve middleware already opened it), ``x-request-id`` on every response. ``usage``:
    count it in the usage per key (the API's routes; not health or metrics)."""
    from ._auth import CALLER, Caller  # here: the auth guard's errors import this module

    observer = state.observer
    keep_prompts = state.config.log_prompts

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
            record = RequestRecord(id=_request_id(headers), method=scope["method"], path=scope["path"])
            record.counted = usage
            record.keep_prompt = keep_prompts
            scope[RECORD] = record
            header = (_REQUEST_ID, record.id.encode())
            tracing = observer.tracing()
            trace_token = tracing.begin(record, headers) if tracing is not None else None

            async def sending(message: Any) -> None:
                if message["type"] == "http.response.start":
                    record.status = message["status"]
                    message["headers"] = [*message.get("headers", ()), header]
                await send(message)

            token = _current.set(record)
            error: BaseException | None = None
            try:
                await app(scope, receive, sending)
            except BaseException as exc:
                error = exc
                raise
            finally:
                _current.reset(token)
                record.route = scope.get("path_template") or record.route
                caller = scope.get(CALLER)
                record.key = caller.key if isinstance(caller, Caller) else None
                if error is not None and not record.status:
                    record.status = 500
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
        if not any(name.lower() == _REQUEST_ID for name, _ in headers):
            message["headers"] = [*headers, (_REQUEST_ID, request_id_of(scope).encode())]


class Observer:
    """What a mounted ortserve records of its requests: the access log line, the usage per
    key, and the tracing that :func:`observe_requests` starts (decided on first use)."""

    def __init__(self, config: ServerConfig, count_usage: Callable[[RequestRecord], None]) -> None:
        self._config = config
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
            record.path,
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
