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
too: some 10 ms a pass for 16 MiB), then, only past it, exactly, with numpy, 256 KiB at a
time (:func:`_shape`): a Python loop over tokens took 0.4-1.2 s for 200,000 ``logit_bias``
entries or 900,000 numbers, and the hostile request waited that long for its 400.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass

import anyio
import anyio.to_thread
import numpy as np

from ._errors import BadRequestError

__all__ = [
    "DEEPER_BY",
    "MAX_JSON_DEPTH",
    "MAX_JSON_ITEMS",
    "MAX_JSON_KEYS",
    "check_json_counts",
    "counts_past_bounds",
    "deepest_field",
    "json_depth",
    "json_past_bounds",
    "one_at_a_time",
]

MAX_JSON_KEYS = 50_000
"""Object keys a JSON body may have in all: some 60 ms of decoding at most. Requests hold a
few hundred (2,048 ``logit_bias`` entries, 128 tools with their schemas, long histories)."""
MAX_JSON_ITEMS = 500_000
"""Array items a JSON body may have in all: some 60 ms of decoding for short strings (900,000
held the event loop 114 ms); above OpenAI's 300,000 tokens of embedding input a request."""
MAX_JSON_DEPTH = 128
"""Objects and arrays a JSON body may nest (the body itself is the first). What Python walks
by recursion (schemas made closed, a forced call's grammar, templates, ``json.dumps``) takes
up to 4 frames a level against the interpreter's 1,000: a body decoded 970 deep then failed
in one of them as a 500 (twenty-first probe, issue 45). Requests nest a few levels, JSON
schemas a few tens."""
_LOOK_ABOVE = 256 * 1024
"""Bodies this size or smaller are not counted."""

_CHUNK = 256 * 1024
"""Bytes scanned a numpy pass (some 2 MiB of temporary arrays, a few ms of work): the GIL
goes back to the event loop between passes."""
_QUOTE, _BACKSLASH, _COLON, _COMMA = b'"\\:,'
_OPENS, _CLOSES = b"{[", b"}]"


@dataclass(frozen=True, slots=True)
class _Shape:
    """What a JSON text holds, counted outside its strings."""

    keys: int
    containers: int
    """Objects and arrays."""
    separators: int
    """Commas: between keys and between array items."""
    heaviest: str | None
    """The top-level field whose value holds the most keys, separators and containers."""
    deepest: str | None
    """The top-level field whose value nests deepest (first of equals), if any nests."""
    depth: int
    """How deep objects and arrays nest (the outermost is 1)."""


def _string_boundaries(body: bytes, start: int, text: np.ndarray, backslashes: int) -> tuple[np.ndarray, int]:
    """Where strings begin or end in ``text`` (``body`` from ``start``), after a chunk that
    ended with ``backslashes`` backslashes: the quotes, and the backslashes ending this one."""
    quotes = text == _QUOTE
    if body.find(b"\\", start, start + text.size) < 0:  # mostly: no escapes to read
        quotes[0] &= backslashes % 2 == 0
        return quotes, 0
    # A quote is a string's boundary after an even run of backslashes (``\\\\"`` ends one).
    at = np.arange(text.size, dtype=np.int32)
    last_other = np.maximum.accumulate(np.where(text == _BACKSLASH, -1, at))
    run = at - last_other + np.where(last_other < 0, backslashes, 0)  # backslashes ending at each byte
    quotes &= np.concatenate(([backslashes], run[:-1])) % 2 == 0
    return quotes, int(run[-1])


def _nesting(body: bytes) -> int:
    """How deep ``body``'s objects and arrays nest outside its strings: :func:`_shape`'s
    ``depth`` alone, in a third of its time (2.5 against 8.4 ms for a 460 KB schema, most of
    it in numpy, without the GIL; twenty-second round of issue 45: sixteen such bodies at
    once made /health wait on the full count)."""
    in_string = backslashes = depth = deepest = 0
    for start in range(0, len(body), _CHUNK):
        text = np.frombuffer(body, np.uint8, min(_CHUNK, len(body) - start), start)
        quotes, backslashes = _string_boundaries(body, start, text, backslashes)
        outside = (np.cumsum(quotes, dtype=np.int32) + in_string) % 2 == 0
        opens = (text == _OPENS[0]) | (text == _OPENS[1])
        closes = (text == _CLOSES[0]) | (text == _CLOSES[1])
        depths = np.cumsum(np.where(outside, opens.view(np.int8) - closes.view(np.int8), 0), dtype=np.int32) + depth
        deepest = max(deepest, int(depths.max()))
        in_string, depth = int(not outside[-1]), int(depths[-1])
    return deepest


