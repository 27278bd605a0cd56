"""Footprint: start-up time and memory of `ortserve serve` beside the floor, in one run.

    uv run python benchmarks/bench_footprint.py --model DIR [--rounds 3] [-- extra serve args]

DIR: SmolLM2-135M int4 (``../shared/tools/mk_smollm2.py``'s ``ort-int4-kqmixed``), default
settings. Rows:

- floor: a fresh interpreter that imports onnxruntime, opens the decoder and loads the
  tokenizer, what any Python server must pay (wall time and RSS at the end);
- ``ortserve --help``;
- ``ortserve serve`` from exec to the first ``GET /health`` 200;
- RSS of the server after the workload of issue 31 (3 single chats of 128 tokens, 8 at
  once, a 2,000-token prompt and its next turn, 8 at once again), its peak (VmHWM), and
  the key/value bytes ``/metrics`` says it holds;
- llama.cpp's ``llama-server`` on the same work where one is on PATH with ``--gguf FILE``.

Medians of --rounds runs. Targets (issue 31): ready within floor + 0.4 s, ``--help`` <= 0.3 s,
RSS after the workload <= 560 MiB.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from bench_generation import cpu_features

FLOOR = """
import sys, time, resource
start = time.perf_counter()
import onnxruntime as ort
from tokenizers import Tokenizer
folder = sys.argv[1]
options = ort.SessionOptions()
session = ort.InferenceSession(folder + "/model.onnx", options, providers=["CPUExecutionProvider"])
tokenizer = Tokenizer.from_file(folder + "/tokenizer.json")
seconds = time.perf_counter() - start
rss = int(open("/proc/self/statm").read().split()[1]) * 4096
print(seconds, rss)
"""
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "while", "sorting", "lists", "of", "numbers"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rss_of(pid: int) -> tuple[int, int]:
    """VmRSS and VmHWM of ``pid`` in bytes."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def wait_ready(url: str, process: subprocess.Popen[bytes], started: float) -> float:
    """Seconds from ``started`` to the first /health 200, asked every 5 ms with a bare
    http.client request: a new httpx client per try costs milliseconds of CPU, which on 2
    cores the starting server then lacks (measured: 1.8 s to ready instead of 1.0)."""
    host, port = url.removeprefix("http://").split(":")
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        connection = http.client.HTTPConnection(host, int(port), timeout=1)
        try:
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return time.perf_counter() - started
        except OSError:
            pass
        finally:
            connection.close()
        time.sleep(0.005)


def chat(url: str, model: str, messages: list[dict[str, str]], tokens: int) -> str:
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
    return str(reply["choices"][0]["message"]["content"])


def workload(url: str, model: str) -> None:
    """Issue 31's: 3 single chats of 128 tokens, 8 at once, a 2,000-token prompt and its next
    turn, 8 at once again."""
    questions = [[{"role": "user", "content": f"Question {i}: tell me about the number {i}."}] for i in range(8)]
    for messages in questions[:3]:
        chat(url, model, messages, 128)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda m: chat(url, model, m, 128), questions))
    long_text = " ".join(WORDS[i % len(WORDS)] for i in range(1800))
    first = [{"role": "user", "content": f"Summarise this: {long_text}"}]
    reply = chat(url, model, first, 128)
    chat(url, model, [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Shorter."}], 128)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda m: chat(url, model, m, 128), questions))


def kv_bytes(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [
        line for line in text.splitlines() if line.startswith(("ortserve_prefix_cache_bytes", "ortserve_kv_live_bytes"))
    ]
    return int(sum(float(line.split()[-1]) for line in lines))


def serve_once(command: list[str], port: int, work: bool) -> tuple[float, int, int, int]:
    """Seconds to ready; RSS, peak RSS and key/value bytes after the workload (0 without it)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        ready = wait_ready(url, process, started)
        if not work:
            return ready, 0, 0, 0
        workload(url, "smol")
        time.sleep(1.0)  # the engine's idle refills of the last replies
        rss, peak = rss_of(process.pid)
        return ready, rss, peak, kv_bytes(url)
    finally:
        process.terminate()
        process.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gguf", type=Path, help="the same model as GGUF, for llama-server where it is on PATH")
    parser.add_argument("serve_args", nargs="*", help="extra `ortserve serve` arguments (after --)")
    args = parser.parse_args()
    print(f"CPU: {cpu_features()}")
    ortserve = shutil.which("ortserve") or str(Path(sys.executable).parent / "ortserve")
    floors = [
        subprocess.run([sys.executable, "-c", FLOOR, str(args.model)], capture_output=True, text=True, check=True)
        for _ in range(args.rounds)
    ]
    floor_seconds = statistics.median(float(f.stdout.split()[0]) for f in floors)
    floor_rss = statistics.median(int(f.stdout.split()[1]) for f in floors)
    helps = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        subprocess.run([ortserve, "--help"], capture_output=True, check=True)
        helps.append(time.perf_counter() - start)
    readies, after = [], []
    for round_ in range(args.rounds):
        port = free_port()
        command = [ortserve, "serve", "--model", f"smol={args.model}", "--port", str(port), *args.serve_args]
        result = serve_once(command, port, work=round_ == 0)
        readies.append(result[0])
        if round_ == 0:
            after.append(result[1:])
    rss, peak, held = after[0]
    mib = 2**20
    print("| figure | floor | ortserve | llama-server |")
    print("|---|---:|---:|---:|")
    print(f"| start to first /health 200 | {floor_seconds:.2f} s | {statistics.median(readies):.2f} s | - |")
    print(f"| `ortserve --help` | - | {statistics.median(helps):.2f} s | - |")
    print(
        f"| RSS after the workload (peak) | {floor_rss / mib:.0f} MiB (idle) | {rss / mib:.0f} MiB ({peak / mib:.0f}) | - |"
    )
    print(f"| key/value bytes held (/metrics) | - | {held / mib:.0f} MiB | - |")
    if args.gguf is not None and shutil.which("llama-server") is None:
        print("llama-server is not on PATH here: its column stays empty")
    print(f"(serve args: {' '.join(args.serve_args) or 'defaults'}; pid {os.getpid()})")


if __name__ == "__main__":
    main()
