"""Anthropic's Messages API through the official ``anthropic`` SDK against a real server.

The tiny models are random: a forced tool call is well-formed only because the output is
constrained, and text is compared with itself (stop sequences, streamed against whole).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from images import TINY_PHI3V, image_bytes
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

KEY = "sekret"
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER},
    {"name": "add", "description": "Sum", "input_schema": ADD},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = ServerConfig(models={"tiny": TINY_MODEL, "vision": TINY_PHI3V}, api_key=KEY, max_body_size=2_000_000)
    with running(create_app(config)) as base:
        yield base


@pytest.fixture
def client(url: str) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0) as c:
        yield c


def sampling(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with the sampling fields moved to ``extra_body``: this SDK's methods no
    longer take ``temperature``, ``top_p`` or ``top_k`` (newer Claude models refuse them),
    while the API, and this server, still do."""
    extra = {name: kwargs.pop(name) for name in ("temperature", "top_p", "top_k") if name in kwargs}
    return {**kwargs, "extra_body": extra} if extra else kwargs


def create(client: anthropic.Anthropic, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    model, max_tokens = kwargs.pop("model", "tiny"), kwargs.pop("max_tokens", 12)
    return client.messages.create(model=model, max_tokens=max_tokens, **sampling(kwargs))


def stream(client: anthropic.Anthropic, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", ASK)
    return client.messages.stream(model="tiny", **sampling(kwargs))


def test_create_returns_a_message(client: anthropic.Anthropic) -> None:
    message = create(client, temperature=0)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == "tiny"
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert [block.type for block in message.content] in (["text"], [])
    assert message.usage.output_tokens <= 12
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 5


def test_max_tokens_is_the_stop_reason_when_reached(client: anthropic.Anthropic) -> None:
    message = create(client, max_tokens=1, temperature=0)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 1)


def test_system_prompt_as_string_or_blocks_reaches_the_prompt(client: anthropic.Anthropic) -> None:
    plain = client.messages.count_tokens(model="tiny", messages=ASK).input_tokens
    system = "You answer in French, always, whatever the question."
    as_string = client.messages.count_tokens(model="tiny", messages=ASK, system=system).input_tokens
    blocks: Any = [{"type": "text", "text": system}]
    assert client.messages.count_tokens(model="tiny", messages=ASK, system=blocks).input_tokens == as_string
    assert as_string != plain
    assert create(client, system=blocks).usage.output_tokens > 0


def test_streaming_matches_the_whole_answer(client: anthropic.Anthropic) -> None:
    whole = create(client, temperature=0, max_tokens=16)
    with stream(client, max_tokens=16, temperature=0) as events:
        streamed_text = "".join(events.text_stream)
        final = events.get_final_message()
    assert streamed_text == "".join(b.text for b in whole.content if b.type == "text")
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The streamed usage adds up to the same prompt, whatever part of it came from the cache.
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == whole.usage.input_tokens + (
        whole.usage.cache_read_input_tokens or 0
    )


def test_raw_stream_events_come_in_anthropics_order(client: anthropic.Anthropic) -> None:
    events = list(create(client, temperature=0, max_tokens=6, stream=True))
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0].message.usage.output_tokens == 0
    body = kinds[1:-2]
    if body:  # a text block: start, deltas, stop
        assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
        assert set(body[1:-1]) == {"content_block_delta"}
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6


def test_the_sse_frames_name_their_events_and_ping(url: str) -> None:
    body = {"model": "tiny", "max_tokens": 3, "messages": ASK, "stream": True}
    response = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert response.headers["content-type"].startswith("text/event-stream")
    names = [line.removeprefix("event: ") for line in response.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert "data: [DONE]" not in response.text


def test_stop_sequences_cut_the_text_exactly(client: anthropic.Anthropic) -> None:
    full = "".join(b.text for b in create(client, temperature=0, max_tokens=24).content)
    assert len(full) > 8
    stop = full[4:7]
    expected = full.split(stop)[0]
    message = create(client, temperature=0, max_tokens=24, stop_sequences=["never-seen-xyz", stop])
    assert "".join(b.text for b in message.content) == expected
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    with stream(client, max_tokens=24, temperature=0, stop_sequences=[stop]) as events:
        assert "".join(events.text_stream) == expected
        final = events.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "add"}], ids=["any", "tool"])
def test_forced_tool_calls_are_valid_tool_use_blocks(client: anthropic.Anthropic, choice: Any) -> None:
    # Greedy: a sampled call of the random model can run past max_tokens (an integer of
    # 200 digits); a call cut short is the next test's.
    message = create(client, tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0)
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) >= 1
    for use in uses:
        assert use.id.startswith("toolu_")
        if choice["type"] == "tool":
            assert use.name == "add"
        jsonschema.validate(use.input, SCHEMAS[use.name])

    with stream(client, max_tokens=200, tools=TOOLS, tool_choice=choice, temperature=0) as events:
        final = events.get_final_message()
    assert final.stop_reason == "tool_use"
    streamed = [block for block in final.content if block.type == "tool_use"]
    assert streamed and all(block.id.startswith("toolu_") for block in streamed)
    for use in streamed:  # the SDK rebuilt input from the input_json_delta fragments
        jsonschema.validate(use.input, SCHEMAS[use.name])


