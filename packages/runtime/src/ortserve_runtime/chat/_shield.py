"""Caller text that spells a special token stays text.

A chat's prompt is its template's rendering, tokenized with the tokenizer's special tokens
matched anywhere (as transformers, vLLM and llama-server do): that is how the template's own
``<|im_start|>`` becomes one token. It also made a caller's: a user message, a tool result
or a tool name holding ``<|im_end|>\\n<|im_start|>system\\n...`` closed its turn and opened
a system turn the model could not tell from a real one (probe 14, issue 45).

So before the template runs, every special token's text in what the request carries (message
contents, names, tool calls, tool definitions, template variables: keys and values) is
marked, each of its characters between two marks; after it, the marked characters are the
caller's, and a special token holding any of them is spelt as plain text, tokenized as the
tokenizer would with special-token matching off. Marks around each character, not around
the token: a template that cuts caller text (``content[:n]``) cut a pair apart, and a lone
mark could not tell the caller's token from the template's own after it (sixteenth probe);
a template that changes characters (``|lower``) keeps theirs. Marks a template writes
escaped (``{{ tools }}`` is Python's repr, which writes them as ``\\ufdd0``) are read as
marks too. Everything else keeps the tokens it had: a prompt with no such text is tokenized in one
call as before, and one with some is tokenized twice (with and without matching), the second
taking over only around each marked span, from the nearest position where both tokenizations
cut the text alike. "Special" is the tokenizer's own flag (``AddedToken.special``: control
tokens such as ``<|im_start|>`` or ``</s>``; GGUF's CONTROL type); added tokens that are not
special (Qwen's ``<think>``, ``<tool_call>``) are matched as before, as the model wrote them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ahocorasick_rs
import numpy as np
from tokenizers import AddedToken, Encoding, Tokenizer

from .._errors import ContextLengthError, InvalidRequestError

__all__ = ["MarkedText", "SpecialTextShield"]

_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
"""Around each character of caller text that spells a special token: Unicode noncharacters,
which text meant for interchange does not hold (any a request carries are dropped, so none
can forge a mark)."""

_ESCAPED = re.compile(r"(?<!\\)\\+[uU]0*[fF][dD][dD]([0-3])")
"""The server's characters as Python's repr and JSON write them (``\\ufdd0``), however many
times escaped. A run of backslashes is tried from its start only: tried from each of its
backslashes, ``"\\" * 40_000 + "fdd"`` took 12 s of the GIL (seventeenth probe)."""

_SEPARATOR = "\ufdd3"
"""Put between the backslash and the ``u`` of text in a request that reads as one of
:data:`_ESCAPED` (code about ``"\\ufdd0"``), so that it is not read as a mark; dropped after
reading, the text is the caller's again (it was deleted: seventeenth probe)."""

_ANCHOR = "\ufdd2"
"""The text of the added token that stands for what comes before a piece (:meth:`_plain_ids`);
dropped from requests too: tokenized, it would be an id past the model's vocabulary."""

_DROP_OWN = dict.fromkeys(map(ord, (_OPEN, _CLOSE, _ANCHOR, _SEPARATOR)))
"""The server's own characters, dropped from requests (``str.translate``)."""

_MAX_SPECIAL_CHARS = 4096
"""The longest special token served: published ones are some tens of characters."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""A mapping key spelt as a name, left unmarked."""

_SEARCHED = 1 << 16
"""Characters searched for special tokens at a time (some 1 ms of the GIL)."""

_MARKED_RUN = re.compile(f"(?:{_OPEN}[^{_OPEN}{_CLOSE}]{_CLOSE})+")
"""Characters each between an opening and a closing mark: the caller's."""


