"""How many characters a text may have before tokenizing it can tell anything: past that,
it is over a token limit whatever its tokens, and is refused (or cut) untokenized."""

from __future__ import annotations

from tokenizers import Tokenizer

__all__ = ["max_text_chars"]


def max_text_chars(tokenizer: Tokenizer, tokens: int) -> int:
    """The most characters ``tokens`` tokens of ``tokenizer`` can spell.

    No token of the vocabulary spans more characters than its longest entry (byte-level
    vocabularies spell one byte per character, so never fewer characters than bytes); a
    normaliser may compose up to 3 characters into one (Hangul jamo). Tokenizing a 15 MB
    text takes over 10 s of a core, holding the GIL. Listing the vocabulary holds it too
    (50 ms for SmolLM2's): callers ask once, where a text first needs it."""
    longest = max((len(token) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return tokens * max(longest, 1) * 3
