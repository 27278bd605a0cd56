"""Speculative decoding: one stream's decode speed with and without each proposer, in one run.

    uv run python benchmarks/bench_speculative.py [--smollm2 DIR] [--bench-model DIR] [--rounds 3]

Models: SmolLM2-135M-Instruct (real weights: ``../shared/tools/mk_smollm2.py``'s
``ort-int4-kqmixed`` or ``ort-fp32``) and the random int4 model with Qwen2.5-0.5B's shapes
(~/.cache/ortserve/bench-qwen2.5-0.5b-shape, see bench_generation.py). Each is loaded twice
on ort-cpu, without speculation and with ``speculative="ngram"``; prompts go through the
chat template, greedy.

- code edit + prediction: rename a 300-token function; ``prediction`` is the function
  with the new name (OpenAI's Predicted Outputs). On the random model, whose output is no
  edit, the prediction is its own plain output with a sentence changed in the middle.
- quoting summary + ngram: summarise an article quoting it (the prompt lookup finds it).
- story + ngram: a free-form story, the worst case: little to look up.
- 8 concurrent stories, ngram against plain: speculation stands aside in a batch.

Speed is decode tokens per second of the stream (first token to last, so prefill, the same
either way, does not dilute it); each row is the median of --rounds runs, plain and
speculative alternating. "same" says whether the tokens equal the plain run's (see docs/guides/speculative.md:
a draft's positions round as a prompt's do; on int4 graphs whose MatMulNBits quantise
activations to int8 that flips near-ties). The raw library's rows run og.Generator on the
same prompts, without and with onnxruntime-genai's own n-gram speculation.

Targets (issue 24): code edit with prediction >= 2.5x, quoting summary with ngram >= 1.6x,
story >= 0.95x, 8 concurrent >= 0.97x (SmolLM2, this CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from pathlib import Path
from typing import Any

import onnxruntime_genai as og
from bench_generation import cpu_features
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelRegistry

BENCH_MODEL = Path.home() / ".cache" / "ortserve" / "bench-qwen2.5-0.5b-shape"
FUNCTION = '''def load_settings(path, defaults=None):
    """Read a settings file of key = value lines into a dictionary."""
    settings = dict(defaults or {})
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if "=" not in line:
                raise ValueError(f"line {number}: expected key = value, got {line!r}")
            key, value = line.split("=", 1)
            key = key.strip().lower()
            value = value.strip()
            if value.lower() in ("true", "yes", "on"):
                settings[key] = True
            elif value.lower() in ("false", "no", "off"):
                settings[key] = False
            elif value.isdigit():
                settings[key] = int(value)
            else:
                settings[key] = value
    return settings
'''
EDIT = (
    "Rename `load_settings` to `read_settings` in this code. Reply with the full updated code and nothing "
    f"else.\n\n```python\n{FUNCTION}```"
)
EDITED = "```python\n" + FUNCTION.replace("def load_settings", "def read_settings") + "```"
ARTICLE = (
    "The city council voted on Tuesday to build a new library in the old railway station. The project will "
    "cost twelve million dollars and is expected to open in two years. Mayor Lena Ortiz said the library would "
    "have a children's wing, a makerspace and a rooftop garden. Some residents worried about parking, but the "
    "council promised a new bus line to the station. Construction will begin in the spring, after the "
    "station's roof is repaired."
)
QUOTE = f"Here is an article:\n\n{ARTICLE}\n\nWrite a summary of it that quotes the article's key sentences exactly."
STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."


async def stream(model: ChatModel, prompt: list[int], options: GenerationOptions) -> tuple[list[int], float, Any]:
    """The tokens, the decode rate (tokens after the first, per second after it) and usage."""
    tokens: list[int] = []
    first = last = 0.0
    usage = None
    async for event in model.generate(prompt, options=options):
        now = time.perf_counter()
        if event.token_id is not None:
            tokens.append(event.token_id)
            if len(tokens) == 1:
                first = now
            last = now
        usage = event.usage or usage
    rate = (len(tokens) - 1) / (last - first) if len(tokens) > 1 and last > first else 0.0
    return tokens, rate, usage


@functools.cache
def _og_model(folder: Path) -> og.Model:
    return og.Model(str(folder))


def og_rate(folder: Path, prompt: list[int], max_tokens: int, ngram: bool) -> tuple[float, list[int]]:
    """og.Generator greedy on the same prompt: decode tokens per second (after the first)."""
    model = _og_model(folder)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + max_tokens, do_sample=False)
    if ngram:
        params.set_speculative_options(ngram_size=3, max_draft_tokens=8, min_adaptive_k=1)
    generator = og.Generator(model, params)
    generator.append_tokens(prompt)
    generator.generate_next_token()
    start = time.perf_counter()
    while not generator.is_done():
        generator.generate_next_token()
    seconds = time.perf_counter() - start
    tokens = [int(t) for t in generator.get_sequence(0)[len(prompt) :]]
    return (len(tokens) - 1) / seconds if seconds > 0 else 0.0, tokens


async def bench_model(folder: Path, label: str, rounds: int, max_tokens: int, real_weights: bool) -> list[str]:
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", prefix_cache_tokens=0))
    registry.add("plain", folder)
    registry.add("ngram", folder, ModelConfig(engine="ort-cpu", prefix_cache_tokens=0, speculative="ngram"))
    plain, ngram = await registry.get("plain"), await registry.get("ngram")
    greedy = GenerationOptions(max_tokens=max_tokens, temperature=0)
    chat = {
        name: list(plain.prepare_chat([{"role": "user", "content": text}]).ids)
        for name, text in (("edit", EDIT), ("quote", QUOTE), ("story", STORY))
    }
    await stream(plain, chat["story"], GenerationOptions(max_tokens=16, temperature=0))  # warm up
    await stream(ngram, chat["story"], GenerationOptions(max_tokens=16, temperature=0))
    reference = {name: (await stream(plain, prompt, greedy))[0] for name, prompt in chat.items()}
    prediction = EDITED
    if not real_weights:  # a random model edits nothing: its own output, a sentence changed
        text = plain.decode(reference["edit"])
        prediction = text[: len(text) // 2] + " and here the caller changed a sentence. " + text[len(text) // 2 + 40 :]
    cases = [
        (
            "code edit + prediction",
            plain,
            chat["edit"],
            GenerationOptions(max_tokens=max_tokens, temperature=0, prediction=prediction),
        ),
        ("quoting summary + ngram", ngram, chat["quote"], greedy),
        ("story + ngram", ngram, chat["story"], greedy),
    ]
    lines = []
    for name, model, prompt, options in cases:
        base_rates, spec_rates, usage, tokens = [], [], None, []
        for _ in range(rounds):
            base_rates.append((await stream(plain, prompt, greedy))[1])
            tokens, rate, usage = await stream(model, prompt, options)
            spec_rates.append(rate)
        key = {"code": "edit", "quoting": "quote", "story": "story"}[name.split()[0]]
        want = reference[key]
        diverged = next((i for i, (a, b) in enumerate(zip(want, tokens, strict=False)) if a != b), None)
        same = (
            "yes"
            if tokens == want
            else f"no (token {diverged if diverged is not None else min(len(want), len(tokens))})"
        )
        base, spec = statistics.median(base_rates), statistics.median(spec_rates)
        accepted, rejected = usage.accepted_prediction_tokens, usage.rejected_prediction_tokens
        og_plain, og_tokens = og_rate(folder, prompt, max_tokens, ngram=False)
        og_ngram, og_spec_tokens = og_rate(folder, prompt, max_tokens, ngram=True)
        lines.append(
            f"| {label} | {name} | {len(tokens)} | {base:.1f} | {spec:.1f} | **{spec / base:.2f}x** | {accepted}/{accepted + rejected} "
            f"| {same} | {og_plain:.1f} | {og_ngram:.1f} ({og_ngram / og_plain:.2f}x, same: {'yes' if og_spec_tokens == og_tokens else 'no'}) |"
        )
        print(lines[-1], flush=True)
    # 8 concurrent stories: ngram against plain, aggregate decode tokens per second.
    prompts = [
        list(plain.prepare_chat([{"role": "user", "content": f"{STORY} Story number {i}."}]).ids) for i in range(8)
    ]
    aggregate = {}
    for _ in range(rounds):
        for name, model in (("plain", plain), ("ngram", ngram)):
            start = time.perf_counter()
            results = await asyncio.gather(*(stream(model, p, greedy) for p in prompts))
            aggregate.setdefault(name, []).append(sum(len(r[0]) for r in results) / (time.perf_counter() - start))
    base, spec = statistics.median(aggregate["plain"]), statistics.median(aggregate["ngram"])
    lines.append(
        f"| {label} | 8 concurrent stories + ngram | 8x{max_tokens} | {base:.1f} | {spec:.1f} | **{spec / base:.2f}x** | - | - | - | - |"
    )
    print(lines[-1], flush=True)
    await registry.close()
    return lines


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M genai folder (mk_smollm2.py)")
    parser.add_argument("--bench-model", type=Path, default=BENCH_MODEL)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    print(f"CPU: {cpu_features()}")
    print(f"onnxruntime-genai {og.__version__}")
    print(
        "| model | work | tokens | plain tok/s | speculative tok/s | speed-up | drafts accepted | same tokens | og.Generator tok/s | og.Generator + og n-gram tok/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|")
    if args.smollm2 is not None:
        await bench_model(args.smollm2, f"SmolLM2-135M ({args.smollm2.name})", args.rounds, args.max_tokens, True)
    if args.bench_model.exists():
        await bench_model(args.bench_model, "0.5B-shaped (random int4)", args.rounds, args.max_tokens, False)


if __name__ == "__main__":
    asyncio.run(main())
