"""``AsyncClient.responses`` against the real server: typed Structs whole and streamed,
and the Responses API's error event raised as :class:`StreamError`."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import msgspec
import pytest
import respx
from ortserve_client import AsyncClient, BadRequestError, NotFoundError, StreamError
from ortserve_client import responses_protocol as rp
from ortserve_client._responses import ResponseCreateParams

pytestmark = pytest.mark.anyio

ADD = rp.FunctionTool(
    name="add",
    parameters={
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    strict=True,
)


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    pytest.importorskip("ortserve_server", reason="the contract test needs the server installed")
    from ortserve_server import ServerConfig, create_app
    from serving import TINY_MODEL, running

    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}))) as url:
        yield url


def test_params_match_the_request_struct() -> None:
    optional = set(rp.ResponseCreateRequest.__struct_fields__) - {"model", "input", "stream"}
    assert set(ResponseCreateParams.__annotations__) == optional


async def test_create_whole_and_streamed(server_url: str) -> None:
    async with AsyncClient(f"{server_url}/v1") as client:
        whole = await client.responses.create(
            model="tiny", input="hi", instructions="Be brief", max_output_tokens=6, temperature=0
        )
        assert isinstance(whole, rp.Response) and whole.status == "incomplete"
        assert whole.usage is not None and whole.usage.output_tokens == 6
        stream = await client.responses.create(
            model="tiny", input="hi", instructions="Be brief", max_output_tokens=6, temperature=0, stream=True
        )
        events = [event async for event in stream]
        assert isinstance(events[0], rp.ResponseCreatedEvent)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if isinstance(e, rp.OutputTextDeltaEvent))
        assert text == whole.output_text
        last = events[-1]
        assert isinstance(last, rp.ResponseIncompleteEvent) and last.response.output_text == text


async def test_function_call_round_trip_with_structs_and_store(server_url: str) -> None:
    async with AsyncClient(f"{server_url}/v1") as client:
        first = await client.responses.create(
            model="tiny",
            input=[rp.InputMessage(role="user", content=[rp.InputText(text="Add 2 and 3")])],
            tools=[ADD],
            tool_choice=rp.ToolChoiceFunction(name="add"),
            store=True,
        )
        [call] = [item for item in first.output if isinstance(item, rp.FunctionCallItem)]
        jsonschema.validate(json.loads(call.arguments), ADD.parameters)
        result = rp.FunctionCallOutputItem(call_id=call.call_id, output='{"sum": 5}')
        follow = await client.responses.create(
            model="tiny", input=[result], previous_response_id=first.id, tools=[ADD], max_output_tokens=2
        )
        assert follow.previous_response_id == first.id and follow.usage is not None
        assert follow.usage.input_tokens_details.cached_tokens > 0
        assert (await client.responses.retrieve(first.id)).id == first.id
        listed = await client.responses.input_items(first.id, order="asc")
        [message] = listed.data
        assert isinstance(message, rp.InputMessage) and message.content == [rp.InputText(text="Add 2 and 3")]
        assert listed.first_id == listed.last_id == message.id and not listed.has_more
        assert (await client.responses.delete(first.id)).deleted is True
        with pytest.raises(NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(NotFoundError) as bad:
            await client.responses.create(model="tiny", input="hi", previous_response_id=first.id)
        assert bad.value.body is not None and bad.value.body.error.param == "previous_response_id"


async def test_error_event_raises() -> None:
    created = rp.ResponseCreatedEvent(
        sequence_number=0, response=rp.Response(id="resp_1", created_at=0, model="m", output=[], status="in_progress")
    )
    body = (
        b"event: response.created\ndata: " + msgspec.json.encode(created) + b"\n\n"
        b'event: error\ndata: {"type": "error", "sequence_number": 1, "code": "server_error", "message": "boom"}\n\n'
    )
    with respx.mock(base_url="http://test/v1") as mock:
        mock.post("/responses").respond(200, content=body, headers={"content-type": "text/event-stream"})
        async with AsyncClient("http://test/v1", max_retries=0) as client:
            stream = await client.responses.create(model="m", input="hi", stream=True)
            assert isinstance(await stream.__anext__(), rp.ResponseCreatedEvent)
            with pytest.raises(StreamError, match="boom"):
                await stream.__anext__()


async def test_bad_items_fail_before_sending() -> None:
    async with AsyncClient("http://test/v1", transport=httpx.MockTransport(lambda _: httpx.Response(500))) as client:
        with pytest.raises(TypeError, match=r"input items.*\$\[0\]\.content"):
            await client.responses.create(model="m", input=[{"role": "user", "content": 3}])


@pytest.fixture(scope="module")
def mcp_server_url() -> Iterator[str]:
    """The tiny model with the tests' MCP server (over stdio) configured as ``tools``."""
    pytest.importorskip("mcp", reason="the MCP test needs the server's mcp extra")
    import sys
    from pathlib import Path

    from ortserve_server import ServerConfig, create_app
    from ortserve_server._config import McpServer
    from serving import TINY_MODEL, running

    script = Path(__file__).resolve().parent.parent / "mcp_tools_server.py"
    tools = McpServer("tools", command=(sys.executable, str(script), "stdio"))
    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}, mcp_servers=(tools,)))) as url:
        yield url


