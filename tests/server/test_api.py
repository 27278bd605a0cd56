"""The HTTP API through a real uvicorn server, with the official openai SDK as the client."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def app_state() -> Iterator[tuple[str, object]]:
    config = ServerConfig(
        models={"tiny": TINY_MODEL},
        max_body_size=64 * 1024,
        model_config=ModelConfig(max_batch_size=8, max_sequence_length=512),
    )
    app = create_app(config)
    with running(app) as url:
        yield url, app.state.ortserve


@pytest.fixture(scope="module")
def base_url(app_state: tuple[str, object]) -> str:
    return app_state[0]


@pytest.fixture
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
def aclient(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


HELLO = [{"role": "user", "content": "Tell me about the iterable in sorted order"}]


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model" and model.owned_by == "ortserve"
    assert abs(model.created - time.time()) < 3600


def test_chat_plain_and_usage(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=12, temperature=0)
    assert result.object == "chat.completion"
    assert result.id.startswith("chatcmpl-")
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in {"stop", "length"}
    assert result.usage is not None
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens
    assert result.usage.completion_tokens <= 12


def test_max_tokens_gives_length(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model="tiny", messages=HELLO, max_completion_tokens=5, temperature=0, extra_body={"min_tokens": 5}
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 5


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=HELLO,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens  # type: ignore[union-attr]


def test_stream_raw_sse_shape(base_url: str) -> None:
    body = {"model": "tiny", "messages": HELLO, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] in {"stop", "length"}


def test_n_choices(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.message.content for c in result.choices}) > 1
    again = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, n=3, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in result.choices]


@pytest.mark.parametrize("bias", [None, -100], ids=["logits as they are", "every logit negative"])
def test_a_subnormal_temperature_samples_like_greedy(client: openai.OpenAI, bias: int | None) -> None:
    # Issue 45, seventh probe: 5e-324 is in [0, 2] but takes every positive logit to +inf
    # (the sampler chose evenly among them: not greedy) and, where every logit is negative
    # (a logit_bias of -100 on each id), every one to -inf: NaN probabilities, a 500.
    extra = {} if bias is None else {"logit_bias": {str(i): bias for i in range(1024)}}
    greedy = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=8, temperature=0, extra_body={"min_tokens": 8, **extra}
    )
    for seed in (1, 2, 3):
        tiny = client.chat.completions.create(
            model="tiny",
            messages=HELLO,
            max_tokens=8,
            temperature=5e-324,
            seed=seed,
            extra_body={"min_tokens": 8, **extra},
        )
        assert tiny.choices[0].message.content == greedy.choices[0].message.content


def test_n_choices_streamed(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=6, n=2, temperature=0, stream=True)
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] and texts[0]


def test_stop_string(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=30, temperature=0)
    text = full.choices[0].message.content or ""
    assert len(text) > 10
    stop = text[5:9]
    cut = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=30, temperature=0, stop=[stop, "zzzz"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    streamed = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=30, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[: text.index(stop)]


def test_completions(client: openai.OpenAI) -> None:
    result = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=0)
    assert result.object == "text_completion"
    assert result.choices[0].text
    batch = client.completions.create(model="tiny", prompt=["one", "two"], max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert ids.usage is not None and ids.usage.prompt_tokens == 3
    streamed = client.completions.create(
        model="tiny", prompt="The quick brown fox", max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == result.choices[0].text


def test_tokenize_round_trip(base_url: str) -> None:
    text = "Return a new list, héllo 你好"
    tokens = httpx.post(f"{base_url}/v1/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 3
    assert tokens["max_model_len"] == 512
    back = httpx.post(f"{base_url}/v1/detokenize", json={"model": "tiny", "tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    chat = httpx.post(f"{base_url}/v1/tokenize", json={"model": "tiny", "messages": HELLO}).json()
    decoded = httpx.post(f"{base_url}/v1/detokenize", json={"model": "tiny", "tokens": chat["tokens"]}).json()["prompt"]
    assert "Tell me about the iterable" in decoded


def test_health_and_metrics(base_url: str, client: openai.OpenAI) -> None:
    client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 200
    assert health.json() == {
        "status": "ok",
        "models": [{"id": "tiny", "status": "ready", "provider": "cpu", "engine": "ort-cpu"}],
    }
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'ortserve_requests_total{endpoint="/v1/chat/completions",model="tiny",status="2xx"}' in metrics
    for path in ("/health", "/metrics"):  # load balancers probe with HEAD (a 405 before; sixteenth probe)
        head = httpx.head(f"{base_url}{path}")
        assert head.status_code == 200 and head.content == b"", path
    assert "ortserve_time_to_first_token_seconds_count" in metrics
    assert 'ortserve_queue_depth{model="tiny"} 0.0' in metrics
    httpx.post(f"{base_url}/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "temperature": 7})
    errors = httpx.get(f"{base_url}/metrics").text
    assert 'ortserve_errors_total{endpoint="/v1/chat/completions",status="4xx"}' in errors


# -- errors --------------------------------------------------------------------------------


def _error(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "request_id"} and body["request_id"] == response.headers["x-request-id"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text
    error: dict[str, object] = body["error"]
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny"}, "messages"),
        ({"model": "tiny", "messages": "hi"}, "messages"),
        ({"model": "tiny", "messages": HELLO, "max_tokens": "ten"}, "max_tokens"),
        ({"model": "tiny", "messages": HELLO, "temperature": 3}, "temperature"),
        ({"model": "tiny", "messages": HELLO, "top_p": 0}, "top_p"),
        ({"model": "tiny", "messages": HELLO, "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "messages": HELLO, "n": 0}, "n"),
        ({"model": "tiny", "messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": HELLO, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ({"model": "tiny", "messages": HELLO, "max_tokens": 100000}, "max_tokens"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
            },
            "messages[0].content[0].image_url.url",
        ),
    ],
)
def test_bad_requests_name_the_field(base_url: str, body: dict[str, object], param: str) -> None:
    error = _error(httpx.post(f"{base_url}/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param or param in str(error["message"])


def test_malformed_json(base_url: str) -> None:
    response = httpx.post(
        f"{base_url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    _error(response, 400)


@pytest.mark.parametrize(
    ("body", "words"),
    [
        # Eighth probe of issue 45: msgspec said "Input data was truncated" of this whole body.
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "without the low surrogate"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi', "truncated"),  # it was cut short
    ],
)
def test_a_lone_surrogate_at_the_end_is_named_not_called_truncated(base_url: str, body: bytes, words: str) -> None:
    json_body = {"content-type": "application/json"}
    error = _error(httpx.post(f"{base_url}/v1/chat/completions", content=body, headers=json_body), 400)
    assert words in error["message"], error["message"]


def test_unknown_model_and_route(base_url: str, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=HELLO)
    error = _error(httpx.post(f"{base_url}/v1/chat/completions", json={"model": "nope", "messages": HELLO}), 404)
    assert error["code"] == "model_not_found"
    _error(httpx.get(f"{base_url}/v1/models/nope"), 404)
    _error(httpx.get(f"{base_url}/v1/nothing-here"), 404)


def test_oversized_body(base_url: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 100_000}]}
    _error(httpx.post(f"{base_url}/v1/chat/completions", json=body), 413)


def test_openai_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=HELLO, temperature=5)
    assert "temperature" in str(info.value)


async def test_disconnect_mid_stream_frees_the_slot(base_url: str, app_state: tuple[str, object]) -> None:
    state = app_state[1]
    model = state.registry.loaded("tiny")  # type: ignore[attr-defined]
    async with httpx.AsyncClient(timeout=30) as http:
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 400, "stream": True, "extra": 1}
        async with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    break
        # The connection is closed: the engine must drop the request promptly.
        deadline = time.monotonic() + 5
        while model.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert model.active == 0
        after = await http.post(
            f"{base_url}/v1/chat/completions", json={"model": "tiny", "messages": HELLO, "max_tokens": 3}
        )
        assert after.status_code == 200


async def test_sixteen_concurrent_streams(aclient: openai.AsyncOpenAI) -> None:
    prompts = [[{"role": "user", "content": f"question number {i} about lists"}] for i in range(16)]

    async def one(messages: list[dict[str, str]], stream: bool) -> str:
        if not stream:
            result = await aclient.chat.completions.create(
                model="tiny", messages=messages, max_tokens=10 + len(messages[0]["content"]) % 7, temperature=0
            )
            return result.choices[0].message.content or ""
        chunks = await aclient.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=10 + len(messages[0]["content"]) % 7,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    together = await asyncio.gather(*(one(m, True) for m in prompts))
    alone = [await one(m, False) for m in prompts]
    assert together == alone
    await aclient.close()


def test_server_keeps_serving_after_errors(client: openai.OpenAI, base_url: str) -> None:
    for _ in range(3):
        httpx.post(f"{base_url}/v1/chat/completions", content=b"\x00\xff")
    threads = [threading.Thread(target=lambda: httpx.post(f"{base_url}/v1/completions", json={})) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2).choices


def test_cache_salt_keeps_users_apart(client: openai.OpenAI) -> None:
    """vLLM's cache_salt: a prompt computed under one salt is no hit for another salt or
    none (the side channel: cached_tokens and timing told user B what user A sent), and is
    for the same salt; on chat, completions, Responses and Messages alike."""
    secret = [{"role": "system", "content": "The PIN is 4711. Never tell it. " * 6}, {"role": "user", "content": "Hi"}]

    def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"cache_salt": salt}
        reply = client.chat.completions.create(
            model="tiny",
            messages=secret,
            max_tokens=2,
            temperature=0,
            extra_body=extra,  # type: ignore[arg-type]
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    first = cached("alice")
    assert first == 0
    deadline = time.monotonic() + 10
    while (hit := cached("alice")) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # the reply's rows go into the cache while the engine is idle
    assert hit > 32
    assert cached("bob") == 0 and cached(None) == 0
    base = str(client.base_url).rstrip("/")
    prompt = "The PIN is 1234. Never tell it. " * 8
    for _ in range(2):
        completion = httpx.post(
            f"{base}/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": "carol"},
        ).json()
    assert completion["usage"]["prompt_tokens_details"]["cached_tokens"] > 32
    other = httpx.post(
        f"{base}/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "cache_salt": "dave"}
    ).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for path, body in (
        ("responses", {"model": "tiny", "input": prompt, "max_output_tokens": 1, "cache_salt": "erin"}),
        (
            "messages",
            {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": prompt}], "cache_salt": "erin"},
        ),
    ):
        assert httpx.post(f"{base}/{path}", json=body).status_code == 200, path


def test_cached_prompt_tokens_are_reported(client: openai.OpenAI) -> None:
    """The next turn of a chat reuses the history from the prefix cache: OpenAI's
    usage.prompt_tokens_details.cached_tokens says how much, whole and streamed."""
    system = {"role": "system", "content": "You sort lists and explain the order of things, briefly. " * 4}
    first = [system, {"role": "user", "content": "Sort 3 1 2"}]
    reply = client.chat.completions.create(model="tiny", messages=first, max_tokens=6, temperature=0)
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    second = [*first, {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "And 9 8?"}]
    again = client.chat.completions.create(model="tiny", messages=second, max_tokens=6, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 32 <= cached < again.usage.prompt_tokens
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=second,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    # the same prompt again: all but its last token (see _prefix_cache)
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    metrics = httpx.get(str(client.base_url).replace("/v1/", "/metrics")).text
    hits = next(
        line for line in metrics.splitlines() if line.startswith('ortserve_prefix_cache_hits_total{model="tiny"}')
    )
    assert float(hits.split()[-1]) >= 2
    assert 'ortserve_prefix_cache_bytes{model="tiny"}' in metrics
    assert 'ortserve_kv_live_bytes{model="tiny"} 0.0' in metrics  # nothing runs now
