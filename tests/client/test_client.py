"""The async client: every method and error path against mocks (respx), and the wire
contract against the real server on a loopback port."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

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
    OrtServeError,
    PayloadTooLargeError,
    PermissionDeniedError,
    RateLimitError,
    ServiceUnavailableError,
    StreamError,
    _transport,
)
from ortserve_client import protocol as p

pytestmark = pytest.mark.anyio
BASE = "http://testserver/v1"


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The client's backoff sleeps, recorded instead of slept."""
    recorded: list[float] = []

    async def sleep(seconds: float) -> None:
        recorded.append(seconds)

    monkeypatch.setattr(_transport, "_sleep", sleep)
    return recorded


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
        await client.chat.completions.create(model="m", messages=[], max_tokens="many")  # type: ignore[call-overload]


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
        (403, PermissionDeniedError),
        (404, NotFoundError),
        (413, PayloadTooLargeError),
        (429, RateLimitError),
        (500, InternalServerError),
        (503, ServiceUnavailableError),
        (418, APIStatusError),
    ],
)
@respx.mock
async def test_status_errors(status: int, cls: type[APIStatusError], sleeps: list[float]) -> None:
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
    assert sleeps == ([0.0] if status in (429, 503) else [])
    assert info.value.response is not None and info.value.response.status_code == status


@respx.mock
async def test_retry_after_then_success(client: AsyncClient, sleeps: list[float]) -> None:
    route = respx.get(f"{BASE}/models").mock(
        side_effect=[
            httpx.Response(503, headers={"retry-after": "1.5"}, json={"error": {"message": "busy", "type": "t"}}),
            httpx.Response(429, headers={"retry-after": "2"}, json={"error": {"message": "slow down", "type": "t"}}),
            httpx.Response(200, json={"object": "list", "data": []}),
        ]
    )
    assert (await client.models.list()).data == []
    assert route.call_count == 3
    assert sleeps == [1.5, 2.0]


@respx.mock
async def test_no_retry_for_400(client: AsyncClient, sleeps: list[float]) -> None:
    route = respx.get(f"{BASE}/models").mock(return_value=httpx.Response(400, text="not json at all"))
    with pytest.raises(BadRequestError) as info:
        await client.models.list()
    assert info.value.body is None and "not json at all" in str(info.value)
    assert route.call_count == 1


@respx.mock
async def test_connection_errors_are_retried_then_explained(sleeps: list[float]) -> None:
    route = respx.get(f"{BASE}/models").mock(side_effect=httpx.ConnectError("refused"))
    async with AsyncClient(BASE, max_retries=1) as client:
        with pytest.raises(APIConnectionError) as info:
            await client.models.list()
    assert str(info.value).startswith(f"could not connect to the ortserve server at {BASE}/models: is it running?")
    assert info.value.url == f"{BASE}/models"
    assert isinstance(info.value.__cause__, httpx.ConnectError)
    assert route.call_count == 2
    assert len(sleeps) == 1 and 0.25 * 0.75 <= sleeps[0] <= 0.25 * 1.25


@respx.mock
async def test_connect_timeouts_are_retried_read_timeouts_are_not(sleeps: list[float]) -> None:
    route = respx.get(f"{BASE}/models").mock(
        side_effect=[httpx.ConnectTimeout("syn"), httpx.Response(200, json={"object": "list", "data": []})]
    )
    async with AsyncClient(BASE, max_retries=2) as client:
        assert (await client.models.list()).data == []
        assert route.call_count == 2
        # After a read timeout the generation may be running: sending it again would repeat it.
        route.side_effect = httpx.ReadTimeout("slow")
        with pytest.raises(APITimeoutError, match="did not answer in time"):
            await client.models.list()
    assert route.call_count == 3


