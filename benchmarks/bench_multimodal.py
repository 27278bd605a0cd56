"""Image chat: ortserve's multimodal runtime next to raw onnxruntime-genai, on the same requests in one run.

    uv run python benchmarks/bench_multimodal.py [--family phi3v ...] [--model DIR] [--requests 4] [--new-tokens 32]

Every request is one small PNG (48x32, a different colour each) and a short question, on the
tiny model of each --family in tests/fixtures (all of them by default: phi3v, whose processor
turns the image into ~2,000 prompt tokens, so prefill dominates; qwen2.5-vl, qwen3-vl,
gemma3, gemma4, mistral3, lfm2-vl with tens to hundreds). The raw rows give og the prompt
text ortserve renders from the model's chat template. Each request generates exactly
--new-tokens tokens, greedy. Rows:
- raw og, one after another: og's processor, then ``og.Generator`` and ``generate_next_token``;
- ortserve, one after another: ``aprepare_chat`` (image decode and the same processor) and ``generate``;
- ortserve, all requests started together (``asyncio.gather``; interleaved token by token).
tokens/s = generated tokens / wall; images/s = requests / wall; x raw = over the raw row. TTFT runs from a request's
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
from bench_generation import cpu_features
from images import TINY_PHI3V, image_bytes

FIXTURES = TINY_PHI3V.parent
FAMILIES = {
    "phi3v": TINY_PHI3V,
    "qwen2.5-vl": FIXTURES / "tiny-qwen2.5-vl",
    "qwen3-vl": FIXTURES / "tiny-qwen3-vl",
    "gemma3": FIXTURES / "tiny-gemma3-mm",
    "gemma4": FIXTURES / "tiny-gemma4-mm",
    "mistral3": FIXTURES / "tiny-mistral3-mm",
    "lfm2-vl": FIXTURES / "tiny-lfm2-vl",
}
QUESTION = "Describe the picture."
COLOURS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (210, 210, 40), (40, 200, 200)]

Run = tuple[list[float], float, list[list[int]]]  # each request's TTFT, wall time, each request's tokens


def raw_og(folder: Path, prompt: str, images: list[bytes], new_tokens: int) -> tuple[Run, int]:
    """og's processor and generator, one request after another; also the prompt token count."""
    model = og.Model(str(folder))
    processor = model.create_multimodal_processor()

    def one(png: bytes) -> tuple[float, list[int], int]:
        start = time.perf_counter()
        inputs = processor(prompt, images=og.Images.open_bytes(png))
        length = int(inputs["input_ids"].as_numpy().shape[-1])
        params = og.GeneratorParams(model)
        # min_length keeps EOS away, as min_tokens does for ortserve, so both make exactly N tokens
        # (at least 128: og refuses a sliding-window cache shorter than gemma's 64-token window)
        end = max(length + new_tokens, 128)
        params.set_search_options(max_length=end, min_length=length + new_tokens)
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


async def bench(family: str, folder: Path, requests: int, new_tokens: int) -> None:
    images = [image_bytes(48, 32, COLOURS[i % len(COLOURS)]) for i in range(requests)]
    registry = ModelRegistry(ModelConfig(multimodal_concurrency=requests))
    try:
        registry.add("vision", folder)
        model: ChatModel = await registry.get("vision")
        prompt = model.apply_chat_template([{"role": "user", "content": [ImageInput(images[0]), QUESTION]}])
        # og blocks; a thread keeps the event loop free, the same as ortserve's own worker threads
        raw, prompt_tokens = await asyncio.to_thread(raw_og, folder, prompt, images, new_tokens)
        await ortserve(model, images[:1], new_tokens, together=False)  # warm-up
        one_by_one = await ortserve(model, images, new_tokens, together=False)
        together = await ortserve(model, images, new_tokens, together=True)
    finally:
        await registry.close()
    rows = [("raw og, one after another", raw), ("ortserve, one after another", one_by_one)]
    rows.append(("ortserve, all together", together))

    expected = requests * new_tokens
    for label, (_, _, tokens) in rows:
        assert sum(map(len, tokens)) == expected, f"{label}: {sum(map(len, tokens))} tokens, expected {expected}"
    raw_rate = expected / raw[1]
    same = one_by_one[2] == raw[2] and together[2] == raw[2]
    print(f"\n{family}: {prompt_tokens} prompt tokens per request (one 48x32 image), {new_tokens} new tokens, greedy;")
    print(f"ortserve's tokens equal raw og's: {'yes' if same else 'NO'}\n")
    print("| engine | requests | images/s | tokens/s | x raw | TTFT p50 | TTFT p95 | wall |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, (firsts, wall, _) in rows:
        rate = expected / wall
        print(
            f"| {label} | {requests} | {requests / wall:.2f} | {rate:.1f} | {rate / raw_rate:.2f} "
            f"| {statistics.median(firsts):.3f} s | {percentile(firsts, 95):.3f} s | {wall:.2f} s |"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=FAMILIES, nargs="+", default=list(FAMILIES))
    parser.add_argument("--model", type=Path, default=None, help="another folder (with one --family)")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    print(cpu_features())
    for family in args.family:
        folder = args.model if args.model is not None and len(args.family) == 1 else FAMILIES[family]
        await bench(family, folder, args.requests, args.new_tokens)


if __name__ == "__main__":
    asyncio.run(main())
