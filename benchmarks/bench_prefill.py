"""Prefill speed, greedy agreement and memory: onnxruntime-genai next to ortserve's CPU engine.

    uv run python benchmarks/bench_prefill.py [--model DIR] [--lengths 256 1024 2048 4000]
        [--real DIR] [--memory] [--rounds 2]

Models: --model, the random int4 model with Qwen2.5-0.5B's shapes
(~/.cache/ortserve/bench-qwen2.5-0.5b-shape, `tests/fixtures/build_fixtures.py --bench`);
--real, a real model folder (SmolLM2-135M-Instruct built by ../shared/tools/mk_smollm2.py,
its ort-int4-kqmixed folder), which adds a greedy-agreement table on real chat prompts.

Prefill rows, for each prompt length (prompts of random token ids; prefix cache off so every
prompt is computed; time to first token = prefill + one sampled token; best of --rounds):
- `og.Generator`, both cores (decoder intra_op_num_threads 2, onnxruntime-genai's best here);
- ortserve ort-cpu as it was before this benchmark's issue (`prefill_int8=False`, 512-token
  chunks), and each candidate: int8 prefill (`prefill_int8=True`, 512-token chunks) and
  int8 with 2,048-token chunks.
The CPU's int8/bf16 features and the load average are printed, since both decide the figures.

Greedy agreement (--real): 32 greedy tokens for a few real chat prompts, int4 prefill against
int8 prefill (same decode graph): how many replies are equal, and the mean length of the
common start; next to the same model computed in exact arithmetic (MatMulNBits accuracy
level 0), which shows how much any change of rounding moves this model's greedy replies.

Memory (--memory; each side in its own process, RSS from /proc/self/statm): the idle model;
after a burst of 8 and one of 16 concurrent streams (200-token prompts, 64 new tokens);
after a 4,096-token prompt. ortserve's default engine config, next to og.Generator's with
8 generators alive at once (the same 8 requests, stepped in turn).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime_genai as og
from bench_generation import cpu_features, og_model
from bench_prefix import rss_mb
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelRegistry

BENCH_MODEL = Path.home() / ".cache" / "ortserve" / "bench-qwen2.5-0.5b-shape"
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences.",
    "List three uses of a paperclip.",
    "What is 17 times 23? Show your steps.",
    "Translate 'good morning, how are you?' into Spanish.",
    "Give me a short tip for writing clean Python code.",
    "Why is the sky blue?",
]


def og_ttft(model: og.Model, prompt: list[int]) -> float:
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 1, do_sample=False)
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(np.array(prompt, dtype=np.int32))
    generator.generate_next_token()
    return time.perf_counter() - start


async def ortserve_ttft(model: ChatModel, prompt: list[int]) -> float:
    options = GenerationOptions(max_tokens=1, temperature=0)
    start = time.perf_counter()
    async for _ in model.generate(prompt, options=options):
        break
    return time.perf_counter() - start


async def load(folder: Path, config: ModelConfig) -> tuple[ModelRegistry, ChatModel]:
    registry = ModelRegistry(config)
    registry.add("m", folder)
    model: ChatModel = await registry.get("m")
    if config.prefill_int8 and model.engine.prefill_session is None:  # type: ignore[attr-defined]
        raise RuntimeError(f"no int8 prefill session for {folder} (see the log)")
    return registry, model


def random_prompt(length: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 20000, length)]


async def prefill_table(folder: Path, lengths: list[int], rounds: int) -> None:
    print(f"\n### Prefill: {folder.name} (time to first token, best of {rounds}; tokens/s = prompt / TTFT)\n")
    configs = {
        "ortserve, int4 prefill (before)": ModelConfig(prefill_int8=False, prefix_cache_tokens=0),
        "ortserve, int8 prefill": ModelConfig(prefill_int8=True, prefix_cache_tokens=0),
        "ortserve, int8 prefill, 2048-token chunks": ModelConfig(
            prefill_int8=True, prefix_cache_tokens=0, prefill_chunk_tokens=2048
        ),
    }
    best: dict[tuple[str, int], float] = {}
    raw = og_model(folder, 2)
    loaded = {name: await load(folder, config) for name, config in configs.items()}
    for length in lengths:
        prompt = random_prompt(length, length)
        og_ttft(raw, prompt[:16])  # warm-up
        for _ in range(rounds):  # interleaved, so that load changes hit every row alike
            key = ("og.Generator, 2 threads", length)
            best[key] = min(best.get(key, 1e9), og_ttft(raw, prompt))
            for name, (_, model) in loaded.items():
                seconds = await ortserve_ttft(model, prompt)
                best[(name, length)] = min(best.get((name, length), 1e9), seconds)
    for registry, _ in loaded.values():
        await registry.close()
    del raw
    names = ["og.Generator, 2 threads", *configs]
    print("| configuration | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    before = "ortserve, int4 prefill (before)"
    for name in names:
        cells = []
        for length in lengths:
            seconds = best[(name, length)]
            ratio = best[(before, length)] / seconds
            cells.append(f"{length / seconds:.0f} tok/s, {seconds:.2f} s ({ratio:.2f}x)")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n(x: against ortserve's int4 prefill at the same length)")


def exact_copy(folder: Path, into: Path) -> Path:
    """``folder`` with every MatMulNBits at accuracy level 0 (float arithmetic on the same
    int4 weights, no int8 activations): rounded differently from the folder, not worse."""
    shutil.copytree(folder, into, symlinks=False)
    model = onnx.load(str(into / "model.onnx"), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attribute in node.attribute:
                if attribute.name == "accuracy_level":
                    attribute.i = 0
    onnx.save(model, str(into / "model.onnx"))
    return into


async def agreement_table(folder: Path, new_tokens: int = 32) -> None:
    print(f"\n### Greedy agreement on real prompts: {folder.name}, {new_tokens} tokens each\n")
    replies: dict[str, list[list[int]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        runs = {
            "int4 prefill (today)": (folder, False),
            "int8 prefill": (folder, True),
            "exact arithmetic (reference)": (exact_copy(folder, Path(scratch) / "exact"), False),
        }
        for name, (path, int8) in runs.items():
            registry, model = await load(path, ModelConfig(prefill_int8=int8, prefix_cache_tokens=0))
            options = GenerationOptions(max_tokens=new_tokens, temperature=0)
            replies[name] = []
            for question in CHAT_PROMPTS:
                # A long system prompt, so the prompt goes through the int8 session (>= 64 tokens).
                system = "You are a helpful, careful assistant. " * 8
                text = model.apply_chat_template(
                    [{"role": "system", "content": system}, {"role": "user", "content": question}]
                )
                prompt = model.encode(text, add_special_tokens=False)
                _, tokens, _, _ = await model.generate(prompt, options=options).collect()
                replies[name].append(tokens)
            for question, reply in zip(CHAT_PROMPTS[:4], replies[name], strict=False):
                print(f"- {name}, {question!r}: {model.decode(reply)!r}")
            await registry.close()
    today = replies["int4 prefill (today)"]
    print("\n| against today's int4 prefill | replies equal | tokens before the first difference (mean) |")
    print("|---|---:|---:|")
    for name in list(runs)[1:]:
        equal = sum(a == b for a, b in zip(today, replies[name], strict=True))
        common = [
            next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            for a, b in zip(today, replies[name], strict=True)
        ]
        print(f"| {name} | {equal}/{len(CHAT_PROMPTS)} | {np.mean(common):.1f} of {new_tokens} |")
    print(
        "\n(exact arithmetic: every MatMulNBits at accuracy level 0, the same int4 weights multiplied in float; "
        "it shows how far any change of rounding moves greedy replies on this model)"
    )


def memory_child(side: str, folder: Path) -> None:
    """One side of the memory table, in its own process; prints a JSON line."""
    marks: dict[str, float] = {}
    if side == "og":
        model = og_model(folder, 2)
        marks["idle"] = rss_mb()
        for burst in (8, 16):
            generators = []
            for i in range(burst):
                params = og.GeneratorParams(model)
                params.set_search_options(max_length=264, min_length=264, do_sample=False)
                generator = og.Generator(model, params)
                generator.append_tokens(np.array(random_prompt(200, burst * 100 + i), dtype=np.int32))
                generators.append(generator)
            while not all(g.is_done() for g in generators):
                for g in generators:
                    if not g.is_done():
                        g.generate_next_token()
            marks[f"after {burst} streams"] = rss_mb()
            del generators
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=4096, min_length=4096, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array(random_prompt(4080, 1), dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()
        del generator
        marks["after a 4,096-token prompt"] = rss_mb()
    else:

        async def run() -> None:
            registry, model = await load(folder, ModelConfig(prefill_int8=side == "ortserve-int8"))
            marks["idle"] = rss_mb()

            async def one(seed: int, length: int, new: int) -> None:
                options = GenerationOptions(max_tokens=new, min_tokens=new, temperature=0)
                await model.generate(random_prompt(length, seed), options=options).collect()

            for burst in (8, 16):
                await asyncio.gather(*(one(burst * 100 + i, 200, 64) for i in range(burst)))
                marks[f"after {burst} streams"] = rss_mb()
            await one(1, 4080, 16)
            marks["after a 4,096-token prompt"] = rss_mb()
            marks["of which prefix cache"] = model.engine.prefix_cache.held_bytes / 2**20  # type: ignore[attr-defined]
            await registry.close()

        asyncio.run(run())
    print(json.dumps(marks))


def memory_table(folder: Path) -> None:
    print(f"\n### Memory: {folder.name} (RSS, MB; each column its own process)\n")
    sides = {
        "og.Generator (8 / 16 generators)": "og",
        "ortserve, int4 prefill": "ortserve",
        "ortserve, int8 prefill": "ortserve-int8",
    }
    results = {}
    for label, side in sides.items():
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", side, "--model", str(folder)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results[label] = json.loads(out.strip().splitlines()[-1])
    rows = ["idle", "after 8 streams", "after 16 streams", "after a 4,096-token prompt", "of which prefix cache"]
    print("| | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for row in rows:
        print(f"| {row} | " + " | ".join(f"{r[row]:.0f}" if row in r else "-" for r in results.values()) + " |")
    og_after = results["og.Generator (8 / 16 generators)"]["after 8 streams"]
    for label in list(results)[1:]:
        print(f"\n{label}: after 8 streams {results[label]['after 8 streams'] / og_after:.2f}x og's")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BENCH_MODEL)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4000])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--real", type=Path, default=None, help="a real model folder: adds greedy agreement")
    parser.add_argument("--memory", action="store_true", help="add the memory table")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill table")
    parser.add_argument("--memory-child", choices=["og", "ortserve", "ortserve-int8"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.model)
        return 0
    print(cpu_features())
    if not args.no_prefill:
        for folder in [args.model, *([args.real] if args.real else [])]:
            asyncio.run(prefill_table(folder, args.lengths, args.rounds))
    if args.real:
        asyncio.run(agreement_table(args.real))
    if args.memory:
        memory_table(args.model)
    print(f"\nload average at the end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
