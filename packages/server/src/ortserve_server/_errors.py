"""Errors of the HTTP layer and their translation into OpenAI's error body.

```
ServerError                  root; carries status_code, type, param, code
├── BadRequestError          400 invalid_request_error
├── AuthenticationError      401 + WWW-Authenticate: Bearer
├── ForbiddenError           403 (a Host or Origin this server does not answer)
├── ModelNotFoundHTTPError   404 (unknown model)
├── PayloadTooLargeError     413
├── UnsupportedMediaTypeError 415 (a body that is not the route's content type)
├── OverloadedError          503 + Retry-After (queue full)
├── ShuttingDownError        503 (the grace period of a shutdown ran out)
├── InsufficientStorageError 507 (a full disk or state database: see storage_full)
└── UnsupportedParameterError 400 for a parameter this server cannot honour
```

Every error that leaves our routes has the shape
``{"error": {"message", "type", "param", "code"}}``; anything unexpected becomes a 500
whose message reveals nothing internal, but a full disk (ENOSPC or a quota, SQLite's
SQLITE_FULL, PostgreSQL's disk_full) is a 507 that says so: nothing was stored.
"""

from __future__ import annotations

import errno
import logging
import re
import sqlite3
from collections.abc import Callable
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, NotAuthorizedException, NotFoundException, ValidationException
from litestar.handlers import HTTPRouteHandler
from litestar.status_codes import HTTP_413_REQUEST_ENTITY_TOO_LARGE
from litestar.types import ExceptionHandlersMap
from ortserve_client.protocol import ErrorDetail, ErrorResponse
from ortserve_runtime import (
    ContextLengthError,
    EngineClosedError,
    EngineError,
    InvalidRequestError,
    ModelCapacityError,
    ModelCrashedError,
    ModelLoadError,
    ModelNotFoundError,
    PreemptedError,
)

from ._metrics import UNMATCHED
from ._record import request_id_of

__all__ = [
    "AuthenticationError",
    "BadRequestError",
    "ClientDisconnectedError",
    "ForbiddenError",
    "InsufficientStorageError",
    "ModelNotFoundHTTPError",
    "NotFoundError",
    "OverloadedError",
    "PayloadTooLargeError",
    "ServerError",
    "ShuttingDownError",
    "UnsupportedMediaTypeError",
    "UnsupportedParameterError",
    "error_response",
    "exception_handlers",
    "reshaped_exception_handlers",
    "storage_full",
    "unavailable_detail",
]

logger = logging.getLogger("ortserve.server")


class ServerError(Exception):
    """Root of the errors our routes raise on purpose."""

    status_code: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}


class BadRequestError(ServerError):
    status_code = 400
    type = "invalid_request_error"


class UnsupportedParameterError(BadRequestError):
    code = "unsupported_parameter"


class AuthenticationError(ServerError):
    status_code = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        # RFC 9110: a 401 names the scheme the client should use.
        super().__init__(message, param=param, headers={**_BEARER, **(headers or {})})


_BEARER = {"WWW-Authenticate": "Bearer"}


class ForbiddenError(ServerError):
    status_code = 403
    type = "permission_error"


class UnsupportedMediaTypeError(ServerError):
    status_code = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class NotFoundError(ServerError):
    """A 404 for something the request names (a file, a batch, a stored response, a model)."""

    status_code = 404
    type = "invalid_request_error"


class ModelNotFoundHTTPError(NotFoundError):
    code = "model_not_found"


class PayloadTooLargeError(ServerError):
    status_code = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class ClientDisconnectedError(ServerError):
    """The client went away before the answer was ready; its work was cancelled. The
    status (nginx's "client closed request") only reaches logs and metrics."""

    status_code = 499
    type = "invalid_request_error"
    code = "client_disconnected"


class OverloadedError(ServerError):
    status_code = 503
    type = "server_error"
    code = "server_overloaded"


class ShuttingDownError(ServerError):
    """The server is stopping and the grace period for in-flight work is over."""

    status_code = 503
    type = "server_error"
    code = "server_shutting_down"


def error_response(
    status: int, message: str, *, type: str, param: str | None = None, code: str | None = None, headers: Any = None
) -> Response[ErrorResponse]:
    body = ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code))
    return Response(body, status_code=status, headers=headers)


