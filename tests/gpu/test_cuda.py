"""On an NVIDIA GPU: the og engines on CUDA give raw onnxruntime-genai's tokens on CUDA, a
folder built for paged attention is batched dynamically by og-engine (requests together give
what each gives alone, per-request seeds, stop strings; reproducible refused), embeddings run
on the CUDA execution provider, and the API serves from the GPU.

Marked ``gpu``; they skip unless onnxruntime-genai really loads a folder on CUDA (checked
by loading, never by asking). Run on a GPU machine with the cuda extra:
``uv sync --no-group cpu --extra cuda && uv run pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import onnxruntime_genai as og
import pytest
from og_reference import og_greedy
from ortserve_runtime import ChatModel, EmbeddingModel, GenerationOptions, ModelConfig, ModelLoadError, ModelRegistry
from serving import TINY_MODEL

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PAGED_MODEL = FIXTURES / "tiny-qwen2-paged"
"""TINY_MODEL's checkpoint in fp16 for CUDA with paged attention (build_fixtures.py --only paged)."""
FP16_MODEL = FIXTURES / "tiny-qwen2-fp16"
"""The same checkpoint in fp16 without paged attention: og.Generator's reference for it."""


@functools.cache
def cuda_error() -> str | None:
    """Why onnxruntime-genai cannot run on CUDA here, or None when it can."""
    try:
        config = og.Config(str(TINY_MODEL))
        config.clear_providers()
        config.append_provider("cuda")
        og.Model(config)
    except Exception as exc:  # noqa: BLE001  # whatever og says is the reason to skip
        return str(exc).splitlines()[0]
    return None


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    reason = cuda_error()
    if reason is not None:
        pytest.skip(f"no CUDA for onnxruntime-genai: {reason}")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["og-engine", "og-generator", "auto"])
async def model(request: pytest.FixtureRequest) -> AsyncIterator[ChatModel]:
    registry = ModelRegistry(ModelConfig(provider="cuda", engine=request.param))
    registry.add("tiny", TINY_MODEL)
    loaded: ChatModel = await registry.get("tiny")
    assert loaded.engine.provider == "cuda"
    yield loaded
    await registry.close()


async def test_greedy_tokens_equal_raw_og_on_cuda(model: ChatModel) -> None:
    for prompt in ("Hello there", "The quick brown fox jumps"):
        ids = model.encode(prompt)
        _, tokens, _, _ = await model.generate(ids, options=GenerationOptions(max_tokens=24, temperature=0)).collect()
        assert tokens == og_greedy(ids, 24, provider="cuda")[: len(tokens)]


async def test_stops_and_concurrency_on_cuda(model: ChatModel) -> None:
    options = GenerationOptions(max_tokens=16, temperature=0)
    alone = [await model.generate(p, options=options).collect() for p in ("a", "b c", "hello")]
    together = await asyncio.gather(*(model.generate(p, options=options).collect() for p in ("a", "b c", "hello")))
    assert list(together) == alone
    full = alone[2][0]
    if len(full) > 6:
        stop = full[3:6]
        cut = await model.generate(
            "hello", options=GenerationOptions(max_tokens=16, temperature=0, stop=(stop,))
        ).collect()
        assert cut[0] == full[: full.index(stop)]


async def test_a_paged_folder_is_batched_dynamically_on_cuda() -> None:
    registry = ModelRegistry(ModelConfig(provider="cuda"))
    registry.add("paged", PAGED_MODEL)
    try:
        model: ChatModel = await registry.get("paged")
        assert (model.engine.name, model.engine.capabilities.batching) == ("og-engine", "dynamic")
        greedy = GenerationOptions(max_tokens=16, temperature=0)
        prompts = ("a", "b c", "hello", "the quick brown fox")
        alone = [await model.generate(p, options=greedy).collect() for p in prompts]
        together = await asyncio.gather(*(model.generate(p, options=greedy).collect() for p in prompts))
        assert [t[1] for t in together] == [a[1] for a in alone]
        ids = model.encode("hello")
        assert alone[2][1] == og_greedy(ids, 16, FP16_MODEL, provider="cuda")[: len(alone[2][1])]

        def sampled(seed: int) -> GenerationOptions:
            return GenerationOptions(max_tokens=16, temperature=1.5, seed=seed)

        runs = await asyncio.gather(*(model.generate("hello", options=sampled(s)).collect() for s in (7, 7, 8, 9, 10)))
        assert runs[0][1] == runs[1][1]  # og applies each request's own seed in a shared batch
        assert len({tuple(r[1]) for r in runs}) >= 2
        full = alone[2][0]
        if len(full) > 6:
            stop = full[3:6]
            cut = model.generate("hello", options=GenerationOptions(max_tokens=16, temperature=0, stop=(stop,)))
            assert (await cut.collect())[0] == full[: full.index(stop)]
    finally:
        await registry.close()


async def test_reproducible_is_refused_on_dynamic_batches() -> None:
    registry = ModelRegistry(ModelConfig(provider="cuda", reproducible=True))
    registry.add("paged", PAGED_MODEL)
    try:
        with pytest.raises(ModelLoadError, match="reproducible cannot be kept on og-engine's dynamic batches"):
            await registry.get("paged")
    finally:
        await registry.close()


def test_the_cuda_libraries_load_without_a_library_path() -> None:
    # The cuda extra installs CUDA 13, cuBLAS and cuDNN as wheels in site-packages, where
    # neither onnxruntime nor og looks: ortserve loads them (onnxruntime.preload_dlls).
    code = (
        "import sys; sys.path.insert(0, 'tests'); from serving import TINY_MODEL; "
        "from ortserve_runtime import ModelConfig; from ortserve_runtime._folder import load_og_model; "
        "load_og_model(TINY_MODEL, ModelConfig(provider='cuda')); print('loaded')"
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]


def test_embeddings_on_the_cuda_execution_provider(tmp_path: Path) -> None:
    from ortserve_server._demo import minilm_folder

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDAExecutionProvider")
    folder = minilm_folder(tmp_path / "minilm")
    assert folder is not None
    cpu = EmbeddingModel("cpu", folder, ModelConfig()).embed_sync(["a GPU sentence"]).vectors
    cuda_model = EmbeddingModel("cuda", folder, ModelConfig(provider="cuda"))
    assert "CUDAExecutionProvider" in cuda_model.session.get_providers()
    assert np.allclose(cuda_model.embed_sync(["a GPU sentence"]).vectors, cpu, atol=1e-3)


def test_the_server_serves_from_the_gpu() -> None:
    import openai
    from ortserve_server import ServerConfig, create_app
    from serving import running

    app = create_app(ServerConfig(models={"tiny": TINY_MODEL}, model_config=ModelConfig(provider="cuda")))
    with running(app) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        card = client.models.retrieve("tiny")
        assert card.provider == "cuda"  # type: ignore[attr-defined]
        result = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
        )
        assert result.usage is not None and result.usage.completion_tokens == 8
        assert json.loads(result.model_dump_json())["choices"][0]["message"]["content"]
