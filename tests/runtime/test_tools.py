"""Tool-call parsing on recorded outputs of each family's format, malformed ones included."""

from __future__ import annotations

import json

import pytest
from ortserve_runtime import ToolCall, ToolCallParser, detect_tool_format, forced_tool_grammar
from ortserve_runtime.chat._tools import tools_as_text
from serving import TINY_MODEL

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "c"}))
ADD = ToolCall("add", json.dumps({"a": 1, "b": 2}))

RECORDED = [
    # Qwen 2.5 / Hermes, with content before the call and two parallel calls
    (
        "hermes",
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
        ),
        "Let me check.\n\n",
        [WEATHER, ADD],
    ),
    # the model ended (EOS) before the closing tag, with the JSON complete: still a call
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', "", [ADD]),
    # Llama 3.1/3.2 JSON tool calls: bare JSON, and after <|python_tag|>
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', "", [WEATHER]),
    ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [ADD]),
    # Phi-4-mini: a JSON list between tool-call tokens
    (
        "phi4",
        (
            '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
            '{"name": "add", "arguments": {"a": 1, "b": 2}}]<|/tool_call|>'
        ),
        "",
        [WEATHER, ADD],
    ),
    # Mistral: [TOOL_CALLS] then a JSON list to the end; arguments double-encoded
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}]', "", [ADD]),
]

