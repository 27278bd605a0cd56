"""Structured output on the tiny random model: only the constraint can make these pass."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import jsonschema
import openai
import pytest
from serving import watched

ASK = [{"role": "user", "content": "Give me data"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["point", "ok"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("seed", [1, 5])
def test_json_object_always_parses(tiny_client: openai.OpenAI, seed: int) -> None:
    # A random-weight model rarely closes a free-form string, so these seeds are ones where
    # it ends within max_tokens (a JSON object has no length bound; the schemas below do).
    result = tiny_client.chat.completions.create(
        model="tiny", messages=ASK, response_format={"type": "json_object"}, max_tokens=400, seed=seed
    )
    assert result.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(result.choices[0].message.content or ""), dict)


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_validates(tiny_client: openai.OpenAI, schema: dict[str, object], temperature: float) -> None:
    result = tiny_client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=300,
        temperature=temperature,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "data", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(result.choices[0].message.content or ""), schema)


def test_streamed_json_schema_equals_non_streamed(tiny_client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "d", "schema": SCHEMAS[1]}}
    plain = tiny_client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=300, temperature=0, response_format=fmt
    )
    chunks = tiny_client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=300, temperature=0, response_format=fmt, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMAS[1])


def test_max_tokens_cutting_the_json_says_length(tiny_client: openai.OpenAI) -> None:
    result = tiny_client.chat.completions.create(
        model="tiny",
        messages=ASK,
        max_tokens=3,
        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": SCHEMAS[0]}},
    )
    assert result.choices[0].finish_reason == "length"


def test_guided_regex_choice_and_grammar(tiny_url: str) -> None:
    def ask(**extra: object) -> str:
        body = {"model": "tiny", "prompt": "answer:", "max_tokens": 40, "seed": 3, **extra}
        response = httpx.post(f"{tiny_url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        text: str = response.json()["choices"][0]["text"]
        return text

    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", ask(guided_regex=r"[0-9]{3}-[a-z]{2,5}"))
    assert ask(guided_choice=["yes", "no", 'maybe "so"']) in {"yes", "no", 'maybe "so"'}
    grammar = 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'
    assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})*\)", ask(guided_grammar=grammar))


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "[0-9"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": '{"a":' * 2000 + "1" + "}" * 2000}, "guided_json"),  # RecursionError: was a 500
        # A forced tool call with a guided_* constraint: the constraint was dropped (fourteenth probe).
        ({"tools": [TOOL], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}, "guided_choice": ["a"]},
            "guided_choice",
        ),
    ],
)
@pytest.mark.timing  # /health's latency meanwhile (issue 45)
def test_invalid_constraints_are_400_naming_the_field(tiny_url: str, extra: dict[str, object], param: str) -> None:
    with watched(tiny_url) as seen:
        response = httpx.post(f"{tiny_url}/v1/chat/completions", json={"model": "tiny", "messages": ASK, **extra})
    seen.assert_within()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "Traceback" not in error["message"]


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"$defs": {"x": {"type": "array", "items": {"$ref": "#/$defs/x"}, "minItems": 1}}, "$ref": "#/$defs/x"},
    ],
    ids=["self-nested-object", "self-nested-array"],
)
def test_a_schema_that_cannot_be_followed_is_a_400_not_a_stop(tiny_url: str, schema: dict[str, object]) -> None:
    """It compiles, but no finite output matches it: llguidance gives up after a token, and
    the answer says so (naming response_format) instead of a "stop" with output that does
    not match; the server goes on serving."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "JSON please"}],
        "max_tokens": 20,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    reply = httpx.post(f"{tiny_url}/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "response_format" and "could not be made to follow" in error["message"]
    assert "<grammar>" not in error["message"]
    ok = httpx.post(f"{tiny_url}/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "guided_regex": "a\u2028b\u2029c\x85d"},
        ),
        ("/v1/completions", {"prompt": "hi", "guided_regex": "a\u2028b\u2029c\x85d"}),
    ],
)
def test_line_separators_a_model_writes_stay_inside_their_event(
    tiny_url: str, path: str, body: dict[str, object]
) -> None:
    """JSON may hold U+2028, U+2029 and U+0085 raw; a reader that splits lines as
    ``str.splitlines`` does (httpx's ``iter_lines``) then cut an event in two."""
    request = {"model": "tiny", "max_tokens": 40, "stream": True, **body}
    with httpx.stream("POST", f"{tiny_url}{path}", json=request, timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]  # every line a whole event
    text = "".join(
        choice.get("text") or (choice.get("delta") or {}).get("content") or ""
        for event in events
        for choice in event["choices"]
    )
    assert text == "a\u2028b\u2029c\x85d"