@respx.mock
async def test_max_retries_zero_disables_retries(sleeps: list[float]) -> None:
    route = respx.get(f"{BASE}/models").mock(
        return_value=httpx.Response(503, headers={"retry-after": "1"}, json={"error": {"message": "busy", "type": "t"}})
    )
    async with AsyncClient(BASE, max_retries=0) as client:
        with pytest.raises(ServiceUnavailableError, match="busy"):
            await client.models.list()
    assert route.call_count == 1 and sleeps == []


@pytest.mark.parametrize(
    ("retry_after", "expected"),
    [("3", [3.0]), ("-4", [0.0]), ("7200", [60.0]), ("Wed, 21 Oct 2015 07:28:00 GMT", None), ("nan", None)],
)
@respx.mock
async def test_retry_after_values(retry_after: str, expected: list[float] | None, sleeps: list[float]) -> None:
    respx.get(f"{BASE}/models").mock(
        side_effect=[
            httpx.Response(429, headers={"retry-after": retry_after}, json={"error": {"message": "m", "type": "t"}}),
            httpx.Response(200, json={"object": "list", "data": []}),
        ]
    )
    async with AsyncClient(BASE, max_retries=1) as client:
        await client.models.list()
    if expected is None:  # not seconds: the exponential backoff
        assert len(sleeps) == 1 and 0.1875 <= sleeps[0] <= 0.3125
    else:
        assert sleeps == expected


def test_backoff_grows_exponentially_with_jitter() -> None:
    for attempt, base in enumerate([0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0]):
        delays = {_transport._backoff(attempt, None) for _ in range(20)}
        assert all(base * 0.75 <= d <= base * 1.25 for d in delays)
        assert len(delays) > 1  # jittered


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
    monkeypatch.delenv("ORTSERVE_API_KEY")
    async with AsyncClient(BASE, headers={"x-tenant": "t1"}) as client:
        await client.models.list()
    assert "authorization" not in route.calls.last.request.headers
    assert route.calls.last.request.headers["x-tenant"] == "t1"


@respx.mock
async def test_chat_tools_and_formats_as_structs_or_dicts(client: AsyncClient) -> None:
    """Nested options may be Structs or OpenAI-shaped dicts; both encode to the same JSON."""
    route = respx.post(f"{BASE}/chat/completions").mock(return_value=httpx.Response(200, json=chat_json()))
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
    await client.chat.completions.create(
        model="m",
        messages=[
            p.SystemMessage(content="be brief"),
            p.UserMessage(
                content=[p.TextContentPart(text="weather?"), p.ImageContentPart(image_url=p.ImageURL(url="data:x"))]
            ),
            p.AssistantMessage(
                tool_calls=[
                    p.ToolCall(id="call_1", function=p.FunctionCall(name="weather", arguments='{"city":"Oslo"}'))
                ]
            ),
            p.ToolMessage(content="sunny", tool_call_id="call_1"),
        ],
        tools=[p.Tool(function=p.FunctionDefinition(name="weather", parameters=schema))],
        tool_choice=p.NamedToolChoice(function=p.NamedToolChoiceFunction(name="weather")),
        response_format=p.ResponseFormatJSONSchema(json_schema=p.JSONSchema(name="w", schema=schema)),
        stream_options=p.StreamOptions(include_usage=True),
        temperature=None,
    )
    from_structs = json.loads(route.calls.last.request.content)
    await client.chat.completions.create(
        model="m",
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "weather?"},
                    {"type": "image_url", "image_url": {"url": "data:x"}},
                ],
            },
            {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        ],
        tools=[{"type": "function", "function": {"name": "weather", "parameters": schema}}],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        stream_options={"include_usage": True},
        temperature=None,
    )
    from_dicts = json.loads(route.calls.last.request.content)
    assert from_structs == from_dicts
    assert from_dicts["messages"][2] == {"role": "assistant", "tool_calls": [call]}
    assert from_dicts["tools"] == [{"type": "function", "function": {"name": "weather", "parameters": schema}}]
    assert from_dicts["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert from_dicts["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    assert from_dicts["temperature"] is None  # an explicit null is sent as null, an absent option not at all
    assert "top_p" not in from_dicts


@respx.mock
async def test_chat_reply_with_tool_calls(client: AsyncClient) -> None:
    body = chat_json()
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body["choices"] = [
        {
            "index": 0,
            "message": {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]},
            "finish_reason": "tool_calls",
            "logprobs": None,
        }
    ]
    respx.post(f"{BASE}/chat/completions").mock(return_value=httpx.Response(200, json=body))
    result = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], tool_choice="required"
    )
    message = result.choices[0].message
    assert message.content is None and result.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls == [p.ToolCall(id="call_1", function=p.FunctionCall(name="f", arguments="{}"))]


