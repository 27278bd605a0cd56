"""How many keys and items a JSON body may hold, counted before it is decoded.

Litestar decodes a request's JSON on the event loop, and msgspec holds the GIL while it
builds the values, so a worker thread would not help: what a body costs is the Python
objects it becomes, not its bytes. Within the 16 MiB body limit, a ``logit_bias`` of a
million entries held the loop 0.5-3 s (0.8 µs or more an object key, decoding and then
converting to the request's Struct), 3,000,000 ``stop`` strings 0.9 s, 300,000 messages
0.8 s; each was refused afterwards by a bound of a few thousand. A body past
:data:`MAX_JSON_KEYS` object keys or objects and arrays (an empty object costs as a key
does: 499,000 conversations ``{}`` to import held the loop 0.25 s; 400,000 one-item arrays
in an MCP result 0.4 s) or :data:`MAX_JSON_ITEMS` array items
is a 400 before it is decoded, naming the top-level field that holds the most.

Counting is cheap where it matters: a body under 256 KiB cannot cost much (some 5 bytes a
key at the least) and is not looked at; a larger one is counted on a worker thread,
first by ``bytes.count`` of ``:``, ``{``, ``[`` and ``,`` (an upper bound, as those inside strings count
too: some 10 ms a pass for 16 MiB), then, only past it, exactly, a token at a time, so that
the event loop gets the GIL back between tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import anyio.to_thread

from ._errors import BadRequestError

__all__ = ["MAX_JSON_ITEMS", "MAX_JSON_KEYS", "check_json_counts", "deepest_field", "json_past_bounds"]

MAX_JSON_KEYS = 50_000
"""Object keys a JSON body may have in all: some 60 ms of decoding at most. Requests hold a
few hundred (2,048 ``logit_bias`` entries, 128 tools with their schemas, long histories)."""
MAX_JSON_ITEMS = 500_000
"""Array items a JSON body may have in all: some 60 ms of decoding for short strings (900,000
held the event loop 114 ms); above OpenAI's 300,000 tokens of embedding input a request."""
_LOOK_ABOVE = 256 * 1024
"""Bodies this size or smaller are not counted."""

_STRUCTURE = re.compile(rb'("(?:[^"\\]++|\\.){0,64}+")|(")|(:)|(,)|(\{)|(\[)|([\]}])', re.DOTALL)
"""A short string whole (64 runs of text or escapes at most, within the window), a longer
string's opening quote, a key's colon, a separator, an object's opening, an array's
opening, a closing."""
_STRING_BODY = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)
"""A string's text up to its closing quote (possessive: a repeated group that can backtrack
kept a record per escape, 561 MiB and 0.56 s of GIL for a string of 5,000,000 escapes)."""
_PIECE = 16 * 1024
"""Bytes one regex call reads at most: the GIL goes back to the event loop between calls."""


class _LongString:
    def __init__(self, start: int, end: int) -> None:
        self._span = (start, end)

    def span(self) -> tuple[int, int]:
        return self._span


_KINDS = (0, 0, 0, 1, 2, 3, 4, 5)
"""Token kind by the group that matched (:data:`_STRUCTURE`)."""


def _tokens(body: bytes) -> Iterator[tuple[int, re.Match[bytes] | _LongString]]:
    """``body``'s JSON tokens as (kind, the token with its ``span()``): kind 0 a whole
    string, 1 a colon, 2 a comma, 3 ``{``, 4 ``[``, 5 a closing; read ``_PIECE`` bytes a
    regex call at most."""
    pos, size = 0, len(body)
    while pos < size:
        window = min(size, pos + _PIECE)
        after = window
        for found in _STRUCTURE.finditer(body, pos, window):
            if found.lastindex != 2:  # all but a long string's opening quote
                yield _KINDS[found.lastindex or 0], found
                continue
            end = found.end()
            while end < size and body[end] != 0x22:  # to the closing quote, a piece at a time
                reached = _STRING_BODY.match(body, end, min(size, end + _PIECE)).end()  # type: ignore[union-attr]
                end = reached if reached > end else size  # no progress: a lone backslash at the end
            yield 0, _LongString(found.start(), min(end + 1, size))
            after = end + 1
            break
        pos = after


