"""ortserve-server: an OpenAI-compatible HTTP API for ONNX Runtime GenAI models.

Mount it into a Litestar app with :class:`OrtServePlugin`, compose :func:`create_router`
by hand, run :func:`create_app` as a standalone ASGI app (enter :func:`lifespan` from
hosts that do not run a mounted app's lifespan), or wrap :func:`wsgi_app` for WSGI hosts.
Scale out over N replicas on Ray Serve with :mod:`ortserve_server.ray` (the ``ray`` extra;
imported only when asked for).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._app import OrtServe, OrtServePlugin, create_app, create_router, lifespan, wsgi_app
    from ._config import ServerConfig
    from ._errors import ServerError

# Imported on first use (PEP 562): `ortserve --help` and `ortserve ls` then start without
# Litestar, onnxruntime and the runtime, which the CLI module imports only to serve.
_WHERE = {
    "OrtServe": "._app",
    "OrtServePlugin": "._app",
    "create_app": "._app",
    "create_router": "._app",
    "lifespan": "._app",
    "wsgi_app": "._app",
    "ServerConfig": "._config",
    "ServerError": "._errors",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "OrtServe",
    "OrtServePlugin",
    "ServerConfig",
    "ServerError",
    "create_app",
    "create_router",
    "lifespan",
    "wsgi_app",
]
