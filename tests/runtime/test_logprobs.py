"""Log-probabilities on the tiny model: each token named by its own bytes, greedy picks the
most likely token, nothing is computed when they are not asked for, and a prompt's tokens
are scored as the whole graph scores them."""

from __future__ import annotations

import math

import pytest
from og_reference import ordinary_ids, prompt_logprobs
from ortserve_runtime import ChatModel, GenerationOptions, InvalidRequestError, ModelConfig, ModelRegistry
from ortserve_runtime.chat import TokenBytes
from serving import TINY_MODEL
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


async def test_prompt_logprobs_are_the_whole_graphs_chunked_and_past_a_cached_prefix() -> None:
    """Prefilled in chunks of 5 (every position's logits of each call), and prefilled whole
    although the prefix cache holds the prompt's beginning (a cached prefix has no logits):
    each prompt token's logprob is the one the graph gives run once over the whole prompt."""
    registry = ModelRegistry(ModelConfig(prefill_chunk_tokens=5, prefix_cache_min_tokens=4))
    registry.add("tiny", TINY_MODEL)
    model = await registry.get("tiny")
    try:
        ids = ordinary_ids(23)
        await model.generate(ids[:16], options=GenerationOptions(max_tokens=2, temperature=0)).collect()
        events = [e async for e in model.generate(ids, options=GenerationOptions(max_tokens=0, prompt_logprobs=3))]
        assert [(e.token_id, e.finish_reason) for e in events] == [(None, "length")]
        assert events[0].usage is not None
        assert (events[0].usage.completion_tokens, events[0].usage.cached_tokens) == (0, 0)
        scored = events[0].prompt_logprobs
        assert scored is not None and scored.first_id == ids[0]
        assert [t.token_id for t in scored.scored] == ids[1:]
        assert [t.logprob for t in scored.scored] == pytest.approx(prompt_logprobs(ids), abs=1e-4)
        for item in scored.scored:
            assert len(item.top) == 3 and item.logprob <= item.top[0].logprob
            assert [t.logprob for t in item.top] == sorted((t.logprob for t in item.top), reverse=True)
        # The same prompt unscored does take its beginning from the cache.
        _, _, _, usage = await model.generate(ids, options=GenerationOptions(max_tokens=1)).collect()
        assert usage.cached_tokens >= 16
        # Scored and generating: the first event carries the prompt's scores, later ones none.
        options = GenerationOptions(max_tokens=3, temperature=0, logprobs=0, prompt_logprobs=0)
        events = [e async for e in model.generate(ids, options=options)]
        assert events[0].prompt_logprobs is not None and all(e.prompt_logprobs is None for e in events[1:])
        assert [t.logprob for t in events[0].prompt_logprobs.scored] == pytest.approx(prompt_logprobs(ids), abs=1e-4)
        assert all(t.top == () for t in events[0].prompt_logprobs.scored)
        assert all(e.logprobs is not None for e in events if e.token_id is not None)
    finally:
        await registry.close()


def test_max_tokens_zero_only_with_prompt_logprobs() -> None:
    GenerationOptions(max_tokens=0, prompt_logprobs=0).validate()
    for options, param in [
        (GenerationOptions(max_tokens=0), "max_tokens"),
        (GenerationOptions(prompt_logprobs=21), "prompt_logprobs"),
        (GenerationOptions(prompt_logprobs=-1), "prompt_logprobs"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            options.validate()
        assert info.value.param == param


def _whole(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True