async def check_json_counts(body: bytes) -> None:
    """A 400 if ``body`` (JSON, not decoded yet) has more keys or items than allowed, naming
    the top-level field that holds the most."""
    past = await json_past_bounds(body)
    if past is not None:
        what, field = past
        raise BadRequestError(
            f"the JSON body has {what}" + (f", most of them in {field!r}" if field else ""), param=field
        )


async def json_past_bounds(
    body: bytes, max_keys: int = MAX_JSON_KEYS, max_items: int = MAX_JSON_ITEMS
) -> tuple[str, str | None] | None:
    """What ``body`` (JSON, or JSON an SSE event carries) has more of than the bounds allow
    (``max_keys`` object keys, or objects and arrays; ``max_items`` array items: lower where
    what it becomes costs more an item), and the top-level field holding the most; ``None``
    within them. Counted on a worker thread, for any text that is to be decoded on the event
    loop (request bodies, MCP messages); one too small to hold that many (5 bytes a key, 2 an
    item at the least) is not counted."""
    if len(body) <= min(_LOOK_ABOVE, 5 * max_keys, 2 * max_items):
        return None
    return await anyio.to_thread.run_sync(_past_bounds, body, max_keys, max_items)


def _past_bounds(body: bytes, max_keys: int, max_items: int) -> tuple[str, str | None] | None:
    """What ``body`` has too many of, and the top-level field that holds the most; ``None``
    when within the bounds."""
    containers = body.count(b"{") + body.count(b"[")
    if max(body.count(b":"), containers) <= max_keys and body.count(b",") <= max_items:
        return None  # upper bounds, within: nothing to scan
    keys = objects = separators = depth = 0
    field: str | None = None
    last_string = (0, 0)
    weights: dict[str | None, int] = {}
    for kind, token in _tokens(body):
        if kind == 0:  # a string: at depth 1, perhaps a top-level key
            if depth == 1:
                last_string = token.span()
        elif kind == 1:
            keys += 1
            if depth == 1:
                field = body[last_string[0] + 1 : last_string[1] - 1].decode("utf-8", "replace")
            else:
                weights[field] = weights.get(field, 0) + 1
        elif kind == 2:
            separators += 1
            if depth > 1:
                weights[field] = weights.get(field, 0) + 1
        elif kind in (3, 4):
            depth += 1
            objects += 1  # an array costs as an object does: 400,000 [[1]] held the loop 400 ms
            if depth > 1:  # in a top-level field's value
                weights[field] = weights.get(field, 0) + 1
        else:
            depth -= 1
    items = max(separators - keys, 0)  # the commas not between keys: one fewer than each array's items
    if keys > max_keys:
        what = f"{keys} object keys (at most {max_keys})"
    elif objects > max_keys:
        what = f"{objects} objects and arrays (at most {max_keys}, as keys)"
    elif items > max_items:
        what = f"about {items} array items (at most {max_items})"
    else:
        return None
    return what, max(weights, key=lambda name: weights[name], default=None)


async def deepest_field(body: bytes) -> str | None:
    """The top-level field of ``body`` (a JSON object) whose value nests deepest, to name
    in the 400 for a body too deep to decode; ``None`` if no field's value nests. Scanned a
    token at a time on a worker thread, as :func:`json_past_bounds` scans."""
    return await anyio.to_thread.run_sync(_deepest_field, body)


def _deepest_field(body: bytes) -> str | None:
    depth = deepest = 0
    field = found = None
    last_string = (0, 0)
    for kind, token in _tokens(body):
        if kind == 0:
            if depth == 1:
                last_string = token.span()
        elif kind == 1:
            if depth == 1:
                field = body[last_string[0] + 1 : last_string[1] - 1].decode("utf-8", "replace")
        elif kind in (3, 4):
            depth += 1
            if depth > max(deepest, 1):
                deepest, found = depth, field
        elif kind == 5:
            depth -= 1
    return found
