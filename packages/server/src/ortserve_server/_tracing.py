"""OpenTelemetry spans of ortserve's requests; imported only where tracing is on (see
``ServerConfig.tracing`` and ``_observe.tracing_source``).

A request's span continues the trace it arrived in: the host's current span where ortserve
is mounted in an instrumented app (its request span), else the W3C ``traceparent`` the
client sent. Its children are the parts that take time: the prompt's preparation, each
generation's queue wait, prefill and decode (timed by the runtime and written afterwards
with their own start and end), a tool loop's turns and MCP calls. Names and attributes
follow OpenTelemetry's GenAI semantic conventions (``gen_ai.*``) where they have one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import SpanKind, Status, StatusCode
except ImportError as _import_error:  # pragma: no cover - the extra is in the dev group
    raise ImportError(
        'OpenTelemetry traces need the otel extra: pip install "ortserve-server[otel]"'
    ) from _import_error

if TYPE_CHECKING:
    from ortserve_runtime import Usage

    from ._config import ServerConfig
    from ._record import RequestRecord

__all__ = ["RequestSpan", "Tracing"]

logger = logging.getLogger("ortserve.server")

_OPERATIONS = {
    "/chat/completions": "chat",
    "/messages": "chat",
    "/responses": "chat",
    "/completions": "text_completion",
    "/embeddings": "embeddings",
}
"""GenAI operation names by the route's last part (``gen_ai.operation.name``)."""


def _operation(route: str) -> str | None:
    for suffix, operation in _OPERATIONS.items():
        if route.endswith(suffix):
            return operation
    return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ortserve-server")
    except PackageNotFoundError:
        return "0"


def traces_url(endpoint: str) -> str:
    """``otlp_endpoint`` as the exporter's URL: ``/v1/traces`` appended unless there."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


class Tracing:
    """The tracer of one mounted ortserve: the host's global provider's (``source``
    ``"host"``), or a provider of its own that exports by OTLP/HTTP (``"endpoint"``:
    ``otlp_endpoint``; ``"env"``: where the ``OTEL_EXPORTER_OTLP_*`` variables say)."""

    def __init__(self, config: ServerConfig, source: str) -> None:
        self._own: Any = None
        if source == "host":
            provider: Any = trace.get_tracer_provider()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            exporter = (
                OTLPSpanExporter(endpoint=traces_url(config.otlp_endpoint))
                if config.otlp_endpoint
                else OTLPSpanExporter()  # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT, _HEADERS...
            )
            name = os.environ.get("OTEL_SERVICE_NAME") or "ortserve"
            provider = self._own = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
            provider.add_span_processor(BatchSpanProcessor(exporter))
        self.source = source
        self.tracer = provider.get_tracer("ortserve_server", _version())
        logger.info("tracing requests with OpenTelemetry (%s)", source)

    def begin(self, record: RequestRecord, headers: Any) -> object:
        """Open ``record``'s span and make it current; the token :meth:`end` takes."""
        inside = trace.get_current_span().get_span_context().is_valid
        parent = None if inside else propagate.extract(_carrier(headers))
        span = self.tracer.start_span(
            f"{record.method} {record.path}",
            context=parent,
            kind=SpanKind.INTERNAL if inside else SpanKind.SERVER,
            start_time=record.start_ns,
            attributes={"http.request.method": record.method, "ortserve.request_id": record.id},
        )
        record.trace = RequestSpan(self, span)
        return otel_context.attach(trace.set_span_in_context(span))

    def end(self, record: RequestRecord, token: object, error: BaseException | None) -> None:
        span = record.trace.span
        for turn in list(record.open_turns):  # a turn that failed before its generation ended
            record.close_turn(turn)
        route = record.route or record.path
        operation = _operation(route) if record.model else None
        attributes: dict[str, Any] = {"http.route": route, "http.response.status_code": record.status}
        if record.key is not None:
            attributes["ortserve.key"] = record.key  # the label, never the key
        if operation is not None:
            attributes["gen_ai.operation.name"] = operation
            attributes["gen_ai.provider.name"] = "ortserve"
        if record.model is not None:
            attributes["gen_ai.request.model"] = record.model
            attributes["gen_ai.response.model"] = record.model
            attributes["gen_ai.usage.input_tokens"] = record.input_tokens
            attributes["gen_ai.usage.output_tokens"] = record.output_tokens
        if record.response_id is not None:
            attributes["gen_ai.response.id"] = record.response_id
        if record.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = record.finish_reasons
        if record.first_token is not None:
            attributes["ortserve.time_to_first_token_s"] = record.first_token - record.start
        span.set_attributes(attributes)
        span.update_name(f"{operation} {record.model}" if operation else f"{record.method} {route}")
        if error is not None or record.status >= 500:
            span.set_status(Status(StatusCode.ERROR))
            attributes["error.type"] = type(error).__qualname__ if error is not None else str(record.status)
            span.set_attribute("error.type", attributes["error.type"])
        with contextlib.suppress(ValueError):  # a context left in another task: nothing to undo there
            otel_context.detach(token)  # type: ignore[arg-type]
        span.end()

    async def close(self) -> None:
        """Send the spans still buffered (a provider of ortserve's own only)."""
        if self._own is not None:
            import asyncio

            await asyncio.to_thread(self._own.shutdown)


