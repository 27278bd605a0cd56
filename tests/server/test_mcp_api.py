"""MCP tools the server calls itself, through the openai SDK's Responses API and the
anthropic SDK's MCP connector (``mcp_servers``), against real MCP servers (the official SDK's MCPServer) started by the tests: one over stdio, one over
streamable HTTP, and one that never answers.

The tiny model is random: it calls a tool when ``tool_choice`` forces it, with random
arguments (``add`` checks them by its answer), and answers with random text otherwise."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from ortserve_server import ServerConfig, create_app
from ortserve_server._config import McpServer
from serving import TINY_MODEL, running, watched

TOOLS_SERVER = Path(__file__).resolve().parent.parent / "mcp_tools_server.py"
FAULTY_SERVER = Path(__file__).resolve().parent.parent / "mcp_faulty_server.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _http_server(script: Path, *args: str) -> Iterator[str]:
    """``script http PORT *args`` in a process of its own; yields its URL."""
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, str(script), "http", str(port), *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError("the MCP test server did not start") from None
            time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="module")
def http_mcp() -> Iterator[str]:
    """The tools server over streamable HTTP."""
    with _http_server(TOOLS_SERVER) as url:
        yield url


@pytest.fixture(scope="module")
def faulty_http() -> Iterator[tuple[str, str, str]]:
    """The faulty server over streamable HTTP, and its crowded and heavy twins."""
    with (
        _http_server(FAULTY_SERVER) as faulty,
        _http_server(FAULTY_SERVER, "crowded") as crowded,
        _http_server(FAULTY_SERVER, "heavy") as heavy,
    ):
        yield faulty, crowded, heavy


@pytest.fixture(scope="module")
def marker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mcp") / "nap"


def _orphans(marker: Path) -> Path:
    """Where the ``orphaning`` server writes the pids of the helpers it leaves behind."""
    return marker.with_name("orphans")


@pytest.fixture(scope="module")
def url(http_mcp: str, faulty_http: tuple[str, str, str], marker: Path) -> Iterator[str]:
    config = ServerConfig(
        models={"tiny": TINY_MODEL},
        mcp_servers=(
            McpServer("tools", command=(sys.executable, str(TOOLS_SERVER), "stdio", str(marker))),
            McpServer("fragile", command=(sys.executable, str(TOOLS_SERVER), "stdio", str(marker), "fragile")),
            McpServer("faulty", command=(sys.executable, str(FAULTY_SERVER))),
            McpServer("crowded", command=(sys.executable, str(FAULTY_SERVER), "crowded")),
            McpServer("heavy", command=(sys.executable, str(FAULTY_SERVER), "heavy")),
            McpServer("orphaning", command=(sys.executable, str(FAULTY_SERVER), "orphan", str(_orphans(marker)))),
            McpServer("web", url=http_mcp),
            McpServer("faulty-web", url=faulty_http[0]),
            McpServer("crowded-web", url=faulty_http[1]),
            McpServer("heavy-web", url=faulty_http[2]),
            McpServer("hang", command=(sys.executable, "-c", "import time; time.sleep(600)")),
            McpServer("gone", command=("/nonexistent/mcp-server",)),
        ),
        mcp_allowed_urls=(http_mcp,),
        mcp_start_timeout=3.0,
        mcp_call_timeout=2.0,
        mcp_max_output_bytes=500,  # the tiny model's context is 1024 tokens
        mcp_max_message_bytes=1_000_000,  # the huge tool's 2 MB is past it; big's 200 KB is not
        mcp_max_tool_calls=2,  # Anthropic requests have no max_tool_calls
    )
    with running(create_app(config)) as base:
        yield base


def _mcp(label: str, **fields: Any) -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "server_url": "https://unused.example/mcp", **fields}


def _forced(label: str, name: str) -> dict[str, Any]:
    return {"type": "mcp", "server_label": label, "name": name}


def _force_alone(client: openai.OpenAI, label: str, name: str) -> Any:
    """A response that must call ``label``'s tool ``name`` (no other), once."""
    return client.responses.create(
        model="tiny",
        input=f"Use {name}",
        tools=[_mcp(label, require_approval="never", allowed_tools=[name])],
        tool_choice=_forced(label, name),  # type: ignore[arg-type]
        max_tool_calls=1,
        max_output_tokens=100,
    )


def _call_alone(client: openai.OpenAI, label: str, name: str) -> Any:
    """The ``mcp_call`` item of :func:`_force_alone`'s response."""
    return _force_alone(client, label, name).output[1]


def _types(response: Any) -> list[str]:
    return [item.type for item in response.output]


def _check_sums(calls: list[Any]) -> None:
    """Each ``add`` call's output is the sum of the arguments the model wrote: the MCP
    server really ran with them."""
    for call in calls:
        arguments = json.loads(call.arguments)
        assert call.error is None, call.error
        assert int(call.output) == arguments["a"] + arguments["b"]