def _server_error(_: Request[Any, Any, Any], exc: ServerError) -> Response[ErrorResponse]:
    return error_response(
        exc.status_code, exc.message, type=exc.type, param=exc.param, code=exc.code, headers=exc.headers
    )


def _engine_error(_: Request[Any, Any, Any], exc: EngineError) -> Response[ErrorResponse]:
    if isinstance(exc, ModelNotFoundError):
        return error_response(404, str(exc), type="invalid_request_error", param="model", code="model_not_found")
    if isinstance(exc, InvalidRequestError):
        code = "context_length_exceeded" if isinstance(exc, ContextLengthError) else None
        return error_response(400, str(exc), type="invalid_request_error", param=exc.param, code=code)
    unavailable = unavailable_detail(exc)
    if unavailable is not None:
        if isinstance(exc, ModelCrashedError):
            logger.error("model crashed: %s", exc)
        return error_response(
            503, unavailable.message, type=unavailable.type, code=unavailable.code, headers={"Retry-After": "1"}
        )
    if isinstance(exc, ModelCapacityError):
        return error_response(
            503, str(exc), type="server_error", param="model", code="model_capacity", headers={"Retry-After": "1"}
        )
    if isinstance(exc, ModelLoadError):  # names the folder and the reason; the next request tries again
        logger.warning("model load failed: %s", exc)
        if (full := storage_full(exc)) is not None:  # converting a model file onto a full disk
            return error_response(507, f"{full.message}: {exc}", type=full.type, param="model", code=full.code)
        return error_response(500, str(exc), type="server_error", param="model", code="model_load_failed")
    logger.error("engine error: %s", exc)
    return error_response(500, "the model failed to process the request", type="server_error")


def unavailable_detail(exc: Exception) -> ErrorDetail | None:
    """The 503 body of an engine error that ends a request which may be sent again (the
    model unloaded or crashed under it, a batch line preempted); ``None`` for others."""
    if isinstance(exc, EngineClosedError):
        message = f"{exc}: it was unloaded, or the server is shutting down, while the request ran; try again"
        return ErrorDetail(message=message, type="server_error", code="model_unloaded")
    if isinstance(exc, ModelCrashedError):
        return ErrorDetail(message=str(exc), type="server_error", code="model_crashed")
    if isinstance(exc, PreemptedError):
        return ErrorDetail(message=str(exc), type="server_error", code="preempted")
    return None


def _http_exception(request: Request[Any, Any, Any], exc: HTTPException) -> Response[ErrorResponse]:
    if isinstance(exc, ValidationException):
        message, param = _validation_detail(exc)
        return error_response(400, message, type="invalid_request_error", param=param)
    if isinstance(exc, NotAuthorizedException):
        return error_response(401, exc.detail, type="authentication_error", code="invalid_api_key", headers=_BEARER)
    if isinstance(exc, NotFoundException):
        return error_response(404, f"no route {request.method} {request.url.path}", type="invalid_request_error")
    if exc.status_code == HTTP_413_REQUEST_ENTITY_TOO_LARGE:
        # Litestar refuses on the declared Content-Length before reading, or once the bytes
        # read pass the route's limit; the message says what that limit is.
        handler = request.scope.get("route_handler")  # absent if raised before routing
        limit = handler.resolve_request_max_body_size() if isinstance(handler, HTTPRouteHandler) else None
        message = f"the request body is larger than {limit} bytes, the most this route takes" if limit else ""
        return error_response(
            413, message or "the request body is too large", type="invalid_request_error", code="payload_too_large"
        )
    if exc.status_code == 400 and exc.detail == "Request Entity Too Large":  # Litestar's multipart parser
        parts = request.app.multipart_form_part_limit
        message = (
            f"the multipart form is past this server's bounds: at most {parts} parts, each with a few "
            "short headers (a file name of at most about 4 KB)"
        )
        return error_response(400, message, type="invalid_request_error")
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return error_response(exc.status_code, exc.detail, type=kind, headers=exc.headers)


_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class InsufficientStorageError(ServerError):
    """A full disk or state database (see :func:`storage_full`): nothing was stored."""

    status_code = 507
    type = "server_error"
    code = "insufficient_storage"

    def __init__(self) -> None:
        super().__init__("the server's storage is full: nothing was stored; try again once the operator has made room")


