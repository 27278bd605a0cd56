"""How many characters a text may have before tokenizing it can tell anything: past that,
it is over a token limit whatever its tokens, and is refused (or cut) untokenized."""

from __future__ import annotations

import concurrent.futures

from tokenizers import Tokenizer

__all__ = ["TextLimit"]

# One thread scans every model's vocabulary, one after another, as models load.
_SCANS = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ortserve-vocab")


class TextLimit:
    """The most characters ``tokens`` tokens of ``tokenizer`` can spell (:attr:`chars`).

    No token of the vocabulary spans more characters than its longest entry (byte-level
    vocabularies spell one byte per character, so never fewer characters than bytes); a
    normaliser may compose up to 3 characters into one (Hangul jamo). Tokenizing a 15 MB
    text takes over 10 s of a core, holding the GIL; so a text past this is refused or cut
    untokenized.

    The vocabulary is scanned from construction, on a thread of its own, one token at a
    time: listing it whole (``get_vocab``) held the GIL 30 ms for 49k tokens in one call,
    and where the first long prompt asked for it that was the event loop's time (/health
    106 ms in a CI run); token by token, the loop takes its turns between them.
    """

    def __init__(self, tokenizer: Tokenizer, tokens: int) -> None:
        self.tokens = tokens
        self._longest = _SCANS.submit(_longest_token, tokenizer)

    @property
    def chars(self) -> int:
        """The bound (waits for the scan: ~20 ms from construction for 50k tokens)."""
        return self.tokens * self._longest.result() * 3


def _longest_token(tokenizer: Tokenizer) -> int:
    ids = range(tokenizer.get_vocab_size(with_added_tokens=False))
    longest = max((len(tokenizer.id_to_token(i) or "") for i in ids), default=1)
    added = (len(token.content) for token in tokenizer.get_added_tokens_decoder().values())
    return max(longest, *added, 1)
