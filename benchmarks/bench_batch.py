"""Interactive time to first token while a batch runs, and the batch's throughput.

    uv run python benchmarks/bench_batch.py --model DIR [--lines 400] [--samples 30]

Starts ``ortserve serve`` on the model (SmolLM2-135M-Instruct int4 is the reference:
``../shared/tools/mk_smollm2.py``), then, over HTTP with streamed chat requests of a few
hundred prompt tokens, measures interactive TTFT (median and p90 of ``--samples``, one
request at a time with a pause between) three ways: with nothing else running; while a
``--lines``-line batch (/v1/batches, 64 new tokens a line) runs; and, for comparison,
while the same lines are sent as ordinary concurrent requests by a client (what a client
without the Batch API does). Also prints the batch's lines per second and the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from bench_generation import cpu_features

QUESTION = (
    "You are a helpful assistant for a small bakery. A customer writes: I ordered a chocolate cake "
    "for Saturday, but my daughter is now allergic to nuts, and I also want to change the message on "
    "the cake to say Happy Birthday Emma instead of Happy Birthday Em. Also, could you tell me whether "
    "you deliver on weekends, and what the price difference is for a larger size? Answer briefly."
)


@contextlib.contextmanager
def server(model: Path, state: Path) -> Iterator[str]:
    command = [sys.executable, "-m", "ortserve_server", "serve", "--port", "0", "--ready-json"]
    process = subprocess.Popen(
        [*command, "--model", f"m={model}", "--state-dir", str(state)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    port = json.loads(process.stdout.readline())["port"]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(30)


def body(i: int, max_tokens: int) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": f"Ticket {i}. {QUESTION}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


async def ttft(client: httpx.AsyncClient, i: int) -> float:
    start = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json={**body(10_000 + i, 16), "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - start
    raise AssertionError("no token came")


async def samples(client: httpx.AsyncClient, count: int, first: int) -> list[float]:
    """TTFTs of ``count`` prompts numbered from ``first`` (no two phases share a prompt,
    so none is in the prefix cache)."""
    found = []
    for i in range(first, first + count):
        found.append(await ttft(client, i))
        await asyncio.sleep(0.3)
    return found


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{statistics.median(ordered) * 1000:7.0f} ms {ordered[int(0.9 * (len(ordered) - 1))] * 1000:7.0f} ms"


async def run(url: str, lines: int, count: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await samples(client, 3, 900)  # warm-up
        alone = await samples(client, count, 1000)

        content = "".join(
            json.dumps({"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(i, 64)})
            + "\n"
            for i in range(lines)
        )
        uploaded = await client.post("/v1/files", data={"purpose": "batch"}, files={"file": ("b.jsonl", content)})
        batch = (
            await client.post(
                "/v1/batches",
                json={
                    "input_file_id": uploaded.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
        ).json()
        started = time.perf_counter()
        await asyncio.sleep(2)  # the batch fills its rows
        during = await samples(client, count, 2000)
        while (state := (await client.get(f"/v1/batches/{batch['id']}")).json())["status"] != "completed":
            await asyncio.sleep(0.5)
        rate = lines / (time.perf_counter() - started)
        assert state["request_counts"]["completed"] == lines, state

        async def flood() -> None:
            limiter = asyncio.Semaphore(8)

            async def one(i: int) -> None:
                async with limiter:
                    await client.post("/v1/chat/completions", json=body(i, 64))

            await asyncio.gather(*(one(i) for i in range(lines)))

        flooding = asyncio.create_task(flood())
        await asyncio.sleep(2)
        crowded = await samples(client, count, 3000)
        await flooding

    print(cpu_features())
    print(f"interactive TTFT (streamed chat, {count} samples)   median      p90")
    print(f"{'alone':<42}{summary(alone)}")
    print(f"{f'with a {lines}-line batch running':<42}{summary(during)}")
    print(f"{'with the same lines as 8 concurrent requests':<42}{summary(crowded)}")
    ratio = statistics.median(during) / statistics.median(alone)
    print(f"batch: {rate:.1f} lines/s (64 new tokens each); TTFT median with the batch / alone: {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--lines", type=int, default=400)
    parser.add_argument("--samples", type=int, default=30)
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as state, server(args.model, Path(state)) as url:
        asyncio.run(run(url, args.lines, args.samples))


if __name__ == "__main__":
    main()
