"""The rerank model on the tiny random cross-encoder (tests/fixtures/tiny-cross-encoder,
built by build_fixtures.py) against the scores transformers computed for it at build time
(reference.json), and, where torch is installed, against transformers run here:

    /tmp/fx/bin/pip install pytest && PYTHONPATH=packages/runtime/src:tests /tmp/fx/bin/python -m pytest \
        tests/runtime/test_rerank.py -q -p no:cacheprovider -k transformers
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from ortserve_runtime import (
    ContextLengthError,
    InvalidRequestError,
    ModelConfig,
    ModelLoadError,
    ModelRegistry,
    RerankConfig,
    RerankModel,
    detect_model_kind,
)

pytestmark = pytest.mark.anyio
FOLDER = Path(__file__).parents[1] / "fixtures" / "tiny-cross-encoder"
REFERENCE = json.loads((FOLDER / "reference.json").read_text("utf-8"))
QUERIES = [r["query"] for r in REFERENCE]
DOCUMENTS = [r["document"] for r in REFERENCE]


def load(folder: Path = FOLDER, **settings: object) -> RerankModel:
    return RerankModel("ce", folder, ModelConfig(rerank=RerankConfig(**settings)))  # type: ignore[arg-type]


@pytest.fixture
async def model() -> AsyncIterator[RerankModel]:
    reranker = load()
    yield reranker
    await reranker.close()


async def test_scores_equal_transformers_reference(model: RerankModel) -> None:
    result = await model.score(QUERIES, DOCUMENTS)
    np.testing.assert_allclose(result.scores, [r["score"] for r in REFERENCE], atol=1e-4, rtol=0)
    assert model.activation == "sigmoid"  # num_labels 1, no activation named: CrossEncoder's default
    # The scores are spread out, so a wrong token type, mask or pair order would show.
    assert np.ptp(result.scores) > 0.2
    raw = load(activation="none")
    logits = await raw.score(QUERIES, DOCUMENTS)
    np.testing.assert_allclose(logits.scores, [r["logit"] for r in REFERENCE], atol=1e-4, rtol=0)
    await raw.close()


async def test_pairs_use_the_tokenizer_pair_template(model: RerankModel) -> None:
    (pair,) = model.tokenize_pairs("a query", ["the document"])
    cls, sep = model.tokenizer.token_to_id("[CLS]"), model.tokenizer.token_to_id("[SEP]")
    query = model.tokenizer.encode("a query", add_special_tokens=False).ids
    document = model.tokenizer.encode("the document", add_special_tokens=False).ids
    assert pair.ids == [cls, *query, sep, *document, sep]
    assert pair.type_ids == [0] * (len(query) + 2) + [1] * (len(document) + 1)


async def test_one_query_many_documents_equals_pairwise(model: RerankModel) -> None:
    query = QUERIES[0]
    together = await model.score(query, DOCUMENTS)
    pairwise = await model.score([query] * len(DOCUMENTS), DOCUMENTS)
    np.testing.assert_allclose(together.scores, pairwise.scores, atol=1e-6)
    assert together.token_counts == pairwise.token_counts
    assert together.prompt_tokens == sum(together.token_counts)
    sync = model.score_sync(query, DOCUMENTS)
    np.testing.assert_allclose(sync.scores, together.scores, atol=1e-6)


async def test_concurrent_requests_are_merged_and_correct(model: RerankModel) -> None:
    pairs = list(zip(QUERIES, DOCUMENTS, strict=True)) * 4
    alone = [(await model.score(q, [d])).scores[0] for q, d in pairs]
    runs_before = model.runs
    together = await asyncio.gather(*(model.score(q, [d]) for q, d in pairs))
    runs = model.runs - runs_before
    assert runs < len(together), f"{len(together)} concurrent requests took {runs} session runs"
    np.testing.assert_allclose([r.scores[0] for r in together], alone, atol=1e-5)


async def test_too_long_pairs_error_or_truncate(model: RerankModel) -> None:
    long_document = "word " * 300
    with pytest.raises(ContextLengthError, match=r"documents\[1\]") as info:
        await model.score("q", ["fine", long_document])
    assert info.value.param == "documents"
    cut = await model.score("q", ["fine", long_document], truncate=True)
    assert cut.token_counts[1] == model.max_tokens == 128
    configured = load(truncate=True)
    np.testing.assert_allclose((await configured.score("q", ["fine", long_document])).scores, cut.scores, atol=1e-6)
    await configured.close()
    with pytest.raises(ContextLengthError):  # past any tokenization: refused untokenized
        await model.score("q", ["x" * (model.max_input_chars + 1)])


@pytest.mark.parametrize(
    ("queries", "documents", "param"),
    [
        ("q", [], "documents"),
        ("", ["d"], "query"),
        ("q", ["d", ""], "documents"),
        (["q", "r"], ["d"], "query"),
        (["q", ""], ["d", "e"], "query"),
    ],
)
async def test_bad_inputs_name_the_field(
    model: RerankModel, queries: str | list[str], documents: list[str], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await model.score(queries, documents)
    assert info.value.param == param
    with pytest.raises(InvalidRequestError) as info:
        await model.score(queries, documents, names=("text_1", "text_2"))
    assert info.value.param == {"query": "text_1", "documents": "text_2"}[param]


async def test_too_many_documents() -> None:
    small = load(max_documents=3)
    with pytest.raises(InvalidRequestError, match="at most 3") as info:
        await small.score("q", ["d"] * 4)
    assert info.value.param == "documents"
    await small.close()


def test_the_folder_is_recognised_and_kind_can_be_explicit(tmp_path: Path) -> None:
    assert detect_model_kind(FOLDER) == "rerank"
    registry = ModelRegistry()
    assert registry.add("ce", FOLDER) == "rerank"
    # An encoder folder without a classifier config is an embedding model unless told otherwise.
    plain = tmp_path / "plain"
    shutil.copytree(FOLDER, plain)
    (plain / "config.json").unlink()
    assert detect_model_kind(plain) == "embedding"
    assert registry.add("plain", plain, kind="rerank") == "rerank"
    with pytest.raises(ValueError, match="cannot be served as generative"):
        registry.add("wrong", FOLDER, kind="generative")


async def test_activation_from_sentence_transformers_config(tmp_path: Path) -> None:
    folder = tmp_path / "ce"
    shutil.copytree(FOLDER, folder)
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}
    (folder / "config.json").write_text(json.dumps(config))
    raw = load(folder)
    assert raw.activation == "none"
    result = await raw.score(QUERIES[:2], DOCUMENTS[:2])
    np.testing.assert_allclose(result.scores, [r["logit"] for r in REFERENCE[:2]], atol=1e-4)
    await raw.close()
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.activation.Tanh"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="Tanh"):
        load(folder)


def test_an_embedding_model_is_not_a_reranker(tmp_path: Path) -> None:
    from ortserve_server._demo import minilm_folder  # here: the torch run below needs no server

    folder = minilm_folder(tmp_path / "minilm")
    assert folder is not None
    with pytest.raises(ModelLoadError, match="not a sequence classifier"):
        load(folder)


async def test_scores_equal_transformers_run_here(model: RerankModel) -> None:
    """transformers' own tokenizer and model on the committed checkpoint (skipped without torch)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(FOLDER)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(FOLDER, dtype=torch.float32).eval()
    queries = [*QUERIES, "Who?", "long query " * 80]
    documents = [*DOCUMENTS, "Nobody knows. " * 5, "long document " * 80]
    batch = tokenizer(queries, documents, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.sigmoid(reference(**batch).logits[:, 0]).numpy()
    got = await model.score(queries, documents, truncate=True)
    np.testing.assert_allclose(got.scores, want, atol=1e-4, rtol=0)
    assert got.token_counts == batch["attention_mask"].sum(dim=1).tolist()
