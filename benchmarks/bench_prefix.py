"""Prefix cache: time to first token with and without it, in one run.

    uv run python benchmarks/bench_prefix.py [--model DIR] [--turns 6] [--users 8]

The model is the random int4 model with Qwen2.5-0.5B's shapes at
~/.cache/ortserve/bench-qwen2.5-0.5b-shape (build it with
`tests/fixtures/build_fixtures.py --bench`; see bench_generation.py). Two copies of it are
loaded side by side: the ort-cpu engine with the prefix cache (its default budget) and
without it (prefix_cache_tokens=0). Prompts are token ids, so both see the same tokens.

- chat: a conversation of --turns turns whose history reaches about 2,000 tokens (each
  turn adds a 200-token user message and the model's 128-token reply); TTFT of the last
  turn with the cache (the earlier turns ran on it) against the same prompt without it.
  Twice: each turn sent --read-seconds after the previous reply (a person reading it; the
  engine prefills the reply into the cache meanwhile, see _prefix_cache), and each sent at
  once (an agent loop: the next turn prefills the reply itself).
- shared system prompt: --users requests with one 1,000-token system prompt and their own
  question, arriving together; TTFT p95 with the cache (cold at the start) against without.
- cold single stream: decode speed of a prompt the cache has never seen, cache on against
  off (what the cache's bookkeeping costs when it cannot help).
- memory: RSS growth over the run and the key/value bytes the cache holds.

Targets (issue 12): chat last-turn TTFT <= 0.15x, shared-prompt TTFT p95 <= 0.35x,
cold single stream >= 0.98x.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import numpy as np
from bench_generation import cpu_features
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelRegistry

BENCH_MODEL = Path.home() / ".cache" / "ortserve" / "bench-qwen2.5-0.5b-shape"
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "the",
    "lazy",
    "dog",
    "while",
    "sorting",
    "lists",
    "of",
    "numbers",
    "in",
    "order",
]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def text_tokens(model: ChatModel, count: int, seed: int) -> list[int]:
    """``count`` token ids of varied English-like text (different per seed)."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    while len(ids) < count:
        ids += model.encode(" ".join(rng.choice(WORDS, 64)), add_special_tokens=False)
    return ids[:count]


async def ttft(model: ChatModel, prompt: list[int], new_tokens: int = 1) -> tuple[float, list[int], int]:
    """Seconds to the first token, the tokens, and the cached prompt tokens."""
    options = GenerationOptions(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0)
    start = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    cached = 0
    async for event in model.generate(prompt, options=options):
        if event.token_id is not None:
            if not tokens:
                first = time.perf_counter() - start
            tokens.append(event.token_id)
        if event.usage is not None:
            cached = event.usage.cached_tokens
    return first, tokens, cached


async def chat(
    cached: ChatModel, plain: ChatModel, turns: int, read_seconds: float, seed: int
) -> tuple[float, float, int, int]:
    history = text_tokens(cached, 60, seed)  # a system prompt
    last = 0.0
    hit = 0
    for turn in range(turns):
        history = history + text_tokens(cached, 200, seed + turn + 1)
        last, reply, hit = await ttft(cached, history, 128)
        if turn < turns - 1:
            history = history + reply
            await asyncio.sleep(read_seconds)
    cold, _, _ = await ttft(plain, history)
    return last, cold, len(history), hit


async def shared(model: ChatModel, users: int, system: list[int]) -> tuple[list[float], list[int]]:
    prompts = [system + text_tokens(model, 20, 100 + i) for i in range(users)]
    results = await asyncio.gather(*(ttft(model, p) for p in prompts))
    return [r[0] for r in results], [r[2] for r in results]


async def single(model: ChatModel, prompt: list[int], new_tokens: int) -> float:
    options = GenerationOptions(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0)
    start = time.perf_counter()
    _, tokens, _, _ = await model.generate(prompt, options=options).collect()
    return len(tokens) / (time.perf_counter() - start)


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) > 1 else values[0]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BENCH_MODEL)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--read-seconds", type=float, default=2.0, help="pause before each next chat turn")
    args = parser.parse_args()
    if not (args.model / "genai_config.json").exists():
        raise SystemExit(f"no model at {args.model}: build it with tests/fixtures/build_fixtures.py --bench")
    start_rss = rss_mb()
    registry = ModelRegistry()
    registry.add("cached", args.model, ModelConfig())
    registry.add("plain", args.model, ModelConfig(prefix_cache_tokens=0))
    cached: ChatModel = await registry.get("cached")
    plain: ChatModel = await registry.get("plain")
    loaded_rss = rss_mb()
    await ttft(cached, text_tokens(cached, 40, 99))  # warm-up, both
    await ttft(plain, text_tokens(plain, 40, 99))

    read = await chat(cached, plain, args.turns, args.read_seconds, 0)
    last, cold, length, hit = await chat(cached, plain, args.turns, 0.0, 1000)
    cache = cached.engine.prefix_cache  # type: ignore[attr-defined]
    cache.clear()
    system = text_tokens(cached, args.system_tokens, 7)
    with_cache, hits = await shared(cached, args.users, system)
    without, _ = await shared(plain, args.users, system)
    # Prompts that share nothing (not even with each other): the cache can only cost here.
    rate_on = [await single(cached, text_tokens(cached, 256, 4242 + i), args.new_tokens) for i in range(3)]
    rate_off = [await single(plain, text_tokens(plain, 256, 4242 + i), args.new_tokens) for i in range(3)]
    end_rss = rss_mb()

    rows = [
        (
            f"chat turn {args.turns} ({read[2]} tokens), sent {args.read_seconds:g} s after a reply, TTFT s",
            *read[:2],
            0.15,
            "<=",
        ),
        (f"chat turn {args.turns} ({length} tokens), sent at once (an agent), TTFT s", last, cold, 0.15, "<="),
        (
            f"{args.users} users, {args.system_tokens}-token system prompt, TTFT p95 s",
            p95(with_cache),
            p95(without),
            0.35,
            "<=",
        ),
        (
            f"cold single stream, {args.new_tokens} new tokens, tokens/s (median of 3)",
            statistics.median(rate_on),
            statistics.median(rate_off),
            0.98,
            ">=",
        ),
    ]
    print(f"model: {args.model.name}; load average {os.getloadavg()[0]:.2f}; {cpu_features()}")
    print(f"{'':<72} {'cache':>9} {'no cache':>9} {'ratio':>7}  target")
    for name, on, off, target, sense in rows:
        ratio = on / off
        ok = ratio <= target if sense == "<=" else ratio >= target
        print(f"{name:<72} {on:>9.3f} {off:>9.3f} {ratio:>7.3f}  {sense} {target} {'met' if ok else 'MISSED'}")
    print(
        f"last chat turn: {read[3]} of {read[2]} prompt tokens from the cache after a pause, {hit} of {length} "
        f"at once; shared prompt hits: {sorted(hits)}"
    )
    print(
        f"RSS: {start_rss:.0f} MB at start, {loaded_rss:.0f} MB with both models, {end_rss:.0f} MB at the end; "
        f"cache holds {cache.held_tokens} tokens = {cache.held_bytes / 2**20:.0f} MB "
        f"(budget {cache.budget_tokens} tokens = {cache.budget_tokens * cache.bytes_per_token / 2**20:.0f} MB)"
    )
    await registry.close()


if __name__ == "__main__":
    asyncio.run(main())
