"""``kv_cache_dtype``: the ort-cpu engine's key/value cache kept as fp16 or int8.

What must hold: the bytes per token drop to a half / a quarter (and the budget in MiB
holds that many more tokens); a request's tokens and logprobs are still a function of the
request alone, to the bit, whatever the prefix cache holds and wherever prefill calls end
(compared with a cold run of the same setting, as test_reproducible does for ``auto``);
logprobs stay near ``auto``'s (on SmolLM2 with ``ORTSERVE_SMOLLM2``: real weights); int8
scales are measured once and kept; settings that cannot apply are refused by name.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelLoadError, ModelRegistry
from ortserve_runtime.engines._kv_storage import store_kv_as
from test_reproducible import CORPUS, fingerprint

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TINY = FIXTURES / "tiny-qwen2"
SMOLLM2 = os.environ.get("ORTSERVE_SMOLLM2")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def scales_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("ORTSERVE_CACHE", str(tmp_path / "cache"))
    yield tmp_path / "cache" / "kv-scales"


async def load(folder: Path, **config: Any) -> tuple[ModelRegistry, ChatModel]:
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", **config))
    registry.add("m", folder)
    return registry, await registry.get("m")


@pytest.mark.parametrize("dtype", ["fp16", "int8"])
@pytest.mark.parametrize(
    "folder",
    [
        pytest.param(TINY, id="qwen2"),
        pytest.param(FIXTURES / "tiny-gemma2-sliding", id="gemma2-sliding"),
        pytest.param(FIXTURES / "tiny-phi3-longrope", id="phi3-longrope"),
        pytest.param(
            Path(SMOLLM2 or "/nonexistent"),
            id="smollm2",
            marks=pytest.mark.skipif(SMOLLM2 is None, reason="ORTSERVE_SMOLLM2 not set"),
        ),
    ],
)
async def test_a_smaller_cache_still_gives_the_cold_runs_logprobs(folder: Path, dtype: str) -> None:
    """Chunked prefill, partial and full prefix-cache hits and neighbours in the batch give
    the logprobs of a cold run with the same ``kv_cache_dtype``, to the bit: rounding
    happens as a row is written, and attention reads a call's own rows as stored."""
    # Bit-identical is the exact mode's promise (reproducible; the default reuses decode-written rows).
    cold_registry, cold = await load(folder, kv_cache_dtype=dtype, prefix_cache_tokens=0, reproducible=True)
    registry, model = await load(
        folder,
        kv_cache_dtype=dtype,
        prefix_cache_min_tokens=8,
        prefill_chunk_tokens=7,
        max_batch_size=4,
        reproducible=True,
    )
    try:
        ids = cold.encode(CORPUS)
        for length in (65, 301):
            prompt = ids[:length]
            want = await fingerprint(cold, prompt)
            assert await fingerprint(model, prompt) == want, f"{length} tokens, chunks of 7"
            assert await fingerprint(model, prompt) == want, f"{length} tokens, a full hit"
        prompt = ids[:99] + ids[600:700]  # a partial hit of the 301 tokens above
        assert await fingerprint(model, prompt) == await fingerprint(cold, prompt)
        others = [ids[40 * i : 40 * i + 60 + 11 * i] for i in range(1, 4)]
        together = await asyncio.gather(*(fingerprint(model, p) for p in [ids[:301], *others]))
        for prompt, result in zip([ids[:301], *others], together, strict=True):
            assert result == await fingerprint(cold, prompt)
    finally:
        await registry.close()
        await cold_registry.close()


async def test_bytes_per_token_and_the_budget_follow_the_dtype() -> None:
    held = {}
    for dtype in ("auto", "fp16", "int8"):
        registry, model = await load(TINY, kv_cache_dtype=dtype, prefix_cache_mb=1, prefix_cache_min_tokens=8)
        try:
            engine: Any = model.engine
            held[dtype] = (engine.prefix_cache.bytes_per_token, engine.prefix_cache.budget_tokens)
            await model.generate(CORPUS[:400], options=GenerationOptions(max_tokens=2)).collect()
            # The engine caches a finished request's rows while idle, so after the request,
            # not at once (a loaded CI machine saw 0 here).
            for _ in range(200):
                if engine.prefix_cache.held_bytes:
                    break
                await asyncio.sleep(0.05)
            assert 0 < engine.prefix_cache.held_bytes <= 2**20
        finally:
            await registry.close()
    assert held["fp16"][0] * 2 == held["auto"][0] == held["int8"][0] * 4  # the tiny model's graph is fp32
    assert held["int8"][1] == 4 * held["auto"][1] == 2 * held["fp16"][1]


