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


MESSAGES = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "tiny", "input": "hi", "max_output_tokens": 4}
FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
CLAUDE_TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}}}
NESTED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/messages", {**MESSAGES, "thinking": {"type": "disabled", "display": "omitted"}}, "thinking.display"),
    ("/v1/messages", {**MESSAGES, "thinking": {"type": "disabled", "bogus": 1}}, "thinking.bogus"),
    ("/v1/messages", {**MESSAGES, "tools": [{**CLAUDE_TOOL, "bogus": 1}]}, "tools[0].bogus"),
    ("/v1/messages", {**MESSAGES, "tool_choice": {"type": "auto", "bogus": 1}}, "tool_choice.bogus"),
    ("/v1/messages", {**MESSAGES, "metadata": {"user_id": "u", "bogus": 1}}, "metadata.bogus"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object", "bogus": 1}}, "response_format.bogus"),
    (
        "/v1/chat/completions",
        {**CHAT, "stream": True, "stream_options": {"include_usage": True, "bogus": 1}},
        "stream_options.bogus",
    ),
    ("/v1/responses", {**RESPONSES, "text": {"bogus": 1}}, "text.bogus"),
    ("/v1/responses", {**RESPONSES, "text": {"format": {"type": "text", "bogus": 1}}}, "text.format.bogus"),
    ("/v1/responses", {**RESPONSES, "tools": [{**FUNCTION, "bogus": 1}]}, "tools[0].bogus"),
    ("/v1/responses", {**RESPONSES, "reasoning": {"bogus": 1}}, "reasoning.bogus"),
    # Twentieth probe: prediction was not walked.
    (
        "/v1/chat/completions",
        {**CHAT, "prediction": {"type": "content", "content": "x", "bogus": 1}},
        "prediction.bogus",
    ),
    (
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 4,
            "prediction": {"type": "content", "content": "x", "bogus": 1},
        },
        "prediction.bogus",
    ),
    # Twenty-third probe: an import dropped these; a lenient server refused a message's.
    ("/v1/ui/conversations", {"messages": [{"role": "user", "content": "a", "bogus": 1}]}, "messages[0].bogus"),
    ("/v1/ui/conversations/import", {"data": [{"title": "t", "bogus": 2}]}, "data[0].bogus"),
    (
        "/v1/ui/conversations/import",
        {"data": [{"title": "t", "settings": {"temprature": 1}}]},
        "data[0].settings.temprature",
    ),
    (
        "/v1/ui/conversations/import",
        {"data": [{"messages": [{"role": "user", "content": "a", "bogus": 1}]}]},
        "data[0].messages[0].bogus",
    ),
    # Twenty-fourth probe: keys the SDKs send and change nothing elsewhere were dropped here.
    (
        "/v1/ui/conversations/import",
        {"data": [{"messages": [{"role": "user", "content": "a", "cache_control": {"type": "ephemeral"}}]}]},
        "data[0].messages[0].cache_control",
    ),
    ("/v1/ui/conversations/import", {"data": [{"title": "k", "strict": True}]}, "data[0].strict"),
]


@pytest.fixture(scope="module")
def strict_and_lenient() -> Any:
    with (
        running(create_app(ServerConfig(models={"tiny": TINY_MODEL}, ui=True))) as strict,
        running(create_app(ServerConfig(models={"tiny": TINY_MODEL}, ui=True, lenient=True))) as lenient,
    ):
        yield strict, lenient


