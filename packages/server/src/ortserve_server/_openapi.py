"""The OpenAPI description of what the routes really send.

Litestar documents a handler's 400 as its own validation error body and a ``Response[Any]``
as an empty object; ours answer errors in OpenAI's shape and generations as JSON or
server-sent events. The response specs here say so, and :class:`RequestLimits` writes the
limits the server enforces (``n`` up to ``max_n``, at most four stop strings) into the
request schemas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from litestar._openapi.schema_generation.plugins.struct import StructSchemaPlugin
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    OpenAPIFormat,
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Reference,
    Schema,
)
from litestar.plugins import OpenAPISchemaPlugin
from litestar.typing import FieldDefinition
from ortserve_client import protocol as p

from ._plan import MAX_LOGIT_BIAS, MAX_STOP, MAX_TOOLS

__all__ = [
    "GET_ERRORS",
    "POST_ERRORS",
    "RequestLimits",
    "also_sends",
    "error_responses",
    "generation_docs",
    "sends_files",
    "with_error_responses",
]

_ERRORS = {
    400: "The request is invalid (a field, a value, or a body that is not a JSON object).",
    401: "The API key is missing or wrong (when the server has one); comes with WWW-Authenticate: Bearer.",
    403: "The Host or Origin header is not allowed (a browser page of another site, or DNS rebinding).",
    404: "No such model.",
    413: "The request body is larger than the server accepts.",
    415: "The body does not have this route's content type.",
    500: "An unexpected error; the message reveals nothing internal.",
    507: "The server's storage (its state database, or the disk) is full: nothing was stored.",
    503: "The model's queue is full or the model is shutting down; retry after Retry-After seconds.",
    529: "The model's queue is full (Anthropic's overloaded_error); retry after Retry-After seconds.",
}


POST_ERRORS = (400, 401, 403, 404, 413, 415, 500, 503)
GET_ERRORS = (401, 403, 500)


def error_responses(*statuses: int, body: type[Any] = p.ErrorResponse) -> dict[int, ResponseSpec]:
    """Error bodies (OpenAI's shape unless ``body`` says otherwise) for these statuses
    (they replace Litestar's own 400)."""
    return {
        status: ResponseSpec(data_container=body, description=_ERRORS[status], generate_examples=False)
        for status in statuses
    }


def with_error_responses(
    ok: type[Any], description: str, *statuses: int, error_body: type[Any] = p.ErrorResponse
) -> dict[int, ResponseSpec]:
    """``ok`` as the 200 body (for handlers whose return annotation cannot say it), plus errors."""
    return {200: ResponseSpec(data_container=ok, description=description, generate_examples=False)} | (
        error_responses(*statuses, body=error_body)
    )


def also_sends(media_type: str, description: str) -> type[Operation]:
    """An Operation class whose 200 also offers ``media_type`` as text (server-sent events
    for ``stream: true``, plain text transcripts): Litestar gives a response one media
    type, and these routes have two."""

    @dataclass
    class TwoMediaTypes(Operation):
        def __post_init__(self) -> None:
            ok = (self.responses or {}).get("200")
            if isinstance(ok, OpenAPIResponse) and ok.content is not None:
                text = Schema(type=OpenAPIType.STRING, description=description)
                ok.content[media_type] = OpenAPIMediaType(schema=text)

    return TwoMediaTypes


def sends_files(media_types: tuple[str, ...], events: str) -> type[Operation]:
    """An Operation class whose 200 is a file in one of ``media_types`` (binary), or
    server-sent ``events`` (text/event-stream)."""

    @dataclass
    class Files(Operation):
        def __post_init__(self) -> None:
            ok = (self.responses or {}).get("200")
            if isinstance(ok, OpenAPIResponse):
                binary = Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY)
                ok.content = {media_type: OpenAPIMediaType(schema=binary) for media_type in media_types}
                ok.content["text/event-stream"] = OpenAPIMediaType(
                    schema=Schema(type=OpenAPIType.STRING, description=events)
                )

    return Files


def generation_docs(body: type[Any], description: str) -> dict[str, Any]:
    """The route decorator arguments of a generation: ``body`` as JSON, or events."""
    return {
        "responses": with_error_responses(body, description, *POST_ERRORS),
        "operation_class": also_sends(
            "text/event-stream",
            "with stream: true, server-sent events: `data: <chunk JSON>` lines, then `data: [DONE]`",
        ),
    }


class RequestLimits(OpenAPISchemaPlugin):
    """Schemas of the generation requests with the limits the server enforces on them.

    The limit on ``n`` is configuration (``ServerConfig.max_n``), so it cannot sit on the
    protocol types; it is written into their schemas when Litestar builds them."""

    _REQUESTS = (p.ChatCompletionRequest, p.CompletionRequest)

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self._structs = StructSchemaPlugin()

    def is_plugin_supported_field(self, field_definition: FieldDefinition) -> bool:
        return field_definition.annotation in self._REQUESTS

    def to_openapi_schema(self, field_definition: FieldDefinition, schema_creator: Any) -> Schema:
        schema = self._structs.to_openapi_schema(field_definition, schema_creator)
        properties = schema.properties or {}
        for part in _alternatives(properties.get("n")):
            if part.type == OpenAPIType.INTEGER:
                part.minimum, part.maximum = 1, self.max_n
        for part in _alternatives(properties.get("stop")):
            if part.type == OpenAPIType.ARRAY:
                part.max_items = MAX_STOP
        for part in _alternatives(properties.get("tools")):
            if part.type == OpenAPIType.ARRAY:
                part.max_items = MAX_TOOLS
        for part in _alternatives(properties.get("logit_bias")):
            if part.type == OpenAPIType.OBJECT:
                part.max_properties = MAX_LOGIT_BIAS
        return schema


def _alternatives(schema: Schema | Reference | None) -> list[Schema]:
    """A property's schema, or the members of its ``oneOf`` (``int | None`` and the like)."""
    if not isinstance(schema, Schema):
        return []
    members = [m for m in (schema.one_of or schema.any_of or []) if isinstance(m, Schema)]
    return members or [schema]