def _calls_then_answer(response: Any) -> list[Any]:
    """The response's MCP calls, checked to come between the listing (if any) and the
    answer: a forced first turn calls; later turns answer (the random model may call again)."""
    kinds = _types(response)
    first = 1 if kinds[0] == "mcp_list_tools" else 0
    # max_output_tokens may run out before the answer: then the response is incomplete.
    last = len(kinds) - 1 if kinds[-1] == "message" or response.status != "incomplete" else len(kinds)
    assert kinds[first] == "mcp_call" and set(kinds[first:last]) == {"mcp_call"}, (kinds, response.status)
    assert last == len(kinds) or kinds[-1] == "message", (kinds, response.status)
    return [item for item in response.output[first:last] if item.output is not None or item.error is not None]


@pytest.mark.parametrize("label", ["tools", "web"], ids=["stdio", "http"])
def test_a_forced_call_loop_runs_the_tool_and_feeds_the_result_back(client: openai.OpenAI, label: str) -> None:
    tools: Any = [_mcp(label, require_approval="never", allowed_tools=["add"])]
    first = client.responses.create(
        model="tiny",
        input=f"Add two numbers ({label}, {time.time()})",
        tools=tools,
        tool_choice=_forced(label, "add"),  # type: ignore[arg-type]  # the SDK's union lacks this form
        max_tool_calls=2,
        max_output_tokens=100,
        store=True,
    )
    listing = first.output[0]
    assert listing.type == "mcp_list_tools" and listing.server_label == label
    assert [tool.name for tool in listing.tools] == ["add"]
    calls = _calls_then_answer(first)
    assert all(call.server_label == label and call.name == "add" for call in calls) and len(calls) <= 2
    _check_sums(calls)
    assert first.status in ("completed", "incomplete") and first.max_tool_calls == 2
    assert first.usage is not None
    # Two turns at least, the second's prompt the first's grown by the call and its result:
    # it is served from the prefix cache (at least the first turn's prompt).
    assert first.usage.input_tokens_details.cached_tokens > 0
    # The next step of the loop, from the stored response: listed already, so not again.
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input="And again",
        tools=tools,
        tool_choice=_forced(label, "add"),  # type: ignore[arg-type]
        max_tool_calls=1,
        max_output_tokens=100,
    )
    _check_sums(_calls_then_answer(second))
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2


def test_streamed_loop_sends_the_mcp_events_in_order(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            model="tiny",
            input=f"Add, streamed ({time.time()})",
            tools=[_mcp("tools", require_approval="never", allowed_tools=["add"])],
            tool_choice=_forced("tools", "add"),  # type: ignore[arg-type]
            max_tool_calls=1,
            max_output_tokens=100,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.mcp_list_tools.in_progress",
        "response.mcp_list_tools.completed",
        "response.output_item.done",
    ]
    assert kinds[6:12] == [
        "response.output_item.added",
        "response.mcp_call.in_progress",
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done",
        "response.mcp_call.completed",
        "response.output_item.done",
    ]
    # The random model's answer may run to max_output_tokens: then the response is incomplete.
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert _types(final) == ["mcp_list_tools", "mcp_call", "message"]
    _check_sums([final.output[1]])
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert [item.type for item in done] == ["mcp_list_tools", "mcp_call", "message"]
    assert done[1].output == final.output[1].output
    assert final.usage.output_tokens <= 100


def test_approval_round_trip_with_previous_response_id(client: openai.OpenAI) -> None:
    tools = [_mcp("tools", allowed_tools=["add"])]  # require_approval: "always" by default
    first = client.responses.create(
        model="tiny",
        input=f"Add ({time.time()})",
        tools=tools,  # type: ignore[arg-type]
        tool_choice=_forced("tools", "add"),  # type: ignore[arg-type]
        max_output_tokens=100,
        store=True,
    )
    assert _types(first) == ["mcp_list_tools", "mcp_approval_request"]
    asked = first.output[1]
    assert asked.name == "add" and asked.server_label == "tools"
    second = client.responses.create(
        model="tiny",
        previous_response_id=first.id,
        input=[{"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": True}],
        tools=tools,  # type: ignore[arg-type]
        max_output_tokens=100,
        store=True,
    )
    # Listed before: not again. The approved call is made first, then the model goes on.
    assert _types(second)[:1] == ["mcp_call"] and "mcp_list_tools" not in _types(second)
    call = second.output[0]
    assert call.approval_request_id == asked.id and call.arguments == asked.arguments
    _check_sums([call])
    # The same request again is an answer to a request answered already.
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="tiny",
            previous_response_id=second.id,
            input=[{"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": True}],
            tools=tools,  # type: ignore[arg-type]
        )
    assert caught.value.body["param"] == "input[0].approval_request_id"  # type: ignore[index]


def test_a_refused_approval_makes_no_call_and_works_without_storing(client: openai.OpenAI) -> None:
    tools = [_mcp("web", allowed_tools=["add"])]
    first = client.responses.create(
        model="tiny",
        input="Add",
        tools=tools,  # type: ignore[arg-type]
        tool_choice=_forced("web", "add"),  # type: ignore[arg-type]
        max_output_tokens=100,
    )
    asked = first.output[-1]
    assert asked.type == "mcp_approval_request"
    handed_back = [item.model_dump(exclude_none=True) for item in first.output]
    second = client.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Add"},
            *handed_back,
            {"type": "mcp_approval_response", "approval_request_id": asked.id, "approve": False, "reason": "no"},
        ],
        tools=tools,  # type: ignore[arg-type]
        max_output_tokens=100,
    )
    assert _types(second) == ["message"]


