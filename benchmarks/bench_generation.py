"""Generation throughput and latency: raw onnxruntime-genai next to ortserve, in one run.

    uv run python benchmarks/bench_generation.py [--model DIR] [--new-tokens 64] [--no-og-engine]
        [--engines ort-cpu og-engine og-generator] [--rounds 3]

The model is the random int4 model with Qwen2.5-0.5B's shapes at
~/.cache/ortserve/bench-qwen2.5-0.5b-shape; build it once with
`tests/fixtures/build_fixtures.py --bench` (run with the fixtures environment, see that file).
Every request has a 32-token prompt and generates exactly --new-tokens tokens (EOS is
suppressed: min_length/min_tokens/set_min_generated_tokens equal to the limit), greedy.
Concurrent requests all start together; tokens/s counts every generated token from the
start to the last token (prefill included), and time to first token (TTFT) is measured
from that common start.

Rows: `og.Generator` batch 1 (the baseline a user writes by hand; warmed up once, best of
two runs) with onnxruntime-genai's default session options, and again with the decoder's
intra-op threads set to --og-threads (default: all CPUs; ortserve uses every physical
core, while the default og session was measured at about one core's worth of CPU time here);
`og.Engine` with 4 and 8 requests (onnxruntime-genai's own batching, --og-threads threads;
skip with --no-og-engine); then ortserve with 1, 4 and 8 concurrent requests on each engine
of --engines (`ModelConfig(engine=...)`; the og engines load the model with every CPU as
the decoder's intra-op threads, like the tuned raw rows). The table is followed by the
targets and the load average, since other processes on the machine skew CPU timings
(--rounds N measures everything N times and reports each row's median round):

- ort-cpu (the default): 1 request >= 0.95x raw og.Generator, 8 concurrent >= 2x raw
  og.Generator (both against the default and the tuned raw row), 8-concurrent TTFT
  p95 <= 1.5 s;
- og-generator: 1 request >= 0.95x the tuned raw og.Generator;
- og-engine: 8 concurrent >= 0.95x raw og.Engine with 8 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime_genai as og
from ortserve_runtime import ChatModel, EngineName, GenerationOptions, ModelConfig, ModelRegistry
from tokenizers import Tokenizer

BENCH_MODEL = Path.home() / ".cache" / "ortserve" / "bench-qwen2.5-0.5b-shape"
PROMPT_TOKENS = 32


@dataclass(frozen=True)
class Row:
    name: str
    tokens_per_s: float
    ttft: list[float] | None = None

    @property
    def p50(self) -> float | None:
        return statistics.median(self.ttft) if self.ttft else None

    @property
    def p95(self) -> float | None:
        return float(np.percentile(self.ttft, 95)) if self.ttft else None


def prompts(folder: Path, count: int) -> list[list[int]]:
    """``count`` different prompts of exactly PROMPT_TOKENS tokens."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    result = []
    for i in range(count):
        ids = tokenizer.encode(f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 8).ids
        assert len(ids) >= PROMPT_TOKENS
        result.append(ids[:PROMPT_TOKENS])
    return result


# -- raw onnxruntime-genai -----------------------------------------------------------------


def cpu_features() -> str:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
        name = next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if "model name" in line
            ),
            "?",
        )
    except OSError:
        return "unknown"
    wanted = ["avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8"]
    return f"{name}, {os.cpu_count()} CPUs: " + ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in wanted)


def og_model(folder: Path, threads: int | None) -> og.Model:
    """The folder's model; ``threads`` overrides the decoder's intra-op thread count."""
    config = og.Config(str(folder))
    if threads is not None:
        options = {"intra_op_num_threads": threads}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    return og.Model(config)