class MarkedText:
    """A rendered prompt whose caller-spelt special tokens are marked: :attr:`text` is the
    prompt as written (marks dropped), :attr:`spans` where the caller's marked characters
    lie in it: each had a mark just before it and its pair just after it, so a cut through
    a token leaves the characters on either side of it unmarked, the template's own ones
    among them."""

    __slots__ = ("spans", "text")

    def __init__(self, rendered: str) -> None:
        if _has_escaped_marks(rendered):
            rendered = _ESCAPED.sub(_unescaped, rendered)
        if _SEPARATOR in rendered:
            rendered = rendered.replace(_SEPARATOR, "")
        if _OPEN not in rendered and _CLOSE not in rendered:  # most prompts: no regex pass over them
            self.text, self.spans = rendered, []
            return
        # Runs of marked characters by one regular expression, the marks before each counted
        # by str.count: a loop over each mark took 0.7 s of the GIL for 30,000 spelt tokens.
        spans: list[tuple[int, int]] = []
        dropped = at = 0  # marks before ``at``
        for run in _MARKED_RUN.finditer(rendered):
            dropped += rendered.count(_OPEN, at, run.start()) + rendered.count(_CLOSE, at, run.start())
            start, chars = run.start() - dropped, (run.end() - run.start()) // 3
            spans.append((start, start + chars))
            dropped += 2 * chars
            at = run.end()
        self.text, self.spans = rendered.replace(_OPEN, "").replace(_CLOSE, ""), spans


def _has_escaped_marks(text: str) -> bool:
    # str's search first: a regular expression over a prompt of code, where backslashes are
    # many, took 12 ms a MB.
    return ("\\u" in text or "\\U" in text) and _ESCAPED.search(text) is not None


def _unescaped(escape: re.Match[str]) -> str:
    # Escaped n times, the mark takes 2**(n-1) backslashes and each backslash before it
    # 2**n: those (the caller's, escaped) are kept.
    backslashes = len(escape.group(0)) - len(escape.group(0).lstrip("\\"))
    kept = backslashes - (backslashes & -backslashes)
    return "\\" * kept + {"0": _OPEN, "1": _CLOSE}.get(escape.group(1), "")


def _separated(escape: re.Match[str]) -> str:
    text = escape.group(0)
    at = len(text) - len(text.lstrip("\\"))  # after the backslashes
    return text[:at] + _SEPARATOR + text[at:]


def _spelt(text: str) -> str:
    """``text`` with each character between an opening and a closing mark."""
    if len(text) < 4096:
        return "".join(_OPEN + char + _CLOSE for char in text)
    # In numpy: a string a character held the GIL 0.45 s and +680 MiB for 8 MB (eighteenth probe).
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    spelt = np.empty(3 * len(points), dtype=np.uint32)
    spelt[0::3], spelt[1::3], spelt[2::3] = ord(_OPEN), points, ord(_CLOSE)
    return spelt.tobytes().decode("utf-32-le", "surrogatepass")


