"""ortserve-client: the OpenAI wire protocol as msgspec Structs, a typed async client,
Hugging Face downloads, and a managed local ortserve server.

Light by design: no onnxruntime, no litestar. ``ortserve_client.protocol`` holds the
Structs; everything else is re-exported here.
"""

from ._client import AsyncClient
from ._download import DownloadComplete, DownloadEvent, DownloadProgress, apull, pull
from ._errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    DownloadError,
    InternalServerError,
    NotFoundError,
    OrtServeError,
    PayloadTooLargeError,
    PortInUseError,
    RateLimitError,
    ServerExited,
    ServerLifecycleError,
    ServerStartupTimeout,
    ServiceUnavailableError,
    StreamError,
)
from ._sidecar import Attached, Exited, LocalServer, LogLine, Ready, Restarting, ServerEvent, Spawned
from ._streaming import AsyncStream

# The client (_client, _streaming, _errors), downloads (_download) and the sidecar (_sidecar).
# Keep this list additive: new names go in alphabetically; none is dropped without a deprecation.

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncStream",
    "Attached",
    "AuthenticationError",
    "BadRequestError",
    "DownloadComplete",
    "DownloadError",
    "DownloadEvent",
    "DownloadProgress",
    "Exited",
    "InternalServerError",
    "LocalServer",
    "LogLine",
    "NotFoundError",
    "OrtServeError",
    "PayloadTooLargeError",
    "PortInUseError",
    "RateLimitError",
    "Ready",
    "Restarting",
    "ServerEvent",
    "ServerExited",
    "ServerLifecycleError",
    "ServerStartupTimeout",
    "ServiceUnavailableError",
    "Spawned",
    "StreamError",
    "apull",
    "pull",
]
