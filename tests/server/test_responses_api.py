"""``/v1/responses`` through the official openai SDK, on the tiny (random) model: only
constrained output (a JSON schema, a forced call) is well-formed, so those carry the
checks of content; the rest checks shapes, statuses, events and token counts."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from images import TINY_PHI3V, data_url, image_bytes
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, closing, running, watched

ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "name": "add", "description": "Sum", "parameters": ADD_PARAMS, "strict": True},
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS, "strict": True},
]
PARAMS = {"add": ADD_PARAMS, "get_weather": WEATHER_PARAMS}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}
LONG_INSTRUCTIONS = "You sort lists and explain the order of things, briefly. " * 4


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = ServerConfig(models={"tiny": TINY_MODEL, "vision": TINY_PHI3V}, responses_store_max=8)
    with running(create_app(config)) as base:
        yield base


def test_plain_input_and_usage(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Hello", max_output_tokens=4, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and response.output_text == message.content[0].text
    usage = response.usage
    assert usage is not None and usage.output_tokens == 4
    assert usage.total_tokens == usage.input_tokens + 4
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.store is False  # stateless unless asked


def test_instructions_reach_the_prompt(client: openai.OpenAI) -> None:
    bare = client.responses.create(model="tiny", input="Hi", max_output_tokens=1)
    told = client.responses.create(model="tiny", input="Hi", instructions=LONG_INSTRUCTIONS, max_output_tokens=1)
    assert bare.usage is not None and told.usage is not None
    assert told.usage.input_tokens > bare.usage.input_tokens + 40
    assert told.instructions == LONG_INSTRUCTIONS


def test_json_schema_format_is_followed(client: openai.OpenAI) -> None:
    text = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    response = client.responses.create(model="tiny", input="2+2?", text=text, max_output_tokens=60, temperature=0)  # type: ignore[arg-type]
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), ANSWER_SCHEMA)
    assert response.text.format is not None and response.text.format.type == "json_schema"
    loose = client.responses.create(
        model="tiny", input="An object", text={"format": {"type": "json_object"}}, max_output_tokens=60
    )
    assert isinstance(json.loads(loose.output_text), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "add"}], ids=["required", "named"])
def test_forced_function_call(client: openai.OpenAI, tool_choice: Any) -> None:
    response = client.responses.create(
        model="tiny", input="Add 2 and 3", tools=TOOLS, tool_choice=tool_choice, max_output_tokens=200, temperature=0
    )
    assert response.status == "completed"
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.call_id.startswith("call_") and call.id is not None and call.status == "completed"
    if isinstance(tool_choice, dict):
        assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
    assert response.output_text == ""


def test_function_call_output_round_trip(client: openai.OpenAI) -> None:
    """The call and its result go back as items: the template sees the tool turn (the
    prompt grows by both), and a forced call after it is still well-formed. (Greedy:
    sampled, a random model's integer argument once ran past 200 tokens in a CI run.)"""
    first = client.responses.create(
        model="tiny", input="Add 2 and 3", tools=TOOLS, tool_choice={"type": "function", "name": "add"}, temperature=0
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    base: list[Any] = [{"role": "user", "content": "Add 2 and 3"}]
    returned: list[Any] = [
        *base,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"sum": 5})},
    ]
    shorter = client.responses.create(model="tiny", input=base, tools=TOOLS, max_output_tokens=1)
    second = client.responses.create(
        model="tiny", input=returned, tools=TOOLS, tool_choice="required", max_output_tokens=200, temperature=0
    )
    assert shorter.usage is not None and second.usage is not None
    assert second.usage.input_tokens > shorter.usage.input_tokens + len(call.arguments) // 4
    [again] = [item for item in second.output if item.type == "function_call"]
    jsonschema.validate(json.loads(again.arguments), PARAMS[again.name])


