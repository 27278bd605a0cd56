"""Tool calls in model output: the formats of the model families served on
onnxruntime-genai, a streaming parser, and grammars that force a well-formed call.

The format follows from the model's chat template, never from the caller:

- ``hermes`` (Qwen 2/2.5/3, Hermes, many fine-tunes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
- ``llama3``: the whole reply is ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``)
- ``phi4`` (Phi-4-mini): ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|>``
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``

Malformed markup is never an error: it stays in the content as the model wrote it. A call
cut short by the length limit is a call, with its arguments as far as they were written
(as OpenAI returns a forced call that ran out of tokens), never markup in the content.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._errors import InvalidRequestError
from ._constraints import Grammar, closed_schema, strict_whitespace
from ._reasoning import _held

__all__ = [
    "ToolCall",
    "ToolCallFormat",
    "ToolCallParser",
    "detect_tool_format",
    "forced_tool_grammar",
    "tools_as_text",
]

ToolCallFormat = Literal["hermes", "llama3", "phi4", "mistral"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; ``arguments`` is a JSON object as text, as OpenAI sends it."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class _Markers:
    start: str
    end: str | None  # None: the call runs to the end of the output
    many: bool  # a JSON list of calls between the markers (else one object per block)
    arguments_key: str


_FORMATS: dict[ToolCallFormat, _Markers] = {
    "hermes": _Markers("<tool_call>", "</tool_call>", many=False, arguments_key="arguments"),
    "phi4": _Markers("<|tool_call|>", "<|/tool_call|>", many=True, arguments_key="arguments"),
    "mistral": _Markers("[TOOL_CALLS]", None, many=True, arguments_key="arguments"),
    "llama3": _Markers("<|python_tag|>", None, many=False, arguments_key="parameters"),
}


_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def tools_as_text(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """``messages`` for a chat template that knows no tools, with the tools and the calls in
    their text: the tools described in the system message (Hermes/Qwen2.5's wording, which
    small models are trained on; a system message is added when there is none), each
    assistant call written as ``<tool_call>{"name", "arguments"}</tool_call>`` in its
    content, and tool results as user turns in ``<tool_response>`` tags (a template
    without tools may refuse the ``tool`` role). The output is parsed in the ``hermes``
    format then."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            response = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and out[-1].get("role") == "user" and str(out[-1].get("content", "")).endswith("</tool_response>"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{response}"}
            else:
                out.append({"role": "user", "content": response})
            continue
        converted = {key: value for key, value in message.items() if key not in ("tool_calls", "tool_call_id")}
        calls = message.get("tool_calls") or []
        if role == "assistant" and calls:
            written = []
            for call in calls:
                function = call.get("function", {})
                arguments = function.get("arguments")
                # As the model wrote them: a call cut by max_tokens comes back as unfinished JSON.
                text = arguments if isinstance(arguments, str) else json.dumps(arguments or {}, ensure_ascii=False)
                name = json.dumps(function.get("name"), ensure_ascii=False)
                written.append(f'<tool_call>\n{{"name": {name}, "arguments": {text.strip() or "{}"}}}\n</tool_call>')
            converted["content"] = "\n".join(filter(None, [_text(message.get("content")), *written]))
        out.append(converted)
    if tools:
        described = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def _text(content: Any) -> str:
    """A message's content as text (a list of parts: their text joined)."""
    if isinstance(content, list):
        return "".join(part if isinstance(part, str) else str(part.get("text", "")) for part in content)
    return "" if content is None else str(content)


def detect_tool_format(template_source: str | None) -> ToolCallFormat | None:
    """The tool-call format a chat template teaches its model, if any."""
    if not template_source:
        return None
    if "<tool_call>" in template_source:
        return "hermes"
    if "<|tool_call|>" in template_source:
        return "phi4"
    if "[TOOL_CALLS]" in template_source:
        return "mistral"
    if "<|python_tag|>" in template_source or "ipython" in template_source:
        return "llama3"
    return None