class RequestSpan:
    """One request's span, and the spans of its parts."""

    __slots__ = ("span", "tracing")

    def __init__(self, tracing: Tracing, span: Any) -> None:
        self.tracing = tracing
        self.span = span

    def traceparent(self) -> str | None:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(self.span))
        return carrier.get("traceparent")

    @contextlib.contextmanager
    def child(self, name: str, attributes: Mapping[str, Any]) -> Iterator[Any]:
        with self.tracing.tracer.start_as_current_span(name, attributes=dict(attributes)) as span:
            yield span

    def open(self, name: str, record: RequestRecord, when: float, attributes: Mapping[str, Any]) -> Any:
        """A span from ``when`` (``perf_counter()``) on, under the current span, not made current."""
        return self.tracing.tracer.start_span(name, start_time=record.wall_ns(when), attributes=dict(attributes))

    def phases(
        self,
        record: RequestRecord,
        index: int,
        usage: Usage,
        model: str,
        now: float,
        parent: Any,
    ) -> None:
        """The queue wait, prefill and decode of one stream (choice ``index``) that ended
        ``now``, as the runtime timed them, under ``parent`` (a turn's span) or the current span."""
        context = trace.set_span_in_context(parent) if parent is not None else None
        decode_start = now - usage.decode_seconds
        prefill_start = decode_start - usage.prefill_seconds
        queue_start = prefill_start - usage.queued_seconds
        common = {"gen_ai.request.model": model, "ortserve.choice": index}
        rate = usage.completion_tokens / usage.decode_seconds if usage.decode_seconds > 0 else 0.0
        parts: tuple[tuple[str, float, float, dict[str, Any]], ...] = (
            ("queue_wait", queue_start, prefill_start, {}),
            (
                "prefill",
                prefill_start,
                decode_start,
                {
                    "gen_ai.usage.input_tokens": usage.prompt_tokens,
                    "gen_ai.usage.cache_read.input_tokens": usage.cached_tokens,
                },
            ),
            (
                "decode",
                decode_start,
                now,
                {
                    "gen_ai.usage.output_tokens": usage.completion_tokens,
                    "ortserve.decode.tokens_per_second": round(rate, 3),
                    "ortserve.speculation.accepted_tokens": usage.accepted_prediction_tokens,
                    "ortserve.speculation.rejected_tokens": usage.rejected_prediction_tokens,
                },
            ),
        )
        tracer = self.tracing.tracer
        for name, start, end, attributes in parts:
            span = tracer.start_span(
                name, context=context, start_time=record.wall_ns(start), attributes={**common, **attributes}
            )
            span.end(end_time=record.wall_ns(end))


def _carrier(headers: Any) -> dict[str, str]:
    """ASGI headers as the propagator reads them (lower-case names; the W3C ones only)."""
    return {
        name.decode("latin-1"): value.decode("latin-1")
        for name, value in headers
        if name in (b"traceparent", b"tracestate", b"baggage")
    }
