"""Generation throughput and latency: raw onnxruntime-genai next to ortserve, in one run.

    uv run python benchmarks/bench_generation.py [--model DIR] [--new-tokens 64]

The model is the random int4 model with Qwen2.5-0.5B's shapes; build it once with
`tests/fixtures/build_fixtures.py --bench` (fixtures environment, see that file).
Every request has a 32-token prompt and generates exactly --new-tokens tokens (EOS is
suppressed), greedy. Concurrent requests all start together.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
from ortserve_runtime import GenerationOptions, GenerativeModel, ModelConfig, ModelRegistry

BENCH_MODEL = Path.home() / ".cache" / "ortserve" / "bench-qwen2.5-0.5b-shape"


def prompts(model: GenerativeModel, count: int) -> list[list[int]]:
    """``count`` different 32-token prompts."""
    return [
        model.encode(f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 8)[:32] for i in range(count)
    ]


def raw_generator_tokens_per_s(folder: Path, prompt: list[int], new_tokens: int) -> float:
    """og.Generator, batch 1, greedy: the baseline a user would write by hand."""
    model = og.Model(str(folder))
    best = 0.0
    for _ in range(2):  # the first run warms up
        params = og.GeneratorParams(model)
        params.set_search_options(
            max_length=len(prompt) + new_tokens, min_length=len(prompt) + new_tokens, do_sample=False
        )
        generator = og.Generator(model, params)
        start = time.perf_counter()
        generator.append_tokens(np.array(prompt, dtype=np.int32))
        count = 0
        while not generator.is_done():
            generator.generate_next_token()
            count += 1
        best = count / (time.perf_counter() - start)
    del generator, params, model
    return best


async def ortserve_run(model: GenerativeModel, batch: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    """Aggregate tokens/s and each request's time to first token."""
    options = GenerationOptions(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0)
    start = time.perf_counter()

    async def one(prompt: list[int]) -> tuple[int, float]:
        first = 0.0
        count = 0
        async for event in model.generate(prompt, options=options):
            if event.token_id is not None:
                count += 1
                if count == 1:
                    first = time.perf_counter() - start
        return count, first

    results = await asyncio.gather(*(one(p) for p in batch))
    elapsed = time.perf_counter() - start
    return sum(c for c, _ in results) / elapsed, [f for _, f in results]


async def measure(folder: Path, new_tokens: int) -> list[tuple[str, float, float | None, float | None]]:
    registry = ModelRegistry(ModelConfig(max_batch_size=8, max_sequence_length=256))
    registry.add("bench", folder)
    model: GenerativeModel = await registry.get("bench")
    batch = prompts(model, 8)
    await ortserve_run(model, batch[:2], 8)  # warm-up
    rows: list[tuple[str, float, float | None, float | None]] = []
    for concurrency in (1, 4, 8):
        rate, ttft = await ortserve_run(model, batch[:concurrency], new_tokens)
        p50 = statistics.median(ttft)
        p95 = float(np.percentile(ttft, 95))
        rows.append((f"ortserve, {concurrency} concurrent", rate, p50, p95))
    await registry.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BENCH_MODEL)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if not (args.model / "genai_config.json").exists():
        print(f"no model at {args.model}: build it with tests/fixtures/build_fixtures.py --bench", file=sys.stderr)
        return 1
    rows = asyncio.run(measure(args.model, args.new_tokens))
    # The raw baseline runs after ortserve has closed its sessions, so both get the cores.
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    prompt = tokenizer.encode("request 0: " + "the quick brown fox jumps over the lazy dog " * 8).ids[:32]
    raw = raw_generator_tokens_per_s(args.model, prompt, args.new_tokens)
    print(f"{'engine':<28} {'tokens/s':>9} {'x raw b1':>9} {'TTFT p50':>9} {'TTFT p95':>9}")
    print(f"{'og.Generator, batch 1':<28} {raw:>9.1f} {1.0:>9.2f} {'':>9} {'':>9}")
    for name, rate, p50, p95 in rows:
        print(f"{name:<28} {rate:>9.1f} {rate / raw:>9.2f} {p50:>8.2f}s {p95:>8.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