def test_a_forced_call_cut_short_is_a_tool_use_block_with_stop_reason_max_tokens(client: anthropic.Anthropic) -> None:
    """Its arguments do not parse yet: the block's input is empty (it was a 500 before)."""
    message = create(client, tools=TOOLS, tool_choice={"type": "tool", "name": "add"}, max_tokens=6)
    assert message.stop_reason == "max_tokens"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "add" and uses[0].input == {}


def test_one_call_only_when_parallel_use_is_disabled(client: anthropic.Anthropic) -> None:
    choice: Any = {"type": "any", "disable_parallel_tool_use": True}
    message = create(client, tools=TOOLS, tool_choice=choice, max_tokens=200)
    assert len([block for block in message.content if block.type == "tool_use"]) == 1


def test_a_tool_result_round_trip(client: anthropic.Anthropic) -> None:
    call = create(client, tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=200)
    use = next(block for block in call.content if block.type == "tool_use")
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in call.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 degrees in the city"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    answer = create(client, messages=history, tools=TOOLS)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The result reached the prompt: the template renders it, so the prompt grows with it.
    shorter = [*history[:2], {"role": "user", "content": [{**history[2]["content"][0], "content": "x"}]}]
    assert client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS).input_tokens > (
        client.messages.count_tokens(model="tiny", messages=shorter, tools=TOOLS).input_tokens
    )