async def test_mcp_items_and_events_are_typed(mcp_server_url: str) -> None:
    tools = [rp.McpTool(server_label="tools", allowed_tools=["add"])]  # approval: "always"
    async with AsyncClient(f"{mcp_server_url}/v1") as client:
        first = await client.responses.create(
            model="tiny",
            input="Add",
            tools=tools,
            tool_choice=rp.ToolChoiceMcp(server_label="tools", name="add"),
            store=True,
        )
        listing, asked = first.output
        assert isinstance(listing, rp.McpListToolsItem) and [t.name for t in listing.tools] == ["add"]
        assert isinstance(asked, rp.McpApprovalRequestItem) and asked.name == "add"
        stream = await client.responses.create(
            model="tiny",
            input=[rp.McpApprovalResponseItem(approval_request_id=asked.id, approve=True)],
            previous_response_id=first.id,
            tools=tools,
            max_output_tokens=4,
            stream=True,
        )
        events = [event async for event in stream]
    kinds = [type(event) for event in events]
    assert rp.McpCallInProgressEvent in kinds and rp.McpCallArgumentsDoneEvent in kinds
    assert rp.McpCallCompletedEvent in kinds
    final = events[-1]
    assert isinstance(final, rp.ResponseCompletedEvent | rp.ResponseIncompleteEvent)
    call = final.response.output[0]
    assert isinstance(call, rp.McpCallItem) and call.approval_request_id == asked.id
    arguments = json.loads(call.arguments)
    assert call.output is not None and int(call.output) == arguments["a"] + arguments["b"]


async def test_speech_whole_and_streamed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``client.audio.speech``: the whole file, and the same bytes as a stream."""
    pytest.importorskip("piper", reason="speech needs the runtime's voice extra")
    import io

    import soundfile
    from ortserve_server import ServerConfig, create_app
    from serving import running
    from voices import quiet_voice

    voice = quiet_voice(tmp_path_factory.mktemp("voice") / "joe")
    with running(create_app(ServerConfig(models={"joe": voice}))) as url:
        async with AsyncClient(f"{url}/v1") as client:
            whole = await client.audio.speech.create(model="joe", input="Hello. Goodbye.", response_format="wav")
            pieces = [
                piece
                async for piece in client.audio.speech.stream(
                    model="joe", input="Hello. Goodbye.", voice="joe", response_format="wav"
                )
            ]
            with pytest.raises(BadRequestError) as bad:
                await client.audio.speech.create(model="joe", input="Hi", voice="alloy")
    assert b"".join(pieces) == whole and len(pieces) >= 2
    samples, rate = soundfile.read(io.BytesIO(whole))
    assert rate == 22_050 and len(samples) > rate // 2
    assert bad.value.body is not None and bad.value.body.error.param == "voice"
