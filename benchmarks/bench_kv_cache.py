"""--kv-cache-dtype: memory, speed and logprob drift of fp16 and int8 key/value caches.

    uv run python benchmarks/bench_kv_cache.py --model DIR [--prompts 6] [--new-tokens 48]

The model should have real weights (SmolLM2-135M-Instruct int4 from
../shared/tools/mk_smollm2.py, ``ort-int4-kqmixed``): random ones hide drift behind wide
logit gaps. All on the ort-cpu engine, in one process, one setting after another.

- bytes a cached token takes, and the tokens the default 16,384-token prefix cache then
  holds in MiB;
- load time (int8's first load measures its scales; the second reads them);
- single-stream decode (tokens/s over ``--new-tokens``), and a 2,000-token prompt's prefill;
- drift against ``auto``, teacher-forced: for each of ``--prompts`` chats, ``auto``'s greedy
  reply is fed token by token and each setting gives the logprob of the token ``auto``
  chose (``logprobs=20``; a token outside the top 20 counts as missing), so every step
  compares the same context. Reported: mean and largest |difference|, and how often the
  setting's own top token is ``auto``'s; then whole greedy replies: how many are
  identical.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench_generation import cpu_features
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelRegistry

CORPUS = (Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "corpus.txt").read_text()
QUESTIONS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is, in three sentences.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Give me a Python function that reverses a string.",
    "List three tips for a good night's sleep.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How do vaccines train the immune system?",
    "Translate 'good morning, how are you?' into French and Spanish.",
]


async def load(folder: Path, dtype: str) -> tuple[ModelRegistry, ChatModel, float]:
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", kv_cache_dtype=dtype))  # type: ignore[arg-type]
    registry.add("m", folder)
    start = time.perf_counter()
    model = await registry.get("m")
    return registry, model, time.perf_counter() - start


async def greedy(model: ChatModel, prompt: list[int], new_tokens: int) -> list[int]:
    _, tokens, _, _ = await model.generate(
        prompt, options=GenerationOptions(max_tokens=new_tokens, temperature=0)
    ).collect()
    return tokens


async def forced_logprobs(model: ChatModel, prompt: list[int], reply: list[int]) -> list[tuple[float | None, int]]:
    """Per reply token: its logprob given the prompt and the reply before it (``None``
    outside the top 20), and the setting's own top token there."""
    steps = []
    for i, token in enumerate(reply):
        options = GenerationOptions(max_tokens=1, temperature=0, logprobs=20)
        async for event in model.generate(prompt + reply[:i], options=options):
            if event.logprobs is not None:
                top = {t.token_id: t.logprob for t in event.logprobs.top}
                steps.append((top.get(token), event.logprobs.top[0].token_id))
                break
    return steps


async def speed(model: ChatModel, new_tokens: int) -> tuple[float, float]:
    """Decode tokens/s of one stream, and a 2,000-token prompt's prefill seconds."""
    prompt = model.encode("Tell me a long story about a lighthouse keeper.")
    options = GenerationOptions(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0)
    start = time.perf_counter()
    first = None
    async for event in model.generate(prompt, options=options):
        if first is None and event.token_id is not None:
            first = time.perf_counter()
    assert first is not None
    decode = (new_tokens - 1) / (time.perf_counter() - first)
    long_prompt = model.encode(CORPUS * 4)[:2000]
    start = time.perf_counter()
    await model.generate(long_prompt, options=GenerationOptions(max_tokens=1)).collect()
    return decode, time.perf_counter() - start


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=48)
    args = parser.parse_args()
    os.environ["ORTSERVE_CACHE"] = tempfile.mkdtemp(prefix="bench-kv-")  # int8's first load measures
    print(f"CPU: {cpu_features()}")
    print(f"model: {args.model}\n")

    registry, reference, _ = await load(args.model, "auto")
    chats = [reference.prepare_chat([{"role": "user", "content": q}]).ids for q in QUESTIONS[: args.prompts]]
    prompts = [list(chat) for chat in chats]
    replies = [await greedy(reference, prompt, args.new_tokens) for prompt in prompts]
    await registry.close()

    rows = []
    base: list[list[tuple[float | None, int]]] = []
    for dtype in ("auto", "fp16", "int8"):
        registry, model, first_load = await load(args.model, dtype)
        await registry.close()
        registry, model, second_load = await load(args.model, dtype)
        engine = model.engine
        token_bytes = engine.prefix_cache.bytes_per_token  # type: ignore[attr-defined]
        decode, prefill = await speed(model, 128)
        forced = [await forced_logprobs(model, p, r) for p, r in zip(prompts, replies, strict=True)]
        same = sum([await greedy(model, p, args.new_tokens) == r for p, r in zip(prompts, replies, strict=True)])
        await registry.close()
        if dtype == "auto":
            base = forced
        deltas, missing, agree, steps = [], 0, 0, 0
        for got, want in zip(forced, base, strict=True):
            for (logprob, top), (reference_logprob, reference_top) in zip(got, want, strict=True):
                steps += 1
                agree += top == reference_top
                if logprob is None or reference_logprob is None:
                    missing += 1
                else:
                    deltas.append(abs(logprob - reference_logprob))
        rows.append(
            (
                dtype,
                token_bytes / 1024,
                16384 * token_bytes / 2**20,
                first_load,
                second_load,
                decode,
                prefill,
                statistics.fmean(deltas),
                max(deltas),
                100 * agree / steps,
                missing,
                f"{same}/{len(prompts)}",
            )
        )

    print(
        "| kv cache | KiB/token | 16k tokens (MiB) | load, first (s) | load, again (s) | decode (tok/s) "
        "| 2k prefill (s) | mean abs dlogprob | max abs dlogprob | top-1 = auto's | missing | same greedy reply |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        dtype, kib, mib, first, again, decode, prefill, mean, worst, agree, missing, same = row
        print(
            f"| {dtype} | {kib:.1f} | {mib:.0f} | {first:.2f} | {again:.2f} | {decode:.0f} | {prefill:.2f} "
            f"| {mean:.4f} | {worst:.3f} | {agree:.1f}% | {missing} | {same} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