def test_the_assistants_tool_use_reaches_the_prompt(client: anthropic.Anthropic) -> None:
    """Ninth session: an assistant turn's tool_use blocks were lost on the way to the
    template (the list of calls was cleared after the message took it), so the model read
    results of calls it had never made; and a tool_result answering no tool_use is a 400."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}

    def counted(turn: list[Any]) -> int:
        history = [*ASK, {"role": "assistant", "content": turn}, {"role": "user", "content": [result]}]
        return client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS).input_tokens

    assert counted([{"type": "text", "text": "Let me look."}, use]) > counted(
        [{"type": "text", "text": "Let me look."}, {**use, "input": {}}]
    )  # the call's arguments are in the prompt
    with pytest.raises(anthropic.BadRequestError, match="did not make"):
        client.messages.count_tokens(
            model="tiny", messages=[*ASK, {"role": "user", "content": [{**result, "tool_use_id": "toolu_9"}]}]
        )


def test_tools_reach_the_prompt_and_count_tokens_says_how_much(client: anthropic.Anthropic) -> None:
    bare = client.messages.count_tokens(model="tiny", messages=ASK).input_tokens
    with_tools = client.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS).input_tokens
    assert with_tools > bare > 0
    # count_tokens is the prompt a message would run on.
    message = create(client, max_tokens=1)
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == bare


def test_image_blocks_reach_a_multimodal_model(client: anthropic.Anthropic) -> None:
    data = base64.b64encode(image_bytes()).decode()
    image: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    messages: Any = [{"role": "user", "content": [image, {"type": "text", "text": "What is in the picture?"}]}]
    text_only: Any = [{"role": "user", "content": "What is in the picture?"}]
    message = create(client, model="vision", messages=messages, temperature=0)
    assert message.content and message.stop_reason in ("end_turn", "max_tokens")
    with_image = client.messages.count_tokens(model="vision", messages=messages).input_tokens
    assert with_image > client.messages.count_tokens(model="vision", messages=text_only).input_tokens + 10


def test_an_image_url_from_a_host_not_allowed_is_refused(client: anthropic.Anthropic) -> None:
    image: Any = {"type": "image", "source": {"type": "url", "url": "http://example.com/cat.png"}}
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "see"}, image]}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(client, model="vision", messages=messages)
    assert "messages.0.content.1.source" in caught.value.message
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"temperature": 1.5}, "temperature"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
        ({"stop_sequences": ["a", ""]}, "stop_sequences"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"messages": []}, "messages"),
        ({"messages": [*ASK, {"role": "assistant", "content": "Pre"}]}, "messages.1"),
        # The prompt too long for the context because of the tools: the message says so.
        (
            {"tools": [{"name": "big", "description": "x " * 200_000, "input_schema": {"type": "object"}}]},
            "of the messages and tools",
        ),
        # Anthropic's own checks (fourteenth probe, issue 45: each was accepted).
        ({"metadata": {"user_id": "u" * 300}}, "metadata.user_id"),
        ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools.0.input_schema.type"),
    ],
    ids=[
        "temperature",
        "thinking",
        "stops",
        "empty-stop",
        "choice-without-tools",
        "unknown-tool",
        "empty",
        "prefill",
        "tools",
        "user-id-length",
        "schema-not-object",
    ],
)
def test_invalid_requests_are_400s_naming_the_field(client: anthropic.Anthropic, kwargs: Any, words: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(client, **kwargs)
    body: Any = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert words in body["error"]["message"]
    assert "'stop'" not in body["error"]["message"]  # OpenAI's field, not this API's


def test_a_missing_max_tokens_is_a_400(url: str) -> None:
    response = httpx.post(f"{url}/v1/messages", json={"model": "tiny", "messages": ASK}, headers={"x-api-key": KEY})
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("max_tokens")


def test_an_unknown_model_is_a_not_found_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        create(client, model="nope")
    assert caught.value.body == {  # type: ignore[comparison-overlap]
        "type": "error",
        "error": {"type": "not_found_error", "message": "model 'nope' does not exist"},
        "request_id": caught.value.response.headers["x-request-id"],  # where Anthropic's own errors have it
    }


def test_x_api_key_and_bearer_are_both_accepted(url: str) -> None:
    by_header = anthropic.Anthropic(base_url=url, api_key=None, default_headers={"x-api-key": KEY}, max_retries=0)
    with by_header:
        assert create(by_header, max_tokens=1).stop_reason == "max_tokens"
    with anthropic.Anthropic(base_url=url, auth_token=KEY, max_retries=0) as by_bearer:
        assert create(by_bearer, max_tokens=1).stop_reason == "max_tokens"
    # Two different keys are refused whichever is right (x-api-key won before, fourteenth
    # probe, issue 45); the same key in both is one key.
    both = {"x-api-key": KEY, "Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "max_tokens": 1, "messages": ASK}
    assert httpx.post(f"{url}/v1/messages", json=body, headers=both, timeout=60).status_code == 200
    sent: tuple[Any, ...] = (
        {"x-api-key": "wrong"},
        {"Authorization": "Bearer wrong"},
        {},
        {"x-api-key": KEY, "Authorization": "Bearer wrong"},
        {"x-api-key": "wrong", "Authorization": f"Bearer {KEY}"},
        {"x-api-key": KEY, "Authorization": "Bearer\twrong"},  # a tab separates too
        [("x-api-key", KEY), ("x-api-key", "wrong")],  # the same header twice (fifteenth probe)
        [("Authorization", f"Bearer {KEY}"), ("Authorization", "Bearer wrong")],
    )
    for headers in sent:
        response = httpx.post(
            f"{url}/v1/messages", json={"model": "tiny", "max_tokens": 1, "messages": ASK}, headers=headers
        )
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    with (
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0) as wrong,
        pytest.raises(anthropic.AuthenticationError),
    ):
        create(wrong)


def test_openai_routes_keep_their_own_errors_and_key_header(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/chat/completions", json={"model": "tiny", "messages": ASK}, headers={"x-api-key": KEY}
    )
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_a_full_queue_is_anthropics_overloaded_error() -> None:
    config = ServerConfig(models={"tiny": TINY_MODEL}, max_queued=0)
    with running(create_app(config)) as base, anthropic.Anthropic(base_url=base, api_key="x", max_retries=0) as c:
        with pytest.raises(anthropic.OverloadedError) as caught:
            create(c)
        assert caught.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert caught.value.response.headers["retry-after"] == "1"


def test_earlier_thinking_blocks_are_accepted_and_left_to_the_template(client: anthropic.Anthropic) -> None:
    # Thinking reaches the template as reasoning_content; tiny's does not read it (for a
    # template that does, see test_reasoning_api.py).
    said: Any = {"type": "text", "text": "Sunny."}
    thought: Any = {"type": "thinking", "thinking": "The user wants weather.", "signature": "sig"}
    with_thinking: Any = [*ASK, {"role": "assistant", "content": [thought, said]}, {"role": "user", "content": "Ok"}]
    without: Any = [*ASK, {"role": "assistant", "content": [said]}, {"role": "user", "content": "Ok"}]
    counted = client.messages.count_tokens(model="tiny", messages=with_thinking).input_tokens
    assert counted == client.messages.count_tokens(model="tiny", messages=without).input_tokens


def test_models_list_pages_as_anthropic_pages(client: anthropic.Anthropic, url: str) -> None:
    """Twenty-second probe, issue 45: the Anthropic SDK's ``models.list(limit=...)`` (and
    ``after_id``/``before_id``) was refused once unknown query parameters were."""
    every = [model.id for model in client.models.list()]
    assert every == ["tiny", "vision"]
    assert [model.id for model in client.models.list(limit=1)] == every  # the SDK pages on through has_more
    first = client.models.list(limit=1)
    assert [m.id for m in first.data] == ["tiny"] and first.has_more and first.last_id == "tiny"
    after = client.models.list(limit=1, after_id="tiny")
    assert [m.id for m in after.data] == ["vision"] and not after.has_more
    before = client.models.list(limit=5, before_id="vision")
    assert [m.id for m in before.data] == ["tiny"] and not before.has_more
    for query, param in (
        ("limit=0", "limit"),
        ("after_id=nope", "after_id"),
        ("after_id=tiny&before_id=vision", "before_id"),
    ):
        refused = httpx.get(f"{url}/v1/models?{query}", headers={"authorization": f"Bearer {KEY}"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
