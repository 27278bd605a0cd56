"""ortserve-server: an OpenAI-compatible HTTP API for ONNX Runtime GenAI models.

Mount it into a Litestar app with :class:`OrtServePlugin`, compose :func:`create_router`
by hand, run :func:`create_app` as a standalone ASGI app (enter :func:`lifespan` from
hosts that do not run a mounted app's lifespan), or wrap :func:`wsgi_app` for WSGI hosts.
Scale out over N replicas on Ray Serve with :mod:`ortserve_server.ray` (the ``ray`` extra;
imported only when asked for).
"""

from ._app import OrtServe, OrtServePlugin, create_app, create_router, lifespan, wsgi_app
from ._config import ServerConfig
from ._errors import ServerError

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
