"""On an NVIDIA GPU: GGUF files converted by ortserve run on CUDA. The converted graph on
onnxruntime's CUDA execution provider gives llama.cpp's logits as the CPU does (the same
bounds as tests/runtime/test_gguf.py), and a GGUF model served on ``provider="cuda"``
gives raw onnxruntime-genai's greedy tokens on CUDA for that folder.

Marked ``gpu``; skipped unless onnxruntime has the CUDA execution provider and og loads on
CUDA (test_cuda.py's check). Run with the cuda extra: ``uv run pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import PROMPT, WITH_MINIMUMS, reference_logits, run_folder, write_tiny_gguf
from og_reference import og_greedy
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelRegistry
from ortserve_runtime.sources import converted_folder
from test_cuda import cuda_error

pytestmark = [pytest.mark.gpu, pytest.mark.anyio]


@pytest.fixture(autouse=True)
def _needs_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDAExecutionProvider")
    reason = cuda_error()
    if reason is not None:
        pytest.skip(f"no CUDA for onnxruntime-genai: {reason}")
    monkeypatch.setenv("ORTSERVE_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("arch", "qtype"),
    [
        *[("llama", q) for q in (Q.F16, Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K)],
        *[("gemma2", Q.Q8_0), ("phi3", Q.Q4_0), ("qwen3", Q.Q4_0)],
    ],
    ids=lambda v: v if isinstance(v, str) else v.name,
)
def test_converted_files_compute_on_cuda(tmp_path: Path, arch: str, qtype: Q) -> None:
    source = write_tiny_gguf(tmp_path / f"{arch}-{qtype.name}.gguf", arch=arch, qtype=qtype)
    if qtype in WITH_MINIMUMS:  # their own head (a tied one is requantized), as the CPU test has it
        source = write_tiny_gguf(source, arch=arch, qtype=qtype, tied=False)
    folder = converted_folder(source)
    reference = reference_logits(source, PROMPT)
    cuda = run_folder(folder, PROMPT, "CUDAExecutionProvider")
    spread = reference.std() * (2 if qtype == Q.Q6_K else 1)
    assert np.abs(cuda - reference).max() < 0.15 * spread, (np.abs(cuda - reference).max(), spread)
    assert np.abs(cuda - reference).mean() < 0.02 * spread
    assert (cuda.argmax(-1) == reference.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("engine", ["og-generator", "og-engine"])
async def test_a_gguf_model_serves_on_cuda(tmp_path: Path, engine: str) -> None:
    source = write_tiny_gguf(tmp_path / "tiny.gguf", qtype=Q.Q4_0)
    registry = ModelRegistry(ModelConfig(provider="cuda", engine=engine))  # type: ignore[arg-type]
    registry.add("tiny", source)
    try:
        model: ChatModel = await registry.get("tiny")
        assert model.engine.provider == "cuda"
        options = GenerationOptions(max_tokens=12, temperature=0)
        _, tokens, _, _ = await model.generate(PROMPT, options=options).collect()
        assert tokens == og_greedy(PROMPT, 12, converted_folder(source), provider="cuda")[: len(tokens)]
    finally:
        await registry.close()
