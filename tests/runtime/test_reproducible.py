"""Same request, same tokens: on the ort-cpu engine a request's tokens and logprobs are a
function of the request alone, to the last bit, whatever the prefix cache holds, whoever
shares its steps and wherever the prefill chunks end.

The reference is a cold run on a model without the prefix cache, one request at a time.
Logprobs are compared, not only tokens: the tiny random models have wide logit gaps that
keep greedy text equal where the arithmetic already differs. The tiny fixtures show each
path that used to differ (a prompt whose last call had one row in onnxruntime's attention
block of 32, a full hit recomputing one token alone, a reply's decode-written rows reused as
a prompt). Set ``ORTSERVE_SMOLLM2`` to a real-weights folder
(``../shared/tools/mk_smollm2.py``'s ``ort-int4-kqmixed``) to run the same on SmolLM2-135M,
where the differences changed answers.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from ortserve_runtime import ChatModel, GenerationOptions, ModelConfig, ModelRegistry

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CORPUS = (FIXTURES / "corpus.txt").read_text()
MODELS = [
    pytest.param(FIXTURES / "tiny-qwen2", id="qwen2"),
    pytest.param(FIXTURES / "tiny-gemma2-sliding", id="gemma2-sliding"),
    pytest.param(FIXTURES / "tiny-gemma4", id="gemma4"),
    pytest.param(FIXTURES / "tiny-phi3-longrope", id="phi3-longrope"),
    # int4 (MatMulNBits), whose kernel for one row rounds otherwise than for several on some
    # CPUs (AVX2-only): a lone decode row then goes with a dummy (see _ort_cpu._decode_rows)
    pytest.param(Path("int4"), id="qwen2-int4"),
    pytest.param(
        Path(os.environ.get("ORTSERVE_SMOLLM2", "/nonexistent")),
        id="smollm2",
        marks=pytest.mark.skipif("ORTSERVE_SMOLLM2" not in os.environ, reason="ORTSERVE_SMOLLM2 not set"),
    ),
]
GREEDY = GenerationOptions(max_tokens=16, temperature=0, logprobs=5)
SEEDED = GenerationOptions(max_tokens=16, temperature=0.8, seed=99, logprobs=5)
LENGTHS = (33, 65, 100, 257, 301)
"""Prompt lengths: one past a block of onnxruntime's attention (32 and 256 rows), odd, even."""

