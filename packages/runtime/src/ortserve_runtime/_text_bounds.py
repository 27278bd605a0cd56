"""How many characters a text may have before tokenizing it can tell anything: past that,
it is over a token limit whatever its tokens, and is refused (or cut) untokenized; and
(:meth:`TextLimit.past`) whether a text has more tokens than a limit, found without
building all its tokens."""

from __future__ import annotations

import itertools
import re
import threading

from tokenizers import Tokenizer
from tokenizers.models import Unigram, WordPiece

_WINDOW = 1 << 16
"""The most characters :meth:`TextLimit.past` tokenizes at a time (fewer for a small
limit: 8 characters a token of it, 4,096 at least); a text no longer is tokenized whole by
its caller (at most a few hundred thousand tokens, some tens of MiB)."""

_CUT = re.compile(r"(?<=\S) (?=\S)")
"""A space between two other characters: every pre-tokenizer :meth:`TextLimit.past` cuts
for (byte-level regexes, Metaspace, whitespace) starts a piece there, so the text before
and the text from it tokenize as they do in the whole."""

_PROBE = "a b 1 2 . , x \U000e0041 y 's t é z \u4e00 \u4e01 ! ? x\ty a\nb \u0301 c <a> b"
"""Text whose cuts a tokenizer's pre-tokenizer must start pieces at for :meth:`TextLimit.past` to cut there."""

__all__ = ["TextLimit"]


class TextLimit:
    """The most characters ``tokens`` tokens of ``tokenizer`` can spell (:meth:`chars`).

    No token of the vocabulary spans more characters than its longest entry (byte-level
    vocabularies spell one byte per character, so never fewer characters than bytes); a
    normaliser may compose up to 3 characters into one (Hangul jamo). Tokenizing a 15 MB
    text takes over 10 s of a core, holding the GIL; so a text past this is refused or cut
    untokenized.
    """

    def __init__(self, tokenizer: Tokenizer, tokens: int) -> None:
        self.tokens = tokens
        self._tokenizer = tokenizer
        self._longest: tuple[int, int] | None = None  # (characters, bytes) of the longest token
        self._cuts: bool | None = None
        self._lock = threading.Lock()

    def chars(self) -> int:
        """The bound. The first call scans the vocabulary (~20 ms for 50k tokens): call it
        off the event loop. It goes token by token, so that the loop takes its turns at the
        GIL meanwhile: listing the vocabulary whole (``get_vocab``) held the GIL 30 ms in one
        call (/health 106 ms in a CI run). Not at load: a scan beside the imports of
        ``ortserve serve`` made its start-up 75 ms slower."""
        return self.tokens * self._longest_token()[0] * 3

    def _longest_token(self) -> tuple[int, int]:
        with self._lock:
            if self._longest is None:
                self._longest = _longest_token(self._tokenizer)
            return self._longest

    def past(self, text: str, most: int) -> int | None:
        """More than ``most`` tokens in ``text`` (added tokens matched, none added): how many
        were found (a lower bound), or ``None`` when it has ``most`` or fewer.

        Seventeenth probe, issue 45: a byte-level BPE spells a rare character as up to 4
        tokens, so the character bound let 990,000 x U+E0041 through to be tokenized whole
        (3.96 M tokens, +600 MiB) before the context check refused it. Here the text is
        tokenized a window of up to :data:`_WINDOW` characters at a time, each cut where the
        tokenizer starts a piece (so the counts add up to the whole text's), with
        ``encode_batch`` (other threads run meanwhile), and counting stops once past
        ``most``. A stretch with no such cut (one long word, or a tokenizer this cannot cut
        for) is tokenized whole only where its bytes do not already say it is past ``most``:
        no token spans more bytes than the longest of the vocabulary (after a normaliser that
        may compose 3 characters into one). Never refuses a text that fits; a text of one window
        or less is left to its caller (``None``). Call it off the event loop.
        """
        window = min(_WINDOW, max(4096, 8 * most))
        if len(text) <= window:
            return None
        per_token, cuts = self._scan()
        counted, at = 0, 0
        while at < len(text):
            end = _next_cut(text, at, window) if cuts else len(text)
            stretch = text[at:end]
            if per_token:
                least = -(-len(stretch.encode("utf-8", "surrogatepass")) // per_token)
                if counted + least > most:
                    return counted + least
            counted += len(self._tokenizer.encode_batch([stretch], add_special_tokens=False)[0])
            if counted > most:
                return counted
            at = end
        return None

    def _scan(self) -> tuple[int, bool]:
        """The most bytes one token spans (0 where none is known: an unknown token may stand
        for a whole word), and whether :data:`_CUT` cuts this tokenizer's texts exactly."""
        longest_bytes = self._longest_token()[1]
        with self._lock:
            if self._cuts is None:
                self._cuts = _cuts_exactly(self._tokenizer)
        return _bytes_per_token(self._tokenizer, longest_bytes), self._cuts


def _next_cut(text: str, at: int, window: int) -> int:
    """The last cut in the second half of the window from ``at``, else the first after it."""
    ends = at + window
    if ends >= len(text):
        return len(text)
    last = None
    for found in _CUT.finditer(text, ends - window // 2, ends):
        last = found.start()
    if last is None:
        after = _CUT.search(text, ends)
        return after.start() if after is not None else len(text)
    return last


def _bytes_per_token(tokenizer: Tokenizer, longest_bytes: int) -> int:
    # The model's own attributes, not its JSON: that is the whole vocabulary and merges (some
    # 10 MB for 128K tokens), decoded holding the GIL.
    model = tokenizer.model
    if isinstance(model, WordPiece | Unigram) or (
        getattr(model, "unk_token", None) and getattr(model, "fuse_unk", False)
    ):
        return 0  # an unknown word (or run of unknown characters) is one token
    # A byte-level token's text spells each byte as one character of at most 2 bytes: an
    # overestimate, which makes the bound only looser.
    return longest_bytes * (1 if tokenizer.normalizer is None else 3)


def _cuts_exactly(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer tokenizes the pieces of a text apart and starts one at every
    :data:`_CUT` (no normaliser, which could join across it)."""
    pre = tokenizer.pre_tokenizer
    if pre is None or tokenizer.normalizer is not None:
        return False
    starts = {start for _, (start, _) in pre.pre_tokenize_str(_PROBE)}
    return all(found.start() in starts for found in _CUT.finditer(_PROBE))


def _longest_token(tokenizer: Tokenizer) -> tuple[int, int]:
    """The characters and the UTF-8 bytes of the vocabulary's longest token (added ones
    too), in one pass over it (token by token: see :meth:`TextLimit.chars`)."""
    chars, size = 1, 1
    texts = (tokenizer.id_to_token(i) or "" for i in range(tokenizer.get_vocab_size(with_added_tokens=False)))
    added = (token.content for token in tokenizer.get_added_tokens_decoder().values())
    for text in itertools.chain(texts, added):
        chars, size = max(chars, len(text)), max(size, len(text.encode()))
    return chars, size
