"""Tool calling through the HTTP API with the openai SDK, on the tiny (random) model: a
forced call is well-formed only because the output is constrained."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from ortserve_runtime import ToolCall

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "add", "description": "Sum", "parameters": ADD_PARAMS}},
]
PARAMS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
ASK: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]


def reassemble(chunks: list[Any]) -> tuple[str, list[dict[str, str]], str | None]:
    """Content, calls and finish reason from streamed deltas, as an OpenAI client does."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["required", "named"]
)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_calls_are_valid_streamed_or_not(
    tiny_client: openai.OpenAI, tool_choice: Any, temperature: float
) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 200,
        "temperature": temperature,
        "seed": 11,
    }
    result = tiny_client.chat.completions.create(**kwargs)
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])

    content, calls, finish = reassemble(list(tiny_client.chat.completions.create(stream=True, **kwargs)))
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "add"}}], ids=["required", "named"]
)
@pytest.mark.parametrize("max_tokens", [1, 3, 9, 14])
def test_a_forced_call_cut_short_is_still_a_call(tiny_client: openai.OpenAI, tool_choice: Any, max_tokens: int) -> None:
    """As OpenAI: ``finish_reason`` ``length`` and the call's arguments as far as they were
    written, never the raw ``<tool_call>`` markup in the content (cut at 1 token: only the
    start marker; then inside the name, inside the arguments)."""
    kwargs: dict[str, Any] = {"model": "tiny", "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice}
    whole = tiny_client.chat.completions.create(max_tokens=200, temperature=0, **kwargs).choices[0]
    assert whole.message.tool_calls is not None
    full = whole.message.tool_calls[0].function
    cut = tiny_client.chat.completions.create(max_tokens=max_tokens, temperature=0, **kwargs).choices[0]
    assert cut.finish_reason == "length"
    assert cut.message.content is None
    assert cut.message.tool_calls is not None and len(cut.message.tool_calls) == 1
    call = cut.message.tool_calls[0].function
    assert full.arguments.startswith(call.arguments) and call.arguments != full.arguments
    if isinstance(tool_choice, dict):
        assert call.name == "add"
    else:
        assert full.name.startswith(call.name)

    content, calls, finish = reassemble(
        list(tiny_client.chat.completions.create(max_tokens=max_tokens, temperature=0, stream=True, **kwargs))
    )
    assert (content, finish) == ("", "length")
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.name, call.arguments)]
    # "required" with one tool forces that tool: cut before its name, the call still names it.
    only = [t for t in TOOLS if t["function"]["name"] == "add"]
    single = tiny_client.chat.completions.create(
        max_tokens=1, temperature=0, **{**kwargs, "tools": only, "tool_choice": "required"}
    ).choices[0]
    assert single.finish_reason == "length"
    assert single.message.tool_calls is not None and single.message.tool_calls[0].function.name == "add"