def test_tool_errors_reach_the_model_and_the_loop_goes_on(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny",
        input="Fail",
        tools=[_mcp("tools", require_approval="never", allowed_tools=["fail"])],
        tool_choice=_forced("tools", "fail"),  # type: ignore[arg-type]
        max_tool_calls=1,
        max_output_tokens=100,
    )
    assert _types(response) == ["mcp_list_tools", "mcp_call", "message"]
    call = response.output[1]
    assert call.output is None and call.error is not None
    assert call.error.type == "mcp_tool_execution_error"
    assert "failed on purpose" in json.dumps(call.error.content)


def test_a_call_past_the_timeout_is_an_error_the_model_reads(client: openai.OpenAI) -> None:
    started = time.monotonic()
    response = client.responses.create(
        model="tiny",
        input="Nap",
        tools=[_mcp("web", require_approval="never", allowed_tools=["nap"])],  # naps 3 s; the timeout is 2
        tool_choice=_forced("web", "nap"),  # type: ignore[arg-type]
        max_tool_calls=1,
        max_output_tokens=100,
    )
    assert time.monotonic() - started < 10
    call = response.output[1]
    assert call.type == "mcp_call" and call.output is None
    assert call.error.type == "mcp_protocol_error" and call.error.code == -32001
    assert response.output[-1].type == "message"


def test_a_long_result_is_cut_with_a_note(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny",
        input="Big",
        tools=[_mcp("tools", require_approval="never", allowed_tools=["big"])],
        tool_choice=_forced("tools", "big"),  # type: ignore[arg-type]
        max_tool_calls=1,
        max_output_tokens=100,
    )
    output = response.output[1].output
    assert output.startswith("x" * 500) and output.endswith(f"[output cut: {200_000 - 500} more bytes]")


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
@pytest.mark.parametrize(
    ("tool", "says"),
    [("quit", "process ended"), ("huge", "more than 1000000 bytes")],
)
def test_a_stdio_server_that_ends_starts_again_on_next_use(
    client: openai.OpenAI, url: str, tool: str, says: str
) -> None:
    """``quit`` ends the process mid-call (then every later call was "Connection closed"
    until a restart); ``huge`` sends one message past the bound (80 MB stalled the event loop
    and wedged the connection for good). The call fails saying why, at once; the next call
    starts the server again."""
    started = time.monotonic()
    with watched(url) as seen:
        call = _call_alone(client, "fragile", tool)
    assert call.type == "mcp_call" and call.output is None and call.error is not None
    assert call.error.type == "mcp_protocol_error" and says in call.error.message, call.error
    assert time.monotonic() - started < 10  # not the call timeout's wait
    seen.assert_within()
    with watched(url) as seen:
        _check_sums(_calls_then_answer(_force_alone(client, "fragile", "add")))  # the server started again
    seen.assert_within()


def test_a_stdio_server_that_exits_leaving_its_output_open_starts_again(client: openai.OpenAI, marker: Path) -> None:
    """Sixteenth probe of issue 45: a server that started a helper in a session of its own
    (outside the process group that is stopped), holding its stdout, then exited was never
    seen to end: the link waited for the end of stdout, so every later call waited out the
    call timeout and no new server was started. The process is watched: the call fails
    saying the server ended, before the call timeout, and the next call starts it again."""
    try:
        started = time.monotonic()
        call = _call_alone(client, "orphaning", "orphan")
        took = time.monotonic() - started
        assert call.type == "mcp_call" and call.output is None and call.error is not None
        assert "process ended" in call.error.message and "keeping its output open" in call.error.message, call.error
        assert took < 10, took
        for _ in range(2):  # a new server, which goes on answering
            again = _call_alone(client, "orphaning", "ok")
            assert again.type == "mcp_call" and again.error is None and again.output == "ok", again
    finally:
        for pid in _orphans(marker).read_text().split() if _orphans(marker).exists() else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
def test_a_stdio_message_that_cannot_be_read_fails_the_call_at_once(client: openai.OpenAI, url: str) -> None:
    """A result nested past the depth the MCP SDK's parser reads: the SDK's session only
    logged it, and the call waited out the call timeout. The server is stopped as for an
    oversized message, the call fails saying why, and the next call starts it again."""
    with watched(url) as seen:
        call = _call_alone(client, "faulty", "deep")
    seen.assert_within()
    assert call.type == "mcp_call" and call.output is None and call.error is not None
    assert "sent a message that is not JSON-RPC it can read" in call.error.message, call.error
    again = _call_alone(client, "faulty", "ok")
    assert again.type == "mcp_call" and again.error is None and again.output == "ok", again