MALFORMED = [
    ("hermes", "<tool_call>\n{not json}\n</tool_call> and more"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments not an object
    ("phi4", '<|tool_call|>[{"name": 3}]<|/tool_call|>'),
    ("mistral", "[TOOL_CALLS] sorry, no JSON here"),
    ("llama3", '{"name": "get_weather", "parameters": {"city": '),
    # Nested past Python's recursion limit (a RecursionError escaped): output a model can be made to write.
    ("hermes", '<tool_call>{"name": "f", "arguments": ' + "[" * 1500 + "]" * 1500 + "}</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": "' + "[" * 1500 + "]" * 1500 + '"}</tool_call>'),
]


def parse(format: str, text: str, step: int | None = None) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(format)  # type: ignore[arg-type]
    pieces = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    content, calls = "", []
    for piece in pieces:
        more, made = parser.feed(piece)
        content += more
        calls += made
    rest, made = parser.finish()
    return content + rest, calls + made


@pytest.mark.parametrize(("format", "text", "content", "calls"), RECORDED)
def test_recorded_outputs(format: str, text: str, content: str, calls: list[ToolCall]) -> None:
    assert parse(format, text) == (content, calls)


@pytest.mark.parametrize(("format", "text", "content", "calls"), RECORDED)
@pytest.mark.parametrize("step", [1, 2, 7])
def test_streaming_in_pieces_gives_the_same(
    format: str, text: str, content: str, calls: list[ToolCall], step: int
) -> None:
    assert parse(format, text, step) == (content, calls)


@pytest.mark.parametrize(("format", "text"), MALFORMED)
@pytest.mark.parametrize("step", [None, 1, 3])
def test_malformed_markup_falls_back_to_content(format: str, text: str, step: int | None) -> None:
    assert parse(format, text, step) == (text, [])


def test_markup_is_never_shown_early() -> None:
    parser = ToolCallParser("hermes")
    assert parser.feed("Hello <tool_") == ("Hello ", [])  # might be a call: held back
    assert parser.feed('call>{"name": "add", "arguments": {"a": 1, "b": 2}}') == ("", [])
    assert parser.feed("</tool_call> bye") == (" bye", [ADD])
    assert ToolCallParser("hermes").feed("a <b>") == ("a <b>", [])


@pytest.mark.parametrize(
    ("format", "text", "forced", "call"),
    [
        ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b"', None, ToolCall("add", '{"a": 1, "b"')),
        ("hermes", '<tool_call>\n{"name": "ad', None, ToolCall("ad", "")),
        ("hermes", '<tool_call>\n{"na', "add", ToolCall("add", "")),
        ("hermes", "<tool_call>", "", ToolCall("", "")),
        ("phi4", '<|tool_call|>[{"name": "f", "arguments": {"x": [1,', None, ToolCall("f", '{"x": [1,')),
        ("llama3", '{"name": "f", "parameters": {"q": "a\\"b', None, ToolCall("f", '{"q": "a\\"b')),
    ],
)
def test_a_call_cut_short_is_a_call_as_far_as_it_got(
    format: str, text: str, forced: str | None, call: ToolCall
) -> None:
    parser = ToolCallParser(format)  # type: ignore[arg-type]
    content, calls = parser.feed(text)
    rest, more = parser.finish(cut_short=True, forced=forced)
    assert (content + rest, calls + more) == ("", [call])


def test_an_unfinished_call_that_was_not_cut_short_stays_content() -> None:
    parser = ToolCallParser("hermes")
    parser.feed('<tool_call>\n{"name": "add", "arg')
    assert parser.finish() == ('<tool_call>\n{"name": "add", "arg', [])
    unnamed = ToolCallParser("hermes")
    unnamed.feed('<tool_call>\n{"na')
    assert unnamed.finish(cut_short=True) == ('<tool_call>\n{"na', [])  # not forced, no name: text


def test_plain_text_is_content() -> None:
    for format in ("hermes", "llama3", "phi4", "mistral"):
        assert parse(format, "Just an answer, no tools.") == ("Just an answer, no tools.", [])


def test_format_follows_the_chat_template() -> None:
    tiny_template = (TINY_MODEL / "chat_template.jinja").read_text()
    assert detect_tool_format(tiny_template) == "hermes"
    assert detect_tool_format("{{ '<|tool_call|>' }}") == "phi4"
    assert detect_tool_format("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_format("{%- if message.role == 'ipython' %}") == "llama3"
    assert detect_tool_format("{{ messages }}") is None
    assert detect_tool_format(None) is None


def test_forced_grammar_names_marker_tokens_by_id() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    grammar = forced_tool_grammar("hermes", tools, token_id={"<tool_call>": 7, "</tool_call>": 8}.get)
    assert grammar is not None and grammar.kind == "lark"
    assert str(grammar.source).startswith('start: tool\ntool: <[7]> "\\n" call "\\n" <[8]>')
    assert forced_tool_grammar("hermes", tools, name="missing") is None


def test_an_answer_beside_tools_keeps_its_own_whitespace_options() -> None:
    """Twenty-seventh probe, issue 45: the format's own ``x-guidance`` was replaced by the
    server's strict whitespace beside tools (so its unknown options were taken, 200)."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    answer = {"type": "object", "x-guidance": {"whitespace_flexible": True, "whitespace_pattern": "[ ]{5}"}}
    grammar = forced_tool_grammar("hermes", tools, or_answer=answer)
    assert grammar is not None
    written = json.loads(str(grammar.source).split("\nanswer: %json ", 1)[1])
    assert written["x-guidance"] == {"whitespace_flexible": True, "whitespace_pattern": "[ ]{5}"}
    strict = forced_tool_grammar("hermes", tools, or_answer={"type": "object"})
    assert strict is not None and '"x-guidance": {"whitespace_flexible": false}' in str(strict.source)


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Lyon"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.mark.anyio
@pytest.mark.parametrize("format", ["hermes", "phi4", "mistral", "llama3"])
@pytest.mark.parametrize("name", ["get_weather", None])
async def test_a_forced_call_in_each_format_parses_back_as_that_call(format: str, name: str | None) -> None:
    """What the grammar lets a model write (the tiny random model, sampled with several
    seeds) is one call of the named tool (or one of the tools), in the layout the format's
    parser reads, with arguments valid for its schema."""
    from ortserve_runtime import GenerationOptions, ModelConfig, ModelRegistry

    registry = ModelRegistry(ModelConfig(engine="ort-cpu"))
    registry.add("tiny", TINY_MODEL)
    model = await registry.get("tiny")
    try:
        grammar = forced_tool_grammar(format, WEATHER, name, model.tokenizer.token_to_id)  # type: ignore[arg-type]
        assert grammar is not None
        for seed in range(4):
            options = GenerationOptions(max_tokens=120, temperature=1.0, seed=seed, grammar=grammar)
            text, _, finish, _ = await model.generate("Call a tool.", options=options).collect()
            assert finish == "stop", text  # the grammar ended the output, not the length
            parser = ToolCallParser(format)  # type: ignore[arg-type]
            content, calls = parser.feed(text)
            rest, more = parser.finish()
            calls = calls + more
            assert (content + rest).strip() == "" and len(calls) == 1, text
            call = calls[0]
            arguments = json.loads(call.arguments)
            if name is not None or call.name == "get_weather":
                assert call.name == "get_weather"
                assert arguments["city"] in ("Paris", "Lyon") and 1 <= arguments["days"] <= 7
            else:
                assert call.name == "get_time" and arguments == {}
    finally:
        await registry.close()


def test_tools_as_text_for_a_template_without_tools() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    cut = {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b'}}
    whole = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": "Sure.", "tool_calls": [whole, cut]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "error"},
    ]
    out = tools_as_text(messages, tools)
    assert out[0]["role"] == "system" and out[0]["content"].startswith("# Tools\n")
    assert '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}' in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b}\n</tool_call>',
    }
    assert out[3] == {
        "role": "user",
        "content": "<tool_response>\n3\n</tool_response>\n<tool_response>\nerror\n</tool_response>",
    }
    with_system = tools_as_text([{"role": "system", "content": "Be brief."}, *messages[:1]], tools)
    assert with_system[0]["content"].startswith("Be brief.\n\n# Tools\n") and len(with_system) == 2
    assert tools_as_text(messages[:1], None) == messages[:1]


def test_closed_schema_closes_declared_objects_only() -> None:
    from ortserve_runtime.chat._constraints import closed_schema

    assert closed_schema({"type": "object"}) == {"type": "object"}  # json_object: any object
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}}
    assert closed_schema(nested) == {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {}}, "additionalProperties": False}},
        "additionalProperties": False,
    }
    kept = {"properties": {"a": {}}, "additionalProperties": True}
    assert closed_schema(kept) == kept
    merged = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed_schema(merged) == merged
    listed = {"type": "array", "items": {"properties": {"x": {}}}}
    assert closed_schema(listed)["items"]["additionalProperties"] is False
