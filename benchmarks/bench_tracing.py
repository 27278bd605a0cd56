"""What OpenTelemetry tracing costs a single stream: tokens/s with tracing off and on.

    uv run python benchmarks/bench_tracing.py [--model DIR] [--tokens 128] [--rounds 7]

Two ``ortserve serve`` processes on the same model, one without tracing and one with
``--otlp-endpoint`` pointing at an OTLP/HTTP receiver in this process (so the spans are
really batched, encoded and sent); each round streams one completion from each, the order
alternating, with as many tokens every time (``min_tokens`` = ``max_tokens``). Prints the
median tokens/s of each (from the request to the last token, and of the decode alone: first
token to last) and the difference. The target is under 2% of a single stream's tokens/s.
Both servers share the machine: give them a few threads each (``--threads``), fewer than the
cores, so that they do not slow each other down while one waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_generation import cpu_features

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from otlp_receiver import otlp_receiver
from serving import TINY_MODEL, serve

BENCH_MODEL = Path.home() / ".cache" / "ortserve" / "bench-qwen2.5-0.5b-shape"
PROMPT = "word " * 31


def one_stream(url: str, tokens: int) -> tuple[float, float]:
    """(tokens/s from the request to the last token, tokens/s first token to last)."""
    body = {
        "model": "m",
        "prompt": PROMPT,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    first = last = 0.0
    seen = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: {"):
                continue
            if json.loads(line[6:])["choices"][0]["text"]:
                seen += 1
            last = time.perf_counter()
            first = first or last
    return tokens / (last - start), max(seen - 1, 1) / max(last - first, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=BENCH_MODEL if BENCH_MODEL.is_dir() else TINY_MODEL)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of each server")
    args = parser.parse_args()
    common = ["--model", f"m={args.model}", "--threads", str(args.threads), "--state-dir", "none"]
    logs = Path(tempfile.mkdtemp(prefix="bench-tracing-")) / "servers.log"
    print(f"CPU: {cpu_features()}")
    print(
        f"model {args.model.name}, {args.tokens} tokens a stream, {args.rounds} rounds, {args.threads} threads a server"
    )
    with (
        otlp_receiver() as (endpoint, receiver),
        serve(logs, *common, "--no-tracing") as off,
        serve(logs, *common, "--otlp-endpoint", endpoint) as on,
    ):
        urls = {"off": off, "on": on}
        for url in urls.values():
            one_stream(url, args.tokens)  # warm-up
        rates: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
        for round_ in range(args.rounds):
            order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
            for name in order:
                rates[name].append(one_stream(urls[name], args.tokens))
        receiver.wait_for(lambda spans: sum(s.name == "decode" for s in spans) >= args.rounds + 1)
    print(f"{'tracing':8} {'tokens/s':>10} {'decode tokens/s':>16}")
    medians = {}
    for name, found in rates.items():
        medians[name] = (statistics.median(r for r, _ in found), statistics.median(d for _, d in found))
        print(f"{name:8} {medians[name][0]:10.1f} {medians[name][1]:16.1f}")
    overall = (medians["off"][0] - medians["on"][0]) / medians["off"][0] * 100
    decode = (medians["off"][1] - medians["on"][1]) / medians["off"][1] * 100
    print(f"tracing on costs {overall:+.2f}% of tokens/s ({decode:+.2f}% of decode tokens/s); target: under 2%")


if __name__ == "__main__":
    main()