@pytest.mark.parametrize("label", ["faulty", "faulty-web"], ids=["stdio", "http"])
def test_a_message_nested_past_what_json_decodes_fails_the_call_saying_so(client: openai.OpenAI, label: str) -> None:
    """Sixteenth probe of issue 45: an answer nested 5,000 deep (an SSE event over HTTP)
    raised a RecursionError where it was decoded to tell notifications apart: over HTTP the
    stream ended with a misleading "SSE stream ended without a response", nothing logged.
    The call fails saying the message nests too deep, and the next call is answered."""
    call = _call_alone(client, label, "abyss")
    assert call.type == "mcp_call" and call.output is None and call.error is not None
    assert "nested too deep" in call.error.message, call.error
    assert _call_alone(client, label, "ok").output == "ok"


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
def test_a_flood_of_notifications_stops_the_server(client: openai.OpenAI, url: str) -> None:
    """200,000 log notifications during a call: the SDK handled each in a task on the
    event loop (``/health`` waited up to 0.5 s) and the call waited out its timeout."""
    with watched(url) as seen:
        call = _call_alone(client, "faulty", "chatty")
    seen.assert_within()
    assert call.type == "mcp_call" and call.output is None and call.error is not None
    assert "more than 1000 notifications in a second" in call.error.message, call.error
    assert _call_alone(client, "faulty", "ok").output == "ok"


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
@pytest.mark.parametrize(
    ("label", "says"),
    [
        ("crowded", "a list of 10000 tools (at most 1000 are taken)"),
        ("crowded-web", "a list of more than 1000 tools (the most taken)"),  # refused as they arrive
        # Tenth probe: 999 tools of 14 properties (47,000 keys) passed the bounds of other
        # messages and held /health 106-200 ms while the SDK made them models.
        ("heavy", "object keys (at most 16384)"),
        ("heavy-web", "object keys (at most 16384)"),
    ],
)
def test_a_listing_of_too_many_tools_is_refused_before_it_is_parsed(
    client: openai.OpenAI, url: str, label: str, says: str
) -> None:
    """10,000 tools (800 KB): parsing them held the event loop 0.6 s (50,000: 3.8 s and
    +227 MiB over stdio; 2 s and +216 MiB over HTTP, where the SDK parsed them) before the
    request was refused for its 128-tool bound."""
    with watched(url) as seen, pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(model="tiny", input="Hi", tools=[_mcp(label, require_approval="never")])
    seen.assert_within(grown=64 * 2**20)
    assert caught.value.status_code == 424, caught.value.message
    assert says in caught.value.message, caught.value.message


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
@pytest.mark.parametrize(
    ("tool", "says"),
    [
        ("chatty", "more than 1000 messages in a second"),
        ("huge", "a message of more than 1000000 bytes"),
        ("bomb", "a message of more than 1000000 bytes"),  # 100 KB of gzip, as decoded
    ],
)
def test_an_http_answer_past_the_bounds_fails_the_call_at_once(
    client: openai.OpenAI, url: str, tool: str, says: str
) -> None:
    """Over streamable HTTP the SDK read a JSON answer whole and handed every event of a
    stream on: the bounds are applied to the bytes as they arrive, decoded (httpx inflated
    a gzip answer above the transport: 200 MB from 200 KB held /health 5 s, +403 MiB, and
    the call succeeded). The call fails saying why, and the server's next call is answered."""
    started = time.monotonic()
    with watched(url) as seen:
        call = _call_alone(client, "faulty-web", tool)
    seen.assert_within()
    assert call.type == "mcp_call" and call.output is None and call.error is not None
    assert says in call.error.message, call.error
    assert time.monotonic() - started < 10  # not the call timeout's wait
    assert _call_alone(client, "faulty-web", "ok").output == "ok"


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
@pytest.mark.parametrize(
    ("label", "tool", "says"),
    [
        ("faulty", "crowd", "object keys (at most 16384)"),
        ("faulty-web", "crowd", "object keys (at most 16384)"),
        ("faulty-web", "nested", "200006 objects and arrays (at most 16384"),
        # Eleventh probe: within a request body's bounds, 12,000-16,000 content items held
        # /health 210-380 ms; 490,000 array items 100-113 ms.
        ("faulty", "throng", "object keys (at most 16384)"),
        ("faulty-web", "throng", "object keys (at most 16384)"),
        ("faulty-web", "wide", "array items (at most 100000)"),
    ],
)
def test_an_answer_of_too_many_items_fails_the_call_before_it_is_parsed(
    client: openai.OpenAI, url: str, label: str, tool: str, says: str
) -> None:
    """Sixth probe of issue 45: a result of 200,000 content items (3 MB, under the message
    bound) held /health 2.8-4 s while the SDK made each a model on the event loop, 400,000
    one-item arrays 0.4 s; 30,000 and 200,000 here. Counted first, on a worker thread, with
    a request body's bounds (an array counts as an object)."""
    with watched(url) as seen:
        call = _call_alone(client, label, tool)
    seen.assert_within()
    assert call.type == "mcp_call" and call.output is None and call.error is not None
    assert says in call.error.message, call.error
    assert _call_alone(client, label, "ok").output == "ok"


def test_an_http_call_past_the_timeout_closes_its_connection(client: openai.OpenAI) -> None:
    """Issue 45: the SDK kept reading a timed-out call's answer over streamable HTTP (in
    the protocol version ortserve speaks it only posts ``notifications/cancelled``), so a
    server trickling it held a connection, and a task reading it, for as long as it liked.
    The session is closed at the timeout, and the next call opens a fresh one."""
    call = _call_alone(client, "faulty-web", "stuck")
    assert call.error is not None and call.error.code == -32001, call
    deadline = time.monotonic() + 10
    while (said := _call_alone(client, "faulty-web", "dropped").output) == "dropped 0":
        assert time.monotonic() < deadline, "the stuck answer's connection was still open"
        time.sleep(0.2)
    assert said == "dropped 1"


