"""Log-probabilities as a caller reads them: each token's text and UTF-8 bytes.

The sampler scores token ids (:class:`~._sampling.Scored`); this module names them. A
token's bytes are its own, not what decoding it alone renders: one byte of a multi-byte
character is a token of its own in byte-level vocabularies, and decodes alone to U+FFFD.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer, decoders

from ._sampling import Scored

__all__ = ["PromptLogprobs", "TokenBytes", "TokenLogprob", "TopLogprob"]


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a step."""

    token_id: int
    text: str
    """The token's text; ``bytes:\\xe2\\x80`` (as OpenAI writes it) when its bytes are not
    whole UTF-8 characters."""
    bytes: bytes
    logprob: float
    """Natural log; -9999.0 for a token the request did not allow."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token of a step, its log-probability and the most likely alternatives."""

    token_id: int
    text: str
    bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...]
    """Best first; as many as the request asked for."""
    offset: int
    """Characters of output text before this token's (the legacy ``text_offset``)."""


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """A prompt's tokens scored: each token after the first with its log-probability given
    the tokens before it (and the most likely alternatives there). The first token has
    nothing before it to score it (OpenAI and vLLM report ``null``): only its text."""

    first_id: int
    first_text: str
    first_bytes: bytes
    scored: tuple[TokenLogprob, ...]
    """The prompt's later tokens in order; ``offset``: characters of the prompt's decoded
    text before the token."""


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_types(decoder: Any) -> set[str]:
    if not isinstance(decoder, dict):
        return set()
    found = {str(decoder.get("type"))}
    for inner in decoder.get("decoders", []) or []:
        found |= _decoder_types(inner)
    return found


class TokenBytes:
    """Token id -> (text, UTF-8 bytes) for one tokenizer, remembered once looked up.

    Byte-level vocabularies (GPT-2, Qwen, Llama 3, Phi-3.5+) spell each byte as a printable
    character; SentencePiece ones (Llama 2, Mistral, Phi-3) write a space as ``▁`` and
    bytes outside the vocabulary as ``<0xE2>``. Added tokens are their content as written.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # The decoder's own JSON (its pickled state), not the whole tokenizer's: parsing
        # SmolLM2's 2 MB tokenizer.json held the GIL 80 ms at a model's first logprobs request.
        decoder = tokenizer.decoder
        types = _decoder_types(json.loads(decoder.__getstate__()) if decoder is not None else None)
        self._byte_level = "ByteLevel" in types
        self._added = {int(i) for i in tokenizer.get_added_tokens_decoder()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        known = self._cache.get(token_id)
        if known is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            known = self._cache[token_id] = (text, raw)
        return known

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
            return piece.encode()
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return piece.replace("▁", " ").encode()

    def named(self, scored: Scored, offset: int) -> TokenLogprob:
        """The sampler's scores of one step, with each token's text and bytes."""
        tops = []
        for token_id, logprob in scored.top:
            text, raw = self(token_id)
            tops.append(TopLogprob(token_id, text, raw, logprob))
        text, raw = self(scored.token)
        return TokenLogprob(scored.token, text, raw, scored.logprob, tuple(tops), offset)

    def prompt(self, prompt: Sequence[int], scores: Sequence[Scored | None]) -> PromptLogprobs:
        """A prompt's scores (one per token; the first ``None``), each token named, with its
        offset in the prompt's text decoded as output is (special tokens skipped)."""
        decoder = decoders.DecodeStream(skip_special_tokens=True)
        offsets = []
        chars = 0
        for token in prompt:
            offsets.append(chars)
            chars += len(decoder.step(self._tokenizer, token) or "")
        named = []
        for position, (scored, offset) in enumerate(zip(scores, offsets, strict=True)):
            if position == 0:
                continue
            if scored is None:
                raise RuntimeError(f"prompt position {position} was not scored")
            named.append(self.named(scored, offset))
        text, raw = self(prompt[0])
        return PromptLogprobs(prompt[0], text, raw, tuple(named))