class SpecialTextShield:
    """Marks a tokenizer's special tokens in caller data (:meth:`mark`) and tokenizes a
    rendered prompt with the marked ones as plain text (:meth:`encode`).

    ``copy`` is a second instance of ``tokenizer`` (made from it when not given), turned into
    the one that matches no special token; ``placeholders``, a multimodal model's media
    placeholders (``<|image_1|>``), are marked as special tokens are."""

    def __init__(
        self, tokenizer: Tokenizer, copy: Tokenizer | None = None, placeholders: re.Pattern[str] | None = None
    ) -> None:
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._added_ids = np.fromiter(added, dtype=np.int64)
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
        self._matcher = _matcher(specials)
        self._spelt = {special: _spelt(special) for special in specials}  # 0.2 s for 30,000 made one by one
        self._longest = len(longest)
        self._placeholders = placeholders
        # Special tokens the tokenizer matches after its normalizer: full-width text that NFKC
        # makes "<|im_end|>" was one (sixteenth probe). Text that normalizes to one is marked
        # whole (the published tokenizers probed match theirs on the text as written).
        normalizer = tokenizer.normalizer
        normalized = {t.content for t in added.values() if t.special and t.normalized and t.content}
        self._normalize = normalizer.normalize_str if normalizer is not None and normalized else None
        self._normalized_matcher = _matcher({self._normalize(t) for t in normalized}) if self._normalize else None
        self._normalized_reach = _reach(self._normalize, normalized) if self._normalize else None
        self._plain: tuple[Tokenizer, int] | None = None
        if self._matcher is not None or placeholders is not None:
            # At load: made at a request's first spelt token, it held the GIL 0.8-1 s for a
            # 128K vocabulary (sixteenth probe).
            plain = copy if copy is not None else Tokenizer.from_str(tokenizer.to_str())
            plain.encode_special_tokens = True
            plain.add_tokens([AddedToken(_ANCHOR, special=False, normalized=False)])
            anchor = plain.token_to_id(_ANCHOR)
            assert anchor is not None  # just added
            self._plain = plain, anchor

    def mark(self, value: Any, param: str, limit: int) -> tuple[Any, bool]:
        """``value`` (strings, mappings, lists; anything else as it is) with the server's own
        characters dropped (:data:`_DROP_OWN`), text that reads as their escapes separated
        (:data:`_SEPARATOR`), and then each special
        token's text (and media placeholder's) spelt between marks, and whether any was
        found; ``value`` itself when nothing changed. More than ``limit`` special tokens (each
        is a token at least once tokenized: the model's context) are a
        :class:`ContextLengthError`, and a value nested past Python's recursion limit an
        :class:`InvalidRequestError`, both naming ``param``."""
        found = 0
        spelt = self._spelt

        def count(more: int) -> None:
            nonlocal found
            found += more
            if found > limit:
                raise ContextLengthError(
                    f"{param} spell the model's special tokens more than {limit} times, each a token at least: "
                    f"more than this model's limit of {limit} tokens",
                    param=param,
                )

        def marked(text: str) -> str:
            if _OPEN in text or _CLOSE in text or _ANCHOR in text or _SEPARATOR in text:  # a regex: 10 ms a MiB
                # Before the search: "<|im_\ufdd0end|>" was no special token until its mark
                # was dropped (fifteenth probe, issue 45).
                text = text.translate(_DROP_OWN)
            if _has_escaped_marks(text):
                text = _ESCAPED.sub(_separated, text)
            pieces: list[str] = []
            at = 0
            for start, end in self._spelt_in(text, count):
                piece = text[start:end]
                pieces += (text[at:start], spelt.get(piece) or _spelt(piece))
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

    def _spelt_in(self, text: str, count: Callable[[int], None]) -> list[tuple[int, int]]:
        """Where ``text`` spells a special token or a media placeholder, each counted (``count``);
        and where its normalized form spells one of the special tokens matched after
        normalizing (:meth:`_normalized_spans`)."""
        spans = [*self._matches(text)] if self._matcher is not None else []
        if self._placeholders is not None:
            spans += [found.span() for found in self._placeholders.finditer(text)]
        count(len(spans))
        if self._normalized_matcher is not None:
            spans += self._normalized_spans(text, len(spans), count)
        return _merged(spans) if len(spans) > 1 else spans

    def _normalized_spans(self, text: str, counted: int, count: Callable[[int], None]) -> list[tuple[int, int]]:
        """The stretches of ``text`` whose normalized form spells a special token matched after
        normalizing: all of it, or where :func:`_reach` bounds the characters one is spelt in,
        the windows of :data:`_SEARCHED` characters (each overlapping the next by that bound,
        so that each spelling lies whole in one) that hold one. The normalizer holds the GIL:
        4 M characters at once held /health 0.6 s (seventeenth probe). The spellings are
        counted as they are found, beyond the ``counted`` found as written (a spelling in two
        windows' overlap counts twice): the whole 8 MB of such text, spelt, took +680 MiB
        before its count refused it (eighteenth probe)."""
        assert self._normalize is not None and self._normalized_matcher is not None
        normalize, matcher, reach = self._normalize, self._normalized_matcher, self._normalized_reach
        step = len(text) if reach is None or len(text) <= _SEARCHED + reach else _SEARCHED
        spans: list[tuple[int, int]] = []
        total = 0
        for at in range(0, len(text), step):
            end = min(len(text), at + step + (reach or 0))
            found = len(matcher.find_matches_as_indexes(normalize(text[at:end])))
            if found:
                spans.append((at, end))
                count(max(0, total + found - max(total, counted)))
                total += found
        return spans

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
        return MarkedText(rendered)

    def encode(self, marked: MarkedText) -> list[int]:
        """The token ids of ``marked.text``: special tokens matched, except those holding a
        character of its spans."""
        text = marked.text
        # encode_batch lets other threads run meanwhile; encode held the GIL (840K characters:
        # 0.9 s of /health; sixteenth probe).
        matched = self._tokenizer.encode_batch([text], add_special_tokens=False)[0]
        matched_ids = matched.ids  # a property making a new list at each use: once
        if not marked.spans:
            return list(matched_ids)
        # The tokenizer cuts the text at every added token it matches and tokenizes the pieces
        # between apart. Where the caller spelt one, the pieces on either side and the token's
        # text are tokenized again as one piece, as plain text (between the nearest added
        # tokens the caller did not spell); every other token stays as it was.
        at_walls = np.flatnonzero(np.isin(np.asarray(matched_ids, dtype=np.int64), self._added_ids))
        walls = [(int(index), *_chars(matched, int(index))) for index in at_walls]
        ids: list[int] = []
        taken = 0  # the matched tokens copied so far
        after, piece_start = 0, 0  # the first token and character after the last wall kept
        spelt = False
        spans, at_span = marked.spans, 0  # walls and spans both in order: one pass over each
        for index, start, end in [*walls, (len(matched_ids), len(text), len(text))]:
            while at_span < len(spans) and spans[at_span][1] <= start:
                at_span += 1
            if index < len(matched_ids) and at_span < len(spans) and spans[at_span][0] < end:
                spelt = True  # the wall holds a character of the caller's
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
        assert self._plain is not None  # made where there is anything to mark
        plain, anchor = self._plain
        piece = piece.replace(_ANCHOR, "")  # a request's are dropped; a template could write one
        if at_start:
            return list(plain.encode_batch([piece], add_special_tokens=False)[0].ids)
        ids = plain.encode_batch([_ANCHOR + piece], add_special_tokens=False)[0].ids
        if not ids or ids[0] != anchor:
            raise AssertionError("the anchor token was not matched")
        return list(ids[1:])


_DELETABLE = "\u0301\x00\x7f\u200b\u00ad\ufe0f\u2060"
"""Characters some normalizers delete (accents, controls, zero-width, format characters)."""


def _reach(normalize: Callable[[str], str], normalized: set[str]) -> int | None:
    """The most characters a text normalizing to one of ``normalized`` (special tokens) can
    hold, where ``normalize`` keeps every character in some form: Unicode's normal forms
    compose at most three into one (Hangul jamo), with some to spare for canonical
    reordering. None for a normalizer that deletes characters: a token's text could be
    spread over any number of them."""
    if any(normalize(f"a{char}a") == normalize("aa") for char in _DELETABLE):
        return None
    return 4 * max((len(normalize(token)) for token in normalized), default=0) + 16


def _chars(encoding: Encoding, index: int) -> tuple[int, int]:
    chars = encoding.token_to_chars(index)
    assert chars is not None  # a token of the text's one sequence
    return chars


def _matcher(texts: set[str]) -> ahocorasick_rs.AhoCorasick | None:
    return (
        ahocorasick_rs.AhoCorasick(list(texts), matchkind=ahocorasick_rs.MatchKind.LeftmostLongest) if texts else None
    )


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, those that overlap made one."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged
