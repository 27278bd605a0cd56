"""A Litestar app that keeps its own routes and adds ortserve with the plugin.

uv run python examples/litestar_host.py
curl http://127.0.0.1:8000/hello
curl http://127.0.0.1:8000/v1/models
"""

from __future__ import annotations

import uvicorn
from _common import MODEL_DIR, PORT
from litestar import Litestar, get
from ortserve_server import OrtServePlugin, ServerConfig


@get("/hello")
async def hello() -> dict[str, str]:
    return {"message": "the host's own route"}


app = Litestar(
    route_handlers=[hello],
    plugins=[OrtServePlugin(ServerConfig(models={"tiny": MODEL_DIR}))],
)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=PORT, log_level="warning")
