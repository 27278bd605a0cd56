"""Ray Serve: what prefix-affinity routing saves over Ray's default router, in one run.

    uv sync --extra ray
    uv run --extra ray python benchmarks/bench_ray.py [--model DIR] [--conversations 8] [--turns 4]

Starts a local Ray (127.0.0.1, no dashboard), deploys two ortserve replicas (ort-cpu, one
onnxruntime thread each) with ``router="prefix"``, holds --conversations chats of --turns
turns (a shared 300-word system prompt, a 60-word question per turn, 16 new tokens,
greedy; the conversations take turns, one request at a time), then redeploys with
``router="default"`` (power of two choices) and repeats. For each router: the share of
prompt tokens the replicas took from their prefix caches (usage.prompt_tokens_details),
how many replicas each conversation touched, and the mean request latency of turns 2 on.

The model defaults to the random int4 model with Qwen2.5-0.5B's shapes at
~/.cache/ortserve/bench-qwen2.5-0.5b-shape (see bench_generation.py).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")  # workers use this environment

import openai
import ray
from bench_generation import BENCH_MODEL
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig
from ortserve_server.ray import REPLICA_HEADER, RayOptions, build_app
from ray import serve

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
]


def words(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n))


def run(client: openai.OpenAI, conversations: int, turns: int) -> dict[str, float]:
    histories: list[list[Any]] = [[{"role": "system", "content": words(300, 0)}] for _ in range(conversations)]
    replicas: list[set[str]] = [set() for _ in range(conversations)]
    prompt = cached = 0
    latencies = []
    for turn in range(turns):
        for c, messages in enumerate(histories):
            messages.append({"role": "user", "content": f"conversation {c}, turn {turn}: {words(60, c * 31 + turn)}"})
            start = time.perf_counter()
            raw = client.chat.completions.with_raw_response.create(
                model="bench", messages=messages, max_tokens=16, temperature=0
            )
            elapsed = time.perf_counter() - start
            reply = raw.parse()
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
            replicas[c].add(raw.headers[REPLICA_HEADER])
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            prompt += reply.usage.prompt_tokens
            cached += reply.usage.prompt_tokens_details.cached_tokens or 0
            if turn:
                latencies.append(elapsed)
    return {
        "cached": cached / prompt,
        "replicas": statistics.mean(len(r) for r in replicas),
        "latency": statistics.mean(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BENCH_MODEL)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    config = ServerConfig(
        models={"bench": args.model},
        model_config=ModelConfig(engine="ort-cpu", intra_op_threads=1, max_sequence_length=2048),
    )
    results = {}
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=300) as client:
            for router in ("prefix", "default"):
                options = RayOptions(replicas=2, replica_cpus=0.5, router=router)
                serve.run(build_app(config, options), name="bench", route_prefix="/")
                results[router] = run(client, args.conversations, args.turns)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"{args.conversations} conversations x {args.turns} turns, 2 replicas, {args.model.name}")
    print(f"{'router':<10}{'prompt tokens cached':>22}{'replicas per chat':>19}{'latency turns 2+ (s)':>22}")
    for router, row in results.items():
        print(f"{router:<10}{row['cached']:>22.1%}{row['replicas']:>19.2f}{row['latency']:>22.3f}")


if __name__ == "__main__":
    main()
