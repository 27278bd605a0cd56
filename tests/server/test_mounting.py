"""Mounting into a host Litestar app: the host keeps its routes and its error handlers."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from litestar import Litestar, Request, Response, get
from ortserve_server import OrtServePlugin, ServerConfig, create_router, lifespan
from serving import TINY_MODEL, running

CONFIG = {"models": {"tiny": TINY_MODEL}, "path": "/llm/v1", "health_path": "/llm/health", "metrics_path": None}


class HostError(Exception):
    pass


@get("/boom")
async def boom() -> None:
    raise HostError


@get("/missing-thing")
async def host_404() -> None:
    from litestar.exceptions import NotFoundException

    raise NotFoundException("host says no")


def host_handler(_: Request, exc: Exception) -> Response[dict[str, str]]:
    return Response({"host": type(exc).__name__}, status_code=418)


def test_plugin_leaves_the_host_alone() -> None:
    app = Litestar(
        route_handlers=[boom, host_404],
        plugins=[OrtServePlugin(ServerConfig(**CONFIG))],  # type: ignore[arg-type]
        exception_handlers={HostError: host_handler},
    )
    with running(app) as url:
        assert httpx.get(f"{url}/boom").json() == {"host": "HostError"}
        host_missing = httpx.get(f"{url}/missing-thing")
        assert host_missing.status_code == 404 and "error" not in host_missing.json()
        models = httpx.get(f"{url}/llm/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        bad = httpx.post(f"{url}/llm/v1/chat/completions", json={"model": "tiny"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
        assert httpx.get(f"{url}/llm/health").json()["status"] == "ok"
        assert httpx.get(f"{url}/metrics").status_code == 404  # turned off in this config


def test_router_composed_by_hand_with_the_lifespan() -> None:
    router = create_router(ServerConfig(**CONFIG))  # type: ignore[arg-type]

    @contextlib.asynccontextmanager
    async def host_lifespan(_: Litestar) -> AsyncIterator[None]:
        async with lifespan(router):
            yield

    app = Litestar(route_handlers=[router], lifespan=[host_lifespan])
    with running(app) as url:
        health = httpx.get(f"{url}/llm/health").json()
        assert health == {
            "status": "ok",
            "models": [{"id": "tiny", "status": "ready", "provider": "cpu", "engine": "ort-cpu"}],
        }
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert httpx.post(f"{url}/llm/v1/chat/completions", json=body).status_code == 200