class ToolCallParser:
    """Splits streamed text into content and tool calls.

    ``feed`` returns the content that is safe to show now and the calls completed so far;
    text that may be the start of a call is held back until it is decided. ``finish``
    settles what is left. Feeding everything at once gives exactly what streaming gives.
    """

    def __init__(self, format: ToolCallFormat) -> None:
        self.format = format
        self._markers = _FORMATS[format]
        self._buffer = ""
        self._in_call = False
        self._seen_content = False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCall] = []
        markers = self._markers
        while self._buffer:
            if not self._in_call:
                start = self._buffer.find(markers.start)
                if start < 0 and self.format == "llama3" and not self._seen_content:
                    if not self._buffer.strip():
                        break  # only whitespace so far: a bare JSON call may still follow
                    start = self._bare_json_start()
                if start < 0:
                    safe = self._buffer[: len(self._buffer) - _held(self._buffer, markers.start)]
                    self._note_content(safe)
                    content.append(safe)
                    self._buffer = self._buffer[len(safe) :]
                    break
                self._note_content(self._buffer[:start])
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._in_call = True
            if markers.end is None:
                break  # the call runs to the end of the output: decided in finish()
            end = self._buffer.find(markers.end)
            if end < 0:
                break
            block = self._buffer[: end + len(markers.end)]
            self._buffer = self._buffer[end + len(markers.end) :]
            self._in_call = False
            parsed = self._parse(block[len(markers.start) : end])
            if parsed is None:
                content.append(block)  # malformed: the model's text, as written
            else:
                calls.extend(parsed)
        return "".join(content), calls

    def finish(self, cut_short: bool = False, forced: str | None = None) -> tuple[str, list[ToolCall]]:
        """Settle what is held back. ``cut_short``: the output ended at the length limit,
        so an unfinished call is returned as far as it got (its name, and its arguments as
        written so far) rather than as text. ``forced``: the call was forced (the name
        ``tool_choice`` named, or ``""``), so even one cut before its name is a call."""
        rest, self._buffer = self._buffer, ""
        if not self._in_call:
            return rest, []
        self._in_call = False
        body = rest.removeprefix(self._markers.start)
        parsed = self._parse(body)
        if parsed is not None:
            return "", parsed
        if cut_short:
            name, arguments = _unfinished(body, self._markers.arguments_key)
            if name is not None or forced is not None:
                return "", [ToolCall(forced or name or "", arguments)]
        return rest, []

    def _bare_json_start(self) -> int:
        """Llama 3 may answer with the call's JSON alone; only a leading ``{`` counts."""
        stripped = self._buffer.lstrip()
        return len(self._buffer) - len(stripped) if stripped.startswith("{") else -1

    def _note_content(self, text: str) -> None:
        if text.strip():
            self._seen_content = True

    def _parse(self, body: str) -> list[ToolCall] | None:
        try:
            value = json.loads(body.strip())
        except (ValueError, RecursionError):  # not JSON, or nested past what Python parses
            return None
        items = value if isinstance(value, list) and self._markers.many else [value]
        calls = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            arguments = item.get(self._markers.arguments_key, item.get("arguments", {}))
            if isinstance(arguments, str):  # some models double-encode
                try:
                    arguments = json.loads(arguments)
                except (ValueError, RecursionError):
                    return None
            if not isinstance(arguments, dict):
                return None
            calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
        return calls or None


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)')


def _unfinished(body: str, arguments_key: str) -> tuple[str | None, str]:
    """The name (``None`` if not begun) and the arguments text so far of a call whose JSON
    was cut off; the text is the model's, not parsed (it cannot be, being unfinished)."""
    found = _NAME.search(body)
    name = None
    if found is not None:
        try:
            name = json.loads(f'"{found.group(1)}"')
        except ValueError:  # cut inside an escape: the name up to it
            name = found.group(1).rpartition("\\")[0]
    arguments = re.search(rf'"(?:{re.escape(arguments_key)}|arguments)"\s*:\s*', body)
    return name, body[arguments.end() :].rstrip() if arguments is not None else ""


_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
"""Keywords whose values are data, not schemas: a "$ref" inside them is not a reference."""


