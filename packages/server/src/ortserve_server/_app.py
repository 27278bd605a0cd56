"""Mounting: the Litestar plugin, a router, a standalone ASGI app, and hooks for other hosts.

One :class:`OrtServe` object holds what the routes share (the model registry, metrics,
the configuration). Models load on first use, so an app that is mounted somewhere that
never runs its lifespan (Starlette sub-apps, WSGI hosts) still works; the lifespan, where
it runs, loads models up front and closes them at shutdown.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from litestar import Litestar, Router
from litestar.config.app import AppConfig
from litestar.config.cors import CORSConfig
from litestar.di import Provide
from litestar.logging import LoggingConfig
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.plugins import InitPlugin, PluginProtocol
from litestar.types import ExceptionHandlersMap, Guard

from ._auth import make_auth_guard
from ._batch_runner import BatchRunner
from ._config import ServerConfig
from ._errors import METRICS_OPT, exception_handlers
from ._leases import mark_admin_callers, release_leases
from ._observe import add_request_id, observe_requests
from ._openapi import RequestLimits
from ._security import SiteGuard, make_body_guard
from ._state import OrtServe
from .api import (
    anthropic_exception_handlers,
    anthropic_route_handlers,
    batch_route_handlers,
    control_route_handlers,
    health_handler,
    metrics_handler,
    openai_route_handlers,
    rerank_alias_handlers,
    usage_handler,
)

__all__ = ["OrtServe", "OrtServePlugin", "create_app", "create_router", "lifespan", "wsgi_app"]

logger = logging.getLogger("ortserve.server")


def _guards(
    config: ServerConfig,
    *,
    keyed: bool = True,
    x_api_key: bool = False,
    key: str | None = None,
    or_admin: bool = False,
) -> list[Guard]:
    """Host/Origin/content type first (a rebinding page learns nothing, not even whether a
    key is set), then the key where the route needs it (``key``, else the API keys, or the
    admin key too with ``or_admin``)."""
    keys = {key: "admin"} if key else config.api_key_labels
    if or_admin and keys and config.admin_key:
        keys = {**keys, config.admin_key: "admin"}
    scoped = config.keys_cached_apart and not key
    # A route that wants the admin key: an API key gets a 403 that says so, not "wrong key".
    not_enough = ("the admin key", config.api_key_labels) if key and key == config.admin_key else None
    guard = make_auth_guard(keys, x_api_key=x_api_key, scoped=scoped, not_enough=not_enough)
    return [SiteGuard(config), *([guard] if keyed and keys else [])]


def _routers(state: OrtServe) -> list[Router]:
    config = state.config
    state.attach_batch_runner(BatchRunner)  # it runs batch lines through these routes
    provide = {"ortserve": Provide(lambda: state, sync_to_thread=False, use_cache=True)}

    def api_router(
        path: str,
        handlers: list[Any],
        guards: list[Guard],
        errors: ExceptionHandlersMap,
        leases: bool = True,
        max_body_size: int = config.max_body_size,
    ) -> Router:
        return Router(
            path=path,
            route_handlers=handlers,
            dependencies=provide,
            guards=[*guards, make_body_guard(lenient=config.lenient, state=state)],
            exception_handlers=errors,
            request_max_body_size=max_body_size,
            middleware=[
                observe_requests(state.observer),
                state.body_budget,
                *([release_leases] if leases else []),
                *([mark_admin_callers(config.admin_key)] if config.admin_key and leases else []),
            ],
            opt={METRICS_OPT: state.metrics},
        )

    routers = [
        api_router(
            config.path,
            openai_route_handlers,
            _guards(config),
            exception_handlers,
        ),
        # Files and batches: uploads may be larger than a request.
        api_router(
            config.path,
            batch_route_handlers,
            _guards(config),
            exception_handlers,
            max_body_size=max(config.max_file_size + 65536, config.max_body_size),  # the file and its form
        ),
        # Loading and unloading models, usage per key: the admin key when one is set, else the API key.
        api_router(
            config.path,
            [*control_route_handlers, usage_handler],
            _guards(config, key=config.admin_key),
            exception_handlers,
            leases=False,
        ),
        # Anthropic's Messages API: its own error shape, and its clients' x-api-key header.
        api_router(
            config.path, anthropic_route_handlers, _guards(config, x_api_key=True), anthropic_exception_handlers
        ),
    ]
    if config.ui:
        from .ui import conversation_route_handlers, page_route_handlers

        routers.append(api_router(config.path, conversation_route_handlers, _guards(config), exception_handlers))
        # The page and its files: Host/Origin checks, no key (the page asks for one).
        routers.append(
            Router(
                path=config.ui_path,
                route_handlers=page_route_handlers,
                dependencies=provide,
                guards=_guards(config, keyed=False),
                exception_handlers=exception_handlers,
            )
        )
    if config.rerank_aliases:
        # /rerank and /v2/rerank: the aliases vLLM serves (llama-server: /rerank), at the root.
        routers.append(api_router("/", rerank_alias_handlers, _guards(config), exception_handlers))
    # Health stays open for probes and LocalServer's readiness wait; metrics name models
    # and traffic, so they need the key unless the operator says otherwise.
    extras = [
        (config.health_path, health_handler, False),
        (config.metrics_path, metrics_handler, not config.public_metrics),  # the admin key too: usage per key
    ]
    routers += [
        Router(
            path=path,
            route_handlers=[handler],
            dependencies=provide,
            guards=_guards(config, keyed=keyed, or_admin=True),
            exception_handlers=exception_handlers,
            middleware=[observe_requests(state.observer, usage=False)],
        )
        for path, handler, keyed in extras
        if path is not None
    ]
    return routers


def create_router(config: ServerConfig | OrtServe) -> Router:
    """One Router (at ``/``) holding the API at ``config.path`` plus health and metrics.

    For hosts that compose routers by hand; such a host must enter :func:`lifespan` (or
    accept lazy model loading and no orderly close).
    """
    state = config if isinstance(config, OrtServe) else OrtServe(config)
    router = _StatefulRouter(path="/", route_handlers=list(_routers(state)))
    router.ortserve = state
    return router


class _StatefulRouter(Router):
    """A Router that remembers its ortserve state, for :func:`lifespan` (Litestar
    deep-copies a router's ``opt``, so the state cannot travel there)."""

    ortserve: OrtServe


class OrtServePlugin(InitPlugin, RequestLimits):
    """Adds ortserve to a Litestar app: routes, the lifespan that loads and closes models,
    OpenAI-style error handlers scoped to ortserve's own routes, CORS when
    ``cors_origins`` asks for it (unless the host has its own), and the request limits in
    the app's OpenAPI schema (as an OpenAPI schema plugin, so it comes before Litestar's)."""

    def __init__(self, config: ServerConfig, *, state: OrtServe | None = None) -> None:
        RequestLimits.__init__(self, config.max_n)
        self.state = state if state is not None else OrtServe(config)

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        config = self.state.config
        app_config.route_handlers.extend(_routers(self.state))
        app_config.lifespan.append(self.state.lifespan)
        if config.cors_origins and app_config.cors_config is None:
            app_config.cors_config = CORSConfig(
                allow_origins=list(config.cors_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            )
        return app_config


class _StandaloneApp(Litestar):
    """Litestar with only the plugin its own routes use: no ortserve route takes a pydantic
    model or an attrs class, yet Litestar loads its pydantic and attrs plugins whenever those
    libraries are installed (pydantic is, wherever FastAPI or an MCP SDK is), and those
    imports were the largest part of building the app: 0.09 s of a 0.15 s ``create_app``
    on a 2-core EPYC.
    A host's own Litestar app, with the plugin, keeps Litestar's defaults."""

    @staticmethod
    def _get_default_plugins(plugins: list[PluginProtocol]) -> list[PluginProtocol]:
        from litestar.plugins.core import MsgspecDIPlugin

        plugins.append(MsgspecDIPlugin())
        return plugins

    @staticmethod
    def _patch_opentelemetry_middleware(config: AppConfig) -> AppConfig:
        # Litestar looks for its OpenTelemetry middleware among the app's, importing its
        # plugin and OpenTelemetry's ASGI instrumentation to do so (40 ms) wherever they are
        # installed; this app has none: ortserve's traces are its own (``_observe``).
        return config


def create_app(config: ServerConfig, *, debug: bool = False, state: OrtServe | None = None) -> Litestar:
    """A standalone ASGI app serving only ortserve (what ``ortserve serve`` runs).

    Unlike the plugin, it also answers unknown routes with an OpenAI-shaped 404 and serves
    its OpenAPI schema at ``config.schema_path``. ``state``: one made beforehand (the CLI
    makes it first, to start loading models while this module's imports run).
    """
    plugin = OrtServePlugin(config, state=state)
    app = _StandaloneApp(
        plugins=[plugin],
        before_send=[add_request_id],  # a path no route matches answers with an x-request-id too
        # Litestar's default would replace the root logger's handlers and disable the loggers
        # made before it (ortserve.access among them): the process's logging stays its own.
        logging_config=LoggingConfig(configure_root_logger=False, disable_existing_loggers=False),
        exception_handlers=exception_handlers,
        request_max_body_size=config.max_body_size,
        openapi_config=_openapi_config(config),
        debug=debug,
    )
    app.state.ortserve = plugin.state
    return app


def _openapi_config(config: ServerConfig) -> OpenAPIConfig | None:
    """The schema as JSON only (HTML docs pages load scripts from a CDN), behind the same
    guards as the API."""
    if config.schema_path is None:
        return None
    router = Router(path=config.schema_path, route_handlers=[], guards=_guards(config), include_in_schema=False)
    return OpenAPIConfig(
        title="ortserve",
        version=_version(),
        render_plugins=[JsonRenderPlugin()],
        openapi_router=router,
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ortserve-server")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0"


@contextlib.asynccontextmanager
async def lifespan(app: Litestar | Router | OrtServe) -> AsyncIterator[None]:
    """Enter ortserve's lifespan from a host that does not run a mounted app's lifespan.

    Starlette and FastAPI do not start the lifespan of an app mounted with ``app.mount``;
    call this from the host's own lifespan with the app (or router) you mounted.
    """
    state = _state_of(app)
    async with state.lifespan():
        yield


def wsgi_app(config: ServerConfig) -> Any:
    """A WSGI callable for Flask/Django hosts (models load on first use).

    Uses a2wsgi, which runs the ASGI app on its own event loop thread and streams
    responses chunk by chunk, so server-sent events still stream.
    """
    from a2wsgi import ASGIMiddleware

    config.load_on_startup = False
    return ASGIMiddleware(create_app(config))  # type: ignore[arg-type]  # a2wsgi's narrower ASGI types


def _state_of(app: Litestar | Router | OrtServe | Sequence[Any]) -> OrtServe:
    if isinstance(app, OrtServe):
        return app
    if isinstance(app, Litestar):
        state = app.state.get("ortserve")
        if isinstance(state, OrtServe):
            return state
    if isinstance(app, _StatefulRouter):
        return app.ortserve
    raise TypeError("expected an app from create_app(), a router from create_router(), or an OrtServe")