def test_previous_response_id_continues_from_the_prefix_cache(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model="tiny", input=[{"role": "user", "content": LONG_INSTRUCTIONS}], max_output_tokens=6, store=True
    )
    assert first.store is True
    follow = client.responses.create(
        model="tiny", input="And 9 8?", previous_response_id=first.id, max_output_tokens=3, store=True
    )
    assert follow.previous_response_id == first.id
    assert first.usage is not None and follow.usage is not None
    # The follow-up's prompt holds the first one's input and output: the first prompt's
    # tokens came from the prefix cache.
    assert follow.usage.input_tokens > first.usage.input_tokens + 3
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2
    # A chain: the third sees both turns before it.
    third = client.responses.create(model="tiny", input="Done?", previous_response_id=follow.id, max_output_tokens=1)
    assert third.usage is not None and third.usage.input_tokens > follow.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_input_items_list_what_a_stored_response_took_in(client: openai.OpenAI) -> None:
    """``responses.input_items.list``: the conversation a response continued and then its own
    input, each item with an id that stays the same along the chain, newest first by
    default, paged by ``limit``/``after``/``before`` as OpenAI pages."""
    first = client.responses.create(
        model="tiny",
        input=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        max_output_tokens=2,
        store=True,
    )
    follow = client.responses.create(
        model="tiny", input="Another?", previous_response_id=first.id, max_output_tokens=2, store=True
    )
    mine = list(client.responses.input_items.list(first.id, order="asc"))
    assert [(item.type, getattr(item, "role", None)) for item in mine] == [("message", "system"), ("message", "user")]
    assert all(item.id.startswith("msg_") for item in mine)
    chain = client.responses.input_items.list(follow.id, order="asc").data
    assert [item.id for item in chain[:2]] == [item.id for item in mine]  # the same items, the same ids
    assert chain[2].id == first.output[0].id and chain[2].role == "assistant"  # the first reply
    assert chain[3].content[0].text == "Another?"  # type: ignore[union-attr]
    newest_first = client.responses.input_items.list(follow.id).data
    assert [item.id for item in newest_first] == [item.id for item in reversed(chain)]
    page = client.responses.input_items.list(follow.id, order="asc", limit=3)
    assert [item.id for item in page.data] == [item.id for item in chain[:3]] and page.has_more
    assert [item.id for item in page.get_next_page().data] == [chain[3].id]  # after the last id
    before = client.responses.input_items.list(follow.id, order="asc", limit=2, extra_query={"before": chain[3].id})
    assert [item.id for item in before.data] == [chain[1].id, chain[2].id] and before.has_more
    with pytest.raises(openai.BadRequestError) as limit:
        client.responses.input_items.list(follow.id, limit=101)
    assert isinstance(limit.value.body, dict) and limit.value.body["param"] == "limit"
    with pytest.raises(openai.BadRequestError) as cursor:
        client.responses.input_items.list(follow.id, after="msg_elsewhere")
    assert isinstance(cursor.value.body, dict) and cursor.value.body["param"] == "after"
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nothing")


def test_a_deleted_response_leaves_the_chain_that_continued_it(client: openai.OpenAI) -> None:
    """Deleting a response deletes its own input and output from the responses after it
    (each holds a copy of the conversation): they were still listed and continued from
    (fourteenth probe, issue 45). The turns before and after it stay."""

    def texts(response_id: str) -> str:
        return json.dumps([item.model_dump() for item in client.responses.input_items.list(response_id, limit=100)])

    r0 = client.responses.create(model="tiny", input="turn0 SECRET0", max_output_tokens=2, store=True)
    r1 = client.responses.create(
        model="tiny", input="turn1 SECRET1", previous_response_id=r0.id, max_output_tokens=2, store=True
    )
    # r2's own input reuses the id of r1's (a caller may send any): it is r2's, and stays.
    r1_input = client.responses.input_items.list(r1.id, order="asc").data[-1].id
    own: Any = [{"type": "message", "id": r1_input, "role": "user", "content": "turn2 SECRET2"}]
    r2 = client.responses.create(model="tiny", input=own, previous_response_id=r1.id, max_output_tokens=2, store=True)
    other = client.responses.create(  # another branch from r0: r1 is none of its business
        model="tiny", input="branch SECRET3", previous_response_id=r0.id, max_output_tokens=2, store=True
    )
    before = texts(r2.id)
    assert all(s in before for s in ("SECRET0", "SECRET1", "SECRET2", r1.output[0].id))
    branch = texts(other.id)
    client.responses.delete(r1.id)
    after = texts(r2.id)
    assert "SECRET1" not in after and r1.output[0].id not in after
    assert "SECRET0" in after and "SECRET2" in after and r0.output[0].id in after
    assert texts(other.id) == branch  # another branch from r0 is untouched
    # Continuing r2 goes on without r1's turn.
    r3 = client.responses.create(
        model="tiny", input="turn3", previous_response_id=r2.id, max_output_tokens=1, store=True
    )
    chain = texts(r3.id)
    assert "SECRET1" not in chain and "SECRET0" in chain and "SECRET2" in chain


