"""A field the server does not know is a 400 naming it, on every API (ignored, it would be a
setting that does nothing: vLLM's ``guided_json`` once gave unconstrained output here);
``--lenient`` (``ServerConfig.lenient``) ignores them for clients that send extras. And
``guided_json`` itself is vLLM's: a JSON schema the output follows."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
    ("/v1/chat/completions", {**CHAT, "functions": [{"name": "f", "parameters": {}}]}, "functions"),
    (
        "/v1/completions",
        {"model": "tiny", "prompt": "hi", "max_tokens": 4, "guided_decoding_backend": "x"},
        "guided_decoding_backend",
    ),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 4, "temprature": 0}, "temprature"),
    (
        "/v1/messages",
        {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "top_kk": 1},
        "top_kk",
    ),
    ("/v1/tokenize", {"model": "tiny", "prompt": "hi", "add_bos": True}, "add_bos"),
]


@pytest.mark.parametrize(("path", "body", "field"), CASES, ids=[c[2] for c in CASES])
def test_an_unknown_field_is_named_unless_lenient(path: str, body: dict[str, Any], field: str) -> None:
    for lenient in (False, True):
        with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}, lenient=lenient))) as base:
            response = httpx.post(f"{base}{path}", json=body, timeout=60)
            if lenient:
                assert response.status_code == 200, response.text
                continue
            assert response.status_code == 400
            error = response.json()["error"]
            assert field in error["message"] and "--lenient" in error["message"]
            assert error.get("param", field) == field  # Anthropic's error shape has no param
            assert httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200


def test_guided_json_constrains_the_output() -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "x-guidance": {"whitespace_flexible": False},
    }
    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}))) as base:
        for given in (schema, json.dumps(schema)):
            body = {**CHAT, "max_tokens": 60, "temperature": 0, "guided_json": given}
            reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
            jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), schema)
        bad = httpx.post(f"{base}/v1/chat/completions", json={**CHAT, "guided_json": "{not json"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "guided_json"
        both = {**CHAT, "guided_json": schema, "guided_regex": "a+"}
        assert (
            httpx.post(f"{base}/v1/chat/completions", json=both, timeout=60).json()["error"]["param"] == "guided_regex"
        )