def test_a_gzip_answer_within_the_bounds_is_read(client: openai.OpenAI) -> None:
    """The transport inflates gzip itself (to bound it): a server that compresses is heard."""
    call = _call_alone(client, "faulty-web", "zipped")
    assert call.type == "mcp_call" and call.error is None and call.output == "ok", call


@pytest.mark.parametrize("label", ["faulty", "faulty-web"])
def test_a_servers_long_error_message_is_cut_as_a_result_is(client: openai.OpenAI, label: str) -> None:
    """An error of 200 KB from the server reached the model whole (the request failed: the
    prompt past the model's context), where a result of 200 KB is cut to mcp_max_output_bytes."""
    call = _call_alone(client, label, "loud")
    assert call.type == "mcp_call" and call.output is None and call.error is not None, call
    assert call.error.message == "E" * 500 + f"\n[output cut: {200_000 - 500} more bytes]", call.error.message[-80:]


def test_a_server_that_never_answers_is_a_424_and_the_server_keeps_serving(client: openai.OpenAI) -> None:
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(model="tiny", input="Hi", tools=[_mcp("hang")], max_output_tokens=4)  # type: ignore[list-item]
    assert caught.value.status_code == 424
    assert "'hang' did not answer within 3 s" in caught.value.message
    assert time.monotonic() - started < 10
    assert client.responses.create(model="tiny", input="Hi", max_output_tokens=4).status in ("completed", "incomplete")


def test_a_server_that_cannot_start_is_a_424_saying_why(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(model="tiny", input="Hi", tools=[_mcp("gone")])  # type: ignore[list-item]
    assert caught.value.status_code == 424
    assert "MCP server 'gone' cannot be reached: " in caught.value.message
    assert "/nonexistent/mcp-server" in caught.value.message


@pytest.mark.parametrize(
    ("tool", "param", "says"),
    [
        (
            {"type": "mcp", "server_label": "nowhere"},
            "tools[0]",
            "no MCP server is configured with the label 'nowhere'",
        ),
        (
            {"type": "mcp", "server_label": "other", "server_url": "http://127.0.0.1:1/mcp"},
            "tools[0]",
            "is not allowed on this server",
        ),
        (
            {"type": "mcp", "server_label": "tools", "headers": {"X-Key": "k"}},
            "tools[0].headers",
            "may not set its headers",
        ),
    ],
    ids=["unknown-label", "url-not-allowed", "headers-on-configured"],
)
def test_refusals_name_the_tool(client: openai.OpenAI, tool: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="Hi", tools=[tool])  # type: ignore[list-item]
    assert caught.value.body["param"] == param  # type: ignore[index]
    assert says in caught.value.message


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
@pytest.mark.parametrize("tail", ["/../secret", "/%2e%2e/secret", "/%2E./x", "/..%2fsecret", "/./x", "\\..\\secret"])
def test_dot_segments_do_not_leave_the_allowed_path(client: openai.OpenAI, url: str, http_mcp: str, tail: str) -> None:
    """With ``/mcp`` allowed, ``/mcp/../secret`` passed the prefix check and the client then
    sent ``POST /secret``: a path with dot segments is refused before anything is sent."""
    tool = {"type": "mcp", "server_label": "other", "server_url": http_mcp + tail, "require_approval": "never"}
    with pytest.raises(openai.BadRequestError) as caught, watched(url) as seen:
        client.responses.create(model="tiny", input="Hi", tools=[tool])  # type: ignore[list-item]
    seen.assert_within()
    assert caught.value.body["param"] == "tools[0]"  # type: ignore[index]
    assert "is not allowed on this server" in caught.value.message


def test_an_allowed_url_is_used_for_that_request(client: openai.OpenAI, http_mcp: str) -> None:
    response = client.responses.create(
        model="tiny",
        input="Look up",
        tools=[
            {
                "type": "mcp",
                "server_label": "mine",
                "server_url": http_mcp,
                "require_approval": "never",
                "authorization": "secret-token",
            }
        ],
        tool_choice=_forced("mine", "lookup"),  # type: ignore[arg-type]
        max_tool_calls=1,
        max_output_tokens=200,  # the five tools fill most of the context
    )
    assert _types(response) == ["mcp_list_tools", "mcp_call", "message"]
    assert response.output[1].output.endswith(": a word")
    # The caller's credentials are not echoed (nor kept with a stored response).
    assert response.tools[0].authorization is None and "secret-token" not in response.model_dump_json()


def test_read_only_tools_need_no_approval_by_filter(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny",
        input="Look up",
        tools=[_mcp("tools", allowed_tools={"read_only": True}, require_approval={"never": {"read_only": True}})],
        tool_choice="required",
        max_tool_calls=1,
        max_output_tokens=100,
    )
    assert [tool.name for tool in response.output[0].tools] == ["lookup"]
    assert _types(response) == ["mcp_list_tools", "mcp_call", "message"]


def test_cancelling_the_request_stops_the_running_call(url: str, marker: Path) -> None:
    body = {
        "model": "tiny",
        "input": "Nap",
        "stream": True,
        "tools": [_mcp("tools", require_approval="never", allowed_tools=["nap"])],
        "tool_choice": _forced("tools", "nap"),
        "max_tool_calls": 1,
    }
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/responses", json=body) as stream:
        seen = []
        lines = stream.iter_lines()
        for line in lines:
            seen.append(line)
            if "response.mcp_call.in_progress" in line:
                break
        assert "response.mcp_call.in_progress" in seen[-1], seen
        deadline = time.monotonic() + 10
        while not Path(str(marker) + ".started").exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"the tool never started: {list(lines)[-8:]}")
            time.sleep(0.05)
    time.sleep(4)  # the nap would have ended by now
    assert not Path(str(marker) + ".finished").exists()
    metrics = httpx.get(f"{url}/metrics").text
    assert 'ortserve_mcp_calls_total{outcome="cancelled",server="tools",tool="nap"} 1.0' in metrics


