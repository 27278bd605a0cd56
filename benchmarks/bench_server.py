"""HTTP overhead of ortserve-server against the runtime called directly, in one run.

    uv run python benchmarks/bench_server.py [--model DIR] [--engine og-generator]

Prints a table:
- tokens/s of one SSE stream over HTTP vs the runtime called directly on the 0.5B-shaped
  model (build it with `tests/fixtures/build_fixtures.py --bench`), and vs a raw
  `og.Generator` (batch 1, every CPU as the decoder's intra-op threads, the same prompt
  ids and exactly as many tokens) in the same run;
- the per-token overhead of HTTP+SSE in microseconds on the tiny model (where the model
  step is cheap, so the overhead shows);
- requests/s and p95 latency for 8 and 32 concurrent short chat requests (tiny model).

--engine picks the generation engine (`ModelConfig(engine=...)`) of both the in-process
server and the direct runtime: ort-cpu (the CPU default), og-engine or og-generator.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from bench_generation import raw_generator
from ortserve_runtime import EngineName, GenerationOptions, ModelConfig, ModelRegistry
from ortserve_server import ServerConfig, create_app
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serving import TINY_MODEL, running

BENCH_MODEL = Path.home() / ".cache" / "ortserve" / "bench-qwen2.5-0.5b-shape"
PROMPT = "word " * 31


ENGINES: tuple[EngineName, ...] = ("auto", "ort-cpu", "og-engine", "og-generator")


def model_config(engine: EngineName) -> ModelConfig:
    return ModelConfig(engine=engine, max_sequence_length=512)


async def runtime_tokens_per_s(model_dir: Path, new_tokens: int, engine: EngineName) -> float:
    registry = ModelRegistry(model_config(engine))
    registry.add("m", model_dir)
    model = await registry.get("m")
    options = GenerationOptions(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0)
    await model.generate(PROMPT, options=options).collect()  # warm-up
    start = time.perf_counter()
    _, tokens, _, _ = await model.generate(PROMPT, options=options).collect()
    elapsed = time.perf_counter() - start
    await registry.close()
    return len(tokens) / elapsed


async def http_tokens_per_s(url: str, new_tokens: int) -> float:
    body = {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": new_tokens,
        "min_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
    }
    async with httpx.AsyncClient(timeout=600) as http:
        for _ in range(2):  # the first is a warm-up
            start = time.perf_counter()
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                async for _line in response.aiter_lines():
                    pass
            elapsed = time.perf_counter() - start
    return new_tokens / elapsed


async def concurrent_chat(url: str, concurrency: int, rounds: int = 3) -> tuple[float, float]:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0}
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as http:

        async def one() -> None:
            start = time.perf_counter()
            response = await http.post(f"{url}/v1/chat/completions", json=body)
            response.raise_for_status()
            latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm-up
        latencies.clear()
        start = time.perf_counter()
        for _ in range(rounds):
            await asyncio.gather(*(one() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    p95 = statistics.quantiles(latencies, n=20, method="inclusive")[-1]  # within the data
    return concurrency * rounds / elapsed, p95


def serve(model_dir: Path, engine: EngineName) -> object:
    return running(create_app(ServerConfig(models={"m": model_dir}, model_config=model_config(engine))))


@contextlib.contextmanager
def serve_process(model_dir: Path, engine: EngineName) -> Iterator[str]:
    """``ortserve serve`` as its own process, as users run it: the client's work (here, this
    process) then does not compete with the server for one interpreter's GIL, which
    og.Generator holds through each model step."""
    command = [sys.executable, "-m", "ortserve_server", "serve", "--port", "0", "--ready-json"]
    command += ["--model", f"m={model_dir}", "--engine", engine, "--max-sequence-length", "512"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        ready = json.loads(process.stdout.readline())
        yield f"http://127.0.0.1:{ready['port']}"
    finally:
        process.terminate()
        process.wait(timeout=60)


def raw_tokens_per_s(model_dir: Path, new_tokens: int) -> float:
    """og.Generator, batch 1, every CPU: the prompt's ids as the runtime gets them."""
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(PROMPT, add_special_tokens=False).ids
    return raw_generator(model_dir, ids, new_tokens, threads=os.cpu_count()).tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BENCH_MODEL)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--engine", choices=ENGINES, default="auto", help="generation engine (ModelConfig.engine)")
    args = parser.parse_args()
    rows: list[tuple[str, str]] = [("engine", args.engine)]
    if (args.model / "genai_config.json").exists():
        raw = raw_tokens_per_s(args.model, args.tokens)
        direct = asyncio.run(runtime_tokens_per_s(args.model, args.tokens, args.engine))
        with serve(args.model, args.engine) as url:  # type: ignore[attr-defined]
            over_http = asyncio.run(http_tokens_per_s(url, args.tokens))
        with serve_process(args.model, args.engine) as url:
            separate = asyncio.run(http_tokens_per_s(url, args.tokens))
        rows += [
            (f"0.5B-shape: raw og.Generator batch 1, {os.cpu_count()} threads, tokens/s", f"{raw:.1f}"),
            ("0.5B-shape: runtime direct, tokens/s", f"{direct:.1f}"),
            ("0.5B-shape: one SSE stream over HTTP, server in this process, tokens/s", f"{over_http:.1f}"),
            ("0.5B-shape: one SSE stream over HTTP, `ortserve serve` process, tokens/s", f"{separate:.1f}"),
            ("0.5B-shape: HTTP (in process) / direct", f"{over_http / direct:.2f}x"),
            ("0.5B-shape: HTTP (ortserve serve) / raw og.Generator", f"{separate / raw:.2f}x"),
        ]
    else:
        print(f"(no benchmark model at {args.model}: build it with tests/fixtures/build_fixtures.py --bench)")
    tiny_tokens = 400
    direct = asyncio.run(runtime_tokens_per_s(TINY_MODEL, tiny_tokens, args.engine))
    with serve(TINY_MODEL, args.engine) as url:  # type: ignore[attr-defined]
        over_http = asyncio.run(http_tokens_per_s(url, tiny_tokens))
        overhead_us = (1 / over_http - 1 / direct) * 1e6
        rows += [
            ("tiny: runtime direct, tokens/s", f"{direct:.0f}"),
            ("tiny: one SSE stream over HTTP, tokens/s", f"{over_http:.0f}"),
            ("tiny: HTTP+SSE overhead per token, us", f"{overhead_us:.0f}"),
        ]
        for concurrency in (8, 32):
            rps, p95 = asyncio.run(concurrent_chat(url, concurrency))
            rows.append((f"tiny: {concurrency} concurrent chats (16 tokens), requests/s", f"{rps:.1f}"))
            rows.append((f"tiny: {concurrency} concurrent chats, p95 latency s", f"{p95:.3f}"))
    width = max(len(name) for name, _ in rows)
    print(f"{'measure':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
