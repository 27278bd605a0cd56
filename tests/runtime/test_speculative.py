"""Speculative decoding on the ort-cpu engine: drafts change how many tokens a call yields,
never which tokens.

The reference is the same request on a model that does not speculate. Tokens are compared
exactly and logprobs to 1e-4: a draft's positions are computed in one call, as a prompt's
are, which rounds differently from a one-token step (on these fp32 graphs by at most 3e-5 in a
logprob; see docs/guides/speculative.md for int4 graphs). Each test also checks that drafts were accepted, so that
it could fail. ``ORTSERVE_SMOLLM2_FP32`` (``mk_smollm2.py``'s ``ort-fp32``) runs the
prompt-lookup test on real weights too.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from ortserve_runtime import (
    ChatModel,
    GenerationOptions,
    InvalidRequestError,
    ModelConfig,
    ModelLoadError,
    ModelRegistry,
)
from ortserve_runtime._drafts import Drafter, PromptLookup

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CORPUS = (FIXTURES / "corpus.txt").read_text()
GREEDY = GenerationOptions(max_tokens=64, temperature=0, logprobs=5)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def registry() -> AsyncIterator[ModelRegistry]:
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", prefix_cache_tokens=0))
    for name in ("tiny-qwen2", "tiny-phi3-longrope", "tiny-gemma4"):
        registry.add(name, FIXTURES / name)
        registry.add(f"{name}+ngram", FIXTURES / name, ModelConfig(engine="ort-cpu", speculative="ngram"))
    yield registry
    await registry.close()


async def run(model: ChatModel, prompt: list[int], options: GenerationOptions = GREEDY) -> dict[str, Any]:
    tokens: list[int] = []
    logprobs: list[float] = []
    last = None
    async for event in model.generate(prompt, options=options):
        if event.token_id is not None:
            tokens.append(event.token_id)
        if event.logprobs is not None:
            logprobs.append(event.logprobs.logprob)
        last = event
    assert last is not None and last.usage is not None
    return {"tokens": tokens, "logprobs": logprobs, "usage": last.usage, "finish": last.finish_reason, "last": last}


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)
    assert got["finish"] == want["finish"]


def prompt_of(model: ChatModel, length: int = 100) -> list[int]:
    return model.encode(CORPUS)[:length]


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-phi3-longrope", "tiny-gemma4"])
async def test_a_prediction_changes_no_token(registry: ModelRegistry, name: str) -> None:
    model = await registry.get(name)
    prompt = prompt_of(model)
    want = await run(model, prompt)
    text = model.decode(want["tokens"])
    edited = text[: len(text) // 3] + " something else entirely " + text[len(text) // 2 :]
    for prediction in (text, edited, "unrelated words that the model will not write"):
        got = await run(
            model, prompt, GenerationOptions(max_tokens=64, temperature=0, logprobs=5, prediction=prediction)
        )
        same(got, want)
        if prediction == text:
            assert got["usage"].accepted_prediction_tokens >= 20
    # The edit: the cursor finds its place again after the changed part.
    got = await run(model, prompt, GenerationOptions(max_tokens=64, temperature=0, prediction=edited))
    assert got["usage"].accepted_prediction_tokens >= 10


async def test_prompt_lookup_changes_no_token(registry: ModelRegistry) -> None:
    # The tiny Gemma 4 repeats itself: its own output is what the lookup finds.
    plain, ngram = await registry.get("tiny-gemma4"), await registry.get("tiny-gemma4+ngram")
    prompt = prompt_of(plain)
    want = await run(plain, prompt)
    got = await run(ngram, prompt)
    same(got, want)
    assert got["usage"].accepted_prediction_tokens >= 20
    assert ngram.engine.accepted_draft_tokens >= 20  # type: ignore[attr-defined]
    assert ngram.engine.capabilities.reproducible is False


@pytest.mark.skipif("ORTSERVE_SMOLLM2_FP32" not in os.environ, reason="ORTSERVE_SMOLLM2_FP32 not set")
async def test_prompt_lookup_changes_no_token_on_real_weights() -> None:
    folder = Path(os.environ["ORTSERVE_SMOLLM2_FP32"])
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", prefix_cache_tokens=0))
    registry.add("plain", folder)
    registry.add("ngram", folder, ModelConfig(engine="ort-cpu", speculative="ngram", prefix_cache_tokens=0))
    try:
        plain, ngram = await registry.get("plain"), await registry.get("ngram")
        article = (
            "The city council voted on Tuesday to build a new library in the old railway station. The project "
            "will cost twelve million dollars and is expected to open in two years. Mayor Lena Ortiz said the "
            "library would have a children's wing, a makerspace and a rooftop garden. Some residents worried "
            "about parking, but the council promised a new bus line to the station."
        )
        content = f"Article: {article}\n\nSummarise the article, quoting its sentences word for word."
        prompt = list(plain.prepare_chat([{"role": "user", "content": content}]).ids)
        options = GenerationOptions(max_tokens=120, temperature=0, logprobs=0)
        want, got = await run(plain, prompt, options), await run(ngram, prompt, options)
        assert got["tokens"] == want["tokens"]
        assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-3)
        assert got["usage"].accepted_prediction_tokens >= 10
        # og-generator's own n-gram speculation on the same weights.
        registry.add("og", folder, ModelConfig(engine="og-generator", speculative="ngram"))
        og_run = await run(await registry.get("og"), prompt, GenerationOptions(max_tokens=120, temperature=0))
        assert og_run["tokens"] == want["tokens"]
        assert og_run["usage"].accepted_prediction_tokens >= 5
    finally:
        await registry.close()


async def test_a_speculating_request_in_a_batch(registry: ModelRegistry) -> None:
    model = await registry.get("tiny-qwen2")
    prompt = prompt_of(model)
    want = await run(model, prompt)
    others = [prompt_of(model, 40 + 7 * i)[5:] for i in range(3)]
    alone = [await run(model, other, GenerationOptions(max_tokens=8, temperature=0, logprobs=5)) for other in others]
    prediction = GenerationOptions(max_tokens=64, temperature=0, logprobs=5, prediction=model.decode(want["tokens"]))
    results = await asyncio.gather(
        run(model, prompt, prediction),
        *(run(model, other, GenerationOptions(max_tokens=8, temperature=0, logprobs=5)) for other in others),
    )
    same(results[0], want)
    for result, reference in zip(results[1:], alone, strict=True):
        same(result, reference)
    # It ran beside the others for their 8 steps, then alone, checking drafts.
    assert results[0]["usage"].accepted_prediction_tokens >= 10


async def test_stops_and_limits_inside_an_accepted_run(registry: ModelRegistry) -> None:
    model = await registry.get("tiny-qwen2")
    prompt = prompt_of(model)
    want = await run(model, prompt)
    text = model.decode(want["tokens"])
    predicted = {"prediction": text, "temperature": 0, "logprobs": 5}
    # A length limit in the middle of a draft: exactly that many tokens.
    got = await run(model, prompt, GenerationOptions(max_tokens=13, **predicted))
    assert got["tokens"] == want["tokens"][:13] and got["finish"] == "length"
    # A stop string inside a run: the text ends before it, as without drafts.
    stop = model.decode(want["tokens"][40:42])
    plain = await model.generate(
        prompt, options=GenerationOptions(max_tokens=64, temperature=0, stop=(stop,))
    ).collect()
    drafted = await model.generate(
        prompt, options=GenerationOptions(max_tokens=64, stop=(stop,), **predicted)
    ).collect()
    assert drafted[:3] == plain[:3] and plain[2] == "stop" and len(plain[1]) >= 30
    assert drafted[3].accepted_prediction_tokens > 0


async def test_a_cancelled_speculating_request_frees_its_row(registry: ModelRegistry) -> None:
    model = await registry.get("tiny-gemma4")
    prompt = prompt_of(model)
    want = await run(model, prompt)
    # Long enough (hundreds of steps, drafts taken all along) for the cancel to land mid-way.
    options = GenerationOptions(max_tokens=3000, temperature=0, prediction=model.decode(want["tokens"]))
    stream = model.generate(prompt, options=options)
    seen = 0
    async for event in stream:
        seen += 1
        if seen == 5:
            stream.cancel()
        if event.finish_reason is not None:
            assert event.finish_reason == "cancelled"
            assert event.usage is not None and 5 <= event.usage.completion_tokens < 3000
            assert event.usage.accepted_prediction_tokens > 0
    assert model.engine.active == 0
    same(await run(model, prompt), want)


async def test_a_seeded_sampled_request_draws_the_same_tokens(registry: ModelRegistry) -> None:
    model = await registry.get("tiny-qwen2")
    prompt = prompt_of(model)
    seeded = GenerationOptions(max_tokens=48, temperature=0.7, seed=7, logprobs=5)
    want = await run(model, prompt, seeded)
    options = GenerationOptions(
        max_tokens=48, temperature=0.7, seed=7, logprobs=5, prediction=model.decode(want["tokens"])
    )
    got = await run(model, prompt, options)
    same(got, want)
    assert got["usage"].accepted_prediction_tokens >= 10


async def test_sampling_keeps_its_distribution(registry: ModelRegistry) -> None:
    """Two-sample chi-squared test of the third token's distribution, 300 draws each, with
    and without a prediction of the greedy text (drafts accepted often, rejected often)."""
    model = await registry.get("tiny-qwen2")
    prompt = prompt_of(model, 30)
    greedy = await run(model, prompt, GenerationOptions(max_tokens=6, temperature=0))
    text = model.decode(greedy["tokens"])
    draws = 300

    async def thirds(prediction: str | None) -> tuple[Counter[int], int]:
        counts: Counter[int] = Counter()
        accepted = 0
        for _ in range(draws):
            options = GenerationOptions(max_tokens=4, temperature=0.8, prediction=prediction)
            result = await run(model, prompt, options)
            counts[result["tokens"][2] if len(result["tokens"]) > 2 else -1] += 1
            accepted += result["usage"].accepted_prediction_tokens
        return counts, accepted

    plain, _ = await thirds(None)
    drafted, accepted = await thirds(text)
    assert accepted >= draws // 4  # the drafts were used
    # Pool tokens seen fewer than 10 times in all; chi-squared over the rest.
    tokens = [t for t in plain | drafted if plain[t] + drafted[t] >= 10]
    rows = [[plain[t] for t in tokens], [drafted[t] for t in tokens]]
    rows[0].append(draws - sum(rows[0]))
    rows[1].append(draws - sum(rows[1]))
    columns = [a + b for a, b in zip(*rows, strict=True)]
    statistic = sum(
        (observed - total * draws / (2 * draws)) ** 2 / (total * draws / (2 * draws))
        for row in rows
        for observed, total in zip(row, columns, strict=True)
        if total
    )
    freedom = sum(1 for total in columns if total) - 1
    assert freedom >= 2
    # Wilson-Hilferty: the chi-squared quantile at p = 0.001 (z = 3.09).
    critical = freedom * (1 - 2 / (9 * freedom) + 3.09 * math.sqrt(2 / (9 * freedom))) ** 3
    assert statistic < critical, (statistic, critical, rows)


async def test_a_grammar_holds_with_a_prediction(registry: ModelRegistry) -> None:
    from ortserve_runtime.chat import Grammar

    model = await registry.get("tiny-qwen2")
    prompt = prompt_of(model, 40)
    grammar = Grammar("regex", r"(ab|cd){3,12}")
    want = await run(model, prompt, GenerationOptions(max_tokens=40, temperature=0, grammar=grammar))
    text = model.decode(want["tokens"])
    for prediction in (text, "abababababcdcdcd"):
        options = GenerationOptions(max_tokens=40, temperature=0, grammar=grammar, prediction=prediction)
        got = await run(model, prompt, options)
        assert got["tokens"] == want["tokens"]


async def test_prediction_is_refused_where_no_drafts_are_taken() -> None:
    registry = ModelRegistry(ModelConfig(engine="og-generator"))
    registry.add("og", FIXTURES / "tiny-qwen2")
    try:
        model = await registry.get("og")
        with pytest.raises(InvalidRequestError) as refused:
            model.generate("Hello", options=GenerationOptions(max_tokens=4, prediction="Hello there"))
        assert refused.value.param == "prediction"
    finally:
        await registry.close()


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence() -> None:
    lookup = PromptLookup()
    sequence = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert lookup.propose(sequence, 3) == [7, 8, 1]  # the latest "1 2 3" before the end
    assert lookup.propose([*sequence, 7, 8, 1, 2], 8) == [3, 7, 8, 1, 2]  # grows without a rescan
    assert PromptLookup().propose([5, 6, 7], 4) == []


def test_a_prediction_cursor_follows_an_edit() -> None:
    prediction = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    drafter = Drafter(prompt=[1, 2], prediction=prediction)
    assert drafter.propose([], 3) == [10, 11, 12]
    assert drafter.propose([10, 11], 3) == [12, 13, 14]
    # The output leaves the prediction (an inserted 99), then rejoins it at 15 16.
    assert drafter.propose([10, 11, 12, 99], 3) == []
    assert drafter.propose([10, 11, 12, 99, 15, 16], 3) == [17, 18, 19]
    drafter.record(3, 2)
    assert (drafter.proposed, drafter.accepted) == (3, 2)
    assert drafter.acceptance < drafter.prior


async def test_og_generator_speculates_with_ogs_ngrams() -> None:
    registry = ModelRegistry(ModelConfig(engine="og-generator"))
    registry.add("plain", FIXTURES / "tiny-qwen2")
    registry.add("ngram", FIXTURES / "tiny-qwen2", ModelConfig(engine="og-generator", speculative="ngram"))
    for refused in ("tiny-gemma4", "tiny-lfm2", "tiny-phi3v"):
        registry.add(refused, FIXTURES / refused, ModelConfig(engine="og-generator", speculative="ngram"))
    try:
        plain, ngram = await registry.get("plain"), await registry.get("ngram")
        prompt = plain.encode(CORPUS[:300])
        options = GenerationOptions(max_tokens=200, temperature=0)
        want = await run(plain, prompt, options)
        got = await run(ngram, prompt, options)
        assert got["tokens"] == want["tokens"] and got["finish"] == want["finish"]
        # The random model seldom repeats itself: og checked a draft, and would take one that
        # held (the real-weights test below counts accepted ones).
        assert got["usage"].rejected_prediction_tokens + got["usage"].accepted_prediction_tokens >= 1
        assert ngram.engine.draft_tokens >= 1  # type: ignore[attr-defined]
        # A stop string and a short limit end og's run where the host's would.
        text = plain.decode(want["tokens"])
        for limited in (
            GenerationOptions(max_tokens=9, temperature=0),
            GenerationOptions(max_tokens=64, temperature=0, stop=(text[10:14],)),
        ):
            assert (await run(ngram, prompt, limited))["tokens"] == (await run(plain, prompt, limited))["tokens"]
        # What only the host sampler does (logprobs here) decodes as usual, without drafts.
        scored = await run(ngram, prompt, GREEDY)
        assert scored["tokens"] == want["tokens"][:64] and scored["usage"].accepted_prediction_tokens == 0
        # What og cannot speculate on fails to load, naming the setting.
        for refused in ("tiny-gemma4", "tiny-lfm2", "tiny-phi3v"):
            with pytest.raises(ModelLoadError, match="speculative"):
                await registry.get(refused)
    finally:
        await registry.close()


async def test_a_draft_model_changes_no_token() -> None:
    """The tiny Gemma 4 drafted for by the smaller tiny Qwen2 (the same tokenizer): drafts
    checked like any other; a draft model with another tokenizer, or on og, fails the load
    naming it; the same model as its own draft is never worth a call (a draft token would
    cost a whole step)."""
    target, draft = FIXTURES / "tiny-gemma4", FIXTURES / "tiny-qwen2"
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", prefix_cache_tokens=0))
    registry.add("plain", target)
    registry.add("drafted", target, ModelConfig(engine="ort-cpu", speculative=f"draft:{draft}"))
    registry.add("itself", target, ModelConfig(engine="ort-cpu", speculative=f"draft:{target}"))
    registry.add("mismatched", target, ModelConfig(engine="ort-cpu", speculative=f"draft:{FIXTURES / 'tiny-qwen3-vl'}"))
    registry.add("og", draft, ModelConfig(engine="og-generator", speculative=f"draft:{draft}"))
    try:
        plain, drafted = await registry.get("plain"), await registry.get("drafted")
        checked = 0
        for length in (20, 100):  # a new request, then another: the draft's row follows each
            prompt = prompt_of(plain, length)
            want = await run(plain, prompt)
            got = await run(drafted, prompt)
            same(got, want)
            checked += got["usage"].accepted_prediction_tokens + got["usage"].rejected_prediction_tokens
        assert checked >= 2 and drafted.engine.draft_tokens == checked  # type: ignore[attr-defined]
        # Beside others it decodes in the batch; alone again, its draft catches up.
        others = [prompt_of(plain, 30 + i)[3:] for i in range(2)]
        results = await asyncio.gather(
            run(drafted, prompt), *(run(drafted, o, GenerationOptions(max_tokens=5, temperature=0)) for o in others)
        )
        same(results[0], want)
        itself = await run(await registry.get("itself"), prompt)
        same(itself, want)
        assert itself["usage"].accepted_prediction_tokens + itself["usage"].rejected_prediction_tokens == 0
        with pytest.raises(ModelLoadError, match="another tokenizer"):
            await registry.get("mismatched")
        with pytest.raises(ModelLoadError, match="ort-cpu only"):
            await registry.get("og")
    finally:
        await registry.close()