def test_metrics_count_calls_by_configured_server_and_tool(client: openai.OpenAI, url: str) -> None:
    client.responses.create(
        model="tiny",
        input="Add",
        tools=[_mcp("web", require_approval="never", allowed_tools=["add"])],
        tool_choice=_forced("web", "add"),  # type: ignore[arg-type]
        max_tool_calls=1,
        max_output_tokens=100,
    )
    metrics = httpx.get(f"{url}/metrics").text
    assert 'ortserve_mcp_calls_total{outcome="ok",server="web",tool="add"}' in metrics
    assert 'ortserve_mcp_list_seconds_count{server="web"}' in metrics


# -- Anthropic's MCP connector ----------------------------------------------------------------

BETA = ["mcp-client-2025-04-04"]


@pytest.fixture
def claude(url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as c:
        yield c


def _server(name: str, url: str = "https://unused.example/mcp", **fields: Any) -> dict[str, Any]:
    return {"type": "url", "name": name, "url": url, **fields}


def _check_pairs(content: list[Any], label: str) -> None:
    """mcp_tool_use / mcp_tool_result pairs: each result is the sum of its call's input."""
    uses = [block for block in content if block.type == "mcp_tool_use"]
    results = [block for block in content if block.type == "mcp_tool_result"]
    assert uses and len(uses) == len(results)
    for use, result in zip(uses, results, strict=True):
        assert use.server_name == label and use.name == "add" and result.tool_use_id == use.id
        assert result.is_error is False
        assert int(result.content[0].text) == use.input["a"] + use.input["b"]


@pytest.mark.parametrize("label", ["tools", "web"], ids=["stdio", "http"])
def test_anthropic_mcp_servers_loop_runs_the_tool_and_answers(claude: anthropic.Anthropic, label: str) -> None:
    message = claude.beta.messages.create(
        model="tiny",
        max_tokens=100,
        messages=[{"role": "user", "content": f"Add ({label}, {time.time()})"}],
        mcp_servers=[_server(label, tool_configuration={"allowed_tools": ["add"]})],
        tool_choice={"type": "tool", "name": "add"},
        betas=BETA,
    )
    kinds = [block.type for block in message.content]
    assert kinds[:2] == ["mcp_tool_use", "mcp_tool_result"]  # forced first, then free (random) turns
    assert set(kinds[2:]) <= {"mcp_tool_use", "mcp_tool_result", "text"} and kinds.count("mcp_tool_use") <= 2
    _check_pairs(message.content, label)
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.cache_read_input_tokens and message.usage.cache_read_input_tokens > 0
    assert message.usage.output_tokens <= 100


def test_anthropic_streamed_loop_gives_the_same_blocks(claude: anthropic.Anthropic) -> None:
    with claude.beta.messages.stream(
        model="tiny",
        max_tokens=100,
        messages=[{"role": "user", "content": f"Add, streamed ({time.time()})"}],
        mcp_servers=[_server("tools", tool_configuration={"allowed_tools": ["add"]})],
        tool_choice={"type": "tool", "name": "add"},
        betas=BETA,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    starts = [event.content_block.type for event in events if event.type == "content_block_start"]
    assert starts[:2] == ["mcp_tool_use", "mcp_tool_result"]
    indexes = [event.index for event in events if event.type == "content_block_start"]
    assert indexes == list(range(len(indexes)))
    _check_pairs(final.content, "tools")
    # A follow-up hands the whole turn back, MCP blocks and all: it reads as the calls and
    # results the model saw.
    follow_up = claude.beta.messages.create(
        model="tiny",
        max_tokens=8,
        messages=[
            {"role": "user", "content": "Add, streamed"},
            {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in final.content]},
            {"role": "user", "content": "Thanks"},
        ],
        betas=BETA,
    )
    assert follow_up.content is not None


def test_anthropic_tool_errors_are_results_marked_as_errors(claude: anthropic.Anthropic) -> None:
    message = claude.beta.messages.create(
        model="tiny",
        max_tokens=100,
        messages=[{"role": "user", "content": "Fail"}],
        mcp_servers=[_server("web", tool_configuration={"allowed_tools": ["fail"]})],
        tool_choice={"type": "tool", "name": "fail"},
        betas=BETA,
    )
    results = [block for block in message.content if block.type == "mcp_tool_result"]
    assert results and all(result.is_error for result in results)
    assert "failed on purpose" in results[0].content[0].text


def test_anthropic_an_allowed_url_by_a_new_name(claude: anthropic.Anthropic, http_mcp: str) -> None:
    message = claude.beta.messages.create(
        model="tiny",
        max_tokens=100,
        messages=[{"role": "user", "content": "Look up"}],
        mcp_servers=[_server("mine", http_mcp, tool_configuration={"allowed_tools": ["lookup"]})],
        tool_choice={"type": "any"},
        betas=BETA,
    )
    results = [block for block in message.content if block.type == "mcp_tool_result"]
    assert results and results[0].content[0].text == "ortserve: a word"


@pytest.mark.parametrize(
    ("server", "says"),
    [
        (
            _server("other", "http://127.0.0.1:1/mcp"),
            "mcp_servers.0: MCP server URL 'http://127.0.0.1:1/mcp' is not allowed",
        ),
        (
            _server("tools", authorization_token="t"),
            "mcp_servers.0.authorization_token: MCP server 'tools' is configured",
        ),
    ],
    ids=["url-not-allowed", "token-on-configured"],
)
def test_anthropic_refusals_name_the_server(claude: anthropic.Anthropic, server: dict[str, Any], says: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.beta.messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "Hi"}], mcp_servers=[server], betas=BETA
        )
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert caught.value.body["error"]["message"].startswith(says)  # type: ignore[index]