def _shape(body: bytes) -> _Shape:
    """Count ``body``'s structure (JSON, perhaps malformed) with numpy, :data:`_CHUNK` bytes
    at a time, carrying from chunk to chunk whether a string is open, the backslashes just
    read, the depth and the top-level field."""
    in_string = backslashes = depth = field = 0
    keys = containers = separators = 0
    names: list[np.ndarray] = []  # the top-level keys' quotes (opening, closing): field k's is row k - 1
    last_quotes = np.full(2, -1, np.int64)  # the last two string boundaries read, for a key cut by a chunk
    weights = np.zeros(1, np.int64)  # by field, 0: before the first top-level key
    deepest, deepest_field = 1, 0
    for start in range(0, len(body), _CHUNK):
        text = np.frombuffer(body, np.uint8, min(_CHUNK, len(body) - start), start)
        quotes, backslashes = _string_boundaries(body, start, text, backslashes)
        outside = (np.cumsum(quotes, dtype=np.int32) + in_string) % 2 == 0
        opens = outside & ((text == _OPENS[0]) | (text == _OPENS[1]))
        closes = outside & ((text == _CLOSES[0]) | (text == _CLOSES[1]))
        depths = np.cumsum(opens.astype(np.int32) - closes, dtype=np.int32) + depth  # after each byte
        colon = outside & (text == _COLON)
        comma = outside & (text == _COMMA)
        top_colon = colon & (depths == 1)
        fields = np.cumsum(top_colon, dtype=np.int32) + field
        # What a top-level field's value holds: keys and commas within it, containers opened in it.
        counted = np.bincount(fields[(colon | comma | opens) & (depths > 1)], minlength=int(fields[-1]) + 1)
        weights = np.concatenate((weights, np.zeros(counted.size - weights.size, np.int64)))
        weights[: counted.size] += counted
        here = int(depths.argmax())
        if depths[here] > deepest:
            deepest, deepest_field = int(depths[here]), int(fields[here])
        keys += int(colon.sum())
        containers += int(opens.sum())
        separators += int(comma.sum())
        # A key is the string just before its colon: the last two boundaries before it.
        boundaries = np.concatenate((last_quotes, np.flatnonzero(quotes) + start))
        before = np.searchsorted(boundaries, np.flatnonzero(top_colon) + start)
        names.append(np.stack((boundaries[before - 2], boundaries[before - 1]), axis=1))
        last_quotes = boundaries[-2:]
        in_string, depth, field = int(not outside[-1]), int(depths[-1]), int(fields[-1])
    quoted = np.concatenate(names) if names else np.zeros((0, 2), np.int64)

    def name(field: int) -> str | None:  # 1 the first top-level field; 0 none
        if field == 0:
            return None
        begin, end = (int(at) for at in quoted[field - 1])
        return body[begin + 1 : end].decode("utf-8", "replace") if begin >= 0 else None  # malformed: no key

    heaviest = name(int(weights.argmax()) if weights.any() else 0)
    return _Shape(keys, containers, separators, heaviest, name(deepest_field), deepest)


DEEPER_BY = "json_deeper_by"
"""A route's ``opt`` key: levels its bodies may nest past :data:`MAX_JSON_DEPTH` (the web page's
import takes an export, which holds conversations two levels deeper than they were sent)."""


async def check_json_counts(body: bytes, deeper_by: int = 0) -> None:
    """A 400 if ``body`` (JSON, not decoded yet) has more keys or items than allowed, naming
    the top-level field that holds the most, or nests deeper than :data:`MAX_JSON_DEPTH`
    (and ``deeper_by``), naming the deepest."""
    past = await json_past_bounds(body, max_depth=MAX_JSON_DEPTH + deeper_by)
    if past is not None:
        what, field = past
        if what.startswith("nested"):  # "nested too deeply (N levels; ...)"
            nested, _, levels = what.partition(" (")
            raise BadRequestError(
                f"the JSON body is {nested}" + (f" in {field!r}" if field else "") + f" ({levels}", param=field
            )
        raise BadRequestError(
            f"the JSON body has {what}" + (f", most of them in {field!r}" if field else ""), param=field
        )