# pydantic writes nested models as "$defs" and "$ref"s from the parameters' root (LangChain,
# openai-agents and the SDK's pydantic_function_tool send them so); a recursive one refers
# to the root itself.
TRIP_PARAMS = {
    "type": "object",
    "properties": {"home": {"$ref": "#/$defs/City"}, "stops": {"type": "array", "items": {"$ref": "#/$defs/City"}}},
    "required": ["home", "stops"],
    "$defs": {
        "City": {
            "type": "object",
            "properties": {"name": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
            "required": ["name", "days"],
        }
    },
}
TREE_PARAMS = {
    "type": "object",
    "properties": {"leaf": {"type": "boolean"}, "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
    "required": ["leaf", "kids"],
}


@pytest.mark.parametrize("named", ["plan_trip", "tree", None])
def test_forced_calls_follow_schemas_with_defs_and_references(tiny_client: openai.OpenAI, named: str | None) -> None:
    """Tenth probe: a forced call to a tool whose parameters refer to their own ``$defs``
    (or to their root) was a 400 ("Pointer '/$defs/City' does not exist"): the parameters
    sit inside the call's schema, so their references must point from there."""
    params = {"plan_trip": TRIP_PARAMS, "tree": TREE_PARAMS, "add": ADD_PARAMS}
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in params.items()]
    choice: Any = {"type": "function", "function": {"name": named}} if named else "required"
    message = (
        tiny_client.chat.completions.create(
            model="tiny", messages=ASK, tools=tools, tool_choice=choice, max_tokens=300, temperature=0
        )
        .choices[0]
        .message
    )
    assert message.tool_calls is not None
    [call] = message.tool_calls
    assert call.function.name == named or named is None
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_stream_puts_id_and_name_first_then_arguments(tiny_client: openai.OpenAI) -> None:
    chunks = list(
        tiny_client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0, stream=True
        )
    )
    deltas = [d for c in chunks for ch in c.choices for d in (ch.delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name
    assert deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert all(not (ch.delta.content or "").strip() for c in chunks for ch in c.choices)  # no markup leaks


def test_auto_lets_the_model_answer(tiny_client: openai.OpenAI) -> None:
    result = tiny_client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=12, temperature=0)
    choice = result.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert "<tool_call>" not in choice.message.content


def test_history_with_tool_calls_and_results(tiny_client: openai.OpenAI, tiny_url: str) -> None:
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    prompt = httpx.post(f"{tiny_url}/v1/tokenize", json={"model": "tiny", "messages": history}).json()["tokens"]
    text = httpx.post(f"{tiny_url}/v1/detokenize", json={"model": "tiny", "tokens": prompt}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in text
    result = tiny_client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=5)
    assert result.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    "history",
    [
        [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "21"}],  # no call at all
        [  # a call, but another id
            *ASK,
            {
                "role": "assistant",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "call_2", "content": "21"},
        ],
        [  # the call two turns back
            *ASK,
            {
                "role": "assistant",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "21"},
            {"role": "user", "content": "and?"},
            {"role": "tool", "tool_call_id": "call_1", "content": "22"},
        ],
    ],
)
def test_a_tool_result_for_no_call_before_it_is_a_400(tiny_url: str, history: list[Any]) -> None:
    """Ninth probe of issue 45: a result answering no call was rendered as if it answered
    one (OpenAI's and Anthropic's APIs refuse it)."""
    response = httpx.post(f"{tiny_url}/v1/chat/completions", json={"model": "tiny", "messages": history})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == f"messages[{len(history) - 1}].tool_call_id" and "did not make" in error["message"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "nope"}}, "response_format"),
        ({"tools": [{"type": "function"}]}, "tools"),
        (  # sixteenth probe: taken (OpenAI refuses it)
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tool_requests(tiny_url: str, extra: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{tiny_url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, **extra})
    assert response.status_code == 400, response.text
    assert param in (response.json()["error"]["param"] or response.json()["error"]["message"])


def _nested_object(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"tool_choice": "required"}, "tools"),
        ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tools"),
        ("/v1/messages/count_tokens", {}, "tools"),
        ("/v1/messages", {"tool_choice": {"type": "tool", "name": "f"}}, "tools"),
        ("/v1/responses", {"tool_choice": "required"}, "tools"),
    ],
    ids=["chat-required", "chat-named", "chat-auto", "anthropic-count", "anthropic-tool", "responses-required"],
)
def test_forced_calls_with_parameters_nested_too_deep_are_400(
    tiny_url: str, path: str, body: dict[str, Any], param: str
) -> None:
    """Twentieth probe, issue 45: a forced call's grammar walked the parameters by recursion
    (a 500 at 240 levels), where a response format that deep was a 400; twenty-first: any
    tools nested some 480 levels were a 500 (they are made plain values first). The body's
    nesting is bounded now, well within what Python walks."""
    deep = _nested_object(240)
    if path.startswith("/v1/messages"):
        request = {"tools": [{"name": "f", "input_schema": deep}], "messages": ASK}
        request.update({} if path.endswith("count_tokens") else {"max_tokens": 4})
    elif path == "/v1/responses":
        request = {"max_output_tokens": 4, "tools": [{"type": "function", "name": "f", "parameters": deep}]}
        request["input"] = "Weather?"
    else:
        request = {"max_tokens": 4, "tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]}
        request["messages"] = ASK
    response = httpx.post(f"{tiny_url}{path}", json={"model": "tiny", **request, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert param in (error.get("param") or "") + error["message"] and "nested too deeply" in error["message"], error
    assert httpx.get(f"{tiny_url}/health").status_code == 200


def test_a_format_too_deep_beside_tools_is_named_not_tool_choice(tiny_url: str) -> None:
    """Twenty-second probe, issue 45: a ``guided_json`` (a JSON string, so past the body's
    nesting bound) too deep to compile beside tools was a 400 naming ``tool_choice``, which
    the request did not send."""
    deep = json.dumps({"type": "object", "properties": {"x": _nested_object(400)}})
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, "tools": TOOLS, "guided_json": deep}
    refused = httpx.post(f"{tiny_url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "guided_json", refused.text


def _chain(length: int) -> dict[str, Any]:
    """A schema whose ``$defs`` chain ``length`` references deep."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(length)}
    defs[f"d{length}"] = {"type": "integer"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"$ref": "#/$defs/nope"}, "does not exist"),
        (_chain(1500), "$refs go 4503 deep; at most 4000"),
        ({"type": "object", "x-guidance": {"bogus_option": 1}}, "bogus_option"),
        ({"type": "object", "x-guidance": "strict"}, "x-guidance must be an object"),
    ],
    ids=["missing $ref", "1,500-reference chain", "unknown x-guidance option", "x-guidance not an object"],
)
def test_a_format_beside_tools_that_cannot_compile_is_named(tiny_url: str, schema: dict[str, Any], words: str) -> None:
    """Twenty-third probe, issue 45: what the compiler refused of a response format beside
    tools (the tools compile alone) was a 400 naming ``tools``. Twenty-seventh: its message
    quoted the lines of the grammar the server wrote around it (``tool: <[1022]> ...``), a
    chain the format alone may have was refused beside tools as Lark rule references, and
    the format's ``x-guidance`` was replaced there (unknown options taken, 200). It is told
    as the format alone is refused."""
    response_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, "response_format": response_format}
    alone = httpx.post(f"{tiny_url}/v1/chat/completions", json=body, timeout=60)
    refused = httpx.post(f"{tiny_url}/v1/chat/completions", json={**body, "tools": TOOLS}, timeout=60)
    assert refused.status_code == alone.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "response_format" and words in error["message"], error
    assert error["message"] == alone.json()["error"]["message"] and "Lark" not in error["message"]
    bad_tools = [{"type": "function", "function": {"name": "g", "parameters": {"$ref": "#/$defs/nope"}}}]
    refused = httpx.post(f"{tiny_url}/v1/chat/completions", json={**body, "tools": bad_tools}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools", refused.text


def test_a_format_beside_tools_keeps_its_own_depth_bound(tiny_url: str) -> None:
    """A chain of 1,500 plain references compiles alone and beside tools alike (its depth
    was added to the rules' there and refused as Lark rule references: twenty-seventh probe)."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1500)}
    defs["d1500"] = {"type": "integer"}
    chain = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#/$defs/d0", "$defs": defs}}}
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, "response_format": chain}
    for request in (body, {**body, "tools": TOOLS}):
        taken = httpx.post(f"{tiny_url}/v1/chat/completions", json=request, timeout=60)
        assert taken.status_code == 200, taken.text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_format_beside_a_forced_call_must_compile(tiny_url: str, choice: Any) -> None:
    """Twenty-fourth probe, issue 45: a response format that cannot compile, beside a forced
    call (the format shapes the turns after the call), was taken, 200."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "r", "schema": {"type": "string", "pattern": "(["}},
    }
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, "tools": TOOLS, "tool_choice": choice}
    refused = httpx.post(f"{tiny_url}/v1/chat/completions", json={**body, "response_format": response_format})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "response_format" and "regex parse error" in refused.text, refused.text
    taken = httpx.post(f"{tiny_url}/v1/chat/completions", json={**body, "response_format": FORMAT}, timeout=60)
    assert taken.status_code == 200 and taken.json()["choices"][0]["message"]["tool_calls"], taken.text


def test_parallel_tool_calls_false_keeps_the_first(tiny_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two calls in the output; with parallel_tool_calls=false only the first comes back."""
    from ortserve_runtime import ToolCallParser

    two = [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("add", '{"a": 3, "b": 4}')]
    original = ToolCallParser.finish

    def finish(self: ToolCallParser, **kwargs: Any) -> tuple[str, list[ToolCall]]:
        rest, _ = original(self, **kwargs)
        return rest, list(two)

    monkeypatch.setattr(ToolCallParser, "finish", finish)
    body = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 3}
    both = httpx.post(f"{tiny_url}/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
    one = httpx.post(f"{tiny_url}/v1/chat/completions", json={**body, "parallel_tool_calls": False}).json()
    assert len(both) == 2
    assert [c["function"]["arguments"] for c in one["choices"][0]["message"]["tool_calls"]] == ['{"a": 1, "b": 2}']


FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"answer": {"type": "string", "maxLength": 8}},
            "required": ["answer"],
        },
    },
}


