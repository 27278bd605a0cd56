"""Speech to text: ortserve's Whisper runtime next to onnxruntime-genai's own loop, in one run.

    uv run python benchmarks/bench_speech.py [--model DIR] [--requests 8] [--new-tokens 64]

Both transcribe the same clips (10-second tones of different pitches, language given,
greedy, exactly N tokens each) with the tiny Whisper of tests/fixtures:
- raw: og's processor, then ``og.Generator`` with ``generate_next_token``, one after another;
- ortserve: ``SpeechModel.transcribe``, one after another, then all started together;
- ortserve with ``timestamps=True`` (what verbose_json, srt and vtt use).
The table gives tokens/s over the whole run and the latency per clip.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import onnxruntime_genai as og
from ortserve_runtime import ModelRegistry, SpeechModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from audio import TINY_WHISPER, tone_wav

PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def raw_og(folder: Path, clips: list[bytes], new_tokens: int) -> tuple[list[float], float]:
    """og's processor and generator, one clip after another: latencies and wall time."""
    model = og.Model(str(folder))
    processor = model.create_multimodal_processor()

    def one(clip: bytes) -> float:
        start = time.perf_counter()
        inputs = processor(PROMPT, audios=og.Audios.open_bytes(clip))
        params = og.GeneratorParams(model)
        # min_length keeps <|endoftext|> away, so both engines make exactly N tokens
        params.set_search_options(max_length=4 + new_tokens, min_length=4 + new_tokens)
        generator = og.Generator(model, params)
        generator.set_inputs(inputs)
        for _ in range(new_tokens):
            generator.generate_next_token()
        return time.perf_counter() - start

    one(clips[0])  # warm-up
    start = time.perf_counter()
    latencies = [one(clip) for clip in clips]
    return latencies, time.perf_counter() - start


async def ortserve(
    model: SpeechModel, clips: list[bytes], new_tokens: int, *, together: bool, timestamps: bool
) -> tuple[list[float], float, int]:
    async def one(clip: bytes) -> tuple[float, int]:
        start = time.perf_counter()
        result = await model.transcribe(clip, language="en", max_tokens=new_tokens, timestamps=timestamps)
        return time.perf_counter() - start, result.tokens

    start = time.perf_counter()
    if together:
        results = list(await asyncio.gather(*(one(clip) for clip in clips)))
    else:
        results = [await one(clip) for clip in clips]
    return [r[0] for r in results], time.perf_counter() - start, sum(r[1] for r in results)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=TINY_WHISPER)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    clips = [tone_wav(10.0, hertz=200.0 + 60 * i) for i in range(args.requests)]
    expected = args.requests * args.new_tokens

    raw_latencies, raw_wall = await asyncio.to_thread(raw_og, args.model, clips, args.new_tokens)
    rows = [("raw og, one after another", raw_latencies, raw_wall, expected)]
    registry = ModelRegistry()
    try:
        registry.add("whisper", args.model)
        model: SpeechModel = await registry.get("whisper")
        await model.transcribe(clips[0], language="en", max_tokens=args.new_tokens)  # warm-up
        for label, together, timestamps in (
            ("ortserve, one after another", False, False),
            ("ortserve, all together", True, False),
            ("ortserve, timestamps, one after another", False, True),
        ):
            latencies, wall, tokens = await ortserve(
                model, clips, args.new_tokens, together=together, timestamps=timestamps
            )
            rows.append((label, latencies, wall, tokens))
    finally:
        await registry.close()

    raw_rate = expected / raw_wall
    print(f"{args.requests} clips of 10 s, {args.new_tokens} new tokens each, greedy\n")
    print("| engine | tokens/s | x raw | latency p50 | latency max | wall |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, latencies, wall, tokens in rows:
        rate = tokens / wall
        print(
            f"| {label} | {rate:.1f} | {rate / raw_rate:.2f} | {statistics.median(latencies):.3f} s "
            f"| {max(latencies):.3f} s | {wall:.2f} s |"
        )


if __name__ == "__main__":
    asyncio.run(main())