async def test_unknown_keyword_arguments_are_a_type_error(client: AsyncClient) -> None:
    with pytest.raises(TypeError, match="temprature"):
        await client.chat.completions.create(model="m", messages=[], temprature=0.5)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        await client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])


def test_keyword_arguments_match_the_request_structs() -> None:
    """The TypedDicts behind ``**options`` list every optional field of their Struct."""
    from ortserve_client import _params

    def fields(struct: type[msgspec.Struct]) -> set[str]:
        return {f.name for f in msgspec.structs.fields(struct)}

    def keys(params: Any) -> set[str]:
        return set(params.__required_keys__) | set(params.__optional_keys__)

    assert keys(_params.ChatCompletionParams) == fields(p.ChatCompletionRequest) - {"model", "messages", "stream"}
    assert keys(_params.CompletionParams) == fields(p.CompletionRequest) - {"model", "prompt", "stream"}
    assert keys(_params.EmbeddingParams) == fields(p.EmbeddingRequest) - {"model", "input", "encoding_format"}


@respx.mock
async def test_stream_request_body_and_sse_framing(client: AsyncClient) -> None:
    """Comments, event names, CRLF and multi-line ``data`` follow the SSE rules."""
    first = json.dumps(chunk("a"))
    split = json.dumps(chunk("b"), indent=1).split("\n")  # one JSON document over several data lines
    body = (
        ": keep-alive\r\n\r\n"
        + f"event: message\r\ndata: {first}\r\n\r\n"
        + "".join(f"data: {line}\n" for line in split)
        + "\n"
        + "data: [DONE]\n\n"
        + f"data: {json.dumps(chunk('never'))}\n\n"
    )
    route = respx.post(f"{BASE}/chat/completions").mock(
        return_value=httpx.Response(200, content=body.encode(), headers={"x-request-id": "r-1"})
    )
    async with await client.chat.completions.create(
        model="m", messages=[], stream=True, stream_options={"include_usage": True}
    ) as stream:
        assert stream.request_id == "r-1"
        assert [c.choices[0].delta.content async for c in stream] == ["a", "b"]
    assert json.loads(route.calls.last.request.content) == {
        "model": "m",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert stream.response.is_closed


def slow_body(closed: list[bool]) -> httpx.AsyncByteStream:
    class Body(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for i in range(100):
                yield b"data: " + json.dumps(chunk(str(i))).encode() + b"\n\n"

        async def aclose(self) -> None:
            closed.append(True)

    return Body()


async def test_aclose_without_reading_closes_the_response() -> None:
    closed: list[bool] = []
    transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=slow_body(closed)))
    async with AsyncClient(BASE, transport=transport) as client:
        stream = await client.chat.completions.create(model="m", messages=[], stream=True)
        await stream.aclose()
        await stream.aclose()  # twice is fine
        assert closed == [True] and stream.response.is_closed
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()


async def test_an_exception_in_the_loop_closes_the_response() -> None:
    closed: list[bool] = []
    transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=slow_body(closed)))
    async with AsyncClient(BASE, transport=transport) as client:
        stream = await client.chat.completions.create(model="m", messages=[], stream=True)
        with pytest.raises(RuntimeError, match="caller"):
            async with stream:
                async for _ in stream:
                    raise RuntimeError("the caller gave up")
    assert closed == [True] and stream.response.is_closed


