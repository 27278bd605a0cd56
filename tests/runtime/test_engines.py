"""The same behaviour on every engine: ort-cpu, og-engine and og-generator on the CPU.

og-engine and og-generator run onnxruntime-genai's CPU provider here; on a GPU they are
the same code on another provider (see the ``gpu`` tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from og_reference import og_greedy
from og_reference import ordinary_ids as ids
from ortserve_runtime import (
    ChatModel,
    ContextLengthError,
    EngineClosedError,
    GenerationOptions,
    Grammar,
    InvalidRequestError,
    ModelConfig,
    ModelRegistry,
    pick_engine,
)
from ortserve_runtime._folder import GenaiFolder
from serving import TINY_MODEL

pytestmark = pytest.mark.anyio

ENGINES = ["ort-cpu", "og-engine", "og-generator"]
GREEDY = GenerationOptions(max_tokens=24, temperature=0)
PROMPTS = ["Hello there, how are you", "The quick brown fox jumps", "hello", "Write a poem about the sea"]
EOS_PROMPT = "the the world"
"""Greedy decoding of this prompt ends with EOS after 10 tokens."""


@pytest.fixture(params=ENGINES)
async def model(request: pytest.FixtureRequest) -> AsyncIterator[ChatModel]:
    registry = ModelRegistry(ModelConfig(engine=request.param))
    registry.add("tiny", TINY_MODEL)
    loaded: ChatModel = await registry.get("tiny")
    assert loaded.engine.name == request.param
    yield loaded
    await registry.close()


async def idle(model: ChatModel) -> None:
    for _ in range(500):
        if not (model.active or model.queued):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still busy: {model.active} active, {model.queued} queued")


async def test_greedy_tokens_equal_raw_og_generator(model: ChatModel) -> None:
    for prompt in PROMPTS[:3]:
        text, tokens, reason, usage = await model.generate(prompt, options=GREEDY).collect()
        assert reason == "length" and len(tokens) == 24
        assert tokens == og_greedy(model.encode(prompt), 24)
        assert text == model.decode(tokens)
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(model.encode(prompt)), 24)


async def test_usage_times_the_queue_wait_prefill_and_decode(model: ChatModel) -> None:
    """What a server's trace shows of a request's phases: each engine says when it took the
    request up, and the three spans add up to no more than the request took."""
    start = asyncio.get_running_loop().time()
    _, tokens, _, usage = await model.generate(PROMPTS[0], options=GREEDY).collect()
    elapsed = asyncio.get_running_loop().time() - start
    assert len(tokens) == 24
    assert usage.queued_seconds >= 0 and usage.prefill_seconds > 0 and usage.decode_seconds > 0
    assert usage.queued_seconds + usage.prefill_seconds + usage.decode_seconds <= elapsed


async def test_eos_ends_with_stop_and_counts_it(model: ChatModel) -> None:
    events = [e async for e in model.generate(EOS_PROMPT, options=GenerationOptions(max_tokens=40, temperature=0))]
    reference = og_greedy(model.encode(EOS_PROMPT), 40)
    assert reference[-1] in model.eos_token_ids
    assert [e.finish_reason for e in events][-1] == "stop"
    assert [e.token_id for e in events if e.token_id is not None] == reference[:-1]
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == len(reference)


async def test_min_tokens_holds_off_eos(model: ChatModel) -> None:
    options = GenerationOptions(max_tokens=16, min_tokens=14, temperature=0)
    _, tokens, _, _ = await model.generate(EOS_PROMPT, options=options).collect()
    assert len(tokens) >= 14 and not set(tokens[:14]) & model.eos_token_ids


async def test_stop_strings_are_exact(model: ChatModel) -> None:
    full, _, _, _ = await model.generate(PROMPTS[1], options=GREEDY).collect()
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    text, _, reason, _ = await model.generate(
        PROMPTS[1], options=GenerationOptions(max_tokens=24, temperature=0, stop=(stop,))
    ).collect()
    assert reason == "stop" and text == full[: full.index(stop)]
    await idle(model)


async def test_concurrent_requests_get_what_they_get_alone(model: ChatModel) -> None:
    alone = [await model.generate(p, options=GREEDY).collect() for p in PROMPTS]
    together = await asyncio.gather(*(model.generate(p, options=GREEDY).collect() for p in PROMPTS * 2))
    assert list(together) == alone * 2
    await idle(model)


async def test_cancel_frees_the_engine(model: ChatModel) -> None:
    long = GenerationOptions(max_tokens=500, min_tokens=500, temperature=0)  # no EOS can end it first
    stream = model.generate(PROMPTS[0], options=long)
    await anext(stream)
    await anext(stream)
    stream.cancel()
    rest = [e async for e in stream]
    assert rest[-1].finish_reason == "cancelled"
    await idle(model)
    abandoned = model.generate(PROMPTS[0], options=long)
    await anext(abandoned)
    await abandoned.aclose()
    await idle(model)
    assert (await model.generate(PROMPTS[2], options=GREEDY).collect())[2] == "length"


async def test_grammar_constrains_the_output(model: ChatModel) -> None:
    options = GenerationOptions(max_tokens=20, temperature=0, grammar=Grammar("regex", "[0-9]{3}-[a-z]{2}"))
    text, _, reason, _ = await model.generate(PROMPTS[0], options=options).collect()
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", text), text
    assert reason == "stop"


async def test_sampling_varies_and_respects_top_k(model: ChatModel) -> None:
    options = GenerationOptions(max_tokens=12, temperature=1.0)
    runs = {tuple((await model.generate(PROMPTS[0], options=options).collect())[1]) for _ in range(4)}
    assert len(runs) > 1  # random weights: sampling wanders
    top1 = GenerationOptions(max_tokens=12, temperature=1.0, top_k=1)
    assert (await model.generate(PROMPTS[0], options=top1).collect())[1] == og_greedy(model.encode(PROMPTS[0]), 12)


async def test_seeds_are_reproducible_or_refused_naming_seed(model: ChatModel) -> None:
    options = GenerationOptions(max_tokens=12, temperature=1.0, seed=7)
    if not model.engine.capabilities.seeds:  # og.Engine's static batches (the CPU) cannot reseed
        with pytest.raises(InvalidRequestError, match="seed") as info:
            model.generate(PROMPTS[0], options=options)
        assert info.value.param == "seed"
        return
    first = await model.generate(PROMPTS[0], options=options).collect()
    assert first == await model.generate(PROMPTS[0], options=options).collect()


async def test_context_errors_come_before_the_engine(model: ChatModel) -> None:
    with pytest.raises(ContextLengthError):
        model.generate([1] * model.max_sequence_length, options=GREEDY)
    with pytest.raises(ContextLengthError):
        model.generate("hi", options=GenerationOptions(max_tokens=model.max_sequence_length))


async def test_close_fails_what_is_pending(model: ChatModel) -> None:
    stream = model.generate(PROMPTS[0], options=GenerationOptions(max_tokens=900, min_tokens=900, temperature=0))
    await anext(stream)
    await model.close()
    with pytest.raises(EngineClosedError):
        async for _ in stream:
            pass
    with pytest.raises(EngineClosedError):
        model.generate("hi", options=GREEDY)


async def test_og_engine_static_batches_and_what_it_reports() -> None:
    registry = ModelRegistry(ModelConfig(engine="og-engine"))
    registry.add("tiny", TINY_MODEL)
    model: ChatModel = await registry.get("tiny")
    assert model.engine.capabilities.batching == "static" and model.engine.batch_size == 4  # type: ignore[attr-defined]
    options = GenerationOptions(max_tokens=400, min_tokens=400, temperature=0)
    streams = [model.generate(p, options=options) for p in PROMPTS * 2]
    firsts = [asyncio.ensure_future(anext(s)) for s in streams]
    for _ in range(1000):
        if model.active == 4:
            break
        await asyncio.sleep(0.002)
    # A static batch: four run, the other four wait in og's queue until the batch is done.
    assert (model.active, model.queued) == (4, 4)
    assert sum(f.done() for f in firsts) <= 4
    for stream in streams:
        stream.cancel()
    await asyncio.gather(*firsts)
    await registry.close()


def _folder(tmp_path: Path, genai_extra: dict[str, object], model_type: str = "qwen2") -> GenaiFolder:
    genai: dict[str, object] = {"model": {"type": model_type, "decoder": {}}, **genai_extra}
    return GenaiFolder(tmp_path, genai)


def test_auto_picks_the_engine_from_provider_and_folder(tmp_path: Path) -> None:
    text = _folder(tmp_path, {})
    # As og 0.18's builder writes a folder with use_paged_attention=true (tests/gpu's paged fixture).
    paged = _folder(tmp_path, {"engine": {"dynamic_batching": {"block_size": 256, "max_batch_size": 100}}})
    vision = GenaiFolder(tmp_path, {"model": {"type": "phi3v", "decoder": {}, "vision": {}}})
    assert pick_engine(text, ModelConfig()) == "ort-cpu"
    assert pick_engine(vision, ModelConfig()) == "og-generator"
    assert pick_engine(text, ModelConfig(provider="cuda")) == "og-generator"
    assert pick_engine(paged, ModelConfig(provider="cuda")) == "og-engine"
    assert pick_engine(vision, ModelConfig(provider="cuda")) == "og-generator"
    assert pick_engine(text, ModelConfig(engine="og-engine")) == "og-engine"


async def test_a_paged_attention_folder_is_refused_on_the_cpu_by_name() -> None:
    from ortserve_runtime import ModelLoadError

    paged = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen2-paged"  # tests/gpu run it on CUDA
    for engine in ("auto", "og-engine", "og-generator"):
        registry = ModelRegistry(ModelConfig(engine=engine))  # type: ignore[arg-type]
        registry.add("paged", paged)
        with pytest.raises(ModelLoadError, match=r"built with paged attention .* serve it with --provider cuda"):
            await registry.get("paged")
        await registry.close()
    # On an accelerator, only og.Engine feeds its packed inputs (og.Generator: "Invalid rank
    # for input: input_ids", measured on an H100); refused before anything loads.
    registry = ModelRegistry(ModelConfig(provider="cuda", engine="og-generator"))
    registry.add("paged", paged)
    with pytest.raises(ModelLoadError, match="only the og-engine engine runs"):
        await registry.get("paged")
    await registry.close()


async def test_a_multimodal_folder_refuses_the_text_only_engines() -> None:
    from images import TINY_PHI3V
    from ortserve_runtime import ModelLoadError

    for engine in ("ort-cpu", "og-engine"):
        registry = ModelRegistry(ModelConfig(engine=engine))  # type: ignore[arg-type]
        registry.add("vision", TINY_PHI3V)
        with pytest.raises(ModelLoadError, match=f"runs on the og-generator engine only, not {engine}"):
            await registry.get("vision")


async def test_session_options_reach_the_og_engines() -> None:
    """og passes string entries of the decoder's session_options to onnxruntime as session
    config entries; a malformed one shows they really arrive (onnxruntime refuses it)."""
    from ortserve_runtime import ModelLoadError

    for engine in ("og-engine", "og-generator"):
        registry = ModelRegistry(ModelConfig(engine=engine, session_options={"session.intra_op.allow_spinning": "0"}))  # type: ignore[arg-type]
        registry.add("tiny", TINY_MODEL)
        model: ChatModel = await registry.get("tiny")
        assert (await model.generate("hi", options=GREEDY).collect())[2] == "length"
        await registry.close()
        broken = ModelRegistry(ModelConfig(engine=engine, session_options={"session.dynamic_block_base": "abc"}))  # type: ignore[arg-type]
        broken.add("tiny", TINY_MODEL)
        with pytest.raises(ModelLoadError):
            await broken.get("tiny")


@pytest.mark.parametrize("batched", [False, True])
def test_a_hand_back_to_a_closed_loop_says_so(batched: bool) -> None:
    """A consumer's loop that is gone must cancel its request (else it decodes on, unread),
    whether the event was handed back alone or with a decode step's others."""
    from ortserve_runtime._contract import batched_hand_backs, hand_back

    live, closed = asyncio.new_event_loop(), asyncio.new_event_loop()
    closed.close()
    received: list[object] = []
    gone: list[str] = []
    try:
        with batched_hand_backs() if batched else contextlib.nullcontext():
            hand_back(live, received.append, "a", lambda: gone.append("live"))
            hand_back(closed, received.append, "b", lambda: gone.append("closed"))
            assert gone == ([] if batched else ["closed"])
        assert gone == ["closed"]
        live.run_until_complete(asyncio.sleep(0))
        assert received == ["a"]
    finally:
        live.close()


async def test_cache_salt_runs_where_it_keeps_requests_apart(model: ChatModel) -> None:
    """Every CPU engine honours cache_salt (ort-cpu scopes its prefix cache by it; og-engine's
    static batches and og-generator reuse nothing across requests). og-engine's dynamic
    batches (paged attention: accelerators only) reuse prefixes inside og, which takes no
    salt: there the salt is refused by name rather than accepted and ignored (the engine
    itself needs a GPU, so its capability stands in for it here)."""
    import dataclasses

    salted = GenerationOptions(max_tokens=3, temperature=0, cache_salt="alice")
    _, tokens, _, _ = await model.generate(ids(10), options=salted).collect()
    assert len(tokens) == 3
    original = model.engine.capabilities
    model.engine.capabilities = dataclasses.replace(original, salted_cache=False)
    try:
        with pytest.raises(InvalidRequestError, match="cache_salt") as refused:
            model.generate(ids(10), options=salted)
        assert refused.value.param == "cache_salt"
    finally:
        model.engine.capabilities = original