def test_a_forced_call_with_a_response_format_is_a_call(tiny_client: openai.OpenAI) -> None:
    """openai-agents sends both (an output type and tool_choice required): the forced turn
    is the call; the format shapes the text turn after the tool results."""
    for seed in range(3):
        reply = tiny_client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            response_format=FORMAT,  # type: ignore[arg-type]
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        calls = reply.choices[0].message.tool_calls or []
        assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        jsonschema.validate(json.loads(calls[0].function.arguments), PARAMS[calls[0].function.name])  # type: ignore[union-attr]
    response = tiny_client.responses.create(
        model="tiny",
        input="What is the weather in Paris?",
        tools=[{"type": "function", "name": "add", "parameters": ADD_PARAMS, "strict": True}],
        tool_choice="required",
        text={"format": {"type": "json_schema", "name": "answer", "schema": FORMAT["json_schema"]["schema"]}},  # type: ignore[index,typeddict-item]
        max_output_tokens=200,
    )
    assert [item.type for item in response.output] == ["function_call"]


def test_auto_with_a_response_format_calls_or_answers_in_it(tiny_client: openai.OpenAI) -> None:
    """The format must not rule out calls: each reply is a valid call or a valid answer."""
    kinds = set()
    for seed in range(8):
        reply = tiny_client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            response_format=FORMAT,  # type: ignore[arg-type]
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        message = reply.choices[0].message
        if message.tool_calls:
            kinds.add("call")
            call = message.tool_calls[0].function  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
        else:
            kinds.add("answer")
            assert reply.choices[0].finish_reason == "stop", message.content
            jsonschema.validate(json.loads(message.content or ""), FORMAT["json_schema"]["schema"])  # type: ignore[index]
    assert kinds  # which of the two a random model picks is its business; both are well-formed