@pytest.mark.parametrize(
    "event",
    [
        'event: error\ndata: {"error": {"message": "out of memory", "type": "server_error"}}\n\n',
        'data: { "error" : {"message": "out of memory", "type": "server_error", "param": null, "code": "oom"}}\n\n',
    ],
)
@respx.mock
async def test_error_events_raise_stream_error(client: AsyncClient, event: str) -> None:
    body = f"data: {json.dumps(chunk('a'))}\n\n{event}data: [DONE]\n\n"
    respx.post(f"{BASE}/chat/completions").mock(return_value=httpx.Response(200, content=body.encode()))
    seen: list[object] = []
    stream = await client.chat.completions.create(model="m", messages=[], stream=True)
    with pytest.raises(StreamError, match="mid-stream: out of memory") as info:
        async for c in stream:
            seen.append(c.choices[0].delta.content)
    assert seen == ["a"]
    assert info.value.body is not None and info.value.body.error.message == "out of memory"
    assert stream.response.is_closed


@respx.mock
async def test_a_chunk_that_does_not_decode_is_a_stream_error(client: AsyncClient) -> None:
    respx.post(f"{BASE}/chat/completions").mock(return_value=httpx.Response(200, content=b"data: {not json\n\n"))
    stream = await client.chat.completions.create(model="m", messages=[], stream=True)
    with pytest.raises(StreamError, match="unexpected event") as info:
        await stream.__anext__()
    assert info.value.body is None
    assert isinstance(info.value.__cause__, msgspec.DecodeError)


async def test_a_connection_lost_mid_stream_is_a_connection_error() -> None:
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b"data: " + json.dumps(chunk("a")).encode() + b"\n\n"
            raise httpx.RemoteProtocolError("peer closed connection")

    transport = httpx.MockTransport(lambda request: httpx.Response(200, stream=Broken()))
    async with AsyncClient(BASE, transport=transport) as client:
        stream = await client.chat.completions.create(model="m", messages=[], stream=True)
        assert (await stream.__anext__()).choices[0].delta.content == "a"
        with pytest.raises(APIConnectionError, match="lost the connection"):
            await stream.__anext__()
    assert stream.response.is_closed


@respx.mock
async def test_stream_requests_retry_and_raise_before_the_stream_starts(
    client: AsyncClient, sleeps: list[float]
) -> None:
    error = {"error": {"message": "bad stop", "type": "invalid_request_error", "param": "stop", "code": None}}
    route = respx.post(f"{BASE}/chat/completions").mock(
        side_effect=[
            httpx.Response(503, headers={"retry-after": "0"}, json={"error": {"message": "busy", "type": "t"}}),
            httpx.Response(200, content=sse(chunk("ok"))),
            httpx.Response(400, json=error),
        ]
    )
    stream = await client.chat.completions.create(model="m", messages=[], stream=True)
    assert [c.choices[0].delta.content async for c in stream] == ["ok"]
    with pytest.raises(BadRequestError) as info:
        await client.chat.completions.create(model="m", messages=[], stream=True, stop="x")
    assert info.value.body is not None and info.value.body.error.param == "stop"
    assert route.call_count == 3 and sleeps == [0.0]


@respx.mock
async def test_embedding_options_and_token_inputs(client: AsyncClient) -> None:
    reply = {
        "object": "list",
        "model": "e",
        "data": [{"object": "embedding", "index": i, "embedding": [float(i)]} for i in range(2)],
        "usage": {"prompt_tokens": 4, "total_tokens": 4},
    }
    route = respx.post(f"{BASE}/embeddings").mock(return_value=httpx.Response(200, json=reply))
    result = await client.embeddings.create(model="e", input=[[1, 2], [3, 4]], dimensions=1, truncate=True, user="u")
    assert json.loads(route.calls.last.request.content) == {
        "model": "e",
        "input": [[1, 2], [3, 4]],
        "encoding_format": "float",
        "dimensions": 1,
        "user": "u",
        "truncate": True,
    }
    assert [d.embedding for d in result.data] == [[0.0], [1.0]]
    assert result.usage.prompt_tokens == 4


