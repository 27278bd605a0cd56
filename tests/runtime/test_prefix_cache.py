"""The ort-cpu engine's prefix cache: the same greedy tokens as without it, token for token,
and ``cached_tokens`` exact, whatever the requests share (logprobs to the last bit:
test_reproducible.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelLoadError, ModelRegistry
from serving import TINY_MODEL, refilled

pytestmark = pytest.mark.anyio

GREEDY = GenerationOptions(max_tokens=12, temperature=0)
TEXT = (
    "You are a helpful assistant who answers questions about sorting lists, iterables and "
    "the order of things in Python, briefly and with an example each time you are asked."
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def load(**config: int) -> tuple[ModelRegistry, ChatModel]:
    registry = ModelRegistry(ModelConfig(**config))  # type: ignore[arg-type]
    registry.add("tiny", TINY_MODEL)
    return registry, await registry.get("tiny")


@pytest.fixture
async def models() -> AsyncIterator[tuple[ChatModel, ChatModel]]:
    """A model with the cache (min 8 tokens) and one without, for reference outputs."""
    cached_registry, cached = await load(prefix_cache_min_tokens=8)
    plain_registry, plain = await load(prefix_cache_tokens=0)
    yield cached, plain
    await cached_registry.close()
    await plain_registry.close()


def reused(common: int, prompt: int) -> int:
    """Tokens a hit reuses of a ``prompt``-token prompt sharing ``common`` with an entry: the
    rest, one token at least, is prefilled (see _prefix_cache; with ``reproducible`` on, an
    even number and two at least: test_reproducible.py)."""
    return min(common, prompt - 1)


async def run(model: ChatModel, prompt: list[int], options: GenerationOptions = GREEDY) -> tuple[list[int], int]:
    _, tokens, _, usage = await model.generate(prompt, options=options).collect()
    return tokens, usage.cached_tokens


async def test_an_exact_repeat_reuses_all_but_the_last_prompt_token(models: tuple[ChatModel, ChatModel]) -> None:
    cached, plain = models
    prompt = cached.encode(TEXT)
    reference, none = await run(plain, prompt)
    assert none == 0
    assert await run(cached, prompt) == (reference, 0)
    assert await run(cached, prompt) == (reference, len(prompt) - 1)
    cache = cached.engine.prefix_cache  # type: ignore[attr-defined]
    assert cache.hits == 1 and cache.hit_tokens == len(prompt) - 1


async def test_a_prompt_sent_again_finds_its_rows_in_place(models: tuple[ChatModel, ChatModel]) -> None:
    """A lone request leaves its prompt in row 0: the same prompt again (a retry, a
    regenerate) reuses it there rather than copying it back from the cache, every time, and
    also when the cache held it already as part of a longer entry."""
    cached, plain = models
    prompt = cached.encode(TEXT)
    reference, _ = await run(plain, prompt)
    engine = cached.engine
    await run(cached, prompt + cached.encode(" Please."))  # an entry holding the prompt and more
    for turn in range(3):
        assert await run(cached, prompt) == (reference, len(prompt) - 1)
        assert engine.prefixes_in_place == turn + 1  # type: ignore[attr-defined]
    await run(cached, cached.encode("Something else entirely, to take row 0 for other words."))
    assert await run(cached, prompt) == (reference, len(prompt) - 1)
    assert engine.prefixes_in_place == 3  # type: ignore[attr-defined]  # copied back this time


async def test_the_next_turn_reuses_the_history_and_the_refilled_reply(models: tuple[ChatModel, ChatModel]) -> None:
    cached, plain = models
    first = cached.encode(TEXT)
    reply, _ = await run(cached, first)
    second = first + reply + cached.encode(" Thanks, and now the other way round?")
    # The reply's rows as decode steps wrote them are kept (all but its last token's, which
    # no step fed); with ``reproducible`` on, the engine prefills them again while idle
    # (test_reproducible.py).
    await refilled(cached)
    want = (await run(plain, second))[0]
    assert await run(cached, second) == (want, reused(len(first) + len(reply) - 1, len(second)))
    cache = cached.engine.prefix_cache  # type: ignore[attr-defined]
    assert cache.hits == 1  # the refill's own lookup is not counted


async def test_a_next_turn_arriving_before_the_refill_prefills_the_reply(models: tuple[ChatModel, ChatModel]) -> None:
    cached, plain = models
    first = cached.encode(TEXT)
    reply, _ = await run(cached, first)
    second = first + reply + cached.encode(" Thanks, and now the other way round?")
    tokens, hit = await run(cached, second)  # takes the row from the refill, or finds it done
    assert tokens == (await run(plain, second))[0]
    assert reused(len(first), len(second)) <= hit <= reused(len(first) + len(reply), len(second))
    await refilled(cached)
    assert (await run(cached, second))[1] == len(second) - 1


async def test_a_prompt_diverging_in_the_middle_reuses_the_common_part(models: tuple[ChatModel, ChatModel]) -> None:
    cached, plain = models
    prompt = cached.encode(TEXT)
    await run(cached, prompt)
    other = prompt[:20] + [t + 1 for t in prompt[20:30]] + prompt[30:]
    assert other[20] != prompt[20]
    assert await run(cached, other) == ((await run(plain, other))[0], reused(20, len(other)))


@pytest.mark.parametrize("users", [2, 8])
async def test_concurrent_requests_share_a_system_prompt(models: tuple[ChatModel, ChatModel], users: int) -> None:
    cached, plain = models
    system = cached.encode(TEXT)
    prompts = [[*system, 100 + i, *cached.encode(f" question {i}")] for i in range(users)]
    results = await asyncio.gather(*(run(cached, p) for p in prompts))
    references = [(await run(plain, p))[0] for p in prompts]
    assert [tokens for tokens, _ in results] == references
    # Prompts are prefilled one after another: the first computes the shared part, every
    # later one takes it from the first's entry (their next tokens all differ).
    assert sorted(hit for _, hit in results) == [0] + [reused(len(system), len(p)) for p in prompts[1:]]


async def test_an_entry_evicted_while_its_hit_is_prefilled_changes_nothing() -> None:
    registry, cached = await load(prefix_cache_tokens=120, prefix_cache_min_tokens=8, prefill_chunk_tokens=4)
    plain_registry, plain = await load(prefix_cache_tokens=0)
    try:
        prompt = cached.encode(TEXT)
        await run(cached, prompt)
        longer = prompt + cached.encode(" And what about tuples, sets and dictionaries, in order?")
        hit = asyncio.ensure_future(run(cached, longer))  # copies the entry, then prefills 4 at a time
        others = [cached.encode(f"{i} unrelated words to fill the cache with something else") for i in range(4)]
        await asyncio.gather(*(run(cached, o) for o in others))  # their entries push the first one out
        assert await hit == ((await run(plain, longer))[0], reused(len(prompt), len(longer)))
        cache = cached.engine.prefix_cache  # type: ignore[attr-defined]
        assert cache.evictions > 0 and cache.held_tokens <= 120
    finally:
        await registry.close()
        await plain_registry.close()


async def test_cancelling_a_cached_prefill_leaves_the_cache_sound() -> None:
    registry, cached = await load(prefix_cache_min_tokens=8, prefill_chunk_tokens=2)
    plain_registry, plain = await load(prefix_cache_tokens=0)
    try:
        prompt = cached.encode(TEXT)
        await run(cached, prompt)
        longer = prompt + cached.encode(" " + TEXT * 4)  # hundreds of 2-token chunks to cancel in
        stream = cached.generate(longer, options=GREEDY)
        pending = asyncio.ensure_future(anext(stream))
        while cached.active < 1 and not pending.done():  # (the engine thread may outpace this loop)
            await asyncio.sleep(0.001)
        stream.cancel()
        assert (await pending).finish_reason in ("cancelled", None)
        await stream.aclose()
        assert (await run(cached, longer))[0] == (await run(plain, longer))[0]
        assert (await run(cached, prompt))[0] == (await run(plain, prompt))[0]
    finally:
        await registry.close()
        await plain_registry.close()


async def test_off_means_off_and_short_prefixes_are_not_reused() -> None:
    registry, model = await load(prefix_cache_tokens=0)
    try:
        prompt = model.encode(TEXT)
        await run(model, prompt)
        assert (await run(model, prompt))[1] == 0
        assert len(model.engine.prefix_cache) == 0  # type: ignore[attr-defined]
    finally:
        await registry.close()
    registry, model = await load()  # the default minimum: 32 tokens
    try:
        short = model.encode("sort this list for me")
        assert len(short) < 32
        await run(model, short)
        assert (await run(model, short))[1] == 0
    finally:
        await registry.close()


async def test_sampled_requests_reuse_too_and_stay_reproducible(models: tuple[ChatModel, ChatModel]) -> None:
    cached, plain = models
    prompt = cached.encode(TEXT)
    options = GenerationOptions(max_tokens=12, temperature=0.9, seed=4)
    reference, _ = await run(plain, prompt, options)
    await run(cached, prompt, options)
    assert await run(cached, prompt, options) == (reference, len(prompt) - 1)


async def test_prompts_differing_only_in_the_image_never_share_a_cache_entry() -> None:
    """Multimodal prompts run on og-generator, which keeps no prefix cache: two prompts with
    the same text and placeholder ids but different images each get their own answer."""
    from images import TINY_PHI3V, image_bytes
    from ortserve_runtime import ImageInput

    registry = ModelRegistry()
    registry.add("vision", TINY_PHI3V)
    model: ChatModel = await registry.get("vision")
    try:
        results = {}
        colours = {"red": (200, 30, 30), "blue": (30, 30, 200)}
        for colour in ("red", "blue", "red"):
            content = [ImageInput(image_bytes(colour=colours[colour])), "What is in the picture?"]
            prompt = await model.aprepare_chat([{"role": "user", "content": content}])
            _, tokens, _, usage = await model.generate(prompt, options=GREEDY).collect()
            assert usage.cached_tokens == 0
            results.setdefault(colour, tokens)
            assert results[colour] == tokens  # the same image again: the same tokens
        assert results["red"] != results["blue"]
    finally:
        await registry.close()


async def test_a_budget_in_mib_and_the_bytes_held() -> None:
    registry, model = await load(prefix_cache_mb=1, prefix_cache_min_tokens=8)  # type: ignore[arg-type]
    try:
        engine: Any = model.engine
        cache = engine.prefix_cache
        assert cache.budget_tokens == 2**20 // cache.bytes_per_token > 0
        await model.generate(TEXT, options=GREEDY).collect()
        assert 0 < cache.held_bytes <= 2**20
        # The running rows' bytes follow the tokens they hold, and are given up at the end.
        stream = model.generate(TEXT, options=GenerationOptions(max_tokens=300, min_tokens=300, temperature=0))
        await stream.__anext__()
        assert engine.live_kv_bytes >= len(model.encode(TEXT)) * cache.bytes_per_token
        await stream.aclose()
        for _ in range(100):
            if engine.active == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.live_kv_bytes == 0
    finally:
        await registry.close()
    with pytest.raises(ValueError, match="prefix_cache_mb"):
        ModelConfig(prefix_cache_mb=-1)
    # An engine without ortserve's prefix cache refuses it, naming it (never a setting ignored).
    og = ModelRegistry(ModelConfig(engine="og-generator", prefix_cache_mb=1))
    og.add("tiny", TINY_MODEL)
    with pytest.raises(ModelLoadError, match="prefix_cache_mb"):
        await og.get("tiny")
    await og.close()
