"""How many characters a text may have before tokenizing it can tell anything: past that,
it is over a token limit whatever its tokens, and is refused (or cut) untokenized."""

from __future__ import annotations

import threading

from tokenizers import Tokenizer

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
        self._longest: int | None = None
        self._lock = threading.Lock()

    def chars(self) -> int:
        """The bound. The first call scans the vocabulary (~20 ms for 50k tokens): call it
        off the event loop. It goes token by token, so that the loop takes its turns at the
        GIL meanwhile: listing the vocabulary whole (``get_vocab``) held the GIL 30 ms in one
        call (/health 106 ms in a CI run). Not at load: a scan beside the imports of
        ``ortserve serve`` made its start-up 75 ms slower."""
        with self._lock:
            if self._longest is None:
                self._longest = _longest_token(self._tokenizer)
        return self.tokens * self._longest * 3


def _longest_token(tokenizer: Tokenizer) -> int:
    ids = range(tokenizer.get_vocab_size(with_added_tokens=False))
    longest = max((len(tokenizer.id_to_token(i) or "") for i in ids), default=1)
    added = (len(token.content) for token in tokenizer.get_added_tokens_decoder().values())
    return max(longest, *added, 1)
