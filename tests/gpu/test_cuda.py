"""On an NVIDIA GPU: the og engines on CUDA give raw onnxruntime-genai's tokens on CUDA,
embeddings run on the CUDA execution provider, and the API serves from the GPU.

Marked ``gpu``; they skip unless onnxruntime-genai really loads a folder on CUDA (checked
by loading, never by asking). Run on a GPU machine with the cuda extra:
``uv sync --no-group cpu --extra cuda && uv run pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import onnxruntime_genai as og
import pytest
from og_reference import og_greedy
from ortserve_runtime import ChatModel, EmbeddingModel, GenerationOptions, ModelConfig, ModelRegistry
from serving import TINY_MODEL

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]


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
    import asyncio

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
