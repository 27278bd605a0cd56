"""Errors of the client.

```
OrtServeError                    root of everything this package raises
├── APIConnectionError           the server could not be reached
│   └── APITimeoutError          it did not answer in time
├── APIStatusError               the server answered 4xx/5xx (status_code, body, request_id,
│   │                            response); raised as is for the statuses not listed below
│   ├── BadRequestError          400
│   ├── AuthenticationError      401
│   ├── PermissionDeniedError    403
│   ├── NotFoundError            404
│   ├── PayloadTooLargeError     413
│   ├── RateLimitError           429
│   ├── InternalServerError      500
│   └── ServiceUnavailableError  503
├── StreamError                  an error reported in the middle of a stream
├── DownloadError                a model download failed (names repo, revision, file)
└── ServerLifecycleError         a local server could not be started, attached or stopped
    ├── ServerStartupTimeout     it did not become ready in time (the log tail is attached)
    ├── ServerExited             it exited before it was ready (returncode)
    └── PortInUseError           something else holds the port
```
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import msgspec

from .protocol import ErrorResponse

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadRequestError",
    "DownloadError",
    "InternalServerError",
    "NotFoundError",
    "OrtServeError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
    "PortInUseError",
    "RateLimitError",
    "ServerExited",
    "ServerLifecycleError",
    "ServerStartupTimeout",
    "ServiceUnavailableError",
    "StreamError",
    "status_error",
    "translate_transport_errors",
]


class OrtServeError(Exception):
    """Root of every error this package raises."""


class APIConnectionError(OrtServeError):
    """The server could not be reached."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class APITimeoutError(APIConnectionError):
    """The server did not answer within the timeout."""


class APIStatusError(OrtServeError):
    """The server answered with an error status.

    ``body`` is the decoded OpenAI error body (``None`` when the server sent something
    else), ``request_id`` the ``x-request-id`` response header, ``response`` the (closed)
    ``httpx.Response``. Subclasses name the common statuses as a class attribute.
    """

    status_code: int = 0

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        body: ErrorResponse | None,
        request_id: str | None,
        response: httpx.Response | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body
        self.request_id = request_id
        self.response = response


class BadRequestError(APIStatusError):
    """400: the request is invalid (``body.error.param`` names the field)."""

    status_code = 400


class AuthenticationError(APIStatusError):
    """401: the API key is missing or wrong."""

    status_code = 401


class PermissionDeniedError(APIStatusError):
    """403: the key is good but not for this (``/v1/models/load`` and the other routes that
    want the admin key, a ``keep_alive`` only the admin key may give), or the request's
    ``Host``/``Origin`` is not allowed."""

    status_code = 403


class NotFoundError(APIStatusError):
    """404: no such model (``code`` ``model_not_found``) or route."""

    status_code = 404


class PayloadTooLargeError(APIStatusError):
    """413: the request body, or the prompt in tokens, is too large."""

    status_code = 413


class RateLimitError(APIStatusError):
    """429: too many requests; retried (``max_retries``) before it is raised."""

    status_code = 429


class InternalServerError(APIStatusError):
    """500: the server failed; never retried."""

    status_code = 500


class ServiceUnavailableError(APIStatusError):
    """503: the server is busy or still loading; retried before it is raised."""

    status_code = 503


class StreamError(OrtServeError):
    """The server reported an error after the stream had started."""

    def __init__(self, message: str, *, body: ErrorResponse | None = None) -> None:
        super().__init__(message)
        self.body = body


class DownloadError(OrtServeError):
    """A model download failed; the message names the repo, revision and file if known."""

    def __init__(self, message: str, *, repo_id: str, revision: str | None = None, filename: str | None = None) -> None:
        super().__init__(message)
        self.repo_id = repo_id
        self.revision = revision
        self.filename = filename


class ServerLifecycleError(OrtServeError):
    """A local server could not be started, attached to, or stopped."""


class ServerStartupTimeout(ServerLifecycleError):
    """The server did not become ready within ``startup_timeout`` (log tail in the notes)."""


class ServerExited(ServerLifecycleError):
    """The server process exited before it was ready."""

    def __init__(self, message: str, *, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


class PortInUseError(ServerLifecycleError):
    """Something that is not an ortserve server holds the port."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    cls.status_code: cls
    for cls in (
        BadRequestError,
        AuthenticationError,
        PermissionDeniedError,
        NotFoundError,
        PayloadTooLargeError,
        RateLimitError,
        InternalServerError,
        ServiceUnavailableError,
    )
}
_decode_error = msgspec.json.Decoder(ErrorResponse).decode


def status_error(response: httpx.Response, content: bytes) -> APIStatusError:
    """The :class:`APIStatusError` subclass for ``response`` with its decoded body."""
    body: ErrorResponse | None
    try:
        body = _decode_error(content)
    except msgspec.DecodeError:
        body = None
    detail = body.error.message if body is not None else content[:200].decode(errors="replace")
    cls = _BY_STATUS.get(response.status_code, APIStatusError)
    return cls(
        f"{response.status_code} from {response.request.method} {response.request.url}: {detail}",
        status_code=response.status_code,
        body=body,
        request_id=response.headers.get("x-request-id"),
        response=response,
    )


@contextlib.contextmanager
def translate_transport_errors(url: str) -> Iterator[None]:
    """The one place where httpx's transport errors become this package's errors."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise APITimeoutError(f"the ortserve server at {url} did not answer in time ({exc})", url=url) from exc
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
        raise APIConnectionError(
            f"could not connect to the ortserve server at {url}: is it running? ({exc})", url=url
        ) from exc
    except httpx.TransportError as exc:  # the connection broke after it was made
        raise APIConnectionError(f"lost the connection to the ortserve server at {url} ({exc})", url=url) from exc
    except httpx.RequestError as exc:  # a body that does not decode, too many redirects
        raise OrtServeError(f"the request to {url} failed: {exc}") from exc