def storage_full(exc: BaseException) -> InsufficientStorageError | None:
    """``exc`` as the 507 it means where it (or what caused it) is a full disk or quota (an
    ``OSError`` with ENOSPC or EDQUOT), SQLite's SQLITE_FULL ("database or disk is full") or
    PostgreSQL's disk_full (53100); else ``None``."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain of causes, not a loop
        if seen is None:
            return None
        if (
            (isinstance(seen, OSError) and seen.errno in _DISK_FULL)
            or (isinstance(seen, sqlite3.Error) and getattr(seen, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL)
            or getattr(seen, "sqlstate", None) == "53100"
        ):
            logger.error("no room to store: %s", seen)
            return InsufficientStorageError()
        seen = seen.__cause__ or seen.__context__
    return None


def _unexpected(request: Request[Any, Any, Any], exc: Exception) -> Response[ErrorResponse]:
    full = storage_full(exc)
    if full is not None:
        return _server_error(request, full)
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error", type="server_error")


def _validation_detail(exc: ValidationException) -> tuple[str, str | None]:
    """Message and offending field of a body that failed to decode or validate."""
    extra = exc.extra
    if not (isinstance(extra, list) and extra and isinstance(extra[0], dict)):
        return str(exc.detail), None
    message = str(extra[0].get("message", exc.detail))
    key = extra[0].get("key")
    # Litestar removes every "data." from the path it names ("metadata.user_id" became
    # "metauser_id"); msgspec's own error, the cause, has it whole.
    whole = _MSGSPEC_PATH.search(str(exc.__cause__)) if exc.__cause__ is not None else None
    if whole is not None and isinstance(key, str):
        path = whole.group(1).removeprefix("data.")  # the handler's parameter, not the body's
        if key == path.replace("data.", ""):
            key = path
    if key in (None, "data", "body"):  # a problem with the body as a whole, e.g. a missing field
        missing = _MISSING_FIELD.search(message)
        key = missing.group(1) if missing else None
    return (f"{message} (field {key!r})" if key else message), key


_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")
_MSGSPEC_PATH = re.compile(r" - at `\$\.([^`]+)`$")


def _counted(handler: Callable[[Request[Any, Any, Any], Any], Response[Any]]) -> Any:
    """Count every error response in the metrics of the ortserve mount that produced it."""

    def counting(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        response = handler(request, exc)
        if hasattr(response.content, "request_id"):
            response.content.request_id = request_id_of(request.scope)  # as the x-request-id header
        metrics, endpoint = _metrics_of(request)
        if metrics is not None:
            metrics.count_error(endpoint, response.status_code)
        return response

    return counting


def _metrics_of(request: Request[Any, Any, Any]) -> tuple[Any, str]:
    """The Metrics that count an error on ``request``, and its endpoint label: the route
    template (``/v1/models/{model_id}``), never the raw path, which a client can vary
    without end; a path that matched no route counts under one label, and only in
    ``create_app``'s own app (a host's unknown routes are the host's)."""
    if request.scope.get("route_handler"):
        return request.route_handler.opt.get(METRICS_OPT), request.scope.get("path_template") or UNMATCHED
    state = request.app.state.get("ortserve")
    return getattr(state, "metrics", None), UNMATCHED


METRICS_OPT = "ortserve_metrics"
"""The route option under which our routers carry their Metrics (for the handlers above)."""

_HANDLERS: dict[type[Exception], Callable[[Request[Any, Any, Any], Any], Response[ErrorResponse]]] = {
    ServerError: _server_error,
    EngineError: _engine_error,
    HTTPException: _http_exception,
    Exception: _unexpected,
}

exception_handlers: ExceptionHandlersMap = {kind: _counted(handler) for kind, handler in _HANDLERS.items()}
"""Scoped to our own routers, so a host app's handlers stay in charge of its routes."""


def reshaped_exception_handlers(reshape: Callable[[Response[ErrorResponse]], Response[Any]]) -> ExceptionHandlersMap:
    """The same translation for another API family's routes: each OpenAI-shaped error
    response goes through ``reshape`` (its body and status), then is counted as sent."""

    def reshaping(handler: Callable[[Request[Any, Any, Any], Any], Response[ErrorResponse]]) -> Any:
        return lambda request, exc: reshape(handler(request, exc))

    return {kind: _counted(reshaping(handler)) for kind, handler in _HANDLERS.items()}
