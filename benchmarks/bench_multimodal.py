"""Image chat: ortserve's multimodal runtime next to raw onnxruntime-genai, on the same requests in one run.

    uv run python benchmarks/bench_multimodal.py [--model DIR] [--requests 4] [--new-tokens 32]

Every request is one small PNG (48x32, a different colour each) and a short question, on the
tiny Phi-3-vision of tests/fixtures; the processor turns the image into ~2,000 prompt tokens,
so prefill dominates. Each request generates exactly --new-tokens tokens, greedy. Rows:
- raw og, one after another: og's processor, then ``og.Generator`` and ``generate_next_token``;
- ortserve, one after another: ``aprepare_chat`` (image decode and the same processor) and ``generate``;
- ortserve, all requests started together (``asyncio.gather``; interleaved token by token).
tokens/s = generated tokens / wall; x raw = over the raw row. TTFT runs from a request's
start (processor or ``aprepare_chat`` call included) to its first token. Each engine gets one
warm-up request first. The last line says whether ortserve's greedy tokens equal og's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import onnxruntime_genai as og
from ortserve_runtime import ChatModel, GenerationOptions, ImageInput, ModelConfig, ModelRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from images import TINY_PHI3V, image_bytes

QUESTION = "Describe the picture."
RAW_PROMPT = f"<|user|>\n<|image_1|>\n{QUESTION}<|end|>\n<|assistant|>\n"
COLOURS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (210, 210, 40), (40, 200, 200)]

Run = tuple[list[float], float, list[list[int]]]  # each request's TTFT, wall time, each request's tokens


def raw_og(folder: Path, images: list[bytes], new_tokens: int) -> tuple[Run, int]:
    """og's processor and generator, one request after another; also the prompt token count."""
    model = og.Model(str(folder))
    processor = model.create_multimodal_processor()

    def one(png: bytes) -> tuple[float, list[int], int]:
        start = time.perf_counter()
        inputs = processor(RAW_PROMPT, images=og.Images.open_bytes(png))
        length = int(inputs["input_ids"].as_numpy().shape[-1])
        params = og.GeneratorParams(model)
        # min_length keeps EOS away, as min_tokens does for ortserve, so both make exactly N tokens
        params.set_search_options(max_length=length + new_tokens, min_length=length + new_tokens)
        generator = og.Generator(model, params)
        generator.set_inputs(inputs)
        tokens: list[int] = []
        first = 0.0
        for _ in range(new_tokens):
            generator.generate_next_token()
            first = first or time.perf_counter() - start
            tokens.append(int(generator.get_next_tokens()[0]))
        return first, tokens, length

    one(images[0])  # warm-up
    start = time.perf_counter()
    results = [one(png) for png in images]
    wall = time.perf_counter() - start
    return ([r[0] for r in results], wall, [r[1] for r in results]), results[0][2]


async def ortserve(model: ChatModel, images: list[bytes], new_tokens: int, together: bool) -> Run:
    options = GenerationOptions(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0)

    async def one(png: bytes) -> tuple[float, list[int]]:
        start = time.perf_counter()
        prompt = await model.aprepare_chat([{"role": "user", "content": [ImageInput(png), QUESTION]}])
        tokens: list[int] = []
        first = 0.0
        async for event in model.generate(prompt, options=options):
            if event.token_id is not None:  # the final event may carry no token
                first = first or time.perf_counter() - start
                tokens.append(event.token_id)
        return first, tokens

    start = time.perf_counter()
    if together:
        results = list(await asyncio.gather(*(one(png) for png in images)))
    else:
        results = [await one(png) for png in images]
    return [r[0] for r in results], time.perf_counter() - start, [r[1] for r in results]


def percentile(values: list[float], q: int) -> float:
    # "inclusive" stays within the data; the default method extrapolates past the maximum for few samples
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=TINY_PHI3V)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    images = [image_bytes(48, 32, COLOURS[i % len(COLOURS)]) for i in range(args.requests)]

    # og blocks; a thread keeps the event loop free, the same as ortserve's own worker threads
    raw, prompt_tokens = await asyncio.to_thread(raw_og, args.model, images, args.new_tokens)
    registry = ModelRegistry(ModelConfig(multimodal_concurrency=args.requests))
    try:
        registry.add("vision", args.model)
        model: ChatModel = await registry.get("vision")
        await ortserve(model, images[:1], args.new_tokens, together=False)  # warm-up
        one_by_one = await ortserve(model, images, args.new_tokens, together=False)
        together = await ortserve(model, images, args.new_tokens, together=True)
    finally:
        await registry.close()
    rows = [("raw og, one after another", raw), ("ortserve, one after another", one_by_one)]
    rows.append(("ortserve, all together", together))

    expected = args.requests * args.new_tokens
    for label, (_, _, tokens) in rows:
        assert sum(map(len, tokens)) == expected, f"{label}: {sum(map(len, tokens))} tokens, expected {expected}"
    raw_rate = expected / raw[1]
    print(f"{prompt_tokens} prompt tokens per request (one 48x32 image), {args.new_tokens} new tokens, greedy\n")
    print("| engine | requests | tokens/s | x raw | TTFT p50 | TTFT p95 | wall |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, (firsts, wall, _) in rows:
        rate = expected / wall
        print(
            f"| {label} | {args.requests} | {rate:.1f} | {rate / raw_rate:.2f} | {statistics.median(firsts):.3f} s "
            f"| {percentile(firsts, 95):.3f} s | {wall:.2f} s |"
        )
    same = one_by_one[2] == raw[2] and together[2] == raw[2]
    print(f"\nortserve's tokens equal raw og's (greedy): {'yes' if same else 'NO'}")


if __name__ == "__main__":
    asyncio.run(main())