def test_undeclared_keys_are_never_generated(tiny_client: openai.OpenAI) -> None:
    """Schemas that do not say additionalProperties (LangChain's, LiteLLM's, most hand-written
    tools') get objects holding their declared keys only (``note`` declares none; an object
    that declares no ``properties`` at all stays any object)."""
    open_params = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "note": {"type": "object", "properties": {}}},
    }
    tools = [{"type": "function", "function": {"name": "add", "parameters": open_params}}]
    complete = 0
    for seed in range(6):
        reply = tiny_client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=tools,  # type: ignore[arg-type]
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        calls = reply.choices[0].message.tool_calls or []
        if reply.choices[0].finish_reason == "tool_calls":
            arguments = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
            assert set(arguments) <= {"a", "note"} and set(arguments.get("note") or {}) == set(), arguments
            complete += 1
        answer = tiny_client.chat.completions.create(
            model="tiny",
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": open_params}},
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        if answer.choices[0].finish_reason == "stop":
            parsed = json.loads(answer.choices[0].message.content or "")
            assert set(parsed) <= {"a", "note"} and set(parsed.get("note") or {}) == set(), parsed
            complete += 1
    assert complete >= 6  # most replies end well-formed within max_tokens


# A chat template per format: each renders the conversation (and the tools, which the
# format check reads from the template) as its family's templates do, minimally.
FORMAT_TEMPLATES = {
    "llama3": "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}"
    "{% endfor %}{% if tools %}Respond with a JSON call; tool results come back as ipython.{% endif %}"
    "<|start_header_id|>assistant<|end_header_id|>",
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}{# calls: [TOOL_CALLS] #}",
    "phi4": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if tools %}<|tool|>{{ tools | tojson }}<|/tool|>{# calls: <|tool_call|> #}{% endif %}<|assistant|>",
}


@pytest.fixture(scope="module")
def formats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from serving import serving_templates

    with serving_templates(tmp_path_factory.mktemp("templates"), FORMAT_TEMPLATES) as url:
        yield url


@pytest.mark.parametrize("format", list(FORMAT_TEMPLATES))
@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_in_llama3_mistral_and_phi4_formats(formats_url: str, format: str, stream: bool) -> None:
    """tool_choice required or named on a model of each other format: one valid call, as
    on Hermes models (before, a 400 said forcing was Hermes-only)."""
    with openai.OpenAI(base_url=f"{formats_url}/v1", api_key="x", max_retries=0) as client:
        assert client.models.retrieve(format).model_extra["tool_format"] == format  # type: ignore[index]
        for tool_choice in ("required", {"type": "function", "function": {"name": "add"}}):
            kwargs: dict[str, Any] = {
                "model": format,
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": tool_choice,
                "max_tokens": 200,
                "temperature": 1.0,
                "seed": 5,
            }
            if stream:
                content, calls, finish = reassemble(list(client.chat.completions.create(stream=True, **kwargs)))
                named = [(c["name"], c["arguments"]) for c in calls]
            else:
                choice = client.chat.completions.create(**kwargs).choices[0]
                content, finish = choice.message.content or "", choice.finish_reason
                named = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
            assert (content, finish, len(named)) == ("", "tool_calls", 1), (format, tool_choice, named)
            if isinstance(tool_choice, dict):
                assert named[0][0] == "add"
            jsonschema.validate(json.loads(named[0][1]), PARAMS[named[0][0]])


@pytest.mark.parametrize("format", list(FORMAT_TEMPLATES))
def test_anthropic_forced_tool_use_in_llama3_mistral_and_phi4_formats(formats_url: str, format: str) -> None:
    """The same through the anthropic SDK: tool_choice ``tool`` (named) and ``any``, whole
    and streamed, each a ``tool_use`` block whose input fits the schema."""
    import anthropic

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
    }
    tools: list[Any] = [{"name": "pick", "description": "Pick", "input_schema": schema}]
    ask: list[Any] = [{"role": "user", "content": "pick something"}]
    with anthropic.Anthropic(base_url=formats_url, api_key="x", max_retries=0) as client:
        for choice in ({"type": "tool", "name": "pick"}, {"type": "any"}):
            whole = client.messages.create(model=format, max_tokens=100, messages=ask, tools=tools, tool_choice=choice)  # type: ignore[arg-type]
            with client.messages.stream(
                model=format,
                max_tokens=100,
                messages=ask,
                tools=tools,
                tool_choice=choice,  # type: ignore[arg-type]
            ) as stream:
                streamed = stream.get_final_message()
            for message in (whole, streamed):
                assert message.stop_reason == "tool_use", (format, message)
                uses = [block for block in message.content if block.type == "tool_use"]
                assert len(uses) == 1 and uses[0].name == "pick"
                jsonschema.validate(uses[0].input, schema)


