"""Unknown keys inside a request's settings objects (``thinking``, ``reasoning``,
``response_format``, ``stream_options``, ``text``, ``tools``, ``tool_choice``,
``metadata``, ``prediction``, Anthropic's ``mcp_servers``, a web page conversation's
``settings``): a 400 naming the key by its path, as for the body's own keys; ignored, they
would be settings that do nothing (seventeenth probe, issue 45: ``thinking.bogus``, ``reasoning.generate_summary``,
``tools[0].bogus``... were answered 200; twentieth: ``prediction.bogus``, keys inside
``mcp_servers[0]``; twenty-first: a conversation's ``settings.temprature``). A web page
conversation is walked whole, its messages too: the page wrote every key of it (twenty-third
probe: an import dropped unknown keys of its conversations and their settings).

Keys the official SDKs send that this server cannot honour are a 400 saying so; the few
that change nothing here (``cache_control``, which marks a prefix this server caches
anyway, Anthropic's ``eager_input_streaming`` and ``strict``) are taken. Messages, content
blocks and schemas of the APIs are not walked: they are data, not settings."""

from __future__ import annotations

import functools
from typing import Any

from msgspec import inspect
from ortserve_client import conversations_protocol as cp

from ._errors import BadRequestError, UnsupportedParameterError

__all__ = ["check_settings_fields"]

_SETTINGS = (
    "response_format",
    "stream_options",
    "text",
    "reasoning",
    "tools",
    "tool_choice",
    "metadata",
    "prediction",
    "mcp_servers",
    "settings",
)

_WALKED_WHOLE = frozenset({cp.ConversationWrite, cp.ConversationImport})
"""Bodies whose every field is walked: the web page's conversations, as it wrote them."""

_TAKEN = frozenset({"cache_control", "eager_input_streaming", "strict"})
"""Keys the SDKs send that change nothing here: taken wherever they appear in a walked object
(``strict`` as OpenAI's tools take it: a forced call is held to its schema whatever it says;
nineteenth probe: Anthropic's was refused, even ``strict: false``)."""

_UNSUPPORTED = frozenset(
    {
        "allowed_callers",
        "connector_id",
        "context",
        "defer_loading",
        "generate_summary",
        "include_obfuscation",
        "input_examples",
        "mode",
        "output_schema",
    }
)
"""Keys of the SDKs' settings objects this server does not implement."""

_THINKING = {"enabled": {"type", "budget_tokens", "display"}, "adaptive": {"type", "display"}, "disabled": {"type"}}
"""Anthropic's ``thinking`` (a plain object in the request Struct): its keys by type."""


def check_settings_fields(body: dict[str, Any], body_type: Any, *, where: str = "", param: str | None = None) -> None:
    """A 400 for the first unknown key of ``body``'s settings objects (``body_type``'s
    fields); ``where`` and ``param`` as :func:`~._security.check_known_fields` takes them."""
    fields = _struct_fields(body_type) if isinstance(body_type, type) else None
    if fields is None:
        return
    whole = body_type in _WALKED_WHOLE
    taken = frozenset() if whole else _TAKEN  # the page sends none of the SDKs' keys
    for name in fields if whole else _SETTINGS:
        field = fields.get(name)
        if field is not None and name in body:
            _walk(body[name], field, name, where, param, taken)
    thinking = body.get("thinking")
    if "thinking" in fields and isinstance(thinking, dict):
        known = _THINKING.get(str(thinking.get("type")))
        if known is not None:
            _refuse([key for key in thinking if key not in known], "thinking", where, param)
        if thinking.get("display") == "omitted":
            raise UnsupportedParameterError(
                f"{where}thinking.display 'omitted' is not supported: the thinking is always sent",
                param=param or "thinking.display",
            )


@functools.cache
def _struct_fields(body_type: type) -> dict[str, inspect.Type] | None:
    try:
        info = inspect.type_info(body_type)
    except (TypeError, ValueError):
        return None
    if not isinstance(info, inspect.StructType):
        return None
    return {field.encode_name: field.type for field in info.fields}


def _holds_structs(kind: inspect.Type) -> bool:
    """Whether a value of ``kind`` may hold an object :func:`_walk` checks: a list of plain
    values is not walked item by item (twenty-fourth probe, issue 45: 499,000 strings in
    ``mcp_servers`` held the event loop 213-294 ms)."""
    if isinstance(kind, inspect.UnionType):
        return any(_holds_structs(member) for member in kind.types)
    if isinstance(kind, inspect.ListType):
        return _holds_structs(kind.item_type)
    return isinstance(kind, inspect.StructType)


def _walk(value: Any, kind: inspect.Type, path: str, where: str, param: str | None, taken: frozenset[str]) -> None:
    if isinstance(kind, inspect.UnionType):
        if isinstance(value, list):
            kind = next((t for t in kind.types if isinstance(t, inspect.ListType)), kind)
        elif isinstance(value, dict):
            structs = [t for t in kind.types if isinstance(t, inspect.StructType)]
            tagged = [t for t in structs if t.tag_field is not None and value.get(t.tag_field) == t.tag]
            kind = tagged[0] if tagged else structs[0] if len(structs) == 1 else kind
    if isinstance(kind, inspect.ListType) and isinstance(value, list):
        if _holds_structs(kind.item_type):
            for index, item in enumerate(value):
                if isinstance(item, dict | list):  # a plain value holds no key (its type is checked later)
                    _walk(item, kind.item_type, f"{path}[{index}]", where, param, taken)
    elif isinstance(kind, inspect.StructType) and isinstance(value, dict):
        known = _known(kind)
        _refuse([key for key in value if key not in known and key not in taken], path, where, param)
        for key, item in value.items():
            if key in known:
                _walk(item, known[key], f"{path}.{key}", where, param, taken)


_KNOWN: dict[int, tuple[inspect.StructType, dict[str, inspect.Type]]] = {}
"""Each Struct type's fields by their JSON names (and its tag's), by the type's id: made once,
not once an object walked (the types are not hashable; :func:`_struct_fields` keeps them)."""


def _known(kind: inspect.StructType) -> dict[str, inspect.Type]:
    kept = _KNOWN.get(id(kind))
    if kept is None or kept[0] is not kind:
        known = {field.encode_name: field.type for field in kind.fields}
        if kind.tag_field is not None:
            known.setdefault(kind.tag_field, inspect.AnyType())
        kept = _KNOWN[id(kind)] = (kind, known)
    return kept[1]


def _refuse(unknown: list[str], path: str, where: str, param: str | None) -> None:
    if not unknown:
        return
    key = min(unknown, key=lambda k: k not in _UNSUPPORTED)
    at = f"{path}.{key}"
    if key in _UNSUPPORTED:
        raise UnsupportedParameterError(f"{where}{at} is not supported by this server", param=param or at)
    raise BadRequestError(
        f"{where}unknown field {at!r}: this server does not take it "
        "(start it with --lenient to ignore fields it does not know)",
        param=param or at,
    )
