"""Caller text that spells a special token stays text.

A chat's prompt is its template's rendering, tokenized with the tokenizer's special tokens
matched anywhere (as transformers, vLLM and llama-server do): that is how the template's own
``<|im_start|>`` becomes one token. It also made a caller's: a user message, a tool result
or a tool name holding ``<|im_end|>\\n<|im_start|>system\\n...`` closed its turn and opened
a system turn the model could not tell from a real one (probe 14, issue 45).

So before the template runs, every special token's text in what the request carries (message
contents, names, tool calls, tool definitions, template variables: keys and values) is
marked; after it, the marks give the spans that came from the caller, and there the special
tokens are spelt as plain text, tokenized as the tokenizer would with special-token matching
off. Everything else keeps the tokens it had: a prompt with no such text is tokenized in one
call as before, and one with some is tokenized twice (with and without matching), the second
taking over only around each marked span, from the nearest position where both tokenizations
cut the text alike. "Special" is the tokenizer's own flag (``AddedToken.special``: control
tokens such as ``<|im_start|>`` or ``</s>``; GGUF's CONTROL type); added tokens that are not
special (Qwen's ``<think>``, ``<tool_call>``) are matched as before, as the model wrote them.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import ahocorasick_rs
from tokenizers import AddedToken, Tokenizer

from .._errors import ContextLengthError, InvalidRequestError

__all__ = ["MarkedText", "SpecialTextShield"]

_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
"""Around caller text that spells a special token: Unicode noncharacters, which text meant
for interchange does not hold (any a request carries are dropped, so none can forge a mark)."""

_ANCHOR = "\ufdd2"
"""The text of the added token that stands for what comes before a piece (:meth:`_plain_ids`);
dropped from requests too: tokenized, it would be an id past the model's vocabulary."""

_DROP_OWN = dict.fromkeys(map(ord, (_OPEN, _CLOSE, _ANCHOR)))
"""The server's own characters, dropped from requests (``str.translate``)."""

_MAX_SPECIAL_CHARS = 4096
"""The longest special token served: published ones are some tens of characters."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""A mapping key spelt as a name, left unmarked."""

_SEARCHED = 1 << 16
"""Characters searched for special tokens at a time (some 1 ms of the GIL)."""

_MARKS = re.compile(f"[{_OPEN}{_CLOSE}]")


class MarkedText:
    """A rendered prompt whose caller-spelt special tokens are marked: :attr:`text` is the
    prompt as written (marks dropped), :attr:`spans` where those tokens lie in it.

    A template may cut caller text (``content[:n]``, ``content[1:]``) between a mark and its
    pair: a special token (of ``specials``) that starts at a lone opening mark, or ends at a
    lone closing one, is the caller's too, so that a cut cannot unmark it."""

    __slots__ = ("spans", "text")

    def __init__(self, rendered: str, specials: frozenset[str]) -> None:
        if _OPEN not in rendered and _CLOSE not in rendered:  # most prompts: no regex pass over them
            self.text, self.spans = rendered, []
            return
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        lone: list[tuple[int, bool]] = []  # (where, opening) of marks without their pair
        written = at = 0
        opened: int | None = None  # where the last mark still unpaired opened
        for mark in _MARKS.finditer(rendered):
            pieces.append(rendered[at : mark.start()])
            written += mark.start() - at
            at = mark.end()
            if mark.group() == _OPEN:
                if opened is not None:
                    lone.append((opened, True))
                opened = written
            elif opened is not None:
                spans.append((opened, written))
                opened = None
            else:
                lone.append((written, False))
        pieces.append(rendered[at:])
        if opened is not None:
            lone.append((opened, True))
        self.text = "".join(pieces)
        lengths = sorted({len(special) for special in specials}, reverse=True)
        for where, opening in lone:
            for length in lengths:
                start, end = (where, where + length) if opening else (where - length, where)
                if start >= 0 and self.text[start:end] in specials:
                    spans.append((start, end))
                    break
        self.spans = _merged(spans)


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, those that overlap made one."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


