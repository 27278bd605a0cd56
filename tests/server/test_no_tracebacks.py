"""Every field of valid requests replaced by wrong values: the server answers 2xx or 4xx in
the OpenAI error shape, never a 5xx or a traceback, and keeps serving."""

from __future__ import annotations

import base64
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from audio import TINY_WHISPER, tone_wav
from images import TINY_PHI3V, image_part
from ortserve_server import ServerConfig, create_app
from ortserve_server._demo import minilm_folder
from serving import TINY_MODEL, running

CROSS_ENCODER = Path(__file__).parents[1] / "fixtures" / "tiny-cross-encoder"

AUDIO = {"type": "input_audio", "input_audio": {"data": base64.b64encode(tone_wav(0.2)).decode(), "format": "wav"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
VALID: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/chat/completions",
        {
            "model": "vision",
            "messages": [
                {"role": "system", "content": "brief"},
                {"role": "user", "content": [image_part(), {"type": "text", "text": "hi"}]},
            ],
            "max_tokens": 2,
            "temperature": 0.5,
            "stop": ["x"],
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "tools": [TOOL],
            "tool_choice": "auto",
            "response_format": {"type": "json_object"},
            "seed": 3,
        },
    ),
    ("/v1/chat/completions", {"model": "whisper", "messages": [{"role": "user", "content": [AUDIO]}], "max_tokens": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2, "n": 1, "stop": "x"}),
    ("/v1/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/detokenize", {"model": "tiny", "tokens": [1, 2, 3]}),
    ("/v1/embeddings", {"model": "minilm", "input": ["one", "two"], "encoding_format": "float", "dimensions": 384}),
    (
        "/v1/rerank",
        {"model": "ce", "query": "q", "documents": ["one", {"text": "two"}], "top_n": 1, "return_documents": True},
    ),
    ("/v1/score", {"model": "ce", "text_1": ["a", "b"], "text_2": ["one", "two"], "truncate": True}),
]
WRONG = [None, -1, "x", {"a": [1]}]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        if key != "url":  # a data URL is long and its wrong values are covered elsewhere
            yield from _paths(child, (*prefix, key))


def _replaced(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    body = copy.deepcopy(body)
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return body


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    minilm = minilm_folder(tmp_path_factory.mktemp("m") / "minilm")
    assert minilm is not None
    models = {"vision": TINY_PHI3V, "tiny": TINY_MODEL, "whisper": TINY_WHISPER, "minilm": minilm, "ce": CROSS_ENCODER}
    with running(create_app(ServerConfig(models=models))) as base:
        yield base


@pytest.mark.parametrize(("endpoint", "body"), VALID, ids=[f"{e}:{b['model']}" for e, b in VALID])
def test_wrong_values_in_every_field(url: str, endpoint: str, body: dict[str, Any]) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        assert client.post(endpoint, json=body).status_code == 200  # the body is valid as it stands
        for path in _paths(body):
            for value in WRONG:
                response = client.post(endpoint, json=_replaced(body, path, value))
                where = f"{endpoint} {path} = {value!r}"
                assert response.status_code < 500, f"{where}: {response.text}"
                assert "Traceback" not in response.text, where
                if response.status_code >= 400:
                    error = response.json()["error"]
                    assert error["type"] and error["message"], where
        assert client.post(endpoint, json=body).status_code == 200  # still serving