def test_anthropic_a_server_that_never_answers_is_a_424(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.beta.messages.create(
            model="tiny",
            max_tokens=8,
            messages=[{"role": "user", "content": "Hi"}],
            mcp_servers=[_server("hang")],
            betas=BETA,
        )
    assert caught.value.status_code == 424
    assert "'hang' did not answer" in caught.value.body["error"]["message"]  # type: ignore[index]


def test_the_server_description_reaches_the_prompt(client: openai.OpenAI) -> None:
    """OpenAI's ``server_description`` leads the server's tool descriptions in the prompt."""

    def prompt_tokens(**fields: Any) -> int:
        response = client.responses.create(
            model="tiny",
            input="Hi",
            tools=[_mcp("tools", require_approval="never", allowed_tools=["add"], **fields)],
            tool_choice="none",
            max_output_tokens=1,
        )
        assert response.usage is not None
        return response.usage.input_tokens

    plain = prompt_tokens()
    described = prompt_tokens(server_description="A calculator for small sums, used by the accounting team")
    assert described > plain + 5


def test_an_answer_the_sdk_cannot_parse_is_one_warning_line(
    client: openai.OpenAI, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Sixth probe of issue 45: over streamable HTTP, an answer nested past the depth the
    MCP SDK's parser reads failed the call (it says why), and the SDK also logged its
    traceback at ERROR. It is one WARNING line naming the error."""
    with caplog.at_level(logging.DEBUG, logger="mcp.client.streamable_http"):
        call = _call_alone(client, "faulty-web", "deep")
    assert call.type == "mcp_call" and call.output is None and call.error is not None
    said = [r for r in caplog.records if r.name == "mcp.client.streamable_http" and "parsing" in r.getMessage()]
    assert said, caplog.text
    assert all(r.levelno == logging.WARNING and r.exc_info is None and "\n" not in r.getMessage() for r in said)
    assert "ValidationError" in said[0].getMessage()


def test_a_stdio_servers_stderr_is_logged_within_a_bound(caplog: pytest.LogCaptureFixture) -> None:
    """Seventeenth probe: a stdio server's stderr was passed to ours unbounded (64 KiB lines
    in a loop grew the log by 3.1 GB in 10 s). Lines are cut and a minute's are bounded;
    what is left out is counted."""
    import anyio
    from ortserve_server._mcp_stdio import STDERR_LINE_CHARS, STDERR_LINES_PER_MINUTE, StdioLink

    script = "import sys\nfor i in range(900):\n    sys.stderr.write(f'line{i} ' + 'x' * 1100 + '\\n')\n"
    link = StdioLink((sys.executable, "-c", script), 1 << 20, "noisy")

    async def run() -> None:
        async with link.transport():
            with anyio.fail_after(60):
                while link.ended is None:
                    await anyio.sleep(0.05)
            await anyio.sleep(0.5)  # the last lines read

    with caplog.at_level(logging.WARNING, "ortserve.mcp"):
        anyio.run(run)
    logged = [r.getMessage() for r in caplog.records if r.name == "ortserve.mcp"]
    lines = [m for m in logged if m.startswith("MCP server noisy: line")]
    assert len(lines) == STDERR_LINES_PER_MINUTE and lines[0].endswith(f": line0 {'x' * (STDERR_LINE_CHARS - 6)}")
    assert f"{900 - STDERR_LINES_PER_MINUTE} lines of its stderr were not logged" in logged[-1], logged[-1]


@pytest.mark.timing  # the event loop's latency meanwhile
def test_a_stdio_server_flooding_its_stderr_does_not_hold_the_event_loop(caplog: pytest.LogCaptureFixture) -> None:
    """Eighteenth probe: lines past the bound were still counted one by one on the event
    loop (newlines in a loop: 95% of a core, /health 517 ms). They are counted at C's speed,
    and past a megabyte a minute stderr is not read until the minute ends."""
    import anyio
    from ortserve_server._mcp_stdio import STDERR_BYTES_PER_MINUTE, StdioLink

    script = "import sys\nwhile True:\n    sys.stderr.buffer.write(b'\\n' * 65536); sys.stderr.flush()\n"
    link = StdioLink((sys.executable, "-c", script), 1 << 20, "flood")
    gaps: list[float] = []

    async def run() -> None:
        async with link.transport():
            last = time.monotonic()
            for _ in range(300):  # 3 s
                await anyio.sleep(0.01)
                gaps.append(time.monotonic() - last - 0.01)
                last = time.monotonic()

    with caplog.at_level(logging.WARNING, "ortserve.mcp"):
        anyio.run(run)
    assert max(gaps) < 0.1, max(gaps)
    logged = [r.getMessage() for r in caplog.records if r.name == "ortserve.mcp"]
    (dropped,) = [m for m in logged if "not logged" in m]
    assert int(dropped.split(": ")[1].split()[0]) <= STDERR_BYTES_PER_MINUTE + 65536, dropped


_PING = b'{"jsonrpc": "2.0", "id": 7, "method": "ping"}\n'


_LARGE = "b'x' * 900_000"
"""A Python expression for 900 KB of text, built in the flooding server (too long for its argv)."""


@pytest.mark.timing  # the event loop's latency meanwhile
@pytest.mark.parametrize(
    ("line", "said"),
    [
        (b"\n", "bytes of blank lines"),
        (b"\x0c\n", "bytes of blank lines"),  # twenty-second probe: vertical tabs, form feeds went one by one
        (b" \x0b\n", "bytes of blank lines"),
        (b'{"jsonrpc": "2.0", "id": 99999, "result": {}}\n', "other messages in a second"),  # answers never asked
        (_PING, "other messages in a second"),
        # Twenty-third probe: lines just under the message bound, a few a second.
        (
            f"""b'{{"jsonrpc": "2.0", "method": "notifications/message", "params": {{"data": "' + {_LARGE} + b'"}}}}\\n'""",
            "bytes in a minute of messages no call asked for",
        ),
        (f"""b'{{"jsonrpc": "2.0", "id": 99999, "result": {{"x": "' + {_LARGE} + b'"}}}}\\n'""", "no call asked for"),
    ],
    ids=["newlines", "form-feeds", "vertical-tabs", "unasked-answers", "pings", "large-notices", "large-answers"],
)
def test_a_stdio_server_flooding_its_stdout_is_stopped(
    caplog: pytest.LogCaptureFixture, line: bytes | str, said: str
) -> None:
    """Twentieth probe, issue 45: blank lines on stdout were handled one by one on the event
    loop (/health 113-156 ms for as long as the server wrote them); twenty-second: lines of
    form feeds, answers to ids never asked and pings in a loop held most of a core. Blank
    lines are dropped at C's speed, and past a megabyte a minute, or past a thousand other
    messages a second, the server is stopped, saying why."""
    import anyio
    from ortserve_server._mcp_stdio import StdioLink

    written, repeat = (repr(line), 4096) if isinstance(line, bytes) else (line, 1)  # str: the line's expression
    script = (
        f"import sys\nline = {written}\nwhile True:\n    sys.stdout.buffer.write(line * {repeat}); sys.stdout.flush()\n"
    )
    link = StdioLink((sys.executable, "-c", script), 1 << 20, "flood")
    gaps: list[float] = []

    async def run() -> None:
        async with link.transport() as (read_stream, _), anyio.create_task_group() as tasks:

            async def drain() -> None:  # as the SDK's session reads what comes
                async for _ in read_stream:
                    pass

            tasks.start_soon(drain)
            last = time.monotonic()
            for _ in range(200):  # 2 s
                await anyio.sleep(0.01)
                gaps.append(time.monotonic() - last - 0.01)
                last = time.monotonic()
            tasks.cancel_scope.cancel()

    with caplog.at_level(logging.WARNING, "ortserve.mcp"):
        anyio.run(run)
    assert max(gaps) < 0.1, max(gaps)
    assert link.ended is not None and said in link.ended, link.ended


def test_what_a_stdio_server_leaves_in_its_group_is_stopped_with_it(tmp_path: Path) -> None:
    """Twenty-third probe, issue 45: children a stdio server started in its process group
    outlived it (it exited), and this server's exit; they are stopped with the link."""
    import anyio
    from ortserve_server._mcp_stdio import StdioLink

    pidfile = tmp_path / "child"
    script = f"import subprocess\nchild = subprocess.Popen(['sleep', '60'])\nopen({str(pidfile)!r}, 'w').write(str(child.pid))\n"
    link = StdioLink((sys.executable, "-c", script), 1 << 20, "forks")

    async def run() -> None:
        async with link.transport():
            while not pidfile.exists() or not pidfile.read_text():
                await anyio.sleep(0.05)
            await anyio.sleep(0.5)  # the server has exited; its child runs on

    anyio.run(run)
    stat = Path(f"/proc/{pidfile.read_text()}/stat")

    def running() -> bool:
        try:
            return stat.read_text().rpartition(")")[2].split()[0] != "Z"  # a zombie has ended
        except OSError:
            return False

    deadline = time.monotonic() + 5
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running()
