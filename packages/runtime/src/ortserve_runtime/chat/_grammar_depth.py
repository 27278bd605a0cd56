"""How deep a grammar's references go, measured before llguidance compiles it.

llguidance's compiler follows a JSON schema's ``$ref`` chain and a Lark grammar's rule
references by recursion on the calling thread's stack: a schema whose ``$defs`` chain
1,500 deep (each ``anyOf: [{$ref: next}, {type: null}]``), or 3,000 chained Lark rules,
overflows an 8 MiB thread stack and the process dies (SIGSEGV), though both are small.
Its own limits cover nesting in the text (128 levels of JSON, Lark parentheses), not
chains of references. Compiling runs on a 256 MiB stack (:mod:`._large_stack`), where
every grammar within the size bound fits; this check keeps what a request may ask for
well inside it.

The depth here is the longest path through the reference graph, where a strongly
connected part (a type that refers to itself, rules that refer to each other) counts as
all of its members: an upper bound on how deep any walk that visits each node once can
go, so a recursive schema (a tree of nodes) stays shallow. Everything is iterative and
linear in the grammar's size.
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Hashable, Iterator, Mapping, Sequence
from typing import Any, TypeVar
from urllib.parse import unquote, urljoin, urlsplit, uses_relative

__all__ = ["MAX_GRAMMAR_DEPTH", "MAX_SCHEMA_DEPTH", "json_schema_depth", "lark_depth", "lark_json_depth"]

_N = TypeVar("_N", bound=Hashable)

MAX_GRAMMAR_DEPTH = 1000
"""The deepest chain of Lark rules compiled (a ``%json`` body is held to
:data:`MAX_SCHEMA_DEPTH`). Chains twice this long compiled on an 8 MiB thread stack (2,000 rules; 1,000 ``$ref``
hops); 1,500 hops and 3,000 rules crashed it. Compiling now runs on a 256 MiB stack
(:mod:`._large_stack`), where a rule with 24 nested parentheses takes 45 KiB: 1,000 such
rules take 45 MiB of it."""

MAX_SCHEMA_DEPTH = 4000
"""The deepest graph of a JSON schema compiled, counted in objects and arrays: at most
3.8 KiB of compiler stack each (an ``items`` ``$ref`` chain, measured; 2.7 KiB in an
``anyOf`` chain), so 15 MiB of the 256 MiB it compiles on. A recursive union of 400 node
types (85 KiB, a component of 2,005) passes; a 1,500-link chain (4,503) does not
(seventeenth probe, issue 45)."""

_DEFAULT_BASE = "json-schema:///"
"""The base URI llguidance (its ``referencing`` crate) gives a schema without ``$id``."""


def json_schema_depth(schema: Any) -> int:
    """The depth of ``schema``'s graph: each object and array (each place it occurs) a
    node, its members and the targets of each ``$ref`` (``$dynamicRef``,
    ``$recursiveRef``) its successors.

    References resolve as llguidance's do: against a base URI that each ``$id`` sets
    (``json-schema:///`` at the root), then the fragment as a JSON pointer, or an anchor,
    within the resource that URI names. A reference resolved to nothing here leads to
    every node: llguidance may resolve what this does not (URI normalization, older
    drafts' ``id``), and a chain must not vanish at the one link this misses (seventeenth
    probe: a nested ``$id`` switched pointers off, and ``/#/$defs/x`` was not resolved:
    1,500 links measured 7 deep and crashed the server). Refusing such a reference
    instead would refuse schemas llguidance takes; the whole schema as one component is
    an upper bound, and a small schema stays well under the limit."""
    nodes: list[Any] = []  # node number -> its object or array
    edges: list[list[int]] = []
    numbers: dict[int, list[int]] = {}  # id() of an object or array -> the nodes it is
    resources: dict[str, list[int]] = {}  # a base URI, without fragment -> its root nodes
    anchors: dict[tuple[str, str], list[int]] = {}
    references: list[tuple[int, str, str]] = []  # (node, base, ref)
    root_id = schema.get("$id") if isinstance(schema, dict) else None
    work: list[tuple[Any, str, int]] = [(schema, _DEFAULT_BASE, -1)]
    while work:
        node, base, parent = work.pop()
        number = len(nodes)
        nodes.append(node)
        edges.append([])
        numbers.setdefault(id(node), []).append(number)
        if parent >= 0:
            edges[parent].append(number)
        if isinstance(node, dict):
            if isinstance(node.get("$id"), str):
                uri, _, fragment = _join(base, node["$id"]).partition("#")
                if fragment:  # draft 6-7: "$id": "#name" names an anchor
                    anchors.setdefault((uri, fragment), []).append(number)
                else:
                    base = uri
                    resources.setdefault(uri, []).append(number)
            for field in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(field), str):
                    anchors.setdefault((base.partition("#")[0], node[field]), []).append(number)
            for field in ("$ref", "$dynamicRef", "$recursiveRef"):
                if isinstance(node.get(field), str):
                    references.append((number, base, node[field]))
        members = node.values() if isinstance(node, dict) else node
        work += ((member, base, number) for member in members if isinstance(member, dict | list))
    if not isinstance(root_id, str):
        resources.setdefault(_DEFAULT_BASE, []).append(0)
    everywhere = len(nodes)
    _link(references, edges, (resources, anchors, nodes, numbers))
    return _longest_path(dict(enumerate(edges)), weightless=range(everywhere, len(edges)))


def _link(
    references: list[tuple[int, str, str]],
    edges: list[list[int]],
    found: tuple[Mapping[str, list[int]], Mapping[tuple[str, str], list[int]], Sequence[Any], Mapping[int, list[int]]],
) -> None:
    """Adds each reference's edges, and the hubs they pass through, to ``edges`` (one list
    per node of the schema, numbered from 0; the hubs come after them)."""
    # Hubs, which weigh nothing: one for "everywhere" (an unresolved reference leads to it,
    # it to every node) and one for each name that resolves to several nodes (its references
    # lead to it, it to each of them), so K nodes sharing an ``$anchor`` and R references to
    # it make K + R edges, not K * R (eighteenth probe: 18.5 M edges from a 126 KiB schema).
    resources, anchors, nodes, numbers = found
    everywhere = len(edges)
    edges.append([])
    hubs: dict[tuple[str, str], int | None] = {}  # a resolved uri and fragment -> its node
    budget = [everywhere]  # pointer steps past a name's first resource (several share a $id)
    for number, base, ref in references:
        uri, _, fragment = _join(base, ref).partition("#")
        key = (uri, unquote(fragment))
        if key not in hubs:
            targets = _resolve(*key, resources, anchors, nodes, numbers, budget)
            if targets is None:
                hubs[key] = None
            elif len(targets) == 1:
                hubs[key] = targets[0]
            else:
                hubs[key] = len(edges)
                edges.append(targets)
        hub = hubs[key]
        if hub is None:
            edges[number].append(everywhere)
            if not edges[everywhere]:
                edges[everywhere] = list(range(everywhere))
        else:
            edges[number].append(hub)


def _join(base: str, ref: str) -> str:
    """``ref`` resolved against ``base`` (RFC 3986, as the ``referencing`` crate does; Python's
    ``urljoin`` leaves schemes it does not know, ``json-schema:`` among them, unresolved)."""
    if ref.startswith("#"):
        return base.partition("#")[0] + ref
    scheme = urlsplit(base).scheme
    if not scheme or scheme in uses_relative:
        return urljoin(base, ref)
    joined = urljoin("http" + base[len(scheme) :], ref)  # the same hierarchy under a known scheme
    return scheme + joined[len("http") :] if joined.startswith("http:") else joined


def _resolve(
    uri: str,
    fragment: str,
    resources: Mapping[str, list[int]],
    anchors: Mapping[tuple[str, str], list[int]],
    nodes: Sequence[Any],
    numbers: Mapping[int, list[int]],
    budget: list[int],
) -> list[int] | None:
    """The nodes ``uri#fragment`` names, or ``None`` (not a resource or anchor here, or the
    pointer's steps through resources sharing ``uri`` past the first would overspend
    ``budget``: resolving to every node is the upper bound that keeps this linear)."""
    if not fragment.startswith("/") and fragment:
        return anchors.get((uri, fragment))
    roots = resources.get(uri, ())
    if len(roots) > 1:
        budget[0] -= (len(roots) - 1) * (fragment.count("/") + 1)
        if budget[0] < 0:
            return None
    targets: list[int] = []
    for root in roots:
        target = _pointer_target(nodes[root], fragment)
        if target is not None:
            targets += numbers[id(target)]
    return targets or None


def _pointer_target(root: Any, pointer: str) -> dict[str, Any] | list[Any] | None:
    """What a JSON pointer (``""``, ``/$defs/x``) points at within ``root``, or ``None``."""
    node = root
    for raw in pointer[1:].split("/") if pointer else ():
        part = raw.replace("~1", "/").replace("~0", "~")
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
# A rule's head: ``name:``, ``?name.2 :``, and with llguidance's attributes, ``name[lazy]:``,
# ``name [capture, stop=""]:`` (seventeenth probe: a chain of those was not seen).
_ATTRIBUTES = r'(?:\[(?:"(?:\\.|[^"\\\n])*"|[^\]"\n])*\]\s*)?'
_LARK_RULE = re.compile(rf"\s*[?!]?([A-Za-z_]\w*)\s*{_ATTRIBUTES}(?:\.-?\d+\s*)?{_ATTRIBUTES}:")


def lark_depth(source: str) -> int:
    """The depth of a Lark grammar's graph: each rule and terminal a node, the rules and
    terminals its definition names its successors (a definition runs from its
    ``name:`` line to the next one)."""
    bodies: dict[str, list[str]] = {}
    current: list[str] | None = None
    # Lines end at "\n" alone, as llguidance's lexer reads them: splitlines() also ends one
    # at U+2028 or U+0085 inside a string, whose halves then hid the references around them
    # (twentieth probe, issue 45: a chain of 3,000 rules passed).
    for line in source.split("\n"):
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
    return _longest_path(edges)


def lark_json_depth(source: str) -> int:
    """The deepest ``%json {...}`` body of a Lark grammar: a JSON schema llguidance compiles
    in place (a tool's parameters among them; a 1,500-link chain in one crashed it), held to
    a schema's bound as it is alone (twenty-seventh probe, issue 45: added to the rules'
    depth, a chain taken alone was refused beside tools). The stack both take together:
    1,000 rules of 45 KiB and 4,000 schema nodes of 3.8 KiB, 60 MiB of the 256 MiB."""
    return max(map(json_schema_depth, _json_bodies(source)), default=0)


def _json_bodies(source: str) -> Iterator[Any]:
    """The JSON values after each ``%json`` of a Lark grammar (those that read as JSON)."""
    decoder = json.JSONDecoder()
    for directive in re.finditer(r"%json\s*", source):
        try:
            yield decoder.raw_decode(source, directive.end())[0]
        except ValueError:
            continue  # not JSON: llguidance refuses it (or it was inside a string)


def _longest_path(edges: Mapping[_N, Sequence[_N]], weightless: Container[_N] = ()) -> int:
    """The longest path through ``edges`` (every successor is a key), a strongly connected
    component weighing its size (its members not in ``weightless``): Tarjan's algorithm,
    iterative, whose components come out after every component they reach, so each one's
    depth is known when it is needed."""
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
                    depth_of.append(_component_depth(members, edges, component_of, depth_of, weightless))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return max(depth_of, default=0)


def _component_depth(
    members: list[_N],
    edges: Mapping[_N, Sequence[_N]],
    component_of: dict[_N, int],
    depth_of: list[int],
    weightless: Container[_N],
) -> int:
    """The depth of a component just closed (numbered ``len(depth_of)``): its size and the
    deepest component it reaches, all of which closed before it."""
    number = len(depth_of)
    for member in members:
        component_of[member] = number
    below = (depth_of[other] for member in members for s in edges[member] if (other := component_of[s]) != number)
    weight = sum(member not in weightless for member in members)
    return weight + max(below, default=0)
