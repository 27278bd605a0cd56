"""Image chat: ortserve's multimodal runtime against onnxruntime-genai's own loop, in one run.

    uv run python benchmarks/bench_multimodal.py [--model DIR] [--requests 4] [--new-tokens 32]

Both run the same requests (one small image each, a few colours; greedy; N new tokens) on
the tiny Phi-3-vision of tests/fixtures, where one image becomes ~2,500 prompt tokens:
- raw: og's processor, then ``og.Generator`` with ``generate_next_token``, one request
  after another;
- ortserve, one after another: ``aprepare_chat`` (Pillow decode, PNG, the same processor)
  and ``generate`` (host-side sampling from ``get_logits``);
- ortserve, all requests started together (interleaved token by token).
The table gives tokens/s over the whole run, time to first token, and wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import onnxruntime_genai as og
from ortserve_runtime import GenerationOptions, ImageInput, ModelConfig, ModelRegistry, MultimodalModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from images import TINY_PHI3V, image_bytes

QUESTION = "Describe the picture."
COLOURS = [(220, 20, 20), (20, 220, 20), (20, 20, 220), (200, 200, 20), (20, 200, 200), (90, 60, 30)]


def raw_requests(folder: Path, images: list[bytes], new_tokens: int) -> tuple[list[float], float, int]:
    """og's processor and generator, one request after another: TTFTs, wall, prompt tokens."""
    model = og.Model(str(folder))
    processor = model.create_multimodal_processor()
    prompt = f"<|user|>\n<|image_1|>\n{QUESTION}<|end|>\n<|assistant|>\n"

    def one(png: bytes) -> tuple[float, int]:
        start = time.perf_counter()
        inputs = processor(prompt, images=og.Images.open_bytes(png))
        length = int(inputs["input_ids"].as_numpy().shape[-1])
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=length + new_tokens, do_sample=False)
        generator = og.Generator(model, params)
        generator.set_inputs(inputs)
        generator.generate_next_token()
        first = time.perf_counter() - start
        for _ in range(new_tokens - 1):
            generator.generate_next_token()
        return first, length

    one(images[0])  # warm-up
    start = time.perf_counter()
    results = [one(png) for png in images]
    return [r[0] for r in results], time.perf_counter() - start, results[0][1]


async def ortserve_requests(
    model: MultimodalModel, images: list[bytes], new_tokens: int, together: bool
) -> tuple[list[float], float]:
    options = GenerationOptions(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0)

    async def one(png: bytes) -> float:
        start = time.perf_counter()
        prompt = await model.aprepare_chat([{"role": "user", "content": [ImageInput(png), QUESTION]}])
        first = 0.0
        async for _event in model.generate(prompt, options=options):
            if not first:
                first = time.perf_counter() - start
        return first

    start = time.perf_counter()
    if together:
        firsts = list(await asyncio.gather(*(one(png) for png in images)))
    else:
        firsts = [await one(png) for png in images]
    return firsts, time.perf_counter() - start


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=TINY_PHI3V)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    images = [image_bytes(colour=COLOURS[i % len(COLOURS)]) for i in range(args.requests)]
    generated = args.requests * args.new_tokens

    raw_firsts, raw_wall, prompt_tokens = await asyncio.to_thread(raw_requests, args.model, images, args.new_tokens)
    registry = ModelRegistry(ModelConfig(multimodal_concurrency=args.requests))
    registry.add("vision", args.model)
    model: MultimodalModel = await registry.get("vision")
    await ortserve_requests(model, images[:1], args.new_tokens, together=False)  # warm-up
    rows = [("og.Generator, one after another", raw_firsts, raw_wall)]
    for label, together in (("ortserve, one after another", False), ("ortserve, all together", True)):
        firsts, wall = await ortserve_requests(model, images, args.new_tokens, together)
        rows.append((label, firsts, wall))
    await registry.close()

    raw_rate = generated / raw_wall
    print(f"{args.requests} requests, {prompt_tokens} prompt tokens each (one image), {args.new_tokens} new tokens\n")
    print("| engine | tokens/s | x raw | TTFT p50 | TTFT p95 | wall |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, firsts, wall in rows:
        p95 = statistics.quantiles(firsts, n=20)[-1] if len(firsts) > 1 else firsts[0]
        rate = generated / wall
        print(
            f"| {label} | {rate:.1f} | {rate / raw_rate:.2f} | {statistics.median(firsts):.3f} s "
            f"| {p95:.3f} s | {wall:.2f} s |"
        )


if __name__ == "__main__":
    asyncio.run(main())