async def test_logprobs_stay_near_the_models_own() -> None:
    """Greedy on the tiny model: each step's chosen-token logprob, while the tokens agree,
    near ``auto``'s (random weights; SmolLM2's figures are in docs/performance.md)."""
    results = {}
    prompt = CORPUS[:600]
    for dtype in ("auto", "fp16", "int8"):
        registry, model = await load(TINY, kv_cache_dtype=dtype)
        try:
            results[dtype] = await fingerprint(model, model.encode(prompt))
        finally:
            await registry.close()
    tokens, steps = results["auto"]
    for dtype in ("fp16", "int8"):
        other_tokens, other_steps = results[dtype]
        agree = next((i for i, (a, b) in enumerate(zip(tokens, other_tokens, strict=True)) if a != b), len(tokens))
        assert agree >= 4, f"{dtype}: greedy tokens part after {agree}"
        drift = [abs(a[1] - b[1]) for a, b in zip(steps[:agree], other_steps[:agree], strict=True)]
        assert max(drift) < 0.3 and sum(drift) / len(drift) < 0.05, (dtype, drift)  # measured: 0.13, 0.025
        assert other_steps != steps  # the cache really is stored otherwise


async def test_int8_scales_are_measured_once_and_kept(scales_cache: Path) -> None:
    registry, model = await load(TINY, kv_cache_dtype="int8")
    first = await fingerprint(model, model.encode(CORPUS[:300]))
    await registry.close()
    kept = list(scales_cache.glob("*.npz"))
    assert len(kept) == 1
    stamp = kept[0].stat().st_mtime_ns
    registry, model = await load(TINY, kv_cache_dtype="int8")
    try:
        assert await fingerprint(model, model.encode(CORPUS[:300])) == first
        assert kept[0].stat().st_mtime_ns == stamp  # read, not measured again
    finally:
        await registry.close()


async def test_int8_scales_without_a_writable_cache(scales_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = scales_cache.parent / "file-not-dir"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("")
    monkeypatch.setenv("ORTSERVE_CACHE", str(blocker))  # a file: nothing can be written under it
    registry, model = await load(TINY, kv_cache_dtype="int8")
    try:
        _, tokens, _, _ = await model.generate(CORPUS[:200], options=GenerationOptions(max_tokens=4)).collect()
        assert len(tokens) == 4
    finally:
        await registry.close()


async def test_settings_that_cannot_apply_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype 'bf16'; choose one of auto, fp16, int8"):
        ModelConfig(kv_cache_dtype="bf16")  # type: ignore[arg-type]
    registry = ModelRegistry(ModelConfig(engine="og-generator", kv_cache_dtype="int8"))
    registry.add("og", TINY)
    with pytest.raises(ModelLoadError, match=r"kv_cache_dtype=int8 \(--kv-cache-dtype\).*og-generator"):
        await registry.get("og")
    await registry.close()
    # Set for a model that keeps no key/value cache: refused when added.
    embeddings = ModelRegistry()
    with pytest.raises(ValueError, match="rerank model: kv_cache_dtype applies to generative models only"):
        embeddings.add("rerank", FIXTURES / "tiny-cross-encoder", ModelConfig(kv_cache_dtype="int8"))
    await embeddings.close()
    # On auto, a model ort-cpu cannot drive would run on og, where the setting goes unread:
    # it is refused, with the reason.
    registry = ModelRegistry(ModelConfig(kv_cache_dtype="fp16"))
    registry.add("hybrid", FIXTURES / "tiny-lfm2")
    with pytest.raises(ModelLoadError, match="not a decoder the ort-cpu engine can drive"):
        await registry.get("hybrid")
    await registry.close()
    # A graph whose cache is int8 already (written by the engine's own edit) cannot be
    # stored otherwise; the model fails alone, the others load.
    quantized = tmp_path / "tiny-int8-cache"
    shutil.copytree(TINY, quantized)
    graph = onnx.load(str(quantized / "model.onnx"), load_external_data=False)
    layers = len([i for i in graph.graph.input if i.name.endswith(".key")])
    names = [
        (f"past_key_values.{i}.key", f"present.{i}.key", f"past_key_values.{i}.value", f"present.{i}.value")
        for i in range(layers)
    ]
    inputs = {i.name: i for i in graph.graph.input}
    dims = inputs[names[0][0]].type.tensor_type.shape.dim
    shape = (1, dims[1].dim_value or 2, 1, dims[3].dim_value or 16)
    scales = [(np.full(shape, 0.05, np.float32), np.full(shape, 0.05, np.float32)) for _ in range(layers)]
    store_kv_as(graph, names, onnx.TensorProto.INT8, scales)
    onnx.save(graph, str(quantized / "model.onnx"))
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", kv_cache_dtype="fp16"))
    registry.add("quantized", quantized)
    registry.add("plain", TINY)
    with pytest.raises(ModelLoadError, match=r"kv_cache_dtype=fp16 \(--kv-cache-dtype\).*INT8 already quantized"):
        await registry.get("quantized")
    assert (await registry.get("plain")).engine.name == "ort-cpu"
    await registry.close()
