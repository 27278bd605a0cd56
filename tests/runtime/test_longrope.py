"""LongRoPE models (Phi-3.x, Phi-4-mini) on the ort-cpu engine: the same greedy tokens as
onnxruntime-genai's own generator, on both sides of the model's original window.

The builder's graph takes the long rotary factors when the attention mask is wider than
``original_max_position_embeddings`` (256 in the fixture) and the short ones otherwise, at
every call. og prefills a prompt in one call, so a prompt past the window is computed
with the long factors throughout; its decode steps are one call per token, so a sequence
crossing the window while decoding keeps the short-factor keys of its first 256 tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from og_reference import og_greedy
from og_reference import ordinary_ids as ids
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelRegistry

pytestmark = pytest.mark.anyio

LONGROPE_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-phi3-longrope"
WINDOW = 256
TOKENS = 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def model() -> AsyncIterator[ChatModel]:
    """The fixture on ort-cpu with small chunks (several per prompt) and the prefix cache."""
    config = ModelConfig(engine="ort-cpu", prefill_chunk_tokens=64, prefix_cache_min_tokens=8)
    registry = ModelRegistry(config)
    registry.add("phi3", LONGROPE_MODEL)
    yield await registry.get("phi3")
    await registry.close()


async def run(model: ChatModel, prompt: list[int], tokens: int = TOKENS) -> tuple[list[int], int]:
    options = GenerationOptions(max_tokens=tokens, temperature=0)
    _, out, _, usage = await model.generate(prompt, options=options).collect()
    return out, usage.cached_tokens


async def test_a_prompt_past_the_window_matches_og(model: ChatModel) -> None:
    prompt = ids(300)
    assert await run(model, prompt) == (og_greedy(prompt, TOKENS, LONGROPE_MODEL), 0)


async def test_the_default_config_matches_og_on_a_next_turn_past_the_window() -> None:
    """Default chunks (512, more than the window) and cache: a 200-token turn, then the
    next past the window and past a chunk, sharing the first turn and its reply."""
    registry = ModelRegistry(ModelConfig(engine="ort-cpu"))
    registry.add("phi3", LONGROPE_MODEL)
    model = await registry.get("phi3")
    try:
        first = ids(200, seed=1)
        reply, _ = await run(model, first)
        second = first + reply + ids(400, seed=9)
        assert await run(model, second) == (og_greedy(second, TOKENS, LONGROPE_MODEL), 0)
    finally:
        await registry.close()


async def test_a_prompt_within_the_window_matches_og_and_reuses_the_cache(model: ChatModel) -> None:
    first = ids(150)
    assert await run(model, first) == (og_greedy(first, TOKENS, LONGROPE_MODEL), 0)
    second = first + ids(90, seed=2)  # 240 tokens: still within the window
    assert await run(model, second) == (og_greedy(second, TOKENS, LONGROPE_MODEL), len(first))


async def test_a_longer_prompt_after_a_cached_shorter_turn_matches_og(model: ChatModel) -> None:
    """The first turn's row was computed with the short factors; og computes the second
    turn, past the window, with the long ones throughout: nothing may be reused."""
    first = ids(200)
    reply, _ = await run(model, first)
    assert reply == og_greedy(first, TOKENS, LONGROPE_MODEL)
    second = first + reply + ids(100, seed=3)
    assert await run(model, second) == (og_greedy(second, TOKENS, LONGROPE_MODEL), 0)
    # Nor is the long turn's row (long factors) served to a prompt within the window: the
    # first prompt's row is (a reply's rows are never kept; see _prefix_cache).
    third = second[:250]
    out, cached = await run(model, third)
    assert out == og_greedy(third, TOKENS, LONGROPE_MODEL)
    assert cached == len(first)


async def test_turns_past_the_window_reuse_each_other_and_match_og(model: ChatModel) -> None:
    """A row computed past the window (one call, long factors throughout) is what og
    computes for a longer prompt past the window: it is reused, and the rest of the
    prompt is prefilled in one call, past the window too."""
    first = ids(300, seed=10)
    reply, _ = await run(model, first)
    assert reply == og_greedy(first, TOKENS, LONGROPE_MODEL)
    second = first + reply + ids(100, seed=11)
    assert await run(model, second) == (og_greedy(second, TOKENS, LONGROPE_MODEL), len(first))
    # A prompt sharing only the beginning, shorter than the window after it: reused too.
    third = first[:100] + ids(200, seed=12)
    assert await run(model, third) == (og_greedy(third, TOKENS, LONGROPE_MODEL), 100)
    # Within the window nothing of those rows is reused: og computes it with the short factors.
    fourth = first[:200]
    assert await run(model, fourth) == (og_greedy(fourth, TOKENS, LONGROPE_MODEL), 0)


async def test_decoding_across_the_window_matches_og(model: ChatModel) -> None:
    """240 prompt tokens and 40 more: og's decode steps switch to the long factors at 257."""
    prompt = ids(240, seed=4)
    reference = og_greedy(prompt, 40, LONGROPE_MODEL)
    assert len(reference) == 40, "the fixture should not stop early here"
    assert await run(model, prompt, 40) == (reference, 0)
    # The row now holds 279 tokens, the last 23 computed with the long factors; the cache
    # keeps the prompt's 240 (short factors), reused by a prompt within the window...
    within = prompt + reference[:10]
    assert await run(model, within) == (og_greedy(within, TOKENS, LONGROPE_MODEL), len(prompt))
    # ...and none by one past it.
    past = prompt + reference[:30]
    assert await run(model, past) == (og_greedy(past, TOKENS, LONGROPE_MODEL), 0)


async def test_batched_requests_on_both_sides_of_the_window_match_og(model: ChatModel) -> None:
    """One decode step serves rows within and past the window: each must get its own factors."""
    prompts = [ids(100, seed=5), ids(300, seed=6), ids(250, seed=7), ids(40, seed=8)]
    results = await asyncio.gather(*(run(model, p, 24) for p in prompts))
    assert [tokens for tokens, _ in results] == [og_greedy(p, 24, LONGROPE_MODEL) for p in prompts]


async def test_rows_on_both_sides_of_the_window_take_two_calls_a_step(
    model: ChatModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arrivals alternate sides and one row crosses while decoding: rows are reordered
    (row copies) so that a step is one call per side, and every stream still equals og."""
    engine: Any = model.engine
    steps: list[list[list[bool]]] = []
    decode_step, decode_rows = engine._decode_step, engine._decode_rows

    def step() -> None:
        steps.append([])
        decode_step()

    def rows(requests: list[Any], first: int) -> Any:
        steps[-1].append([engine._past_window(r.length) for r in requests])
        return decode_rows(requests, first)

    monkeypatch.setattr(engine, "_decode_step", step)
    monkeypatch.setattr(engine, "_decode_rows", rows)
    prompts = [ids(100, seed=13), ids(300, seed=14), ids(245, seed=15), ids(40, seed=16), ids(280, seed=17)]
    results = await asyncio.gather(*(run(model, p, 24) for p in prompts))
    assert [tokens for tokens, _ in results] == [og_greedy(p, 24, LONGROPE_MODEL) for p in prompts]
    assert max(len(calls) for calls in steps) == 2
    assert all(len(set(call)) == 1 for calls in steps for call in calls)
