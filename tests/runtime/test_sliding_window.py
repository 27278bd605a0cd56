"""Sliding-window attention (Gemma 2's local layers, builder 0.18's bounded key/value cache;
Gemma 4's, whose global layers also have wider heads than its sliding ones) on the ort-cpu
engine: the same greedy tokens as onnxruntime-genai's own generator on prompts and replies
past the window."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from og_reference import og_greedy
from og_reference import ordinary_ids as ids
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelRegistry
from serving import refilled

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SLIDING_MODEL = FIXTURES / "tiny-gemma2-sliding"
WINDOW = 64
TOKENS = 16


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=[SLIDING_MODEL, FIXTURES / "tiny-gemma4"], ids=["gemma2", "gemma4"])
async def model(request: pytest.FixtureRequest) -> AsyncIterator[ChatModel]:
    """A fixture on ort-cpu with chunks of 48 tokens (less than the window) and the cache."""
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", prefill_chunk_tokens=48, prefix_cache_min_tokens=8))
    registry.add("sliding", request.param)
    yield await registry.get("sliding")
    await registry.close()


async def run(model: ChatModel, prompt: list[int], tokens: int = TOKENS) -> tuple[list[int], int]:
    _, out, _, usage = await model.generate(
        prompt, options=GenerationOptions(max_tokens=tokens, temperature=0)
    ).collect()
    return out, usage.cached_tokens


async def test_a_prompt_within_the_window_matches_og(model: ChatModel) -> None:
    prompt = ids(40)
    # og.Generator sizes the sliding layers' cache to max_length (prompt + 24 here) and
    # refuses one smaller than the window, so its reference needs 64 tokens in all.
    assert (await run(model, prompt, 24))[0] == og_greedy(prompt, 24, model.folder)


async def test_a_prompt_past_the_window_matches_og(model: ChatModel) -> None:
    prompt = ids(200, seed=1)
    assert (await run(model, prompt))[0] == og_greedy(prompt, TOKENS, model.folder)


async def test_decoding_past_the_window_matches_og(model: ChatModel) -> None:
    prompt = ids(30, seed=2)
    assert (await run(model, prompt, 60))[0] == og_greedy(prompt, 60, model.folder)


async def test_a_next_turn_reusing_the_cache_matches_og(model: ChatModel) -> None:
    first = ids(100, seed=3)
    reply, _ = await run(model, first)
    second = first + reply + ids(50, seed=4)
    assert not model.engine.refilling  # the reply's decode-written rows went to the cache as they are
    tokens, cached = await run(model, second)
    # All but the reply's last token (no step fed it), less one for an even prefill call.
    assert tokens == og_greedy(second, TOKENS, model.folder) and cached >= len(first) + len(reply) - 2


async def test_a_next_turn_reusing_the_refilled_cache_matches_og_exactly(model: ChatModel) -> None:
    registry = ModelRegistry(
        ModelConfig(engine="ort-cpu", prefill_chunk_tokens=48, prefix_cache_min_tokens=8, reproducible=True)
    )
    registry.add("exact", model.folder)
    exact = await registry.get("exact")
    try:
        first = ids(100, seed=3)
        reply, _ = await run(exact, first)
        second = first + reply + ids(50, seed=4)
        await refilled(exact)  # the reply goes into the cache while idle, as a prefill computes it
        assert await run(exact, second) == (og_greedy(second, TOKENS, exact.folder), len(first) + len(reply))
    finally:
        await registry.close()


async def test_batched_requests_match_og(model: ChatModel) -> None:
    prompts = [ids(100, seed=5), ids(20, seed=6), ids(150, seed=7)]
    results = await asyncio.gather(*(run(model, p, 48) for p in prompts))
    assert [tokens for tokens, _ in results] == [og_greedy(p, 48, model.folder) for p in prompts]


async def test_a_context_shorter_than_the_window_still_runs() -> None:
    """max_sequence_length 48 < window 64: GroupQueryAttention refuses a sliding layer's
    ring shorter than the window, so those layers get the window's length."""
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", max_sequence_length=48))
    registry.add("gemma2", SLIDING_MODEL)
    model = await registry.get("gemma2")
    prompt = ids(20, seed=8)
    try:
        assert (await run(model, prompt, 8))[0] == og_greedy(prompt, 44, SLIDING_MODEL)[:8]
    finally:
        await registry.close()


@pytest.mark.parametrize("engine", ["og-engine", "og-generator"])
async def test_the_og_engines_run_requests_shorter_than_the_window(engine: str) -> None:
    """og sizes a sliding layer's cache by the request's length and refuses one below the
    window: a short prompt with a few new tokens must still run (and give og's tokens)."""
    registry = ModelRegistry(ModelConfig(engine=engine))  # type: ignore[arg-type]
    registry.add("gemma2", SLIDING_MODEL)
    model: ChatModel = await registry.get("gemma2")
    try:
        prompt = ids(10, 3)
        _, tokens, _, _ = await model.generate(prompt, options=GenerationOptions(max_tokens=8, temperature=0)).collect()
        assert tokens == og_greedy(prompt, WINDOW, SLIDING_MODEL)[: len(tokens)] and len(tokens) == 8
    finally:
        await registry.close()
