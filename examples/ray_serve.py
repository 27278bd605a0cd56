"""ortserve on Ray Serve: two replicas on a local Ray instance, routed by prefix.

Starts Ray on this machine (or joins the cluster that ``RAY_ADDRESS`` names), deploys two
ortserve replicas behind Ray's HTTP proxy on ``PORT``, holds a short conversation with the
openai SDK (every turn lands on the replica that holds its prefix, which reports the
prompt tokens it did not prefill again), then serves until Ctrl-C.

    uv sync --extra ray
    uv run python examples/ray_serve.py
    curl http://127.0.0.1:8000/v1/models
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

# Under `uv run`, Ray would start its workers with `uv run` in a copy of this project,
# which syncs the default environment; the workers must use this one.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import openai
import ray
from _common import MODEL_DIR, PORT
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig
from ortserve_server.ray import REPLICA_HEADER, RayOptions, build_app
from ray import serve

REPLICAS = 2


def main() -> None:
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    # Each replica gets one CPU and one onnxruntime thread: replicas add throughput by
    # running side by side, not by sharing cores.
    config = ServerConfig(models={"tiny": MODEL_DIR}, model_config=ModelConfig(engine="ort-cpu", intra_op_threads=1))
    serve.run(build_app(config, RayOptions(replicas=REPLICAS, replica_cpus=0.5)), name="ortserve", route_prefix="/")
    print(f"serving on http://127.0.0.1:{PORT}/v1 with {REPLICAS} replicas", flush=True)

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="none")
    messages: list[Any] = [{"role": "system", "content": "You answer in one short sentence. " * 8}]
    for question in ("What is Ray Serve?", "And a replica?", "Why route by prefix?"):
        messages.append({"role": "user", "content": question})
        raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=16)
        reply = raw.parse()
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        cached = (
            reply.usage.prompt_tokens_details.cached_tokens if reply.usage and reply.usage.prompt_tokens_details else 0
        )
        print(
            f"replica {raw.headers[REPLICA_HEADER]}: {reply.usage.prompt_tokens if reply.usage else 0} prompt tokens, "
            f"{cached} from its prefix cache",
            flush=True,
        )

    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print("ready; Ctrl-C stops", flush=True)
    stop.wait()
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
