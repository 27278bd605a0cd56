"""The ort-cpu engine's concurrency curve: throughput and TTFT by concurrent requests and
``max_batch_size``, to choose the default from measurement.

    uv run python benchmarks/bench_concurrency.py [--model DIR] [--batch-sizes 8 16 32] [--concurrency 1 4 8 16 32]

Same model and requests as bench_generation.py (32-token prompts, exactly --new-tokens new
tokens, greedy, all requests started together). A request past ``max_batch_size`` waits for
a row, so its TTFT includes whole generations of others; a larger batch makes every step
slower. The table shows both for each setting.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

import numpy as np
from bench_generation import BENCH_MODEL, ortserve_run, prompts
from ortserve_runtime import ChatModel, ModelConfig, ModelRegistry


async def curve(folder: Path, batch_size: int, levels: list[int], new_tokens: int) -> list[tuple[int, float, float]]:
    registry = ModelRegistry(ModelConfig(max_batch_size=batch_size, max_sequence_length=256, prefix_cache_tokens=0))
    registry.add("bench", folder)
    model: ChatModel = await registry.get("bench")
    batch = prompts(folder, max(levels))
    await ortserve_run(model, batch[:2], 8)  # warm-up
    rows = []
    for level in levels:
        rate, ttft = await ortserve_run(model, batch[:level], new_tokens)
        rows.append((level, rate, float(np.percentile(ttft, 95))))
    await registry.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BENCH_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if not (args.model / "genai_config.json").exists():
        raise SystemExit(f"no model at {args.model}: build it with tests/fixtures/build_fixtures.py --bench")
    load = os.getloadavg()[0]
    print(f"ort-cpu, {args.new_tokens} new tokens per request; tokens/s / TTFT p95 (s)")
    print(f"{'max_batch_size':<16}" + "".join(f"{f'{c} concurrent':>20}" for c in args.concurrency))
    for size in args.batch_sizes:
        rows = asyncio.run(curve(args.model, size, args.concurrency, args.new_tokens))
        print(f"{size:<16}" + "".join(f"{f'{rate:.1f} / {p95:.2f}':>20}" for _, rate, p95 in rows))
    print(f"load average (1 min) {load:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