Fingerprint = tuple[list[int], list[tuple[Any, ...]]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def fingerprint(model: ChatModel, prompt: list[int], options: GenerationOptions = GREEDY) -> Fingerprint:
    """The tokens and every step's logprob and top-5 alternatives, as floats to the bit."""
    tokens, steps = [], []
    async for event in model.generate(prompt, options=options):
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.logprobs is not None:
            top = tuple((t.token_id, t.logprob) for t in event.logprobs.top)
            steps.append((event.logprobs.token_id, event.logprobs.logprob, top))
    return tokens, steps


async def cached_tokens(model: ChatModel, prompt: list[int]) -> int:
    _, _, _, usage = await model.generate(prompt, options=GREEDY).collect()
    return usage.cached_tokens


@pytest.fixture(scope="module")
def int4_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_int8_prefill import int4_copy_of_tiny

    return int4_copy_of_tiny(tmp_path_factory.mktemp("int4") / "tiny-qwen2-int4")


@pytest.fixture(params=MODELS)
def folder(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    return request.getfixturevalue("int4_folder") if path == Path("int4") else path


@pytest.fixture
async def cold(folder: Path) -> AsyncIterator[ChatModel]:
    """The reference: no prefix cache, one request at a time."""
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", prefix_cache_tokens=0, reproducible=True))
    registry.add("cold", folder)
    yield await registry.get("cold")
    await registry.close()


async def served(folder: Path, **config: Any) -> tuple[ModelRegistry, ChatModel]:
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", prefix_cache_min_tokens=8, reproducible=True, **config))
    registry.add("served", folder)
    return registry, await registry.get("served")


def prompts(model: ChatModel) -> dict[int, list[int]]:
    ids = model.encode(CORPUS)
    assert len(ids) > 2 * max(LENGTHS)
    return {length: ids[:length] for length in LENGTHS}


@pytest.mark.parametrize("chunk", [512, 64, 7])
async def test_cold_partial_and_full_hits_give_the_cold_runs_logprobs(
    folder: Path, cold: ChatModel, chunk: int
) -> None:
    registry, model = await served(folder, prefill_chunk_tokens=chunk)
    try:
        ids = cold.encode(CORPUS)
        for length, prompt in prompts(cold).items():
            want = await fingerprint(cold, prompt)
            assert await fingerprint(model, prompt) == want, f"{length} tokens, first run"
            assert await fingerprint(model, prompt) == want, f"{length} tokens, a full hit"
            # LongRoPE's window (256) + 1 is the one prompt never reused (see _odd_long_rope)
            odd_long_rope = "longrope" in str(folder) and length == 257
            assert await cached_tokens(model, prompt) == (0 if odd_long_rope else len(prompt) - 2)
        for cut in (40, 99, 128, 255, 256):  # partial hits: the cached prompt, then another tail
            prompt = ids[:cut] + ids[600:700]
            await fingerprint(model, ids[: cut + 5])
            assert await fingerprint(model, prompt) == await fingerprint(cold, prompt), f"a hit of {cut}"
            assert await cached_tokens(model, prompt) >= cut - 1
    finally:
        await registry.close()


async def test_a_next_turn_holding_an_earlier_reply_gives_the_cold_runs_logprobs(folder: Path, cold: ChatModel) -> None:
    registry, model = await served(folder)
    try:
        first = prompts(cold)[100]
        reply, _ = await fingerprint(model, first)
        second = first + reply + cold.encode(" Tell me more about that, and why.")
        want = await fingerprint(cold, second)
        assert await fingerprint(model, second) == want  # the first prompt from the cache
        assert await fingerprint(model, second) == want  # a full hit, reply included
        third = second + want[0] + cold.encode(" And then?")
        assert await fingerprint(model, third) == await fingerprint(cold, third)
        # A lone request's next turn finds its history where the last one left it (row 0),
        # not copied back from the cache: the same bits either way.
        assert model.engine.prefixes_in_place > 0  # type: ignore[attr-defined]
    finally:
        await registry.close()


@pytest.mark.parametrize("neighbours", [1, 7])
async def test_a_request_beside_others_gives_the_cold_runs_logprobs(
    folder: Path, cold: ChatModel, neighbours: int
) -> None:
    registry, model = await served(folder, max_batch_size=8)
    try:
        ids = cold.encode(CORPUS)
        prompt = prompts(cold)[301]
        others = [ids[40 * i : 40 * i + 60 + 11 * i] for i in range(1, neighbours + 1)]
        want = await fingerprint(cold, prompt)
        await fingerprint(model, prompt)  # so that the run below is a full hit as well
        results = await asyncio.gather(fingerprint(model, prompt), *(fingerprint(model, o) for o in others))
        assert results[0] == want
        for other, result in zip(others, results[1:], strict=True):
            assert result == await fingerprint(cold, other)
    finally:
        await registry.close()


async def test_a_seeded_sampled_request_repeats_to_the_bit(folder: Path, cold: ChatModel) -> None:
    registry, model = await served(folder, prefill_chunk_tokens=64)
    try:
        prompt = prompts(cold)[257]
        want = await fingerprint(cold, prompt, SEEDED)
        assert await fingerprint(model, prompt, SEEDED) == want
        together = await asyncio.gather(fingerprint(model, prompt, SEEDED), fingerprint(model, prompts(cold)[65]))
        assert together[0] == want
    finally:
        await registry.close()


async def test_an_int4_model_is_reproducible_on_request(int4_folder: Path) -> None:
    """Exactness costs (the lone-row dummy where the CPU needs it, replies prefilled again
    for the prefix cache), so it is kept only when asked for (``reproducible=True``); the
    status says which a model is."""
    for asked in (False, True):
        registry = ModelRegistry(ModelConfig(engine="ort-cpu", reproducible=asked))
        registry.add("m", int4_folder)
        await registry.get("m")
        assert registry.status_of("m").reproducible is asked
        await registry.close()


def test_reproducible_is_refused_where_it_cannot_be_kept() -> None:
    with pytest.raises(ValueError, match="prefill_int8"):
        ModelConfig(reproducible=True, prefill_int8=True)
    with pytest.raises(ValueError, match="speculative"):
        ModelConfig(reproducible=True, speculative="ngram")
