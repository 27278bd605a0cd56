"""A Starlette app that mounts ortserve under /llm and enters its lifespan itself.

Starlette (and FastAPI) do not run the lifespan of a mounted app, so the host's lifespan
enters ``ortserve_server.lifespan``; models then load at startup and close at shutdown.

    uv run python examples/starlette_host.py
    curl http://127.0.0.1:8000/llm/v1/models
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import uvicorn
from _common import MODEL_DIR, PORT
from ortserve_server import ServerConfig, create_app, lifespan
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

llm = create_app(ServerConfig(models={"tiny": MODEL_DIR}))


async def hello(_: Request) -> JSONResponse:
    return JSONResponse({"message": "the host's own route"})


@contextlib.asynccontextmanager
async def host_lifespan(_: Starlette) -> AsyncIterator[None]:
    async with lifespan(llm):
        yield


app = Starlette(routes=[Route("/hello", hello), Mount("/llm", app=llm)], lifespan=host_lifespan)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