@pytest.mark.parametrize(("path", "body", "field"), NESTED, ids=[f"{c[0]}-{c[2]}" for c in NESTED])
def test_an_unknown_key_of_a_settings_object_is_named_unless_lenient(
    strict_and_lenient: tuple[str, str], path: str, body: dict[str, Any], field: str
) -> None:
    """Seventeenth probe, issue 45: only the body's own keys were checked, so these were
    answered 200 with the setting ignored."""
    strict, lenient = strict_and_lenient
    refused = httpx.post(f"{strict}{path}", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert field in error["message"], error
    assert error.get("param", field) == field  # Anthropic's error shape has no param
    taken = httpx.post(f"{lenient}{path}", json=body, timeout=60)
    assert taken.status_code == 200, taken.text


def test_many_unknown_fields_are_named_ten_at_most(strict_and_lenient: tuple[str, str]) -> None:
    """Twenty-seventh probe, issue 45: 49,990 unknown keys made a 640 KB error listing each."""
    strict, _ = strict_and_lenient
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **{f"k{i:05d}": 1 for i in range(5000)}}
    refused = httpx.post(f"{strict}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["param"] == "k00000" and "'k00009' and 4990 more" in error["message"] and len(error["message"]) < 400


def test_unknown_mcp_server_keys_and_verbosity_are_named(strict_and_lenient: tuple[str, str]) -> None:
    """Twentieth probe, issue 45: keys inside Anthropic's ``mcp_servers`` entries were not
    walked (the URL check answered, or the key was ignored), and Responses'
    ``text.verbosity`` was echoed and ignored (OpenAI's default, ``medium``, is taken)."""
    strict, _ = strict_and_lenient
    server = {"type": "url", "url": "https://mcp.example/mcp", "name": "m"}
    for extra, field in (
        ({**server, "bogus": 1}, "mcp_servers[0].bogus"),
        ({**server, "tool_configuration": {"enabled": True, "bogus": 1}}, "mcp_servers[0].tool_configuration.bogus"),
    ):
        refused = httpx.post(f"{strict}/v1/messages", json={**MESSAGES, "mcp_servers": [extra]}, timeout=60)
        assert refused.status_code == 400 and field in refused.json()["error"]["message"], refused.text
    for verbosity in ("low", "high"):
        refused = httpx.post(f"{strict}/v1/responses", json={**RESPONSES, "text": {"verbosity": verbosity}}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "text.verbosity", refused.text
    taken = httpx.post(f"{strict}/v1/responses", json={**RESPONSES, "text": {"verbosity": "medium"}}, timeout=60)
    assert taken.status_code == 200, taken.text


def test_an_unknown_query_parameter_is_named_unless_lenient(strict_and_lenient: tuple[str, str]) -> None:
    """Twenty-first probe, issue 45: ``GET /v1/responses/{id}?stream=true`` answered plain JSON,
    and any made-up query key on any route was ignored."""
    strict, lenient = strict_and_lenient
    stored = httpx.post(f"{strict}/v1/responses", json=RESPONSES, timeout=60).json()["id"]
    for path, key in (
        (f"/v1/responses/{stored}?stream=true", "stream"),
        (f"/v1/responses/{stored}/input_items?include[]=x&limit=2", "include[]"),
        ("/v1/files?limit=5&bogus=1", "bogus"),
        ("/v1/models?x=1", "x"),
        ("/v1/files?limit=1&limit=2", "limit"),  # twenty-second probe: the first was dropped
        # Twenty-third probe: names of the handler's other arguments were taken and ignored.
        ("/v1/models?ortserve=1", "ortserve"),
        (f"/v1/responses/{stored}?request=1", "request"),
        (f"/v1/responses/{stored}?response_id=other", "response_id"),
    ):
        refused = httpx.get(f"{strict}{path}", timeout=60)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == key and repr(key) in error["message"], error
        assert "--lenient" in error["message"] or "given 2 times" in error["message"], error
    with_data = httpx.post(f"{strict}/v1/responses?data=x", json=RESPONSES, timeout=60)
    assert with_data.status_code == 400 and with_data.json()["error"]["param"] == "data", with_data.text
    assert httpx.get(f"{strict}/v1/files?limit=5&order=asc", timeout=60).status_code == 200
    assert httpx.get(f"{lenient}/v1/files?limit=5&bogus=1", timeout=60).status_code == 200


def test_sdk_keys_of_settings_objects_are_taken_or_said_unsupported(strict_and_lenient: tuple[str, str]) -> None:
    """What the official SDKs send: taken where it is honoured or changes nothing
    (``cache_control``), a 400 saying it is not supported otherwise."""
    import anthropic
    import openai

    strict, _ = strict_and_lenient
    claude = anthropic.Anthropic(base_url=strict, api_key="x", max_retries=0)
    tool = {**CLAUDE_TOOL, "cache_control": {"type": "ephemeral"}, "strict": False}  # strict: as OpenAI's
    reply = claude.messages.create(
        model="tiny",
        max_tokens=2,
        messages=[{"role": "user", "content": "hi"}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        metadata={"user_id": "u"},
        thinking={"type": "disabled"},
    )
    assert reply.stop_reason == "max_tokens"
    with pytest.raises(anthropic.BadRequestError) as deferred:
        claude.messages.create(
            model="tiny",
            max_tokens=2,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{**CLAUDE_TOOL, "defer_loading": True}],  # type: ignore[list-item]
        )
    assert "tools[0].defer_loading is not supported" in str(deferred.value)
    client = openai.OpenAI(base_url=f"{strict}/v1", api_key="x", max_retries=0)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}},
        stream=True,
        stream_options={"include_usage": True},
    )
    assert any(chunk.usage for chunk in chat)
    response = client.responses.create(
        model="tiny",
        input="hi",
        max_output_tokens=16,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}, "verbosity": "medium"},
        tools=[{"type": "function", "name": "f", "parameters": {}, "strict": False, "description": "d"}],
    )
    assert response.status == "incomplete" or response.output
    with pytest.raises(openai.BadRequestError) as summary:
        client.responses.create(
            model="tiny", input="hi", max_output_tokens=4, reasoning={"generate_summary": "concise"}
        )
    assert summary.value.body["param"] == "reasoning.generate_summary"  # type: ignore[index]


