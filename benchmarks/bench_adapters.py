"""LoRA adapters: what generating through one costs, and what mixing two in a batch costs.

    uv run python benchmarks/bench_adapters.py [--model DIR] [--new-tokens 64] [--concurrency 8]
        [--engines ort-cpu og-generator] [--rounds 3]

The model is a random fp32 model (hidden 512, 8 layers) whose decoder takes LoRA weights as
inputs, with two random adapters in DIR/adapters/*.onnx_adapter, at
~/.cache/ortserve/bench-lora; build it once with `tests/fixtures/build_fixtures.py
--bench-lora` (the fixtures environment; `--model tests/fixtures/tiny-qwen2-lora` runs on
the committed tiny one, where per-call overhead is all there is to see). Prompts and
timing are bench_generation.py's (32-token prompts, exactly --new-tokens new tokens,
greedy, all requests started together, tokens/s over the whole run).

Rows, per engine: 1 request through the base model and through an adapter (next to raw
og.Generator with og.Adapters, the baseline); --concurrency requests all on the base, all
on one adapter, on two adapters arriving interleaved (a, b, a, b...: ort-cpu decodes each
run of same-adapter rows in its own call, so one call per row), and on two adapters
arriving grouped (a, a, ..., b, b, ...: two calls per step).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

from bench_generation import ortserve_run, prompts, raw_generator
from ortserve_runtime import ChatModel, EngineName, ModelConfig, ModelRegistry

BENCH_LORA = Path.home() / ".cache" / "ortserve" / "bench-lora"


async def mixed(views: list[ChatModel], batch: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of ``batch[i]`` through ``views[i]``, all started together."""
    start = time.perf_counter()
    await asyncio.gather(*(ortserve_run(view, [prompt], new_tokens) for view, prompt in zip(views, batch, strict=True)))
    return len(batch) * new_tokens / (time.perf_counter() - start)


async def engine_rows(
    folder: Path, adapters: dict[str, Path], engine: EngineName, concurrency: int, new_tokens: int
) -> list[tuple[str, float]]:
    config = ModelConfig(engine=engine, adapters=adapters, max_batch_size=concurrency, max_sequence_length=256)
    registry = ModelRegistry(ModelConfig(engine=engine, max_batch_size=concurrency, max_sequence_length=256))
    registry.add("bench", folder, config)
    model: ChatModel = await registry.get("bench")
    a, b = (model.with_adapter(name) for name in sorted(adapters)[:2])
    batch = prompts(folder, concurrency)
    await mixed([a, b], batch[:2], 8)  # warm-up
    half = concurrency // 2
    cases = {
        "1 request, base": [model],
        "1 request, adapter": [a],
        f"{concurrency} concurrent, base": [model] * concurrency,
        f"{concurrency} concurrent, one adapter": [a] * concurrency,
        f"{concurrency} concurrent, 2 adapters interleaved": [a, b] * half,
        f"{concurrency} concurrent, 2 adapters grouped": [a] * half + [b] * half,
    }
    rows = [
        (f"ortserve {engine}, {name}", await mixed(views, batch[: len(views)], new_tokens))
        for name, views in cases.items()
    ]
    await registry.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BENCH_LORA)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8, help="an even number")
    parser.add_argument(
        "--engines", nargs="+", choices=["ort-cpu", "og-generator"], default=["ort-cpu", "og-generator"]
    )
    parser.add_argument("--rounds", type=int, default=1, help="measure everything this many times; report medians")
    args = parser.parse_args()
    adapters = {path.stem: path for path in sorted((args.model / "adapters").glob("*.onnx_adapter"))}
    if len(adapters) < 2:
        print(
            f"no model with two adapters at {args.model}: build it with the fixtures environment, e.g.\n"
            "    python tests/fixtures/build_fixtures.py --bench-lora",
            file=sys.stderr,
        )
        return 1
    load_before = os.getloadavg()
    first = next(iter(adapters.values()))
    rounds = []
    for _ in range(args.rounds):
        # og.Generator through the adapter with every CPU as intra-op threads, as ortserve's og engines load it.
        raw = raw_generator(args.model, prompts(args.model, 1)[0], args.new_tokens, os.cpu_count(), adapter=first)
        rows = [("raw og.Generator + og.Adapters, 1 request", raw.tokens_per_s)]
        for engine in args.engines:
            rows += asyncio.run(engine_rows(args.model, adapters, engine, args.concurrency, args.new_tokens))
        rounds.append(rows)
    names = [name for name, _ in rounds[0]]
    medians = {name: statistics.median(r[i][1] for r in rounds) for i, name in enumerate(names)}
    raw = medians[names[0]]
    median_text = f"; median of {args.rounds} rounds" if args.rounds > 1 else ""
    print(
        f"{args.model.name}: 32-token prompts, {args.new_tokens} new tokens each, greedy; {os.cpu_count()} CPUs{median_text}"
    )
    print(f"{'run':<58} {'tokens/s':>9} {'x raw':>7}")
    for name, rate in medians.items():
        print(f"{name:<58} {rate:>9.1f} {rate / raw:>7.2f}")
    print("x raw: over raw og.Generator batch 1 through the same adapter")
    print(f"load average (1 min) {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
