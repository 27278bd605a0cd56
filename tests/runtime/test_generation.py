"""The generation engine on the tiny fixture model (random weights, real onnxruntime)."""

from __future__ import annotations

import asyncio
import math
import re
import time

import numpy as np
import onnxruntime_genai as og
import pytest
from ortserve_runtime import (
    ContextLengthError,
    EngineClosedError,
    GenerationOptions,
    GenerativeModel,
    Grammar,
    InvalidRequestError,
    ModelConfig,
    ModelRegistry,
)
from serving import TINY_MODEL

pytestmark = pytest.mark.anyio

GREEDY = GenerationOptions(max_tokens=40, temperature=0)
PROMPTS = [
    "The quick brown fox jumps",
    "Return a new list containing all items from the iterable in ascending order",
    "hello",
    "Write a poem about the sea and the sky, with many words in it please",
]


def og_greedy(prompt_ids: list[int], n: int) -> list[int]:
    """onnxruntime-genai's own greedy search on the same folder: the reference."""
    model = og.Model(str(TINY_MODEL))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + n, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompt_ids, dtype=np.int32))
    out: list[int] = []
    while not generator.is_done() and len(out) < n:
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    return out


async def wait_idle(model: GenerativeModel, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (model.active or model.queued) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert (model.active, model.queued) == (0, 0)


async def test_greedy_is_deterministic_and_matches_onnxruntime_genai(tiny: GenerativeModel) -> None:
    for prompt in PROMPTS[:3]:
        first = await tiny.generate(prompt, options=GREEDY).collect()
        second = await tiny.generate(prompt, options=GREEDY).collect()
        assert first == second
        _, tokens, _, _ = first
        assert tokens == og_greedy(tiny.encode(prompt), len(tokens))
        assert len(tokens) >= 10


async def test_text_equals_decoded_tokens(tiny: GenerativeModel) -> None:
    text, tokens, _, usage = await tiny.generate(PROMPTS[0], options=GREEDY).collect()
    eos = [t for t in tokens if t in tiny.eos_token_ids]
    assert text == tiny.decode([t for t in tokens if t not in eos])
    assert usage.prompt_tokens == len(tiny.encode(PROMPTS[0]))
    assert usage.completion_tokens == len(tokens)


async def test_max_tokens_gives_length_with_exactly_that_many(tiny: GenerativeModel) -> None:
    for n in (1, 7, 25):
        events = [e async for e in tiny.generate(PROMPTS[1], options=GenerationOptions(max_tokens=n, min_tokens=n))]
        assert events[-1].finish_reason == "length"
        assert [e.finish_reason for e in events[:-1]] == [None] * (n - 1)
        assert sum(e.token_id is not None for e in events) == n
        assert events[-1].usage is not None and events[-1].usage.completion_tokens == n


async def greedy_text(model: GenerativeModel, prompt: str, **kw: object) -> tuple[str, str]:
    text, _, reason, _ = await model.generate(
        prompt, options=GenerationOptions(max_tokens=40, temperature=0, **kw)
    ).collect()  # type: ignore[arg-type]
    return text, reason


async def test_stop_strings(tiny: GenerativeModel) -> None:
    prompt = PROMPTS[1]
    full, _ = await greedy_text(tiny, prompt, min_tokens=40)
    assert len(full) > 30
    pieces = [
        e.text
        async for e in tiny.generate(prompt, options=GenerationOptions(max_tokens=40, min_tokens=40, temperature=0))
    ]
    boundary = len(pieces[0]) + len(pieces[1])  # the end of the second token's text
    cases = {
        "inside one token": full[boundary - 1 : boundary] if pieces[1] else full[2:3],
        "spanning tokens": full[boundary - 2 : boundary + 3],
        "late": full[20:26],
    }
    for name, stop in cases.items():
        assert stop, name
        text, reason = await greedy_text(tiny, prompt, min_tokens=40, stop=(stop,))
        assert reason == "stop", name
        assert text == full[: full.index(stop)], name
        assert stop not in text
    # Several stops: the earliest in the text wins, whatever their order.
    text, reason = await greedy_text(tiny, prompt, min_tokens=40, stop=(full[25:29], full[10:13]))
    assert (text, reason) == (full[: full.index(full[10:13])], "stop")
    # A stop string that never occurs leaves the text alone (held-back prefixes released).
    never = full[5:9] + "\x00never"
    text, reason = await greedy_text(tiny, prompt, min_tokens=40, stop=(never,))
    assert (text, reason) == (full, "length")


async def test_streamed_pieces_never_contain_the_stop(tiny: GenerativeModel) -> None:
    full, _ = await greedy_text(tiny, PROMPTS[0], min_tokens=40)
    stop = full[8:14]
    stream = tiny.generate(
        PROMPTS[0], options=GenerationOptions(max_tokens=40, min_tokens=40, temperature=0, stop=(stop,))
    )
    pieces = [e.text async for e in stream]
    assert "".join(pieces) == full[: full.index(stop)]


async def test_sixteen_concurrent_requests_get_what_they_get_alone(tiny: GenerativeModel) -> None:
    jobs = [
        (f"{PROMPTS[i % 4]} {'and more ' * (i % 5)}{i}", GenerationOptions(max_tokens=5 + 3 * i, temperature=0))
        for i in range(16)
    ]
    together = await asyncio.gather(*(tiny.generate(p, options=o).collect() for p, o in jobs))
    alone = [await tiny.generate(p, options=o).collect() for p, o in jobs]
    assert together == alone
    assert len({len(t[1]) for t in together}) > 5  # rows finished at different steps


async def test_sampling_is_reproducible_with_a_seed(tiny: GenerativeModel) -> None:
    def opts(seed: int) -> GenerationOptions:
        return GenerationOptions(max_tokens=20, min_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=seed)

    a = await tiny.generate(PROMPTS[0], options=opts(1)).collect()
    b = await tiny.generate(PROMPTS[0], options=opts(1)).collect()
    c = await tiny.generate(PROMPTS[0], options=opts(2)).collect()
    assert a == b
    assert a[1] != c[1]
    # Seeded requests batched together still get their own streams of randomness.
    together = await asyncio.gather(*(tiny.generate(PROMPTS[0], options=opts(s)).collect() for s in (1, 2)))
    assert together == [a, c]


async def test_top_k_one_is_greedy(tiny: GenerativeModel) -> None:
    greedy = await tiny.generate(PROMPTS[2], options=GREEDY).collect()
    top1 = await tiny.generate(
        PROMPTS[2], options=GenerationOptions(max_tokens=40, temperature=1.5, top_k=1, seed=3)
    ).collect()
    assert top1 == greedy


async def test_cancelling_eight_in_flight_requests(tiny: GenerativeModel) -> None:
    async def consume_a_little(i: int) -> int:
        seen = 0
        stream = tiny.generate(PROMPTS[i % 4], options=GenerationOptions(max_tokens=800, min_tokens=800))
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.aclose()
        return seen

    assert await asyncio.gather(*(consume_a_little(i) for i in range(8))) == [3] * 8
    await wait_idle(tiny)
    # Tasks cancelled while waiting on their stream cancel the engine request too.
    tasks = [
        asyncio.create_task(
            tiny.generate(PROMPTS[1], options=GenerationOptions(max_tokens=900, min_tokens=900)).collect()
        )
        for _ in range(8)
    ]
    await asyncio.sleep(0.2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await wait_idle(tiny)
    after = await tiny.generate(PROMPTS[0], options=GREEDY).collect()
    assert after == await tiny.generate(PROMPTS[0], options=GREEDY).collect()


async def test_cancel_gives_a_cancelled_event(tiny: GenerativeModel) -> None:
    stream = tiny.generate(PROMPTS[0], options=GenerationOptions(max_tokens=900, min_tokens=900))
    events = []
    async for event in stream:
        events.append(event)
        if len(events) == 2:
            stream.cancel()
    assert events[-1].finish_reason == "cancelled"
    assert events[-1].usage is not None
    await wait_idle(tiny)


async def test_cancelling_a_queued_request() -> None:
    registry = ModelRegistry(ModelConfig(max_batch_size=2))
    registry.add("tiny", TINY_MODEL)
    model: GenerativeModel = await registry.get("tiny")
    long = GenerationOptions(max_tokens=300, min_tokens=300)
    running = [asyncio.create_task(model.generate(PROMPTS[0], options=long).collect()) for _ in range(2)]
    queued = model.generate(PROMPTS[1], options=long)
    waiting = asyncio.create_task(queued.__anext__())
    await asyncio.sleep(0.05)
    assert model.queued == 1
    queued.cancel()
    final = await waiting
    assert final.finish_reason == "cancelled" and final.token_id is None
    assert model.queued == 0
    results = await asyncio.gather(*running)
    assert [r[2] for r in results] == ["length", "length"]
    await registry.close()


async def test_chat_messages_use_the_template(tiny: GenerativeModel) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = tiny.apply_chat_template(messages)
    assert (
        prompt
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = tiny.apply_chat_template(messages, tools=tools)
    assert "<tools>" in with_tools and '"name": "get_weather"' in with_tools
    by_messages = await tiny.generate(messages=messages, options=GREEDY).collect()
    by_ids = await tiny.generate(tiny.encode(prompt, add_special_tokens=False), options=GREEDY).collect()
    assert by_messages == by_ids


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (GenerationOptions(temperature=-1), "temperature"),
        (GenerationOptions(temperature=3), "temperature"),
        (GenerationOptions(temperature=math.nan), "temperature"),
        (GenerationOptions(top_p=0), "top_p"),
        (GenerationOptions(top_k=-1), "top_k"),
        (GenerationOptions(max_tokens=0), "max_tokens"),
        (GenerationOptions(max_tokens=3, min_tokens=4), "min_tokens"),
        (GenerationOptions(repetition_penalty=0), "repetition_penalty"),
        (GenerationOptions(stop=("",)), "stop"),
        (GenerationOptions(seed=-1), "seed"),
    ],
)
async def test_nonsense_options_are_refused(tiny: GenerativeModel, options: GenerationOptions, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        tiny.generate("hello", options=options)
    assert info.value.param == param


async def test_bad_prompts_are_refused_before_the_engine(tiny: GenerativeModel) -> None:
    steps = tiny.steps
    for prompt in ("", []):
        with pytest.raises(InvalidRequestError, match="empty"):
            tiny.generate(prompt)
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        tiny.generate([1, 2, tiny.vocab_size])
    with pytest.raises(InvalidRequestError, match="either"):
        tiny.generate("x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(InvalidRequestError):
        tiny.generate(messages=[])
    with pytest.raises(ContextLengthError) as too_long:
        tiny.generate([5] * 1024)
    assert too_long.value.param == "prompt"
    with pytest.raises(ContextLengthError) as too_many:
        tiny.generate([5] * 1000, options=GenerationOptions(max_tokens=100))
    assert too_many.value.param == "max_tokens"
    assert tiny.steps == steps


async def test_max_sequence_length_config_caps_the_context() -> None:
    registry = ModelRegistry(ModelConfig(max_sequence_length=64))
    registry.add("tiny", TINY_MODEL)
    model: GenerativeModel = await registry.get("tiny")
    with pytest.raises(ContextLengthError, match="64"):
        model.generate("word " * 70)
    room = 64 - len(model.encode("hello"))
    options = GenerationOptions(temperature=0, min_tokens=room)  # no max_tokens: whatever fits
    _, tokens, reason, _ = await model.generate("hello", options=options).collect()
    assert reason == "length" and len(tokens) == 64 - len(model.encode("hello"))
    await registry.close()


async def test_a_closed_model_refuses_work() -> None:
    registry = ModelRegistry()
    registry.add("tiny", TINY_MODEL)
    model: GenerativeModel = await registry.get("tiny")
    pending = model.generate("hello", options=GenerationOptions(max_tokens=900, min_tokens=900))
    await pending.__anext__()
    await registry.unload("tiny")
    with pytest.raises(EngineClosedError):
        async for _ in pending:
            pass
    with pytest.raises(EngineClosedError):
        model.generate("hello")


async def test_grammar_constrains_the_output(tiny: GenerativeModel) -> None:
    regex = GenerationOptions(max_tokens=50, temperature=1.0, seed=4, grammar=Grammar("regex", r"[a-c]{2}\d{2,3}"))
    text, _, reason, _ = await tiny.generate("pick", options=regex).collect()
    assert reason == "stop"
    assert re.fullmatch(r"[a-c]{2}\d{2,3}", text)
    with pytest.raises(InvalidRequestError) as info:
        tiny.generate("x", options=GenerationOptions(grammar=Grammar("regex", "(unclosed")))
    assert info.value.param == "grammar"
    with pytest.raises(InvalidRequestError, match="schema"):
        tiny.generate("x", options=GenerationOptions(grammar=Grammar("json_schema", {"type": 5})))


async def chunked(chunk: int, max_batch_size: int = 8) -> tuple[ModelRegistry, GenerativeModel]:
    registry = ModelRegistry(ModelConfig(prefill_chunk_tokens=chunk, max_batch_size=max_batch_size))
    registry.add("tiny", TINY_MODEL)
    return registry, await registry.get("tiny")


async def test_chunked_prefill_gives_the_same_tokens(tiny: GenerativeModel) -> None:
    registry, small_chunks = await chunked(5, max_batch_size=4)
    jobs = [
        (f"{PROMPTS[i % 4]} {'more words here ' * (i % 6)}{i}", GenerationOptions(max_tokens=4 + 3 * i, temperature=0))
        for i in range(12)
    ]
    # Rows finish and compact while other prompts are half-way into the cache.
    together = await asyncio.gather(*(small_chunks.generate(p, options=o).collect() for p, o in jobs))
    reference = [await tiny.generate(p, options=o).collect() for p, o in jobs]
    assert together == reference
    await registry.close()


async def test_a_long_prompt_does_not_stall_running_streams() -> None:
    registry, model = await chunked(16)
    running = model.generate(PROMPTS[0], options=GenerationOptions(max_tokens=900, min_tokens=900))
    await running.__anext__()
    long_prompt = model.encode("word " * 300)
    seen_meanwhile = 0
    waiting = asyncio.create_task(model.generate(long_prompt, options=GenerationOptions(max_tokens=1)).collect())
    while not waiting.done():
        await running.__anext__()
        seen_meanwhile += 1
    assert seen_meanwhile >= 20, f"the running stream got {seen_meanwhile} tokens during a 600-token prefill"
    assert (await waiting)[2] == "length"
    await running.aclose()
    await registry.close()


async def test_cancelling_during_a_chunked_prefill() -> None:
    registry, model = await chunked(8)
    keeper = asyncio.create_task(
        model.generate(PROMPTS[1], options=GenerationOptions(max_tokens=300, min_tokens=300)).collect()
    )
    await asyncio.sleep(0.05)
    stream = model.generate(model.encode("word " * 500), options=GenerationOptions(max_tokens=5))
    first = asyncio.create_task(stream.__anext__())
    while not (model.queued or model.active > 1):  # submitted; 63 chunks to go
        await asyncio.sleep(0)
    stream.cancel()
    assert (await first).finish_reason == "cancelled"
    result = await keeper
    assert result[2] == "length" and len(result[1]) == 300
    await wait_idle(model)
    await registry.close()