class SpecialTextShield:
    """Marks a tokenizer's special tokens in caller data (:meth:`mark`) and tokenizes a
    rendered prompt with the marked ones as plain text (:meth:`encode`)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        specials = {t.content for t in added.values() if t.special and t.content}
        longest = max(specials, key=len, default="")
        if len(longest) > _MAX_SPECIAL_CHARS:
            # Building the matcher over a 10 MB token did not end (fifteenth probe).
            raise ValueError(
                f"a special token of the tokenizer is {len(longest):,} characters long; at most "
                f"{_MAX_SPECIAL_CHARS:,} are served"
            )
        # Aho-Corasick, not a regular expression: Gemma's tokenizers have thousands of special
        # tokens, and an alternation of 6,000 took 23 s to search a megabyte.
        self._matcher = (
            ahocorasick_rs.AhoCorasick(list(specials), matchkind=ahocorasick_rs.MatchKind.LeftmostLongest)
            if specials
            else None
        )
        self._specials = frozenset(specials)
        self._longest = max(map(len, specials), default=0)
        self._plain: tuple[Tokenizer, int] | None = None
        self._lock = threading.Lock()

    def mark(self, value: Any, param: str, limit: int) -> tuple[Any, bool]:
        """``value`` (strings, mappings, lists; anything else as it is) with the server's own
        characters dropped (:data:`_OWN`) and then each special token's text marked, and
        whether any special token was found; ``value`` itself when nothing changed. More
        than ``limit`` special tokens (each is a token at least once tokenized: the model's
        context) are a :class:`ContextLengthError`, and a value nested past Python's
        recursion limit an :class:`InvalidRequestError`, both naming ``param``."""
        found = 0

        def marked(text: str) -> str:
            nonlocal found
            if _OPEN in text or _CLOSE in text or _ANCHOR in text:  # str's search: a regex took 10 ms a MiB
                # Before the search: "<|im_\ufdd0end|>" was no special token until its mark
                # was dropped (fifteenth probe, issue 45).
                text = text.translate(_DROP_OWN)
            if self._matcher is None:
                return text
            pieces: list[str] = []
            at = 0
            for start, end in self._matches(text):
                found += 1
                if found > limit:
                    raise ContextLengthError(
                        f"{param} spell the model's special tokens more than {limit} times, each a token at least: "
                        f"more than this model's limit of {limit} tokens",
                        param=param,
                    )
                pieces += (text[at:start], _OPEN, text[start:end], _CLOSE)
                at = end
            if not pieces:
                return text
            pieces.append(text[at:])
            return "".join(pieces)

        def walk(item: Any) -> Any:
            # Loops, not comprehensions: one frame a level (a tool's schema nests deep).
            if isinstance(item, str):
                return marked(item)
            if isinstance(item, Mapping):
                pairs, changed = [], False
                for key, field in item.items():
                    # A name ("role", "content", a schema's "type") is structure the template
                    # looks up: a tokenizer whose special token is "e" made every chat a 400.
                    pair = (key if isinstance(key, str) and _NAME.fullmatch(key) else walk(key)), walk(field)
                    changed = changed or pair[0] is not key or pair[1] is not field
                    pairs.append(pair)
                return dict(pairs) if changed else item
            if isinstance(item, list | tuple):
                items, changed = [], False
                for element in item:
                    items.append(walk(element))
                    changed = changed or items[-1] is not element
                return items if changed else item
            return item

        try:
            result = walk(value)
        except RecursionError:
            raise InvalidRequestError(f"{param} nests too deep to render", param=param) from None
        return result, found > 0

    def _matches(self, text: str) -> Iterator[tuple[int, int]]:
        """Where special tokens are spelt in ``text``, a stretch of :data:`_SEARCHED`
        characters at a time: the matcher holds the GIL while it searches and makes a tuple
        a match (14 MB of "<|im_end|>" held /health 230-370 ms and took +400 MiB at once)."""
        assert self._matcher is not None
        at = 0
        while at < len(text):
            window = text[at : at + _SEARCHED + self._longest]
            ends_at = at + _SEARCHED
            for _, start, end in self._matcher.find_matches_as_indexes(window):
                if at + start >= ends_at:
                    break  # the next window's: it may find a longer one there
                yield at + start, at + end
                ends_at = max(ends_at, at + end)
            at = ends_at

    def read(self, rendered: str) -> MarkedText:
        """The rendering of marked caller data: its text, and where the caller spelt tokens."""
        return MarkedText(rendered, self._specials)

    def encode(self, marked: MarkedText) -> list[int]:
        """The token ids of ``marked.text``: special tokens matched, except in its spans."""
        text = marked.text
        matched = self._tokenizer.encode(text, add_special_tokens=False)
        if not marked.spans:
            return list(matched.ids)
        # The tokenizer cuts the text at every added token it matches and tokenizes the pieces
        # between apart. Where the caller spelt one, the pieces on either side and the token's
        # text are tokenized again as one piece, as plain text (between the nearest added
        # tokens the caller did not spell); every other token stays as it was.
        matched_ids = matched.ids  # a property making a new list at each use: once
        walls = [
            (index, start, end)
            for index, (token, (start, end)) in enumerate(zip(matched_ids, matched.offsets, strict=True))
            if token in self._added_ids
        ]
        ids: list[int] = []
        taken = 0  # the matched tokens copied so far
        after, piece_start = 0, 0  # the first token and character after the last wall kept
        spelt = False
        for index, start, end in [*walls, (len(matched_ids), len(text), len(text))]:
            if index < len(matched_ids) and _overlaps(marked.spans, start, end):
                spelt = True
                continue
            if spelt:
                ids += matched_ids[taken:after]
                ids += self._plain_ids(text[piece_start:start], at_start=after == 0)
                taken, spelt = index, False
            after, piece_start = index + 1, end
        ids += matched_ids[taken:]
        return ids

    def _plain_ids(self, piece: str, *, at_start: bool) -> list[int]:
        """``piece`` tokenized with no special token matched, as the tokenizer tokenizes a
        piece at the start of a text or, after an added token, elsewhere (some add a space
        to the first piece only): the anchor, an added token of its own, stands for that."""
        plain, anchor = self._plain_tokenizer()
        piece = piece.replace(_ANCHOR, "")  # a request's are dropped; a template could write one
        if at_start:
            return list(plain.encode(piece, add_special_tokens=False).ids)
        ids = plain.encode(_ANCHOR + piece, add_special_tokens=False).ids
        if not ids or ids[0] != anchor:
            raise AssertionError("the anchor token was not matched")
        return list(ids[1:])

    def _plain_tokenizer(self) -> tuple[Tokenizer, int]:
        """A copy of the tokenizer that matches no special token, and its anchor token's id
        (made on first need: the flag is the tokenizer's, and other threads encode with the
        shared one)."""
        with self._lock:
            if self._plain is None:
                plain = Tokenizer.from_str(self._tokenizer.to_str())
                plain.encode_special_tokens = True
                plain.add_tokens([AddedToken(_ANCHOR, special=False, normalized=False)])
                anchor = plain.token_to_id(_ANCHOR)
                assert anchor is not None  # just added
                self._plain = plain, anchor
            plain_tokenizer: tuple[Tokenizer, int] = self._plain
            return plain_tokenizer


def _overlaps(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether ``[start, end)`` overlaps one of ``spans`` (sorted, apart)."""
    at = max(bisect.bisect_right(spans, start, key=lambda span: span[0]) - 1, 0)
    return any(s < end and start < e for s, e in spans[at : at + 2])
