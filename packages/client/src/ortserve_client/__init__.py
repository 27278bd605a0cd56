"""ortserve-client: the OpenAI wire protocol as msgspec Structs, a typed async client,
Hugging Face downloads, and a managed local ortserve server.

Light by design: no onnxruntime, no litestar. ``ortserve_client.protocol`` holds the
Structs; everything else is re-exported here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._batches import batch_file
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
        PermissionDeniedError,
        PortInUseError,
        RateLimitError,
        ServerExited,
        ServerLifecycleError,
        ServerStartupTimeout,
        ServiceUnavailableError,
        StreamError,
    )
    from ._reference import HubReference
    from ._sidecar import (
        Attached,
        Converting,
        Exited,
        LocalServer,
        LogLine,
        Ready,
        Restarting,
        ServerEvent,
        Spawned,
    )
    from ._streaming import AsyncStream

# Imported on first use (PEP 562): a server that needs only `ortserve_client.protocol`
# (msgspec) does not import httpx, whose CLI pulls click, rich and pygments where installed
# (measured: 0.22 s of `ortserve serve`'s start-up).
_WHERE = {
    "APIConnectionError": "._errors",
    "APIStatusError": "._errors",
    "APITimeoutError": "._errors",
    "AsyncClient": "._client",
    "AsyncStream": "._streaming",
    "Attached": "._sidecar",
    "AuthenticationError": "._errors",
    "BadRequestError": "._errors",
    "DownloadComplete": "._download",
    "DownloadError": "._errors",
    "DownloadEvent": "._download",
    "DownloadProgress": "._download",
    "Exited": "._sidecar",
    "HubReference": "._reference",
    "InternalServerError": "._errors",
    "LocalServer": "._sidecar",
    "Converting": "._sidecar",
    "LogLine": "._sidecar",
    "NotFoundError": "._errors",
    "OrtServeError": "._errors",
    "PayloadTooLargeError": "._errors",
    "PermissionDeniedError": "._errors",
    "PortInUseError": "._errors",
    "RateLimitError": "._errors",
    "Ready": "._sidecar",
    "Restarting": "._sidecar",
    "ServerEvent": "._sidecar",
    "ServerExited": "._errors",
    "ServerLifecycleError": "._errors",
    "ServerStartupTimeout": "._errors",
    "ServiceUnavailableError": "._errors",
    "Spawned": "._sidecar",
    "StreamError": "._errors",
    "apull": "._download",
    "batch_file": "._batches",
    "pull": "._download",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


# The client (_client, _streaming, _errors), downloads (_download, _reference) and the sidecar (_sidecar).
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
    "Converting",
    "DownloadComplete",
    "DownloadError",
    "DownloadEvent",
    "DownloadProgress",
    "Exited",
    "HubReference",
    "InternalServerError",
    "LocalServer",
    "LogLine",
    "NotFoundError",
    "OrtServeError",
    "PayloadTooLargeError",
    "PermissionDeniedError",
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
    "batch_file",
    "pull",
]
