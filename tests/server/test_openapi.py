"""The OpenAPI schema the server serves describes what it really sends (issue 14, item 9):
real responses of several routes, successes and errors, validated against it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
KEY = {"Authorization": "Bearer k"}
CROSS_ENCODER = Path(__file__).parents[1] / "fixtures" / "tiny-cross-encoder"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[httpx.Client, dict[str, Any]]]:
    config = ServerConfig(
        models={"tiny": TINY_MODEL, "ce": CROSS_ENCODER}, api_key="k", max_n=3, max_body_size=64 * 1024
    )
    with running(create_app(config)) as url, httpx.Client(base_url=url, headers=KEY, timeout=60) as client:
        yield client, client.get("/schema/openapi.json").json()


def _conforms(schema: dict[str, Any], response: httpx.Response) -> None:
    """``response`` is documented: its path, method, status and media type have a schema, and
    its body validates against it."""
    path = response.request.url.path
    template = next(t for t in schema["paths"] if re.fullmatch(re.sub(r"\{[^}]+\}", "[^/]+", t), path))
    operation = schema["paths"][template][response.request.method.lower()]
    documented = operation["responses"].get(str(response.status_code))
    assert documented is not None, f"{response.request.method} {path}: {response.status_code} is not documented"
    media = response.headers["content-type"].partition(";")[0].strip()
    content = {key.partition(";")[0]: value for key, value in documented["content"].items()}
    assert media in content, f"{path} {response.status_code}: {media} is not documented ({list(content)})"
    body = response.json() if media.endswith("json") else response.text
    # The components travel with the response's schema so that its $refs resolve.
    validator = jsonschema.Draft202012Validator({**content[media]["schema"], "components": schema["components"]})
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(body)]
    assert not errors, f"{response.request.method} {path} {response.status_code}: {errors}"


def test_real_responses_match_the_schema(served: tuple[httpx.Client, dict[str, Any]]) -> None:
    client, schema = served
    stream = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert stream.headers["content-type"].startswith("text/event-stream")
    responses = [
        client.get("/v1/models"),
        client.get("/v1/models/tiny"),
        client.get("/v1/models/nope"),  # 404
        client.post("/v1/chat/completions", json=CHAT),
        stream,
        client.post("/v1/chat/completions", json={**CHAT, "n": 4}),  # 400, over max_n
        client.post("/v1/chat/completions", json={**CHAT, "model": "nope"}),  # 404
        client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 2}),
        client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stream": True, "max_tokens": 2}),
        client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "stop": ["a"] * 5}),  # 400
        client.post("/v1/completions", content=b"{}", headers={"Content-Type": "text/plain"}),  # 415
        client.post("/v1/completions", json=CHAT, headers={"Origin": "https://evil.example"}),  # 403
        client.post("/v1/completions", json=CHAT, headers={"Authorization": "Bearer wrong"}),  # 401
        client.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 70_000}),  # 413
        client.post("/v1/tokenize", json={"model": "tiny", "prompt": "hello"}),
        client.post("/v1/detokenize", json={"model": "tiny", "tokens": [1, 2]}),
        client.post("/v1/embeddings", json={"model": "tiny", "input": "x"}),  # 400: not an embedding model
        client.post("/v1/rerank", json={"model": "ce", "query": "q", "documents": ["a", {"text": "b"}]}),
        client.post("/v1/rerank", json={"model": "ce", "query": "q", "documents": ["a"], "return_documents": False}),
        client.post("/v1/rerank", json={"model": "ce", "query": "q", "documents": []}),  # 400
        client.post("/v1/score", json={"model": "ce", "text_1": "q", "text_2": ["a", "b"]}),
        client.post("/v1/score", json={"model": "tiny", "text_1": "q", "text_2": "a"}),  # 400: not a rerank model
        client.get("/health"),
        client.get("/metrics"),
    ]
    statuses = {r.status_code for r in responses}
    assert {200, 400, 401, 403, 404, 413, 415} <= statuses
    for response in responses:
        _conforms(schema, response)


def test_the_schema_carries_the_limits(served: tuple[httpx.Client, dict[str, Any]]) -> None:
    _, schema = served
    components = schema["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        properties = components[name]["properties"]
        assert {"type": "integer", "minimum": 1, "maximum": 3} in properties["n"]["oneOf"]
        arrays = [s for s in properties["stop"]["oneOf"] if s.get("type") == "array"]
        assert arrays and arrays[0]["maxItems"] == 4
    error = components["ErrorResponse"]
    assert error["required"] == ["error"]
    assert set(components["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    for path, method in (("/v1/chat/completions", "post"), ("/v1/models", "get"), ("/metrics", "get")):
        responses = schema["paths"][path][method]["responses"]
        for status in ("401", "403", "500") + (("400", "404", "413", "415", "503") if method == "post" else ()):
            assert responses[status]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/ErrorResponse"
            }, (path, status)
