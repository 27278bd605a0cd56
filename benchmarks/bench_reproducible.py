"""Same request, same tokens: how far a request's logprobs move by path, in one run.

    uv run python benchmarks/bench_reproducible.py [--model DIR ...] [--new-tokens 24]

Models: --model, repeatable (default: the random int4 model with Qwen2.5-0.5B's shapes at
~/.cache/ortserve/bench-qwen2.5-0.5b-shape, see bench_generation.py); pass a real one too,
for example SmolLM2-135M-Instruct int4 built by ../shared/tools/mk_smollm2.py
(``ort-int4-kqmixed``): real weights have near-ties that turn a last-bit difference into
another answer.

The reference is a cold run (prefix cache off, one request at a time, default chunks) in
the same mode. Each row runs the same request another way on the ort-cpu engine with the
prefix cache on (default settings unless the row says otherwise), with ``reproducible`` on
(the exact mode) and off (the default: decode-written reply rows reused, no lone-row
dummy), side by side, and reports whether the tokens and every step's top-5 logprobs are
identical to the bit, and the largest logprob difference: the same greedy request again (a
full hit), a seeded sampled one again, a chat's next turn holding the first reply (sent at
once, and again: a full hit), a prompt sharing a cached beginning (a partial hit), the
request beside 7 others, and prefill chunks of 64 and 7.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from bench_generation import cpu_features
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelRegistry

BENCH_MODEL = Path.home() / ".cache" / "ortserve" / "bench-qwen2.5-0.5b-shape"
CORPUS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "corpus.txt"

Run = tuple[list[int], list[tuple[Any, ...]]]


async def run(model: ChatModel, prompt: list[int], options: GenerationOptions) -> Run:
    tokens, steps = [], []
    async for event in model.generate(prompt, options=options):
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.logprobs is not None:
            steps.append((event.logprobs.logprob, *(t.logprob for t in event.logprobs.top)))
    return tokens, steps


def compare(got: Run, want: Run) -> tuple[bool, float]:
    """Identical to the bit, and the largest logprob difference over the common steps."""
    delta = max(
        (abs(a - b) for g, w in zip(got[1], want[1], strict=False) for a, b in zip(g, w, strict=False)), default=0.0
    )
    return got == want, delta


async def scenarios(folder: Path, new_tokens: int, exact: bool) -> list[tuple[str, bool, float]]:
    greedy = GenerationOptions(max_tokens=new_tokens, temperature=0, logprobs=5)
    seeded = GenerationOptions(max_tokens=new_tokens, temperature=0.8, seed=99, logprobs=5)
    registry = ModelRegistry(ModelConfig(reproducible=exact))
    registry.add("cold", folder, ModelConfig(prefix_cache_tokens=0, reproducible=exact))
    registry.add("served", folder, ModelConfig(reproducible=exact))
    registry.add("chunk64", folder, ModelConfig(prefill_chunk_tokens=64, reproducible=exact))
    registry.add("chunk7", folder, ModelConfig(prefill_chunk_tokens=7, reproducible=exact))
    cold: ChatModel = await registry.get("cold")
    served: ChatModel = await registry.get("served")
    ids = cold.encode(CORPUS.read_text())
    prompt = ids[:476]
    rows = []

    async def row(name: str, got: Run, want: Run) -> None:
        rows.append((name, *compare(got, want)))

    want = await run(cold, prompt, greedy)
    await row("first run (cold)", await run(served, prompt, greedy), want)
    await row("the same greedy request again (full hit)", await run(served, prompt, greedy), want)
    want_seeded = await run(cold, prompt, seeded)
    await run(served, prompt, seeded)
    await row("the same seeded request again (full hit)", await run(served, prompt, seeded), want_seeded)
    turn = ids[600:900]
    reply, _ = await run(served, turn, greedy)
    second = turn + reply + cold.encode(" Tell me more about that, and why.")
    want_second = await run(cold, second, greedy)
    await row("a chat's next turn, sent at once", await run(served, second, greedy), want_second)
    await row("that next turn again (full hit, reply included)", await run(served, second, greedy), want_second)
    partial = prompt[:299] + ids[1000:1150]
    await row(
        "a prompt sharing 299 cached tokens (partial hit)", *[await run(m, partial, greedy) for m in (served, cold)]
    )
    others = [ids[40 * i : 40 * i + 60 + 11 * i] for i in range(1, 8)]
    together = await asyncio.gather(run(served, prompt, greedy), *(run(served, o, greedy) for o in others))
    await row("beside 7 other requests", together[0], want)
    for name in ("chunk64", "chunk7"):
        model: ChatModel = await registry.get(name)
        await row(f"prefill chunks of {name[5:]} tokens", await run(model, prompt, greedy), want)
        await row(f"prefill chunks of {name[5:]}, full hit", await run(model, prompt, greedy), want)
    await registry.close()
    return rows


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append")
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    print(cpu_features())
    for folder in args.model or [BENCH_MODEL]:
        if not (folder / "genai_config.json").exists():
            raise SystemExit(f"no model at {folder}: build it with tests/fixtures/build_fixtures.py --bench")
        exact = await scenarios(folder, args.new_tokens, exact=True)
        default = await scenarios(folder, args.new_tokens, exact=False)
        print(f"\n{folder.name} (load average {os.getloadavg()[0]:.2f}), {args.new_tokens} tokens, top-5 logprobs")
        print(
            f"{'against a cold run':<52} {'reproducible: identical, max |d|':>34} {'default: identical, max |d|':>30}"
        )
        for (name, same, delta), (_, same_default, delta_default) in zip(exact, default, strict=True):
            print(
                f"{name:<52} {'yes' if same else 'NO':>14} {delta:>19.3g} "
                f"{'yes' if same_default else 'NO':>14} {delta_default:>15.3g}"
            )


if __name__ == "__main__":
    asyncio.run(main())