@respx.mock
async def test_a_base64_embedding_of_a_bad_length_is_an_error(client: AsyncClient) -> None:
    bad = base64.b64encode(b"\x00" * 6).decode()
    respx.post(f"{BASE}/embeddings").mock(
        return_value=httpx.Response(
            200,
            json={
                "object": "list",
                "model": "e",
                "data": [{"object": "embedding", "index": 0, "embedding": bad}],
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
            },
        )
    )
    with pytest.raises(OrtServeError, match="6 bytes"):
        await client.embeddings.create(model="e", input="x", encoding_format="base64")


@respx.mock
async def test_tokenize_chat_messages(client: AsyncClient) -> None:
    route = respx.post(f"{BASE}/tokenize").mock(
        return_value=httpx.Response(200, json={"tokens": [5, 6, 7], "count": 3, "max_model_len": 128})
    )
    result = await client.tokenize(model="m", messages=[{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert result == p.TokenizeResponse(tokens=[5, 6, 7], count=3, max_model_len=128)
    assert json.loads(route.calls.last.request.content) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": False,
    }


@pytest.mark.parametrize(
    ("base_url", "health_url"),
    [
        ("http://h:8000/v1", "http://h:8000/health"),
        ("http://h:8000/v1/", "http://h:8000/health"),
        ("http://h/llm/v1", "http://h/llm/health"),
        ("http://h:8000", "http://h:8000/health"),
    ],
)
@respx.mock
async def test_health_is_at_the_server_root(base_url: str, health_url: str) -> None:
    route = respx.get(health_url).mock(
        return_value=httpx.Response(200, json={"status": "ok", "models": [{"id": "m", "status": "ready"}]})
    )
    async with AsyncClient(base_url) as client:
        health = await client.health()
    assert health == p.Health(status="ok", models=[p.HealthModel(id="m", status="ready")])
    assert route.call_count == 1


@respx.mock
async def test_health_503_with_an_error_body_raises(client: AsyncClient, sleeps: list[float]) -> None:
    route = respx.get("http://testserver/health").mock(
        return_value=httpx.Response(503, json={"error": {"message": "draining", "type": "unavailable"}})
    )
    with pytest.raises(ServiceUnavailableError, match="draining"):
        await client.health()
    assert route.call_count == 1 and sleeps == []


@respx.mock
async def test_a_success_that_does_not_decode_is_an_ortserve_error(client: AsyncClient) -> None:
    respx.get(f"{BASE}/models").mock(return_value=httpx.Response(200, json={"unexpected": True}))
    with pytest.raises(OrtServeError, match=r"unexpected response from .*/models"):
        await client.models.list()


@respx.mock
async def test_transcriptions_upload_multipart(client: AsyncClient, tmp_path: Path) -> None:
    def reply(request: httpx.Request) -> httpx.Response:
        body = request.content
        assert request.headers["content-type"].startswith("multipart/form-data")
        assert b'name="model"\r\n\r\nwhisper' in body and b'name="language"\r\n\r\nen' in body
        assert b'filename="clip.wav"' in body and b"RIFF" in body
        if b'name="response_format"\r\n\r\ntext' in body:
            return httpx.Response(200, text="hello")
        return httpx.Response(200, json={"text": "hello", "unknown": 1})

    respx.post(f"{BASE}/audio/transcriptions").mock(side_effect=reply)
    audio = tmp_path / "clip.wav"
    audio.write_bytes(b"RIFF....")
    assert await client.audio.transcriptions.create(model="whisper", file=audio, language="en") == p.Transcription(
        text="hello"
    )
    text = await client.audio.transcriptions.create(
        model="whisper", file=("clip.wav", b"RIFF...."), response_format="text", language="en"
    )
    assert text == "hello"


@pytest.mark.timing
def test_import_is_light() -> None:
    code = (
        "import sys, time; t = time.perf_counter(); import ortserve_client; t = time.perf_counter() - t; "
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'onnxruntime', 'onnxruntime_genai', 'litestar', "
        "'numpy', 'ortserve_server', 'ortserve_runtime', 'uvicorn', 'httpx'}); print(heavy, t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ")
    assert out[0] == "[]"
    assert float(out[1]) < 1.0
    # The protocol Structs alone (what the server imports) need msgspec only; the client
    # brings httpx when first used.
    code = "import sys; from ortserve_client import protocol; import ortserve_client; ortserve_client.AsyncClient; print('httpx' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "True"
    )


# -- contract with the real server -------------------------------------------------------


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    pytest.importorskip("ortserve_server", reason="the contract test needs the server installed")
    from images import TINY_PHI3V
    from ortserve_server import ServerConfig, create_app
    from serving import TINY_MODEL, running

    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL, "vision": TINY_PHI3V}))) as url:
        yield url