def _chained_defs(links: int) -> dict[str, object]:
    defs: dict[str, object] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(links)
    }
    defs[f"d{links}"] = {"type": "null"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def _chained_names(links: int, kind: str) -> dict[str, object]:
    """A chain through ``$anchor`` names or ``$id`` URIs, which llguidance resolves too."""
    name = (lambda i: f"a{i}") if kind == "anchor" else (lambda i: f"urn:x:{i}")
    ref = (lambda i: f"#a{i}") if kind == "anchor" else name
    key = "$anchor" if kind == "anchor" else "$id"
    defs: dict[str, object] = {
        f"d{i}": {key: name(i), "anyOf": [{"$ref": ref(i + 1)}, {"type": "null"}]} for i in range(links)
    }
    defs[f"d{links}"] = {key: name(links), "type": "null"}
    return {"$ref": ref(0), "$defs": defs}


def _chained_rules(rules: int, attributes: str = "", around: str = "") -> str:
    """``around``: a string literal before and after each reference."""
    return "start: r0\n" + "\n".join(
        [f'r{i}{attributes}: {around} r{i + 1} {around} | "a"' for i in range(rules)] + [f'r{rules}: "b"']
    )


def _chained_spelt(links: int, spelling: str) -> dict[str, object]:
    """A ``#/$defs`` chain, each ref spelt ``spelling`` + the pointer (relative to
    llguidance's base URI ``json-schema:///``), and one unrelated nested ``$id``."""
    defs: dict[str, object] = {
        f"d{i}": {"anyOf": [{"$ref": f"{spelling}#/$defs/d{i + 1}"}, {"type": "null"}]} for i in range(links)
    }
    defs[f"d{links}"] = {"type": "null"}
    defs["zz"] = {"$id": "urn:dummy", "type": "integer"}
    return {"$ref": f"{spelling}#/$defs/d0", "$defs": defs}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _chained_defs(1500)}}},
            "response_format",
        ),
        ({"guided_grammar": _chained_rules(3000)}, "guided_grammar"),
        # Sixteenth probe: chains the check did not follow (each killed the server).
        *(
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                "response_format",
            )
            for schema in (_chained_names(1500, "anchor"), _chained_names(1500, "id"))
        ),
        ({"guided_grammar": "start: %json " + json.dumps(_chained_defs(1500))}, "guided_grammar"),
        # Seventeenth probe: a nested $id switched pointers off, refs relative to the default
        # base were not resolved, rules with attributes were not rules (each killed the server).
        *(
            (
                {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                "response_format",
            )
            for schema in (_chained_spelt(1500, spelt) for spelt in ("", "/", "./", "json-schema:///"))
        ),
        ({"guided_grammar": _chained_rules(3000, "[capture]")}, "guided_grammar"),
        ({"guided_grammar": _chained_rules(3000, ' [lazy, stop=""]')}, "guided_grammar"),
        # Twentieth probe: a line separator inside a string ended the check's line there.
        ({"guided_grammar": _chained_rules(3000, around='"\u2028"')}, "guided_grammar"),
        ({"guided_grammar": _chained_rules(3000, around='"\x85"')}, "guided_grammar"),
    ],
    ids=[
        "defs-chain-1500",
        "lark-rules-3000",
        "anchor-chain-1500",
        "id-chain-1500",
        "lark-json-chain-1500",
        "nested-id-chain-1500",
        "slash-chain-1500",
        "dot-slash-chain-1500",
        "base-uri-chain-1500",
        "lark-capture-rules-3000",
        "lark-lazy-rules-3000",
        "lark-u2028-rules-3000",
        "lark-nel-rules-3000",
    ],
)
@pytest.mark.timing  # /health's latency meanwhile (issue 45)
def test_reference_chains_too_deep_to_compile_are_400(tiny_url: str, extra: dict[str, object], param: str) -> None:
    """Both are flat and under the size limit, but llguidance's compiler follows the chain
    by recursion: it overflowed a worker thread's stack and the process died (SIGSEGV)."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 4, **extra}
    with watched(tiny_url) as seen:
        refused = httpx.post(f"{tiny_url}/v1/chat/completions", json=body, timeout=60)
    seen.assert_within()
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == param and "deep; at most" in error["message"], error
    tree = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v", "kids"],
            }
        },
        "$ref": "#/$defs/node",
    }
    recursive = {"type": "json_schema", "json_schema": {"name": "tree", "schema": tree}}
    ok = httpx.post(
        f"{tiny_url}/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, "max_tokens": 4, "response_format": recursive},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text  # a type that refers to itself is not a chain
    by_anchor = {**tree["$defs"]["node"], "$anchor": "node"}  # type: ignore[index]
    by_anchor["properties"] = {**by_anchor["properties"], "kids": {"type": "array", "items": {"$ref": "#node"}}}
    recursive = {"type": "json_schema", "json_schema": {"name": "tree", "schema": by_anchor}}
    ok = httpx.post(
        f"{tiny_url}/v1/chat/completions",
        json={"model": "tiny", "messages": ASK, "max_tokens": 4, "response_format": recursive},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text
    assert httpx.get(f"{tiny_url}/health").status_code == 200


@pytest.mark.parametrize(
    ("path", "extra", "field"),
    [
        ("/v1/chat/completions", {"messages": ASK, "max_tokens": 2}, "guided_json"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 2}, "guided_json"),
        ("/v1/responses", {"input": "a", "max_output_tokens": 2}, "text"),
    ],
)
def test_a_body_nested_past_the_bound_is_400_naming_the_field(
    tiny_url: str, path: str, extra: dict[str, object], field: str
) -> None:
    """Twenty-first probe, issue 45: a schema nested 970 deep, which JSON still decodes,
    failed in a Python walk as a 500 (the grammar's size check, the tools made plain)."""
    deep = '{"a": [' * 485 + "1" + "]}" * 485  # written out: Python's json cannot encode it
    schema = '{"type": "object", "properties": {"x": ' + deep + "}}"
    text = '{"format": {"type": "json_schema", "name": "n", "schema": ' + schema + "}}"
    value = text if field == "text" else schema
    body = json.dumps({"model": "tiny", **extra})[:-1] + f', "{field}": {value}}}'
    headers = {"content-type": "application/json"}
    refused = httpx.post(f"{tiny_url}{path}", content=body, headers=headers, timeout=60)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == field and f"nested too deeply in '{field}'" in error["message"], error
    assert "at most 128" in error["message"], error
    shallow = {"type": "object", "properties": {"x": {"type": "object", "properties": {"y": {"type": "integer"}}}}}
    if field == "text":
        extra = {**extra, "text": {"format": {"type": "json_schema", "name": "n", "schema": shallow}}}
    else:
        extra = {**extra, "guided_json": shallow}
    taken = httpx.post(f"{tiny_url}{path}", json={"model": "tiny", **extra}, timeout=60)
    assert taken.status_code == 200, taken.text


def test_a_recursive_union_of_many_types_compiles(tiny_url: str) -> None:
    """A tree whose nodes are any of 200 types (a UI tree, an AST), each with children of
    any type: one recursive component of 1,005 objects and arrays, but no chain; llguidance
    compiles it in 16 ms, and it was refused as "1005 deep" (seventeenth probe, issue 45)."""
    defs: dict[str, object] = {"Node": {"anyOf": [{"$ref": f"#/$defs/T{i}"} for i in range(200)]}}
    for i in range(200):
        defs[f"T{i}"] = {
            "type": "object",
            "properties": {
                "kind": {"const": f"t{i}"},
                "label": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
            },
            "required": ["kind"],
        }
    schema = {"$ref": "#/$defs/Node", "$defs": defs}
    body = {
        "model": "tiny",
        "messages": ASK,
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "ui", "schema": schema}},
    }
    reply = httpx.post(f"{tiny_url}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text


def test_names_many_nodes_share_are_measured_in_linear_time() -> None:
    """4,300 nodes bearing one ``$anchor`` (or ``$id``) and 4,300 references to it (126
    KiB) made 18.5 M edges: 6 s and +145 MiB to measure, in the request (eighteenth probe,
    issue 45). Each shared name is now one weightless hub (0.1 s); a chain through shared
    names is still followed, and a pointer into many resources sharing a ``$id`` resolves
    to every node once that grows past the schema's size."""
    from ortserve_runtime.chat._grammar_depth import MAX_SCHEMA_DEPTH, json_schema_depth

    for bearer, ref in (({"$anchor": "a"}, {"$ref": "#a"}), ({"$id": "urn:a"}, {"$ref": "urn:a"})):
        schema = {"anyOf": [dict(bearer) for _ in range(4300)] + [dict(ref) for _ in range(4300)]}
        assert len(json.dumps(schema, separators=(",", ":"))) > 125 * 1024
        assert json_schema_depth(json.loads(json.dumps(schema))) == 4  # object, list, ref, bearer
    links = [{"$anchor": f"a{i}", "anyOf": [{"$ref": f"#a{i + 1}"}]} for i in range(1500)]
    twice = {"$ref": "#a0", "anyOf": links + [dict(link) for link in links]}  # each name on two nodes
    assert json_schema_depth(twice) > MAX_SCHEMA_DEPTH  # 1,500 links of 3 (bearer, list, ref)
    many = {"anyOf": [{"$id": "urn:a", "x": {}} for _ in range(200)] + [{"$ref": f"urn:a#/x{i}"} for i in range(300)]}
    assert json_schema_depth(many) > 300  # the references' pointers lead everywhere: root, list, refs, ...


def test_grammars_compile_on_a_stack_deep_enough_for_any_within_the_size_bound() -> None:
    """Should the depth check miss a shape, the compiler's recursion must not kill the
    process: 2,100 chained Lark rules of 24 nested parentheses each (127 KiB, the size
    bound; some 95 MiB of stack) compile on the compiler's thread. Run in a child process: on
    a small stack it dies of SIGSEGV."""
    script = """
import llguidance
from ortserve_runtime.chat._large_stack import on_large_stack
names = [f"r{i}" for i in range(2101)]
text = "start: r0\\n" + "".join(
    f"{a}: " + "(" * 24 + b + ")" * 24 + "\\n" for a, b in zip(names, names[1:])
) + names[-1] + ': "y"\\n'
assert len(text) <= 131072, len(text)
print(on_large_stack(lambda: llguidance.LLMatcher.validate_grammar(text, None)) or "OK")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "OK", (done.returncode, done.stdout, done.stderr[-2000:])
