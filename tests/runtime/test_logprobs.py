"""Log-probabilities on the tiny model: each token named by its own bytes, greedy picks the
most likely token, and nothing is computed when they are not asked for."""

from __future__ import annotations

import math

import pytest
from ortserve_runtime import ChatModel, GenerationOptions
from ortserve_runtime.chat import TokenBytes
from tokenizers import Tokenizer, decoders, models

pytestmark = pytest.mark.anyio


async def test_greedy_tokens_are_the_most_likely_and_their_bytes_spell_the_text(tiny: ChatModel) -> None:
    options = GenerationOptions(max_tokens=16, temperature=0, logprobs=3)
    events = [e async for e in tiny.generate("Tell me about the iterable", options=options)]
    scored = [e.logprobs for e in events if e.logprobs is not None]
    assert len(scored) == sum(e.token_id is not None for e in events) > 0
    for item in scored:
        assert item.top[0].token_id == item.token_id and item.top[0].logprob == item.logprob
        assert item.logprob <= 0 and len(item.top) == 3
        assert [t.logprob for t in item.top] == sorted((t.logprob for t in item.top), reverse=True)
        assert math.fsum(math.exp(t.logprob) for t in item.top) <= 1 + 1e-6
    text = "".join(e.text for e in events)
    assert b"".join(item.bytes for item in scored).decode() == text
    assert scored[0].offset == 0
    for item in scored:  # each whole token's text begins at its offset
        assert not _whole(item.bytes) or text[item.offset :].startswith(item.text)


async def test_no_logprobs_unless_asked(tiny: ChatModel) -> None:
    events = [e async for e in tiny.generate("Hello", options=GenerationOptions(max_tokens=4, temperature=0))]
    assert all(e.logprobs is None for e in events)


async def test_token_bytes_of_a_byte_level_vocabulary(tiny: ChatModel) -> None:
    names = TokenBytes(tiny.tokenizer)
    text = "naïve café — 東京"
    ids = tiny.encode(text, add_special_tokens=False)
    assert b"".join(names(i)[1] for i in ids) == text.encode()
    partial = [names(i) for i in ids if not _whole(names(i)[1])]
    assert all(t.startswith("bytes:\\x") for t, _ in partial)


def test_token_bytes_of_a_sentencepiece_vocabulary() -> None:
    vocab = {"<unk>": 0, "▁caf": 1, "é": 2, "<0xE2>": 3, "<0x80>": 4, "<0x94>": 5}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    names = TokenBytes(tokenizer)
    assert names(1) == (" caf", b" caf")
    assert names(2) == ("é", "é".encode())
    assert names(3) == ("bytes:\\xe2", b"\xe2")
    assert b"".join(names(i)[1] for i in (3, 4, 5)).decode() == "—"


def _whole(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True
