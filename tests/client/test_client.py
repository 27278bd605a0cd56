"""The async client: every method and error path against mocks (respx), and the wire
contract against the real server on a loopback port."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator, Iterator

import httpx
import msgspec
import pytest
import respx
from ortserve_client import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServiceUnavailableError,
    StreamError,
)
from ortserve_client import protocol as p

pytestmark = pytest.mark.anyio
BASE = "http://testserver/v1"


@pytest.fixture
async def client() -> AsyncIterator[AsyncClient]:
    async with AsyncClient(BASE, max_retries=2) as c:
        yield c


def chat_json(content: str = "hi there") -> dict[str, object]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "some_future_field": {"nested": True},
    }


def sse(*payloads: object) -> bytes:
    return b"".join(b"data: " + json.dumps(x).encode() + b"\n\n" for x in payloads) + b"data: [DONE]\n\n"


def chunk(text: str | None, finish: str | None = None) -> dict[str, object]:
    delta = {} if text is None else {"content": text}
    return {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }


@respx.mock
async def test_chat_request_and_response(client: AsyncClient) -> None:
    route = respx.post(f"{BASE}/chat/completions").mock(return_value=httpx.Response(200, json=chat_json()))
    result = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=5, stop=["x"], top_k=3
    )
    assert isinstance(result, p.ChatCompletion)
    assert result.choices[0].message.content == "hi there"
    assert result.usage is not None and result.usage.total_tokens == 5
    sent = json.loads(route.calls.last.request.content)
    assert sent == {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "stream": False,
        "stop": ["x"],
        "top_k": 3,
    }


async def test_bad_arguments_are_a_type_error(client: AsyncClient) -> None:
    with pytest.raises(TypeError, match="max_tokens"):
        await client.chat.completions.create(model="m", messages=[], max_tokens="many")


@respx.mock
async def test_stream_yields_chunks_until_done(client: AsyncClient) -> None:
    respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, content=sse(chunk("a"), chunk("b"), chunk(None, "stop")))
    )
    stream = await client.chat.completions.create(model="m", messages=[], stream=True)
    chunks = [c async for c in stream]
    assert [c.choices[0].delta.content for c in chunks] == ["a", "b", msgspec.UNSET]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_leaving_a_stream_early_closes_the_response() -> None:
    closed: list[bool] = []

    class Body(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for i in range(100):
                yield b"data: " + json.dumps(chunk(str(i))).encode() + b"\n\n"

        async def aclose(self) -> None:
            closed.append(True)

    transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=Body()))
    async with AsyncClient(BASE, transport=transport) as client:
        stream = await client.chat.completions.create(model="m", messages=[], stream=True)
        async with stream:
            async for item in stream:
                assert item.choices[0].delta.content == "0"
                break
    assert closed == [True]
    assert stream.response.is_closed


@respx.mock
async def test_error_in_the_middle_of_a_stream(client: AsyncClient) -> None:
    error = {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    respx.post(f"{BASE}/chat/completions").mock(return_value=httpx.Response(200, content=sse(chunk("a"), error)))
    stream = await client.chat.completions.create(model="m", messages=[], stream=True)
    with pytest.raises(StreamError, match="boom") as info:
        async for _ in stream:
            pass
    assert info.value.body is not None and info.value.body.error.type == "server_error"


@respx.mock
async def test_completions_and_streamed_completions(client: AsyncClient) -> None:
    body = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "xyz", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4},
    }
    route = respx.post(f"{BASE}/completions").mock(return_value=httpx.Response(200, json=body))
    result = await client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=3)
    assert result.choices[0].text == "xyz"
    assert json.loads(route.calls.last.request.content)["prompt"] == [1, 2, 3]
    route.mock(return_value=httpx.Response(200, content=sse(body, body)))
    stream = await client.completions.create(model="m", prompt="x", stream=True)
    assert [c.choices[0].text async for c in stream] == ["xyz", "xyz"]


@respx.mock
async def test_embeddings_float_and_base64(client: AsyncClient) -> None:
    vector = [0.5, -1.25, 3.0]
    encoded = base64.b64encode(struct.pack("<3f", *vector)).decode()

    def reply(request: httpx.Request) -> httpx.Response:
        fmt = json.loads(request.content)["encoding_format"]
        embedding: object = encoded if fmt == "base64" else vector
        return httpx.Response(
            200,
            json={
                "object": "list",
                "model": "e",
                "data": [{"object": "embedding", "index": 0, "embedding": embedding}],
                "usage": {"prompt_tokens": 2, "total_tokens": 2},
            },
        )

    respx.post(f"{BASE}/embeddings").mock(side_effect=reply)
    as_floats = await client.embeddings.create(model="e", input="hi")
    as_base64 = await client.embeddings.create(model="e", input=["hi"], encoding_format="base64")
    assert as_floats.data[0].embedding == vector
    assert as_base64.data[0].embedding == vector


@respx.mock
async def test_models_tokenize_detokenize_health(client: AsyncClient) -> None:
    respx.get(f"{BASE}/models").mock(
        return_value=httpx.Response(
            200, json={"object": "list", "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "o"}]}
        )
    )
    respx.get(f"{BASE}/models/m").mock(
        return_value=httpx.Response(200, json={"id": "m", "object": "model", "created": 1, "owned_by": "o"})
    )
    tok = respx.post(f"{BASE}/tokenize").mock(
        return_value=httpx.Response(200, json={"tokens": [1, 2], "count": 2, "max_model_len": 9})
    )
    respx.post(f"{BASE}/detokenize").mock(return_value=httpx.Response(200, json={"prompt": "ab"}))
    respx.get("http://testserver/health").mock(
        return_value=httpx.Response(503, json={"status": "loading", "models": [{"id": "m", "status": "loading"}]})
    )
    assert [m.id for m in (await client.models.list()).data] == ["m"]
    assert (await client.models.retrieve("m")).owned_by == "o"
    assert (await client.tokenize(model="m", prompt="ab")).tokens == [1, 2]
    assert json.loads(tok.calls.last.request.content) == {"model": "m", "prompt": "ab"}
    assert (await client.detokenize(model="m", tokens=[1, 2])).prompt == "ab"
    assert (await client.health()).status == "loading"


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, BadRequestError),
        (401, AuthenticationError),
        (404, NotFoundError),
        (413, PayloadTooLargeError),
        (429, RateLimitError),
        (500, InternalServerError),
        (503, ServiceUnavailableError),
        (418, APIStatusError),
    ],
)
@respx.mock
async def test_status_errors(status: int, cls: type[APIStatusError]) -> None:
    body = {"error": {"message": "the field is wrong", "type": "invalid_request_error", "param": "x", "code": None}}
    route = respx.get(f"{BASE}/models").mock(
        return_value=httpx.Response(status, json=body, headers={"x-request-id": "req-9", "retry-after": "0"})
    )
    async with AsyncClient(BASE, max_retries=1) as client:
        with pytest.raises(cls) as info:
            await client.models.list()
    assert type(info.value) is cls
    assert info.value.status_code == status
    assert info.value.body is not None and info.value.body.error.param == "x"
    assert info.value.request_id == "req-9"
    assert "the field is wrong" in str(info.value)
    assert route.call_count == (2 if status in (429, 503) else 1)


@respx.mock
async def test_retry_after_then_success(client: AsyncClient) -> None:
    route = respx.get(f"{BASE}/models").mock(
        side_effect=[
            httpx.Response(503, headers={"retry-after": "0.05"}, json={"error": {"message": "busy", "type": "t"}}),
            httpx.Response(200, json={"object": "list", "data": []}),
        ]
    )
    assert (await client.models.list()).data == []
    assert route.call_count == 2


@respx.mock
async def test_no_retry_for_400(client: AsyncClient) -> None:
    route = respx.get(f"{BASE}/models").mock(return_value=httpx.Response(400, text="not json at all"))
    with pytest.raises(BadRequestError) as info:
        await client.models.list()
    assert info.value.body is None and "not json at all" in str(info.value)
    assert route.call_count == 1


@respx.mock
async def test_connection_errors_are_retried_then_explained() -> None:
    route = respx.get(f"{BASE}/models").mock(side_effect=httpx.ConnectError("refused"))
    async with AsyncClient(BASE, max_retries=1) as client:
        with pytest.raises(APIConnectionError, match=r"could not connect to the ortserve server at .*is it running"):
            await client.models.list()
    assert route.call_count == 2
    respx.get(f"{BASE}/models").mock(side_effect=httpx.ReadTimeout("slow"))
    async with AsyncClient(BASE, max_retries=0) as client:
        with pytest.raises(APITimeoutError):
            await client.models.list()


@respx.mock
async def test_api_key_header(monkeypatch: pytest.MonkeyPatch) -> None:
    route = respx.get(f"{BASE}/models").mock(return_value=httpx.Response(200, json={"object": "list", "data": []}))
    async with AsyncClient(BASE, api_key="k1") as client:
        await client.models.list()
    assert route.calls.last.request.headers["authorization"] == "Bearer k1"
    monkeypatch.setenv("ORTSERVE_API_KEY", "from-env")
    async with AsyncClient(BASE) as client:
        await client.models.list()
    assert route.calls.last.request.headers["authorization"] == "Bearer from-env"


# -- contract with the real server -------------------------------------------------------


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    pytest.importorskip("ortserve_server", reason="the contract test needs the server installed")
    from ortserve_server import ServerConfig, create_app
    from serving import TINY_MODEL, running

    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}))) as url:
        yield url


async def test_contract_with_the_real_server(server_url: str) -> None:
    async with AsyncClient(f"{server_url}/v1") as client:
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        messages = [{"role": "user", "content": "hi"}]
        plain = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
        stream = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
        )
        text = ""
        async for c in stream:
            for choice in c.choices:
                if isinstance(choice.delta.content, str):
                    text += choice.delta.content
        assert text == plain.choices[0].message.content
        tokens = await client.tokenize(model="tiny", prompt="hello world")
        assert (await client.detokenize(model="tiny", tokens=tokens.tokens)).prompt == "hello world"
        assert (await client.health()).status == "ok"
        with pytest.raises(NotFoundError) as info:
            await client.chat.completions.create(model="nope", messages=messages)
        assert info.value.body is not None and info.value.body.error.code == "model_not_found"
        with pytest.raises(BadRequestError) as bad:
            await client.chat.completions.create(model="tiny", messages=messages, temperature=9)
        assert bad.value.body is not None and bad.value.body.error.param == "temperature"