@pytest.mark.parametrize(
    ("field", "value"),
    [("guided_choice", ["a", "b"]), ("guided_regex", "[ab]"), ("guided_grammar", 'start: "a" | "b"')],
)
def test_a_guided_reply_beside_tools_the_model_may_call_is_refused(tiny_url: str, field: str, value: Any) -> None:
    """Twenty-seventh probe, issue 45: a choice, regex or Lark grammar holds the whole reply,
    so beside tools under tool_choice auto the tools could never be called (200). A JSON
    schema goes beside them (a call or an answer in it); with tool_choice none it holds."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 2, "tools": TOOLS, field: value}
    refused = httpx.post(f"{tiny_url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == field and "could not call the tools beside it" in error["message"], error
    answered = httpx.post(f"{tiny_url}/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=60)
    assert answered.status_code == 200 and answered.json()["choices"][0]["message"]["content"] in ("a", "b")


def test_a_responses_format_past_the_grammar_bound_is_named_as_responses_spell_it(tiny_url: str) -> None:
    """Twenty-seventh probe: Responses' text.format past the grammar's size bound was named
    text.format, its message saying 'the response_format grammar'."""
    schema = {"type": "string", "enum": [f"value-{i:05d}-of-a-long-list" for i in range(20_000)]}
    text = {"format": {"type": "json_schema", "name": "r", "schema": schema}}
    refused = httpx.post(f"{tiny_url}/v1/responses", json={"model": "tiny", "input": "hi", "text": text}, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "text.format" and "response_format" not in error["message"], error
    assert error["message"].startswith("the grammar is ")