def test_a_response_deleted_while_its_follower_generates_is_not_stored_with_it(client: openai.OpenAI) -> None:
    """A response deleted while one continuing it is still generating: the follower read the
    conversation before the delete and was stored with the deleted turn in it (fifteenth
    probe, issue 45). A delete is remembered for the responses stored after it."""
    r0 = client.responses.create(model="tiny", input="turn0 SECRET0", max_output_tokens=2, store=True)
    r1 = client.responses.create(
        model="tiny", input="turn1 SECRET1", previous_response_id=r0.id, max_output_tokens=2, store=True
    )
    # A string of at least 2,000 characters: the follower cannot end before the delete.
    long_text: Any = {
        "format": {"type": "json_schema", "name": "long", "schema": {"type": "string", "minLength": 2000}}
    }
    with client.responses.create(
        model="tiny",
        input="turn2",
        previous_response_id=r1.id,
        max_output_tokens=4000,
        text=long_text,
        store=True,
        stream=True,
    ) as stream:
        events = iter(stream)
        first = next(events)
        follower = first.response.id  # type: ignore[union-attr]
        client.responses.delete(r1.id)
        last = list(events)[-1]
    assert last.type in ("response.completed", "response.incomplete")  # stored either way
    items = json.dumps([item.model_dump() for item in client.responses.input_items.list(follower, limit=100)])
    assert "SECRET1" not in items and r1.output[0].id not in items
    assert "SECRET0" in items and "turn2" in items


def test_unknown_previous_response_id(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:  # OpenAI's status and code
        client.responses.create(model="tiny", input="Hi", previous_response_id="resp_nothing")
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["param"] == "previous_response_id"
    assert caught.value.body["code"] == "previous_response_not_found"
    # Not stored unless asked: its id is unknown too.
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="Hi", previous_response_id=unstored.id)


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
def test_stored_responses_belong_to_their_key() -> None:
    """Key B given key A's response id can neither read, continue nor delete it: to B it is
    unknown, as files and batches of other keys are."""
    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}, api_key=("alice", "bob")))) as base:
        alice = closing(openai.OpenAI(base_url=f"{base}/v1", api_key="alice", max_retries=0))
        bob = closing(openai.OpenAI(base_url=f"{base}/v1", api_key="bob", max_retries=0))
        first = alice.responses.create(model="tiny", input="secret plans", max_output_tokens=2, store=True)
        with watched(base) as seen:
            with pytest.raises(openai.NotFoundError) as read:
                bob.responses.retrieve(first.id)
            with pytest.raises(openai.NotFoundError) as continued:
                bob.responses.create(model="tiny", input="go on", previous_response_id=first.id, max_output_tokens=1)
            with pytest.raises(openai.NotFoundError):
                bob.responses.input_items.list(first.id)
            with pytest.raises(openai.NotFoundError):
                bob.responses.delete(first.id)
        seen.assert_within()
        assert isinstance(read.value.body, dict) and read.value.body["code"] == "response_not_found"
        assert isinstance(continued.value.body, dict)
        assert continued.value.body["code"] == "previous_response_not_found"
        assert continued.value.body["param"] == "previous_response_id"
        # Still Alice's, whole.
        assert alice.responses.retrieve(first.id).output_text == first.output_text
        alice.responses.create(model="tiny", input="go on", previous_response_id=first.id, max_output_tokens=1)
        alice.responses.delete(first.id)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"background": True}, "background"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}, "input[0]"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
        ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "ftp://x/y.png"}]}]}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"temperature": -1.0}, "temperature"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ],
)
def test_refusals_name_the_field(client: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**{"model": "tiny", "input": "Hi", **fields})
    assert isinstance(caught.value.body, dict)
    assert str(caught.value.body["param"]).startswith(param), caught.value.body


def test_images_reach_a_vision_model(client: openai.OpenAI) -> None:
    content: list[Any] = [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": data_url(image_bytes())},
    ]
    response = client.responses.create(
        model="vision", input=[{"role": "user", "content": content}], max_output_tokens=2
    )
    text_only = client.responses.create(model="vision", input="What is this?", max_output_tokens=2)
    assert response.usage is not None and text_only.usage is not None
    assert response.usage.input_tokens > text_only.usage.input_tokens + 100  # phi3v: hundreds per image


