"""`POST /v1/rerank` and `POST /v1/score` through a real server, with httpx (no official SDK
speaks them) and ortserve's AsyncClient, on the tiny cross-encoder fixture."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from ortserve_client import AsyncClient, BadRequestError, NotFoundError
from ortserve_client import protocol as p
from ortserve_runtime import ModelConfig, RerankConfig
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running, watched

FOLDER = Path(__file__).parents[1] / "fixtures" / "tiny-cross-encoder"
REFERENCE = json.loads((FOLDER / "reference.json").read_text("utf-8"))
QUERY = REFERENCE[0]["query"]
SAME_QUERY = [r for r in REFERENCE if r["query"] == QUERY]
"""The reference pairs of the first query: one query, several documents."""


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = ServerConfig(
        models={"ce": FOLDER, "tiny": TINY_MODEL},
        model_config=ModelConfig(rerank=RerankConfig(max_documents=50)),
    )
    with running(create_app(config)) as base:
        yield base


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=30)


def test_rerank_sorts_by_the_reference_scores(url: str) -> None:
    documents = [r["document"] for r in SAME_QUERY]
    response = post(url, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": documents})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == "ce" and body["id"].startswith("rerank-")
    results = body["results"]
    assert sorted(r["index"] for r in results) == list(range(len(documents)))
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    for result in results:
        assert result["relevance_score"] == pytest.approx(SAME_QUERY[result["index"]]["score"], abs=1e-4)
        assert result["document"] == {"text": documents[result["index"]]}
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 3 * len(documents)


def test_top_n_return_documents_and_document_objects(url: str) -> None:
    documents = [r["document"] for r in SAME_QUERY]
    full = post(url, "/v1/rerank", {"model": "ce", "query": QUERY, "documents": documents}).json()["results"]
    body = {"model": "ce", "query": QUERY, "documents": [{"text": d} for d in documents], "top_n": 2}
    top = post(url, "/v1/rerank", {**body, "return_documents": False}).json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in full[:2]]
    assert all("document" not in r for r in top)
    everything = post(url, "/v1/rerank", {**body, "top_n": 0}).json()["results"]  # 0: every document (vLLM)
    assert len(everything) == len(documents)


@pytest.mark.parametrize("path", ["/rerank", "/v2/rerank"])
def test_vllm_aliases(url: str, path: str) -> None:
    response = post(url, path, {"model": "ce", "query": QUERY, "documents": [SAME_QUERY[0]["document"]]})
    assert response.status_code == 200, response.text
    assert response.json()["results"][0]["relevance_score"] == pytest.approx(SAME_QUERY[0]["score"], abs=1e-4)
    assert post(url, path, {"model": "ce", "query": QUERY, "documents": []}).json()["error"]["param"] == "documents"


def test_score_one_to_one_one_to_many_and_pairwise(url: str) -> None:
    pairs = {"text_1": [r["query"] for r in REFERENCE], "text_2": [r["document"] for r in REFERENCE]}
    pairwise = post(url, "/v1/score", {"model": "ce", **pairs}).json()
    assert pairwise["object"] == "list" and pairwise["id"].startswith("score-")
    assert [d["index"] for d in pairwise["data"]] == list(range(len(REFERENCE)))
    assert all(d["object"] == "score" for d in pairwise["data"])
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], [r["score"] for r in REFERENCE], atol=1e-4)
    documents = [r["document"] for r in SAME_QUERY]
    want = [r["score"] for r in SAME_QUERY]
    for text_1 in (QUERY, [QUERY]):  # a list of one text_1 scores against every text_2, as in vLLM
        many = post(url, "/v1/score", {"model": "ce", "text_1": text_1, "text_2": documents}).json()
        np.testing.assert_allclose([d["score"] for d in many["data"]], want, atol=1e-4)
    one = post(url, "/v1/score", {"model": "ce", "text_1": QUERY, "text_2": documents[0]}).json()
    assert one["data"][0]["score"] == pytest.approx(want[0], abs=1e-4)
    assert one["usage"]["prompt_tokens"] == one["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": []}, 400, "documents"),
        ("/v1/rerank", {"model": "ce", "query": "", "documents": ["d"]}, 400, "query"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["d", ""]}, 400, "documents"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": [5]}, 400, "documents[0]"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": [{"title": "x"}]}, 400, "documents[0]"),
        ("/v1/rerank", {"model": "ce", "documents": ["d"]}, 400, "query"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["d"] * 51}, 400, "documents"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["word " * 300]}, 400, "documents"),
        ("/v1/rerank", {"model": "ce", "query": "q", "documents": ["d"], "top_n": -1}, 400, "top_n"),
        ("/v1/rerank", {"model": "nope", "query": "q", "documents": ["d"]}, 404, "model"),
        ("/v1/rerank", {"model": "tiny", "query": "q", "documents": ["d"]}, 400, "model"),
        ("/v1/score", {"model": "ce", "text_1": ["a", "b"], "text_2": ["c"]}, 400, "text_1"),
        ("/v1/score", {"model": "ce", "text_1": ["a", ""], "text_2": ["c", "d"]}, 400, "text_1"),
        ("/v1/score", {"model": "ce", "text_1": "a", "text_2": []}, 400, "text_2"),
        ("/v1/score", {"model": "ce", "text_1": "a", "text_2": ["word " * 300]}, 400, "text_2"),
        ("/v1/score", {"model": "ce", "text_1": "a", "text_2": ["d"] * 51}, 400, "text_2"),
        ("/v1/score", {"model": "ce", "text_1": "a"}, 400, "text_2"),
        ("/v1/score", {"model": "tiny", "text_1": "a", "text_2": "b"}, 400, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    url: str, path: str, body: dict[str, Any], status: int, param: str
) -> None:
    response = post(url, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if param == "model":
        assert repr(body["model"]) in error["message"]


def test_truncate_extension(url: str) -> None:
    body = {"model": "ce", "query": "q", "documents": ["word " * 300], "truncate": True}
    response = post(url, "/v1/rerank", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 128
    score = post(url, "/v1/score", {"model": "ce", "text_1": "q", "text_2": "word " * 300, "truncate": True})
    assert score.json()["data"][0]["score"] == pytest.approx(response.json()["results"][0]["relevance_score"])


def test_chat_and_embeddings_with_a_rerank_model_are_refused(url: str) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError, match=r"rerank model; use /v1/rerank or /v1/score"):
            client.chat.completions.create(model="ce", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="rerank model"):
            client.embeddings.create(model="ce", input="hi")
        card = client.models.retrieve("ce").model_extra or {}
        assert {key: card.get(key) for key in ("kind", "status", "provider", "engine")} == {
            "kind": "rerank",
            "status": "ready",
            "provider": "cpu",
            "engine": None,
        }
        assert card["resident_bytes"] > 0 and card["kv_cache_bytes"] is None  # an encoder has no KV cache


def test_async_client_rerank_and_score(url: str) -> None:
    documents = [r["document"] for r in SAME_QUERY]

    async def run() -> None:
        async with AsyncClient(f"{url}/v1", max_retries=0) as client:
            ranked = await client.rerank(model="ce", query=QUERY, documents=documents, top_n=2)
            assert isinstance(ranked, p.RerankResponse) and len(ranked.results) == 2
            best = max(range(len(documents)), key=lambda i: SAME_QUERY[i]["score"])
            assert ranked.results[0].index == best
            assert ranked.results[0].document == p.RerankDocument(text=documents[best])
            bare = await client.rerank(
                model="ce", query=QUERY, documents=[{"text": documents[0]}], return_documents=False
            )
            assert bare.results[0].document is p.UNSET
            scored = await client.score(model="ce", text_1=QUERY, text_2=documents)
            assert [d.score for d in scored.data] == pytest.approx([r["score"] for r in SAME_QUERY], abs=1e-4)
            with pytest.raises(BadRequestError) as info:
                await client.score(model="ce", text_1=["a", "b"], text_2=["c"])
            assert info.value.body is not None and info.value.body.error.param == "text_1"
            with pytest.raises(NotFoundError):
                await client.rerank(model="nope", query="q", documents=["d"])

    asyncio.run(run())


def test_concurrent_requests_match_single_ones(url: str) -> None:
    pairs = [(r["query"], r["document"]) for r in REFERENCE] * 4

    async def run() -> list[float]:
        async with AsyncClient(f"{url}/v1", max_retries=0) as client:
            results = await asyncio.gather(*(client.rerank(model="ce", query=q, documents=[d]) for q, d in pairs))
        return [r.results[0].relevance_score for r in results]

    np.testing.assert_allclose(asyncio.run(run()), [r["score"] for r in REFERENCE] * 4, atol=1e-4)


def test_metrics_count_rerank_and_score(url: str) -> None:
    post(url, "/v1/score", {"model": "ce", "text_1": "q", "text_2": "d"})
    text = httpx.get(f"{url}/metrics").text
    assert 'ortserve_requests_total{endpoint="/v1/score",model="ce",status="2xx"}' in text
    assert 'ortserve_requests_total{endpoint="/v1/rerank",model="ce",status="2xx"}' in text
    assert 'ortserve_prompt_tokens_total{model="ce"}' in text


def test_rerank_score_and_the_aliases_need_the_api_key() -> None:
    with running(create_app(ServerConfig(models={"ce": FOLDER}, api_key="k"))) as base:
        bodies = {
            "/v1/rerank": {"model": "ce", "query": "q", "documents": ["d"]},
            "/rerank": {"model": "ce", "query": "q", "documents": ["d"]},
            "/v2/rerank": {"model": "ce", "query": "q", "documents": ["d"]},
            "/v1/score": {"model": "ce", "text_1": "q", "text_2": "d"},
        }
        for path, body in bodies.items():
            refused = httpx.post(f"{base}{path}", json=body)
            assert refused.status_code == 401, path
            assert refused.json()["error"]["type"] == "authentication_error"
            allowed = httpx.post(f"{base}{path}", json=body, headers={"Authorization": "Bearer k"})
            assert allowed.status_code == 200, (path, allowed.text)


def test_the_root_aliases_can_be_left_to_the_host() -> None:
    with running(create_app(ServerConfig(models={"ce": FOLDER}, rerank_aliases=False))) as base:
        body = {"model": "ce", "query": "q", "documents": ["d"]}
        assert httpx.post(f"{base}/v1/rerank", json=body).status_code == 200
        assert httpx.post(f"{base}/rerank", json=body).status_code == 404
        assert httpx.post(f"{base}/v2/rerank", json=body).status_code == 404


def test_many_long_documents_are_tokenized_a_few_at_a_time() -> None:
    """Sixth probe of issue 45: 1,000 documents under the characters a 128-token model's
    pair may have (some 1,150 tokens each) were all tokenized at once before the first was
    refused for its length. Now the first few are, and the first is refused."""
    documents = ["word " * 1150] * 1000
    content = json.dumps({"model": "ce", "query": "q", "documents": documents}).encode()
    with running(create_app(ServerConfig(models={"ce": FOLDER}))) as url, watched(url) as seen:
        response = httpx.post(
            f"{url}/v1/rerank", content=content, headers={"content-type": "application/json"}, timeout=120
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "documents" and "documents[0] with its query has 1154 tokens" in error["message"]
    # Memory is what this checks; /health is only to be answered throughout (the poller shares
    # this process, and the suite's other worker the two cores).
    seen.assert_within(health=1.0, grown=48 * 2**20)