def test_openai_and_anthropic_fields_at_their_defaults_are_taken(strict_and_lenient: tuple[str, str]) -> None:
    """Twenty-second probe, issue 45: the SDKs' fields at their defaults (``store=False``,
    ``service_tier="auto"``, ``verbosity="medium"``, ``safety_identifier``,
    ``prompt_cache_key``) were 400s as unknown fields; values a local server cannot honour
    are still 400s naming them."""
    import anthropic
    import openai

    strict, _ = strict_and_lenient
    client = openai.OpenAI(base_url=f"{strict}/v1", api_key="x", max_retries=0)
    hi: Any = [{"role": "user", "content": "hi"}]
    taken = {"service_tier": "auto", "safety_identifier": "u1", "prompt_cache_key": "k", "verbosity": "medium"}
    chat = client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, store=False, metadata={}, **taken)
    assert chat.choices
    for refused, param in (
        ({"store": True}, "store"),
        ({"metadata": {"a": "b"}}, "metadata"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"verbosity": "low"}, "verbosity"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, **refused)
        assert caught.value.body["param"] == param  # type: ignore[index]
    answer = client.responses.create(
        model="tiny",
        input="hi",
        max_output_tokens=4,
        service_tier="default",
        safety_identifier="u",
        prompt_cache_key="k",
    )
    assert answer.output is not None
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="hi", max_output_tokens=4, service_tier="priority")
    assert caught.value.body["param"] == "service_tier"  # type: ignore[index]
    claude = anthropic.Anthropic(base_url=strict, api_key="x", max_retries=0)
    for tier in ("auto", "standard_only"):
        assert claude.messages.create(model="tiny", max_tokens=2, messages=hi, service_tier=tier).content is not None
    with pytest.raises(anthropic.BadRequestError, match="service_tier"):
        claude.messages.create(model="tiny", max_tokens=2, messages=hi, extra_body={"service_tier": "priority"})