def test_stream_events_in_order(client: openai.OpenAI) -> None:
    text = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}}
    with client.responses.stream(model="tiny", input="2+2?", text=text, max_output_tokens=60, temperature=0) as stream:  # type: ignore[arg-type]
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(streamed), ANSWER_SCHEMA)
    assert final.output_text == streamed and final.usage is not None and final.usage.output_tokens > 0


def test_stream_of_a_function_call_and_of_a_cut_answer(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(
            # Greedy: sampled at random, the random model's `add` call wrote integers long
            # enough to reach max_output_tokens about once in 60 (then the response was incomplete).
            model="tiny",
            input="Weather?",
            tools=TOOLS,
            tool_choice="required",
            max_output_tokens=200,
            temperature=0,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = events[-2]
    assert done.type == "response.output_item.done" and done.item.type == "function_call"
    jsonschema.validate(json.loads(done.item.arguments), PARAMS[done.item.name])
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.output[0].type == "function_call"
    cut = list(client.responses.create(model="tiny", input="Hello", max_output_tokens=3, stream=True))
    last = cut[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"


def test_store_is_bounded(url: str, client: openai.OpenAI) -> None:
    """The module's server keeps 8 responses: the oldest of 9 is gone."""
    ids = [client.responses.create(model="tiny", input="Hi", max_output_tokens=1, store=True).id for _ in range(9)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    gone = httpx.delete(f"{url}/v1/responses/resp_nothing")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "response_id"


def test_one_key_filling_the_store_evicts_its_own_responses() -> None:
    """Fifth probe of issue 45: the store evicted the oldest response of any key, so one key
    storing responses fast broke every other key's ``previous_response_id`` chain. The key
    holding the most gives way."""
    config = ServerConfig(models={"tiny": TINY_MODEL}, api_key=("alice", "bob"), responses_store_max=4)
    with running(create_app(config)) as base:
        alice = closing(openai.OpenAI(base_url=f"{base}/v1", api_key="alice", max_retries=0))
        bob = closing(openai.OpenAI(base_url=f"{base}/v1", api_key="bob", max_retries=0))
        kept = bob.responses.create(model="tiny", input="Hi", max_output_tokens=1, store=True)
        ids = [alice.responses.create(model="tiny", input="Hi", max_output_tokens=1, store=True).id for _ in range(6)]
        assert bob.responses.retrieve(kept.id).id == kept.id
        bob.responses.create(model="tiny", input="go on", previous_response_id=kept.id, max_output_tokens=1)
        for gone in ids[:3]:  # alice holds the most: her oldest go (the store keeps 4)
            with pytest.raises(openai.NotFoundError):
                alice.responses.retrieve(gone)
        assert alice.responses.retrieve(ids[-1]).id == ids[-1]


def test_a_response_id_tag_that_routing_could_not_read_is_refused() -> None:
    """ortserve_server.ray tags ids with a replica id; a tag its router could not read is refused."""
    with pytest.raises(ValueError, match="response_id_tag must be lower-case letters and digits"):
        create_app(ServerConfig(models={"tiny": TINY_MODEL}, response_id_tag="Replica-1"))


def test_the_state_is_readable_by_its_user_only(tmp_path: Path) -> None:
    """Prompts, outputs, files and digests of API keys are in the state database: its dir is
    made 0700 and its files 0600 whatever the umask (they were 0755 and 0644), and a file an
    earlier version made 0644 is narrowed."""
    state, older = tmp_path / "new" / "state", tmp_path / "older"
    older.mkdir()
    (older / "ortserve.db").touch(mode=0o644)
    (older / "ortserve.db").chmod(0o644)
    umask = os.umask(0o022)
    try:
        for folder in (state, older):
            with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}, state_dir=folder))) as base:
                with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
                    kept = client.responses.create(model="tiny", input="private", max_output_tokens=1, store=True)
                    assert client.responses.retrieve(kept.id).id == kept.id
                files = {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}
                assert {"ortserve.db", "ortserve.db-wal"} <= set(files) and set(files.values()) == {0o600}, files
    finally:
        os.umask(umask)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