def json_depth(text: bytes) -> int:
    """How deep ``text``'s objects and arrays nest (JSON, perhaps malformed), counted outside
    its strings; a text with no more brackets than :data:`MAX_JSON_DEPTH` is not scanned (its
    bracket count, an upper bound, is returned). Call it off the event loop for large texts."""
    containers = text.count(b"{") + text.count(b"[")
    return containers if containers <= MAX_JSON_DEPTH else _nesting(text)


async def json_past_bounds(
    body: bytes, max_keys: int = MAX_JSON_KEYS, max_items: int = MAX_JSON_ITEMS, max_depth: int | None = None
) -> tuple[str, str | None] | None:
    """What ``body`` (JSON, or JSON an SSE event carries) has more of than the bounds allow
    (``max_keys`` object keys, or objects and arrays; ``max_items`` array items: lower where
    what it becomes costs more an item; ``max_depth`` levels, if given, said as ``"nested
    ..."``), and the top-level field holding the most (or nesting deepest); ``None`` within
    them. Counted on a worker thread, for any text that is to be decoded on the event loop
    (request bodies, MCP messages); one too small to hold that many (5 bytes a key, 2 an item
    at the least) and with too few brackets to nest past ``max_depth`` is not counted."""
    deep = max_depth is not None and body.count(b"{") + body.count(b"[") > max_depth
    if len(body) <= min(_LOOK_ABOVE, 5 * max_keys, 2 * max_items) and not deep:
        return None
    return await anyio.to_thread.run_sync(_past_bounds, body, max_keys, max_items, max_depth, limiter=one_at_a_time())


_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = weakref.WeakKeyDictionary()


def one_at_a_time() -> anyio.CapacityLimiter:
    """The running loop's turn for work on a large body: one scan (on a worker thread) or
    one decode (on the loop) at a time. numpy gives the GIL up and takes it back between its
    passes, and sixteen scans on threads at once kept the loop waiting for it (twenty-second
    probe, issue 45: /health 112-169 ms for sixteen 1.4 MB bodies of nested arrays); decodes
    hold the loop, and sixteen back to back held /health 107-304 ms (twentieth probe)."""
    loop = asyncio.get_running_loop()
    turn = _TURNS.get(loop)
    if turn is None:
        turn = _TURNS[loop] = anyio.CapacityLimiter(1)
    return turn


def counts_past_bounds(text: bytes) -> tuple[str, str | None] | None:
    """:func:`json_past_bounds` of a request body's key and item bounds, where a worker thread
    counts (a batch file's lines: twenty-fifth probe, issue 45, lines of 620,000 tools were
    decoded at upload and run, +572-629 MiB and /health 668-926 ms, where a request of
    them alone is refused before decoding)."""
    return _past_bounds(text, MAX_JSON_KEYS, MAX_JSON_ITEMS)


def _past_bounds(
    body: bytes, max_keys: int, max_items: int, max_depth: int | None = None
) -> tuple[str, str | None] | None:
    """What ``body`` has too many of, and the top-level field that holds the most; ``None``
    when within the bounds."""
    containers = body.count(b"{") + body.count(b"[")
    counts_within = max(body.count(b":"), containers) <= max_keys and body.count(b",") + containers <= max_items
    # Upper bounds, within: nothing to count; only the nesting may be past its bound.
    if counts_within and (max_depth is None or containers <= max_depth or _nesting(body) <= max_depth):
        return None
    shape = _shape(body)
    if max_depth is not None and shape.depth > max_depth:
        return f"nested too deeply ({shape.depth} levels; at most {max_depth})", shape.deepest
    items = max(shape.separators - shape.keys + shape.containers, 0)
    if shape.keys > max_keys:
        what = f"{shape.keys} object keys (at most {max_keys})"
    elif shape.containers > max_keys:  # an array costs as an object does: 400,000 [[1]] held the loop 400 ms
        what = f"{shape.containers} objects and arrays (at most {max_keys}, as keys)"
    elif items > max_items:
        what = f"about {items} array items (at most {max_items})"
    else:
        return None
    return what, shape.heaviest


async def deepest_field(body: bytes) -> str | None:
    """The top-level field of ``body`` (a JSON object) whose value nests deepest, to name
    in the 400 for a body too deep to decode; ``None`` if no field's value nests. Scanned on
    a worker thread, as :func:`json_past_bounds` scans."""
    return (await anyio.to_thread.run_sync(_shape, body, limiter=one_at_a_time())).deepest
