"""How deep a grammar's references go, measured before llguidance compiles it.

llguidance's compiler follows a JSON schema's ``$ref`` chain and a Lark grammar's rule
references by recursion on the calling thread's stack: a schema whose ``$defs`` chain
1,500 deep (each ``anyOf: [{$ref: next}, {type: null}]``), or 3,000 chained Lark rules,
overflows it and the process dies (SIGSEGV), though both are small. Its own limits cover
nesting in the text (128 levels of JSON, Lark parentheses), not chains of references.

The depth here is the longest path through the reference graph, where a strongly
connected part (a type that refers to itself, rules that refer to each other) counts as
all of its members: an upper bound on how deep any walk that visits each node once can
go, so a recursive schema (a tree of nodes) stays shallow. Everything is iterative and
linear in the grammar's size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote

__all__ = ["MAX_GRAMMAR_DEPTH", "json_schema_depth", "lark_depth"]

_N = TypeVar("_N", bound=Hashable)

MAX_GRAMMAR_DEPTH = 1000
"""The deepest reference graph compiled. Chains twice this long compiled on an 8 MiB
worker-thread stack (1,000 ``$ref`` hops, each three JSON containers, measured 3,000 here;
2,000 Lark rules); 1,500 hops and 3,000 rules crashed it."""


def json_schema_depth(schema: Any) -> int:
    """The depth of ``schema``'s graph: each object and array a node, its members and the
    target of each ``$ref`` (``$dynamicRef``, ``$recursiveRef``) its successors.

    A JSON pointer (``#``, ``#/$defs/x``) and an ``$anchor`` or ``$id`` named exactly are
    followed; any other reference (relative to a nested ``$id``, or to nothing here) leads
    to every node with an ``$id`` or anchor, through one node of its own, which makes the
    chains it could close one strongly connected part, counted whole: llguidance resolves
    anchors and ids too, and a 1,500-link chain of them crashed it (sixteenth probe)."""
    edges: dict[int, list[int]] = {}
    named: dict[str, int] = {}  # "#anchor" and "$id" -> the node they name
    references: list[tuple[list[int], str]] = []
    nested_ids = False
    stack = [schema]
    while stack:
        node = stack.pop()
        key = id(node)
        if key in edges:
            continue
        members = node.values() if isinstance(node, dict) else node
        successors = edges[key] = []
        for member in members:
            if isinstance(member, dict | list):
                successors.append(id(member))
                stack.append(member)
        if not isinstance(node, dict):
            continue
        for field in ("$anchor", "$dynamicAnchor"):
            if isinstance(node.get(field), str):
                named["#" + node[field]] = key
        if isinstance(node.get("$id"), str):
            named[node["$id"].rstrip("#")] = key
            nested_ids = nested_ids or node is not schema
        for field in ("$ref", "$dynamicRef", "$recursiveRef"):
            if isinstance(node.get(field), str):
                references.append((successors, node[field]))
    anywhere: list[int] = []  # the successors of the node standing for "any named node"
    for successors, ref in references:
        target = None if nested_ids else _pointer_target(schema, ref)
        if target is not None:
            successors.append(id(target))
        elif ref in named or ref.rstrip("#") in named:
            successors.append(named[ref] if ref in named else named[ref.rstrip("#")])
        else:
            successors.append(_ANYWHERE)
            anywhere = list(set(named.values()))
    edges[_ANYWHERE] = anywhere
    return _longest_path(edges)


_ANYWHERE = -1
"""The node a reference this module cannot resolve leads to (``id()`` is never negative)."""


def _pointer_target(root: Any, ref: str) -> dict[str, Any] | list[Any] | None:
    """What a local ``$ref`` points at, or ``None`` (another document, an anchor, a miss)."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node = root
    for raw in ref[2:].split("/") if len(ref) > 1 else ():
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, dict | list) else None


# A Lark grammar's tokens: what can hide a name (strings, regular expressions, comments),
# then names, optionally ``@name`` (llguidance's reference to a nested grammar).
_LARK_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|/(?!/)(?:\\.|[^/\\\n])+/|//[^\n]*|@?[A-Za-z_]\w*')
_LARK_RULE = re.compile(r"\s*[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?\s*:")


def lark_depth(source: str) -> int:
    """The depth of a Lark grammar's graph: each rule and terminal a node, the rules and
    terminals its definition names its successors (a definition runs from its
    ``name:`` line to the next one)."""
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in source.splitlines():
        start = _LARK_RULE.match(line)
        if start is not None:
            current = bodies.setdefault(start.group(1), [])
            line = line[start.end() :]
        elif line.lstrip().startswith("%"):
            current = None  # a directive (%import, %ignore, %llguidance...) is no rule's
        if current is not None:
            current.append(line)
    edges: dict[str, list[str]] = {}
    for name, lines in bodies.items():
        named = (token.lstrip("@") for token in _LARK_TOKENS.findall("\n".join(lines)))
        edges[name] = [other for other in named if other in bodies]
    # A "%json {...}" body is a JSON schema llguidance compiles in place (a tool's parameters
    # among them): its depth adds to the rules' (a 1,500-link chain in one crashed it).
    return _longest_path(edges) + max(map(json_schema_depth, _json_bodies(source)), default=0)


def _json_bodies(source: str) -> Iterator[Any]:
    """The JSON values after each ``%json`` of a Lark grammar (those that read as JSON)."""
    decoder = json.JSONDecoder()
    for directive in re.finditer(r"%json\s*", source):
        try:
            yield decoder.raw_decode(source, directive.end())[0]
        except ValueError:
            continue  # not JSON: llguidance refuses it (or it was inside a string)


def _longest_path(edges: Mapping[_N, Sequence[_N]]) -> int:
    """The longest path through ``edges`` (every successor is a key), a strongly connected
    component weighing its size: Tarjan's algorithm, iterative, whose components come out
    after every component they reach, so each one's depth is known when it is needed."""
    index: dict[_N, int] = {}
    low: dict[_N, int] = {}
    open_nodes: list[_N] = []
    opened_at: dict[_N, int] = {}
    on_stack: set[_N] = set()
    component_of: dict[_N, int] = {}
    depth_of: list[int] = []
    for root in edges:
        if root in index:
            continue
        work: list[tuple[_N, int]] = [(root, 0)]
        while work:
            node, position = work.pop()
            if position == 0:
                index[node] = low[node] = len(index)
                opened_at[node] = len(open_nodes)
                open_nodes.append(node)
                on_stack.add(node)
            successors = edges[node]
            while position < len(successors):
                successor = successors[position]
                position += 1
                if successor not in index:
                    work += [(node, position), (successor, 0)]
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                if low[node] == index[node]:
                    members = open_nodes[opened_at[node] :]
                    del open_nodes[opened_at[node] :]
                    on_stack.difference_update(members)
                    depth_of.append(_component_depth(members, edges, component_of, depth_of))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return max(depth_of, default=0)


def _component_depth(
    members: list[_N], edges: Mapping[_N, Sequence[_N]], component_of: dict[_N, int], depth_of: list[int]
) -> int:
    """The depth of a component just closed (numbered ``len(depth_of)``): its size and the
    deepest component it reaches, all of which closed before it."""
    number = len(depth_of)
    for member in members:
        component_of[member] = number
    below = (depth_of[other] for member in members for s in edges[member] if (other := component_of[s]) != number)
    return len(members) + max(below, default=0)
