"""A Flask (WSGI) app that serves ortserve under /llm.

``wsgi_app`` wraps the ASGI app with a2wsgi; models load on first use and streamed
responses stream. Any WSGI server works; this one uses werkzeug's threaded server.

    uv run python examples/flask_host.py
    curl http://127.0.0.1:8000/llm/v1/models
"""

from __future__ import annotations

from _common import MODEL_DIR, PORT
from flask import Flask
from ortserve_server import ServerConfig, wsgi_app
from werkzeug.middleware.dispatcher import DispatcherMiddleware
from werkzeug.serving import run_simple

flask_app = Flask(__name__)


@flask_app.get("/hello")
def hello() -> dict[str, str]:
    return {"message": "the host's own route"}


app = DispatcherMiddleware(flask_app, {"/llm": wsgi_app(ServerConfig(models={"tiny": MODEL_DIR}))})

if __name__ == "__main__":
    run_simple("127.0.0.1", PORT, app, threaded=True)