def raw_generator(
    folder: Path, prompt: list[int], new_tokens: int, threads: int | None = None, adapter: Path | None = None
) -> Row:
    """og.Generator, batch 1, greedy (through the LoRA ``adapter`` file when given); one
    warm-up run, then the best of two."""
    model = og_model(folder, threads)
    adapters = og.Adapters(model) if adapter is not None else None
    if adapters is not None:
        adapters.load(str(adapter), "adapter")
    rates = []
    for _ in range(3):
        params = og.GeneratorParams(model)
        length = len(prompt) + new_tokens
        params.set_search_options(max_length=length, min_length=length, do_sample=False)
        generator = og.Generator(model, params)
        if adapters is not None:
            generator.set_active_adapter(adapters, "adapter")
        start = time.perf_counter()
        generator.append_tokens(np.array(prompt, dtype=np.int32))
        count = 0
        first = 0.0
        while not generator.is_done():
            generator.generate_next_token()
            count += 1
            if count == 1:
                first = time.perf_counter() - start
        rates.append((count / (time.perf_counter() - start), first))
        assert count == new_tokens, count
        del generator, params
    del adapters, model
    gc.collect()
    rate, first = max(rates[1:])
    return Row(f"og.Generator, batch 1{f', {threads} threads' if threads else ''}", rate, [first])


def raw_engine(folder: Path, batch: list[list[int]], new_tokens: int, threads: int | None) -> Row:
    """og.Engine with every request submitted at once (all calls from this thread)."""
    model = og_model(folder, threads)
    engine = og.Engine(model)
    buffer = engine.create_event_buffer(256)

    def run(prompts_: list[list[int]]) -> tuple[float, list[float]]:
        requests = []  # requests and their options must outlive the run
        start = time.perf_counter()
        for prompt in prompts_:
            request = engine.create_request()
            options = og.TurnOptions(request)
            options.set_do_sample(False)
            options.set_max_generated_tokens(new_tokens)
            options.set_min_generated_tokens(new_tokens)
            request.begin_turn(np.array(prompt, dtype=np.int32), options)
            requests.append((request, options))
        counts = [0] * len(requests)
        first = [0.0] * len(requests)
        while engine.has_pending_requests():
            for event in engine.run(buffer):
                if event.flags & og.EngineEventFlags.FAILED:
                    raise RuntimeError(f"og.Engine request failed: {event.error_code}")
                if event.flags & og.EngineEventFlags.TOKEN:
                    index = next(i for i, (r, _) in enumerate(requests) if event.request is r)
                    counts[index] += 1
                    if counts[index] == 1:
                        first[index] = time.perf_counter() - start
        elapsed = time.perf_counter() - start
        for request, _ in requests:
            request.close()
        assert counts == [new_tokens] * len(requests), counts
        return sum(counts) / elapsed, first

    run(batch[:2])  # warm-up
    rate, first = run(batch)
    return Row(f"og.Engine, {len(batch)} concurrent, {threads} thr", rate, first)


# -- ortserve ------------------------------------------------------------------------------


