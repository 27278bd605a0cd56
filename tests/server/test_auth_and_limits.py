"""API keys, the queue limit and the body limit, through a real server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def keyed() -> Iterator[str]:
    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}, api_key="s3cret"))) as url:
        yield url


def test_api_key_required(keyed: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = httpx.get(f"{keyed}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    ok = httpx.get(f"{keyed}/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200


def test_health_stays_open(keyed: str) -> None:
    assert httpx.get(f"{keyed}/health").status_code == 200


def test_openai_sdk_with_key(keyed: str) -> None:
    with openai.OpenAI(base_url=f"{keyed}/v1", api_key="s3cret", max_retries=0) as client:
        assert client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2).choices
    with (
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="nope", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()


def test_full_queue_gets_503_with_retry_after() -> None:
    """One request generating and one queued fill the model: the next is refused with
    503 and Retry-After. Two clients keep sending long requests back to back, so the
    model stays full even when a machine under load runs them out of step."""
    config = ServerConfig(
        models={"tiny": TINY_MODEL},
        max_queued=1,
        model_config=ModelConfig(max_batch_size=1, max_sequence_length=1024),
    )
    app = create_app(config)
    with running(app) as url:
        model_ready = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert model_ready.status_code == 200
        model = app.state.ortserve.registry.loaded("tiny")
        long_body = {"model": "tiny", "prompt": "a b c", "max_tokens": 900, "min_tokens": 900}
        stop = threading.Event()
        statuses: list[int] = []

        def keep_sending() -> None:
            while not stop.is_set():
                statuses.append(httpx.post(f"{url}/v1/completions", json=long_body, timeout=120).status_code)

        senders = [threading.Thread(target=keep_sending) for _ in range(2)]
        for thread in senders:
            thread.start()
        try:
            refused, depth_seen = None, False
            deadline = time.monotonic() + 30
            while (refused is None or not depth_seen) and time.monotonic() < deadline:
                if refused is None and (model.active, model.queued) == (1, 1):
                    probe = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
                    refused = probe if probe.status_code == 503 else None
                depth_seen = depth_seen or 'ortserve_queue_depth{model="tiny"} 1.0' in httpx.get(f"{url}/metrics").text
                time.sleep(0.01)
        finally:
            stop.set()
            for thread in senders:
                thread.join()
        assert refused is not None, "the model never refused a request while full"
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "server_overloaded"
        assert depth_seen
        # A sender can itself be refused when the probe took the queue's place between
        # two of its requests; what matters is that theirs were served.
        assert 200 in statuses and set(statuses) <= {200, 503}


def test_max_tokens_limit() -> None:
    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}, max_tokens_limit=4))) as url:
        too_many = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 5})
        assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
        capped = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "min_tokens": 4})
        assert capped.json()["usage"]["completion_tokens"] == 4


def test_unexpected_errors_are_500_without_internals(monkeypatch: pytest.MonkeyPatch) -> None:
    from ortserve_runtime import ChatModel

    def broken(*_: object, **__: object) -> object:
        raise RuntimeError("secret internal detail /srv/models/x")

    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}))) as url:
        monkeypatch.setattr(ChatModel, "prepare_chat", broken)
        response = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": HELLO})
        assert response.status_code == 500
        assert response.json() == {
            "error": {"message": "internal server error", "type": "server_error", "param": None, "code": None},
            "request_id": response.headers["x-request-id"],  # what the operator finds the traceback by
        }
        monkeypatch.undo()
        ok = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 2})
        assert ok.status_code == 200


def test_request_bodies_in_memory_have_a_budget() -> None:
    """``max_body_memory``: a body that cannot fit is a 503 before it is read (declared
    length) or as it arrives (chunked), in the API's error shape; bodies that ended give
    their bytes back, and one that fits is served."""
    config = ServerConfig(models={"tiny": TINY_MODEL}, max_body_memory=64 * 1024)
    app = create_app(config)
    with running(app) as url, httpx.Client(timeout=30) as client:
        chat = {"model": "tiny", "messages": HELLO, "max_tokens": 1, "user": "u" * 70_000}
        declared = client.post(f"{url}/v1/chat/completions", json=chat)
        assert declared.status_code == 503
        assert declared.headers["retry-after"] == "1"
        assert declared.json()["error"]["code"] == "server_overloaded"

        def chunks() -> Iterator[bytes]:
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"x" * 10_000
            yield b'"}], "max_tokens": 1}'

        chunked = client.post(
            f"{url}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert chunked.status_code == 503, chunked.text
        assert "--max-body-memory-mb" in chunked.json()["error"]["message"]
        small = client.post(f"{url}/v1/chat/completions", json={**chat, "user": "u" * 30_000})
        assert small.status_code == 200, small.text
        assert app.state.ortserve.body_budget.held == 0