async def test_contract_with_the_real_server(server_url: str) -> None:
    async with AsyncClient(f"{server_url}/v1") as client:
        assert [m.id for m in (await client.models.list()).data] == ["tiny", "vision"]
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


async def test_logprobs_and_sampling_keywords_with_the_real_server(server_url: str) -> None:
    """The new keyword arguments reach the server and its logprobs decode as typed Structs."""
    async with AsyncClient(f"{server_url}/v1") as client:
        messages = [{"role": "user", "content": "hi"}]
        chat = await client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            logit_bias={"7": -100},
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=0.5,
        )
        logprobs = chat.choices[0].logprobs
        assert isinstance(logprobs, p.ChoiceLogprobs) and logprobs.content
        first = logprobs.content[0]
        assert isinstance(first, p.ChatCompletionTokenLogprob) and first.bytes is not None
        assert [type(t) for t in first.top_logprobs] == [p.TopLogprob, p.TopLogprob]
        assert first.top_logprobs[0].token == first.token  # greedy: the best token
        chunks = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, temperature=0, logprobs=True, stream=True
        )
        streamed = [t.token async for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content or []]
        assert streamed == [t.token for t in logprobs.content]
        legacy = await client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0, logprobs=1)
        assert isinstance(legacy.choices[0].logprobs, p.CompletionLogprobs)
        assert len(legacy.choices[0].logprobs.tokens) == len(legacy.choices[0].logprobs.text_offset) > 0
        with pytest.raises(BadRequestError) as bad:
            await client.chat.completions.create(model="tiny", messages=messages, logit_bias={"1": 500})
        assert bad.value.body is not None and bad.value.body.error.param == "logit_bias"


async def test_a_prediction_with_the_real_server(server_url: str) -> None:
    """``prediction`` as a Struct or a dict; usage decodes the prediction token counts."""
    async with AsyncClient(f"{server_url}/v1") as client:
        messages = [{"role": "user", "content": "hi"}]
        plain = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
        text = plain.choices[0].message.content
        assert isinstance(text, str)
        for prediction in (p.PredictionContent(content=text), {"type": "content", "content": text}):
            chat = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=24, temperature=0, prediction=prediction
            )
            assert chat.choices[0].message.content == text
            assert chat.usage is not None and chat.usage.completion_tokens_details is not None
            assert chat.usage.completion_tokens_details.accepted_prediction_tokens > 0


async def test_images_as_protocol_structs(server_url: str) -> None:
    from images import image_bytes

    message = p.UserMessage(
        content=[p.ImageContentPart.from_bytes(image_bytes()), p.TextContentPart(text="What is this?")]
    )
    async with AsyncClient(f"{server_url}/v1") as client:
        reply = await client.chat.completions.create(model="vision", messages=[message], max_tokens=4, temperature=0)
        assert reply.choices[0].message.content and reply.usage is not None and reply.usage.prompt_tokens > 300
        with pytest.raises(BadRequestError) as bad:
            await client.chat.completions.create(model="tiny", messages=[message], max_tokens=4)
        assert bad.value.body is not None and bad.value.body.error.param == "messages[0].content[0]"