def _has_local_ref(schema: Any) -> bool:
    if isinstance(schema, list):
        return any(_has_local_ref(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        return True
    return any(_has_local_ref(value) for key, value in schema.items() if key not in _DATA_KEYWORDS)


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with its local references (``#...``, JSON pointers from its root) made to
    point from ``base``, where it is moved to."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    moved = {key: value if key in _DATA_KEYWORDS else _rebased(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        moved["$ref"] = base + ref[1:]
    return moved


def forced_tool_grammar(
    format: ToolCallFormat,
    tools: Sequence[Mapping[str, Any]],
    name: str | None = None,
    token_id: Callable[[str], int | None] = lambda _: None,
    or_answer: Mapping[str, Any] | None = None,
    answer_field: str = "response_format",
) -> Grammar | None:
    """A grammar that admits exactly one well-formed call (to ``name``, or to any tool)
    whose arguments validate against the tool's parameters schema, laid out as ``format``
    writes calls; ``None`` when no tool is ``name``. ``token_id`` finds markers that are
    single (added) tokens: the grammar must name those by id, as no string of bytes
    produces them. ``or_answer``:
    a JSON schema the output may match instead of calling (``tool_choice`` auto with a
    response format, ``answer_field`` the request's field that asked for it: the model
    calls a tool or answers in the format). Objects admit only
    their declared properties unless a schema says otherwise (:func:`closed_schema`)."""
    markers = _FORMATS[format]
    options, moved = [], {}
    for number, tool in enumerate(tools):
        function = tool.get("function", {})
        if name is not None and function.get("name") != name:
            continue
        with _nested_too_deep(f"tools[{number}].function.parameters"):
            parameters = closed_schema(function.get("parameters") or {"type": "object"})
            if _has_local_ref(parameters):
                # Its "#/$defs/..." (pydantic's nested models, a recursive schema) point into
                # the parameters, which are not the root here: they move to the root's $defs
                # and their references with them.
                moved[f"tool{number}"] = _rebased(parameters, f"#/$defs/tool{number}")
                parameters = {"$ref": f"#/$defs/tool{number}"}
        key = markers.arguments_key
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function.get("name")}, key: parameters},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    if not options:
        return None
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if markers.many:  # a JSON list of calls between the markers: here a list of one
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}, **({"$defs": moved} if moved else {})}

    def literal(text: str) -> str:
        token = token_id(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    # Each as its parser reads it and its chat templates write it: Hermes' call on lines of
    # its own between tags, Phi-4's list between tags, Mistral's list after [TOOL_CALLS],
    # Llama 3's bare object (what its templates ask of custom tools; <|python_tag|> is
    # for its built-in ones).
    layout = {
        "hermes": f'{literal(markers.start)} "\\n" call "\\n" {literal(markers.end or "")}',
        "phi4": f"{literal(markers.start)} call {literal(markers.end or '')}",
        "mistral": f"{literal(markers.start)} call",
        "llama3": "call",
    }[format]
    with _nested_too_deep("tools"):
        rules = f"tool: {layout}\ncall: %json {json.dumps(schema)}"
    tools_alone = Grammar("lark", f"start: tool\n{rules}")
    if or_answer is None:
        return tools_alone
    with _nested_too_deep(answer_field):
        if _nesting(or_answer) > LARK_JSON_DEPTH:  # past it llguidance's error could only name the tools
            raise InvalidRequestError(
                f"{answer_field} is nested too deeply to go beside tools (at most {LARK_JSON_DEPTH} levels)",
                param=answer_field,
            )
        answer = closed_schema(or_answer)
        with contextlib.suppress(TypeError):  # left as sent: refused as the format alone is, tools first
            answer = strict_whitespace(answer)
        either = f"start: tool | answer\n{rules}\nanswer: %json {json.dumps(answer)}"
        return Grammar(
            "lark", either, blame_unless=(answer_field, tools_alone, Grammar("json_schema", dict(or_answer)))
        )


LARK_JSON_DEPTH = 120
"""How deep a JSON schema may nest inside a Lark grammar's ``%json``: llguidance reads it with
serde_json, 128 levels at most, less what the grammar wraps around it (twenty-second probe,
issue 45: a guided_json past it beside tools was refused naming tool_choice)."""


def _nesting(value: Any) -> int:
    """How deep ``value``'s dicts and lists nest, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


@contextlib.contextmanager
def _nested_too_deep(param: str) -> Iterator[None]:
    """A schema nested past Python's recursion limit (the walks above, ``json.dumps``): a
    400 naming ``param``, as a response format's is (twentieth probe, issue 45: a tool's
    parameters 240 deep with a forced call were a 500)."""
    try:
        yield
    except RecursionError:
        raise InvalidRequestError(f"{param} is nested too deeply", param=param) from None
