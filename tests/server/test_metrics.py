"""/metrics stays small whatever paths clients send, and shows every model kind's load."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import httpx
import pytest
from ortserve_server import ServerConfig, create_app
from ortserve_server._demo import demo_models
from serving import running


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    models = {name: path for name, path in demo_models().items() if name != "tiny-phi3v"}
    if "all-minilm-l6-v2" not in models:
        pytest.skip("the demo embedding model's packages are not installed")
    with running(create_app(ServerConfig(models=models))) as base:
        yield base


def test_random_paths_do_not_grow_metrics(url: str) -> None:
    with httpx.Client(base_url=url) as client:
        for path in ("/v1/models/nope", "/nowhere"):  # every series exists before measuring
            client.get(path)
        before = len(client.get("/metrics").content)
        for _ in range(250):
            assert client.get(f"/v1/models/{uuid.uuid4().hex}").status_code == 404
            assert client.get(f"/{uuid.uuid4().hex}/x").status_code == 404
        metrics = client.get("/metrics").text
    assert len(metrics) < 2 * before, (before, len(metrics))
    # One series per route template and status class, and one for all unknown paths.
    assert 'ortserve_errors_total{endpoint="/v1/models/{model_id}",status="4xx"} 251.0' in metrics
    assert 'ortserve_errors_total{endpoint="unmatched",status="4xx"} 251.0' in metrics


def test_every_model_kind_has_load_gauges(url: str) -> None:
    httpx.post(f"{url}/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "warm"}).raise_for_status()
    rerank = {"model": "tiny-cross-encoder", "query": "q", "documents": ["d"]}
    httpx.post(f"{url}/v1/rerank", json=rerank).raise_for_status()
    metrics = httpx.get(f"{url}/metrics").text
    for name in ("tiny-qwen2", "tiny-whisper", "all-minilm-l6-v2", "tiny-cross-encoder"):
        for gauge in ("ortserve_queue_depth", "ortserve_active_requests"):
            assert re.search(rf'^{gauge}{{model="{name}"}} 0\.0$', metrics, re.MULTILINE), (gauge, name)
    assert 'ortserve_requests_total{endpoint="/v1/embeddings",model="all-minilm-l6-v2",status="2xx"}' in metrics
