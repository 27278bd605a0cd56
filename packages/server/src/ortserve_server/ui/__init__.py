"""The web page ortserve serves (``ServerConfig.ui``): static files in ``static/`` and the
routes in ``_routes``: the page, and the conversations it keeps on the server."""

from __future__ import annotations

from ._routes import CONTENT_SECURITY_POLICY, conversation_route_handlers, page_route_handlers

__all__ = ["CONTENT_SECURITY_POLICY", "conversation_route_handlers", "page_route_handlers"]