async def ortserve_run(model: ChatModel, batch: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
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
    assert [c for c, _ in results] == [new_tokens] * len(batch)
    return sum(c for c, _ in results) / elapsed, [f for _, f in results]


ENGINES: tuple[EngineName, ...] = ("ort-cpu", "og-engine", "og-generator")


async def ortserve(folder: Path, batch: list[list[int]], new_tokens: int, engine: EngineName) -> list[Row]:
    """ortserve on ``engine``: 1 request (best of two, as raw), then 4 and 8 concurrent."""
    registry = ModelRegistry(ModelConfig(engine=engine, max_batch_size=8, max_sequence_length=256))
    registry.add("bench", folder)
    model: ChatModel = await registry.get("bench")
    await ortserve_run(model, batch[:2], 8)  # warm-up
    single = max([await ortserve_run(model, batch[:1], new_tokens) for _ in range(2)])
    rows = [Row(f"ortserve {engine}, 1 request", single[0], single[1])]
    for concurrency in (4, 8):
        rate, ttft = await ortserve_run(model, batch[:concurrency], new_tokens)
        rows.append(Row(f"ortserve {engine}, {concurrency} concurrent", rate, ttft))
    await registry.close()
    del model
    gc.collect()
    return rows


def seconds(value: float | None) -> str:
    return f"{value:>8.2f}s" if value is not None else f"{'':>9}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BENCH_MODEL)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-og-engine", action="store_true", help="skip the og.Engine rows")
    parser.add_argument(
        "--og-threads",
        type=int,
        default=os.cpu_count(),
        help="intra-op threads for the tuned og rows (ortserve uses every physical core by default)",
    )
    parser.add_argument(
        "--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="ortserve engines to measure"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure every row this many times; report each row's median"
    )
    args = parser.parse_args()
    if not (args.model / "genai_config.json").exists():
        print(
            f"no model at {args.model}: build it with the fixtures environment, e.g.\n"
            "    python tests/fixtures/build_fixtures.py --bench",
            file=sys.stderr,
        )
        return 1
    load_before = os.getloadavg()
    batch = prompts(args.model, 8)
    rounds = []
    for _ in range(args.rounds):
        raw = raw_generator(args.model, batch[0], args.new_tokens)  # onnxruntime-genai's defaults
        tuned = raw_generator(args.model, batch[0], args.new_tokens, threads=args.og_threads)
        rows = [raw, tuned]
        if not args.no_og_engine:
            rows += [raw_engine(args.model, batch[:n], args.new_tokens, args.og_threads) for n in (4, 8)]
        for engine in args.engines:
            rows += asyncio.run(ortserve(args.model, batch, args.new_tokens, engine))
        rounds.append(rows)
    load_after = os.getloadavg()
    # Each row's median round (its tokens/s and that round's TTFTs).
    rows = [sorted(column, key=lambda row: row.tokens_per_s)[len(column) // 2] for column in zip(*rounds, strict=True)]
    raw, tuned = rows[0], rows[1]

    rounds_text = f"; median of {args.rounds} rounds" if args.rounds > 1 else ""
    print(cpu_features())
    print(
        f"{PROMPT_TOKENS}-token prompts, {args.new_tokens} new tokens each, greedy; {os.cpu_count()} CPUs{rounds_text}"
    )
    print(f"{'engine':<36} {'tokens/s':>9} {'x raw b1':>9} {'x tuned':>8} {'TTFT p50':>9} {'TTFT p95':>9}")
    for row in rows:
        ratio, tuned_ratio = row.tokens_per_s / raw.tokens_per_s, row.tokens_per_s / tuned.tokens_per_s
        print(
            f"{row.name:<36} {row.tokens_per_s:>9.1f} {ratio:>9.2f} {tuned_ratio:>8.2f} "
            f"{seconds(row.p50)} {seconds(row.p95)}"
        )
    print("x raw b1: over og.Generator batch 1 with its defaults; x tuned: over it with --og-threads threads")
    by_name = {row.name: row for row in rows}
    targets: list[tuple[str, bool, str]] = []
    if "ort-cpu" in args.engines:
        single = by_name["ortserve ort-cpu, 1 request"].tokens_per_s
        eight = by_name["ortserve ort-cpu, 8 concurrent"]
        for label, base in (("raw b1", raw.tokens_per_s), ("tuned", tuned.tokens_per_s)):
            targets += [
                (f"ortserve ort-cpu 1 request / {label} = {single / base:.2f}", single >= 0.95 * base, ">= 0.95x"),
                (
                    f"ortserve ort-cpu 8 concurrent / {label} = {eight.tokens_per_s / base:.2f}",
                    eight.tokens_per_s >= 2 * base,
                    ">= 2x",
                ),
            ]
        p95 = eight.p95 if eight.p95 is not None else float("nan")
        targets.append((f"ortserve ort-cpu 8 concurrent TTFT p95 = {p95:.2f} s", p95 <= 1.5, "<= 1.5 s"))
    if "og-generator" in args.engines:
        single = by_name["ortserve og-generator, 1 request"].tokens_per_s
        ratio = single / tuned.tokens_per_s
        targets.append((f"ortserve og-generator 1 request / tuned = {ratio:.2f}", ratio >= 0.95, ">= 0.95x"))
    if "og-engine" in args.engines and not args.no_og_engine:
        eight_rate = by_name["ortserve og-engine, 8 concurrent"].tokens_per_s
        raw_eight = by_name[f"og.Engine, 8 concurrent, {args.og_threads} thr"].tokens_per_s
        ratio = eight_rate / raw_eight
        targets.append((f"ortserve og-engine 8 concurrent / og.Engine 8 = {ratio:.2f}", ratio >= 0.95, ">= 0.95x"))
    for text, ok, goal in targets:
        print(f"target {goal:<9} {'met   ' if ok else 'MISSED'}  {text}")
    print(f"load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
