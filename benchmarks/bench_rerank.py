"""Rerank throughput: raw onnxruntime next to ortserve (runtime and HTTP), in one run.

    /tmp/fx/bin/python tests/fixtures/build_fixtures.py --bench-cross-encoder   # once
    uv run python benchmarks/bench_rerank.py [--requests 16]

Model: a random cross-encoder with the shapes of ms-marco-MiniLM-L-6-v2 (BERT, 6 layers of
384, all-MiniLM's 30,522-token vocabulary; built offline, fp32). Work: the same queries,
each with 32 varied documents of 4 to 40 words, in every column, reported as pairs/s:
- raw onnxruntime on padded batches of 32 pairs (tokenised up front: the best case);
- ortserve runtime, `score` of one query with 32 documents per call;
- HTTP `/v1/rerank` with 32 documents per call;
- HTTP, all the rerank requests at once (micro-batching merges them).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
from bench_embeddings import sentences, server_process
from ortserve_runtime import ModelConfig, RerankModel
from tokenizers import Tokenizer

FOLDER = Path.home() / ".cache" / "ortserve" / "bench-minilm-cross-encoder"
DOCUMENTS = 32


def work(requests: int) -> list[tuple[str, list[str]]]:
    texts = sentences(requests * (DOCUMENTS + 1))
    return [(texts[i * 33], texts[i * 33 + 1 : i * 33 + 33]) for i in range(requests)]


def raw_onnxruntime(folder: Path, requests: list[tuple[str, list[str]]]) -> float:
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_padding()
    session = ort.InferenceSession(str(folder / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    batches = []
    for query, documents in requests:
        encodings = tokenizer.encode_batch([(query, d) for d in documents])
        batches.append(
            {
                "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
                "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
                "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
            }
        )
    session.run(None, batches[0])
    begin = time.perf_counter()
    for feeds in batches:
        (logits,) = session.run(None, feeds)
        1 / (1 + np.exp(-logits[:, 0]))
    return len(requests) * DOCUMENTS / (time.perf_counter() - begin)


async def runtime(folder: Path, requests: list[tuple[str, list[str]]]) -> float:
    model = RerankModel("m", folder, ModelConfig())
    await model.score(*requests[0])
    begin = time.perf_counter()
    for query, documents in requests:
        await model.score(query, documents)
    rate = len(requests) * DOCUMENTS / (time.perf_counter() - begin)
    await model.close()
    return rate


async def http(url: str, requests: list[tuple[str, list[str]]], *, concurrent: bool) -> float:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=len(requests))) as client:

        async def rerank(query: str, documents: list[str]) -> None:
            body = {"model": "m", "query": query, "documents": documents}
            (await client.post(f"{url}/v1/rerank", json=body)).raise_for_status()

        await rerank(*requests[0])
        begin = time.perf_counter()
        if concurrent:
            await asyncio.gather(*(rerank(q, d) for q, d in requests))
        else:
            for query, documents in requests:
                await rerank(query, documents)
        return len(requests) * DOCUMENTS / (time.perf_counter() - begin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="rerank requests of 32 documents per column")
    args = parser.parse_args()
    if not (FOLDER / "onnx" / "model.onnx").exists():
        sys.exit(f"build the model first: python tests/fixtures/build_fixtures.py --bench-cross-encoder ({FOLDER})")
    requests = work(args.requests)
    raw = raw_onnxruntime(FOLDER, requests)
    rows = [("raw onnxruntime, padded batches of 32 pairs", raw)]
    rows.append(("ortserve runtime, 1 query x 32 documents per call", asyncio.run(runtime(FOLDER, requests))))
    with server_process(FOLDER) as url:
        rows.append(("HTTP /v1/rerank, 32 documents per call", asyncio.run(http(url, requests, concurrent=False))))
        rows.append(
            (f"HTTP /v1/rerank, {len(requests)} concurrent requests", asyncio.run(http(url, requests, concurrent=True)))
        )
    width = max(len(name) for name, _ in rows)
    print(f"{'engine':<{width}} {'pairs/s':>9} {'x raw':>7}")
    for name, rate in rows:
        print(f"{name:<{width}} {rate:>9.1f} {rate / raw:>7.2f}")


if __name__ == "__main__":
    main()
