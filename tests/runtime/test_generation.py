"""The generation engine on the tiny fixture model (random weights, real onnxruntime).

Stop strings are taken from the model's own greedy output (generated once without a stop),
so every stop case below really occurs where the test says it does.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from gguf import GGMLQuantizationType as Q
from gguf_files import write_tiny_gguf
from og_reference import og_greedy
from ortserve_runtime import (
    ChatModel,
    ContextLengthError,
    EngineClosedError,
    GenerationEvent,
    GenerationOptions,
    Grammar,
    InvalidRequestError,
    ModelConfig,
    ModelRegistry,
    PreemptedError,
    load_chat_model,
)
from ortserve_runtime.engines._decoder_graph import LOGIT_POSITIONS, open_session
from ortserve_runtime.sources import converted_folder
from serving import TINY_MODEL

pytestmark = pytest.mark.anyio

GREEDY = GenerationOptions(max_tokens=40, temperature=0)
PROMPTS = [
    "The quick brown fox jumps",
    "Return a new list containing all items from the iterable in ascending order",
    "hello",
    "Write a poem about the sea and the sky, with many words in it please",
]
EOS_PROMPT = "the the world"
"""Greedy decoding of this prompt ends with EOS after 10 tokens."""


async def wait_until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.005)


async def wait_idle(model: ChatModel, timeout: float = 5.0) -> None:
    await wait_until(lambda: not (model.active or model.queued), timeout)
    assert (model.active, model.queued) == (0, 0)


async def events_of(model: ChatModel, prompt: str | list[int], options: GenerationOptions) -> list[GenerationEvent]:
    return [event async for event in model.generate(prompt, options=options)]


def check_final(events: list[GenerationEvent], reason: str) -> None:
    """Exactly one final event, the last, with the given reason and usage."""
    assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + [reason]
    assert events[-1].usage is not None


# -- greedy decoding ------------------------------------------------------------------------


async def test_greedy_is_deterministic_and_matches_onnxruntime_genai(tiny: ChatModel) -> None:
    for prompt in PROMPTS[:3]:
        first = await tiny.generate(prompt, options=GREEDY).collect()
        second = await tiny.generate(prompt, options=GREEDY).collect()
        assert first == second
        _, tokens, reason, _ = first
        assert reason == "length" and len(tokens) == 40
        assert tokens == og_greedy(tiny.encode(prompt), len(tokens))
    # The fixture's known continuations (random weights: it wanders over the vocabulary).
    assert og_greedy(tiny.encode(PROMPTS[0]), 5) == [841, 133, 566, 404, 693]
    assert og_greedy(tiny.encode(PROMPTS[2]), 5) == [17, 210, 681, 46, 260]


async def test_greedy_up_to_eos_matches_onnxruntime_genai(tiny: ChatModel) -> None:
    events = await events_of(tiny, EOS_PROMPT, GREEDY)
    check_final(events, "stop")
    tokens = [e.token_id for e in events if e.token_id is not None]
    reference = og_greedy(tiny.encode(EOS_PROMPT), 40)
    # og stops after EOS and includes it; ortserve ends with a final event that carries no
    # token (the EOS id is never streamed) but counts it in usage.
    assert reference[-1] in tiny.eos_token_ids
    assert tokens == reference[:-1]
    assert events[-1].token_id is None
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == len(reference)
    assert "".join(e.text for e in events) == tiny.decode(tokens)


async def test_text_equals_decoded_tokens(tiny: ChatModel) -> None:
    text, tokens, _, usage = await tiny.generate(PROMPTS[0], options=GREEDY).collect()
    assert text == tiny.decode(tokens)
    assert usage.prompt_tokens == len(tiny.encode(PROMPTS[0]))
    assert usage.completion_tokens == len(tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_full_position_logits_give_the_same_tokens(tiny: ChatModel) -> None:
    registry = ModelRegistry(ModelConfig(last_position_logits=False))
    registry.add("tiny", TINY_MODEL)
    plain: ChatModel = await registry.get("tiny")
    for prompt in PROMPTS[:2]:
        assert (
            await plain.generate(prompt, options=GREEDY).collect()
            == await tiny.generate(prompt, options=GREEDY).collect()
        )
    await registry.close()


async def test_a_final_softcap_keeps_the_lm_head_on_the_gathered_positions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 2's final softcap follows the LM head (``Mul``, ``Tanh``, ``Mul`` in a GGUF
    folder): the positions are gathered in front of the head itself, so its 256k rows run
    on one position of a prompt, and the logits are the whole graph's at those positions."""
    monkeypatch.setenv("ORTSERVE_CACHE", str(tmp_path / "cache"))
    folder = converted_folder(write_tiny_gguf(tmp_path / "gemma2.gguf", arch="gemma2", qtype=Q.Q8_0))
    model_path = folder / "model.onnx"
    edited = onnx.load(str(model_path), load_external_data=False)
    session, last_only = open_session(model_path, edited, ort.SessionOptions(), "logits", last_only=True)
    assert last_only
    writers = {output: node for node in edited.graph.node for output in node.output}
    (gather,) = (node for node in edited.graph.node if LOGIT_POSITIONS in node.input)
    (head,) = (node for node in edited.graph.node if gather.output[0] in node.input)
    assert (head.op_type, head.name) == ("MatMulNBits", "/lm_head")
    chain, name = [], "logits"
    while writers[name] is not head:
        chain.append(writers[name].op_type)
        name = next(i for i in writers[name].input if i in writers)
    assert chain == ["Mul", "Tanh", "Mul"]  # the softcap, now on the gathered positions only

    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    ids = [258, 104, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.array([ids], np.int64),
        "attention_mask": np.ones((1, len(ids)), np.int64),
    }
    for i in range(decoder["num_hidden_layers"]):
        for kind in ("key", "value"):
            shape = (1, decoder["num_key_value_heads"], len(ids), decoder["head_size"])
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros(shape, np.float32)
    whole = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    for positions in ([-1], [3, 7, 11]):
        got = session.run(["logits"], {**feeds, LOGIT_POSITIONS: np.array(positions, np.int64)})[0]
        expected = whole[:, positions]
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() < 1e-4 * np.abs(expected).max()

    registries = [ModelRegistry(ModelConfig(last_position_logits=last)) for last in (True, False)]
    replies = []
    for registry in registries:
        registry.add("gemma2", folder)
        model: ChatModel = await registry.get("gemma2")
        replies.append(await model.generate(ids, options=GenerationOptions(max_tokens=12, temperature=0)).collect())
        await registry.close()
    assert replies[0] == replies[1]


async def test_max_tokens_gives_length_with_exactly_that_many(tiny: ChatModel) -> None:
    _, full, reason, _ = await tiny.generate(PROMPTS[0], options=GREEDY).collect()
    assert reason == "length" and not set(full) & tiny.eos_token_ids  # no EOS early: a real test
    for n in (1, 7, 40):
        events = await events_of(tiny, PROMPTS[0], GenerationOptions(max_tokens=n, temperature=0))
        check_final(events, "length")
        assert len(events) == n and all(e.token_id is not None for e in events)
        assert [e.token_id for e in events] == full[:n]
        assert events[-1].usage is not None and events[-1].usage.completion_tokens == n
    # Sampled too, with EOS held off so that nothing ends it early.
    events = await events_of(tiny, PROMPTS[1], GenerationOptions(max_tokens=25, min_tokens=25, seed=0))
    check_final(events, "length")
    assert len(events) == 25 and all(e.token_id is not None for e in events)


async def test_min_tokens_holds_off_eos(tiny: ChatModel) -> None:
    _, short, reason, usage = await tiny.generate(EOS_PROMPT, options=GREEDY).collect()
    assert reason == "stop" and len(short) == 10 and usage.completion_tokens == 11
    _, longer, reason, _ = await tiny.generate(
        EOS_PROMPT, options=GenerationOptions(max_tokens=20, min_tokens=20, temperature=0)
    ).collect()
    assert reason == "length" and len(longer) == 20
    assert longer[:10] == short  # the same until EOS would have come
    assert not set(longer) & tiny.eos_token_ids
    # EOS allowed again after min_tokens: greedy picks it at once where it is the argmax.
    _, early, reason, _ = await tiny.generate(
        EOS_PROMPT, options=GenerationOptions(max_tokens=40, min_tokens=5, temperature=0)
    ).collect()
    assert (early, reason) == (short, "stop")


# -- stop strings ---------------------------------------------------------------------------

STOP_PROMPT = PROMPTS[0]
STOP_OPTIONS = GenerationOptions(max_tokens=30, temperature=0)


async def unstopped(model: ChatModel) -> tuple[str, list[int], list[tuple[int, int]]]:
    """The greedy text, its tokens, and where each token's text lies in it."""
    events = await events_of(model, STOP_PROMPT, STOP_OPTIONS)
    check_final(events, "length")
    spans, at = [], 0
    for event in events:
        spans.append((at, at + len(event.text)))
        at += len(event.text)
    text = "".join(e.text for e in events)
    assert text == model.decode([e.token_id for e in events if e.token_id is not None])
    return text, [e.token_id for e in events if e.token_id is not None], spans


def first_occurrence(text: str, start: int, end: int) -> str | None:
    """``text[start:end]`` if that is where it first occurs (and it is plain text)."""
    stop = text[start:end]
    ok = stop.isascii() and stop.isprintable() and text.find(stop) == start
    return stop if ok else None


async def run_stopped(
    model: ChatModel, stops: tuple[str, ...], max_tokens: int = 30
) -> tuple[list[GenerationEvent], str]:
    options = GenerationOptions(max_tokens=max_tokens, temperature=0, stop=stops)
    events = await events_of(model, STOP_PROMPT, options)
    return events, "".join(e.text for e in events)


async def check_stop(model: ChatModel, stop: str, full: str, tokens: list[int], spans: list[tuple[int, int]]):
    """Generation stops at ``stop``: nothing from it on is emitted, on the right token."""
    start = full.index(stop)
    events, text = await run_stopped(model, (stop,))
    check_final(events, "stop")
    assert text == full[:start]
    emitted = ""
    for event in events:
        emitted += event.text
        assert stop not in emitted
    # It ended on the token that completed the stop string, which is the final event's token.
    last = next(i for i, (_, end) in enumerate(spans) if end >= start + len(stop))
    assert [e.token_id for e in events] == tokens[: last + 1]
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == last + 1
    return events


async def test_stop_inside_one_token(tiny: ChatModel) -> None:
    full, tokens, spans = await unstopped(tiny)
    stop, token = next(
        (s, i)
        for i, (a, b) in enumerate(spans)
        if i >= 3 and b - a >= 4 and (s := first_occurrence(full, a + 1, b - 1)) is not None
    )
    events = await check_stop(tiny, stop, full, tokens, spans)
    assert len(events) == token + 1  # the token whose text holds the stop ends the stream


async def test_stop_spanning_two_tokens(tiny: ChatModel) -> None:
    full, tokens, spans = await unstopped(tiny)
    i, stop = next(
        (i, s)
        for i in range(2, len(spans) - 1)
        if spans[i][1] - spans[i][0] >= 2
        and spans[i + 1][1] - spans[i + 1][0] >= 2
        and (s := first_occurrence(full, spans[i][1] - 2, spans[i][1] + 2)) is not None
    )
    events = await check_stop(tiny, stop, full, tokens, spans)
    assert len(events) == i + 2
    # While undecided, the first half of the stop was held back, not emitted.
    assert "".join(e.text for e in events[: i + 1]) == full[: spans[i][1] - 2]


async def test_stop_spanning_three_tokens(tiny: ChatModel) -> None:
    full, tokens, spans = await unstopped(tiny)
    i, stop = next(
        (i, s)
        for i in range(2, len(spans) - 2)
        if all(spans[j][1] > spans[j][0] for j in (i, i + 1, i + 2))
        and (s := first_occurrence(full, spans[i][1] - 1, spans[i + 1][1] + 1)) is not None
    )
    events = await check_stop(tiny, stop, full, tokens, spans)
    assert len(events) == i + 3


async def test_earliest_of_several_stops_wins(tiny: ChatModel) -> None:
    full, _, _ = await unstopped(tiny)
    early, late = full[10:13], full[25:29]
    assert full.index(early) < full.index(late)
    for stops in ((late, early), (early, late), ("\x00absent", late, early)):
        events, text = await run_stopped(tiny, stops)
        check_final(events, "stop")
        assert text == full[: full.index(early)]


async def test_a_stop_that_never_occurs_leaves_the_text_alone(tiny: ChatModel) -> None:
    full, tokens, _ = await unstopped(tiny)
    events, text = await run_stopped(tiny, ("\x00never", "zzzzzz"))
    check_final(events, "length")
    assert text == full and [e.token_id for e in events] == tokens


async def test_a_held_back_prefix_is_released_when_it_is_no_stop(tiny: ChatModel) -> None:
    full, tokens, spans = await unstopped(tiny)
    # Mid-text: the text of token 5 and more looks like the start of the stop, then is not.
    a, b = spans[5]
    stop = full[a:b] + "\x00"
    events, text = await run_stopped(tiny, (stop,))
    check_final(events, "length")
    assert text == full and [e.token_id for e in events] == tokens
    assert "".join(e.text for e in events[:6]) == full[:a]  # held back at token 5 ...
    assert "".join(e.text for e in events[:7]) == full[: spans[6][1]]  # ... released at token 6
    # At the end: the text ends like the start of the stop; the final event releases it.
    stop = full[-4:] + "\x00"
    events, text = await run_stopped(tiny, (stop,))
    check_final(events, "length")
    assert text == full
    assert events[-1].text.endswith(full[-4:]) and len(events[-1].text) >= 4


async def test_a_stop_on_the_last_allowed_token_is_a_stop(tiny: ChatModel) -> None:
    full, _, spans = await unstopped(tiny)
    stop = full[spans[9][0] : spans[9][1]]
    assert full.index(stop) == spans[9][0]
    events, text = await run_stopped(tiny, (stop,), max_tokens=10)
    check_final(events, "stop")
    assert text == full[: spans[9][0]] and len(events) == 10


async def test_stops_in_concurrent_requests_are_per_request(tiny: ChatModel) -> None:
    full, _, spans = await unstopped(tiny)
    stops = [full[spans[i][0] : spans[i][0] + 2] for i in (4, 8, 12)]
    stops = [s for s in stops if full.index(s) > 0]
    results = await asyncio.gather(*(run_stopped(tiny, (s,)) for s in stops))
    for stop, (_, text) in zip(stops, results, strict=True):
        assert text == full[: full.index(stop)]


# -- sampling options ------------------------------------------------------------------------


async def test_sampling_is_reproducible_with_a_seed(tiny: ChatModel) -> None:
    def opts(seed: int) -> GenerationOptions:
        return GenerationOptions(max_tokens=20, min_tokens=20, temperature=1.0, top_p=0.95, top_k=50, seed=seed)

    a = await tiny.generate(PROMPTS[0], options=opts(1)).collect()
    b = await tiny.generate(PROMPTS[0], options=opts(1)).collect()
    c = await tiny.generate(PROMPTS[0], options=opts(2)).collect()
    assert a == b
    assert a[1] != c[1]
    greedy = await tiny.generate(PROMPTS[0], options=GenerationOptions(max_tokens=20, temperature=0)).collect()
    assert a[1] != greedy[1]  # it really sampled
    # Seeded requests batched together still get their own streams of randomness.
    together = await asyncio.gather(*(tiny.generate(PROMPTS[0], options=opts(s)).collect() for s in (1, 2)))
    assert together == [a, c]


async def test_top_k_one_and_tiny_top_p_are_greedy(tiny: ChatModel) -> None:
    for prompt in PROMPTS[1:3]:
        greedy = await tiny.generate(prompt, options=GREEDY).collect()
        top1 = await tiny.generate(
            prompt, options=GenerationOptions(max_tokens=40, temperature=1.5, top_k=1, seed=3)
        ).collect()
        tiny_p = await tiny.generate(
            prompt, options=GenerationOptions(max_tokens=40, temperature=1.0, top_p=1e-6, seed=3)
        ).collect()
        assert top1 == greedy
        assert tiny_p == greedy


async def test_repetition_penalty_changes_greedy_output(tiny: ChatModel) -> None:
    _, plain, _, _ = await tiny.generate(PROMPTS[0], options=GREEDY).collect()
    assert len(set(plain)) < len(plain)  # greedy repeats itself on this prompt
    _, penalised, _, _ = await tiny.generate(
        PROMPTS[0], options=GenerationOptions(max_tokens=40, temperature=0, repetition_penalty=10.0)
    ).collect()
    assert penalised != plain
    first_repeat = next(i for i, t in enumerate(plain) if t in plain[:i] or t in tiny.encode(PROMPTS[0]))
    assert penalised[:first_repeat] == plain[:first_repeat]  # equal until a seen token would win


# -- batching and cancellation ----------------------------------------------------------------


def uncached(result: object) -> object:
    """A collected result with the prefix cache's share of the prompt left out of its usage
    (a repeated prompt is served from the cache: same tokens, cached_tokens > 0)."""
    if not isinstance(result, tuple):
        return result
    text, tokens, reason, usage = result
    return text, tokens, reason, (usage.prompt_tokens, usage.completion_tokens)


def varied_jobs(count: int) -> list[tuple[str, GenerationOptions]]:
    return [
        (f"{PROMPTS[i % 4]} {'and more ' * (i % 5)}{i}", GenerationOptions(max_tokens=5 + 3 * i, temperature=0))
        for i in range(count)
    ]


async def test_sixteen_concurrent_requests_get_what_they_get_alone(tiny: ChatModel) -> None:
    jobs = varied_jobs(16)
    before = tiny.engine.steps
    together = await asyncio.gather(*(tiny.generate(p, options=o).collect() for p, o in jobs))
    batched_steps = tiny.engine.steps - before
    alone = [await tiny.generate(p, options=o).collect() for p, o in jobs]
    serial_steps = tiny.engine.steps - before - batched_steps
    assert [uncached(r) for r in together] == [uncached(r) for r in alone]
    assert len({len(t[1]) for t in together}) > 5  # rows finished at different steps
    assert len({len(tiny.encode(p)) for p, _ in jobs}) > 5  # prompts of many lengths
    assert batched_steps < serial_steps / 2  # they really shared decode steps


async def test_cancelling_eight_in_flight_requests(tiny: ChatModel) -> None:
    reference = await tiny.generate(PROMPTS[0], options=GREEDY).collect()

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
    assert await tiny.generate(PROMPTS[0], options=GREEDY).collect() == reference
    # Tasks cancelled while waiting on their stream cancel the engine request too.
    tasks = [
        asyncio.create_task(
            tiny.generate(PROMPTS[1], options=GenerationOptions(max_tokens=900, min_tokens=900)).collect()
        )
        for _ in range(8)
    ]
    await wait_until(lambda: tiny.active == 8)
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    await wait_idle(tiny)
    assert await tiny.generate(PROMPTS[0], options=GREEDY).collect() == reference


async def test_cancelling_some_rows_leaves_the_others_exact(tiny: ChatModel) -> None:
    jobs = varied_jobs(12)
    alone = [await tiny.generate(p, options=o).collect() for p, o in jobs]

    async def run(i: int) -> object:
        prompt, options = jobs[i]
        if i % 3:
            return await tiny.generate(prompt, options=options).collect()
        stream = tiny.generate(prompt, options=GenerationOptions(max_tokens=500, min_tokens=500))
        async for event in stream:
            if i % 2:  # odd ones: leave after the first token
                await stream.aclose()
                return "left"
            stream.cancel()  # even ones: cancel and read on to the "cancelled" event
            if event.finish_reason is not None:
                return event.finish_reason
        return "no final event"

    results = await asyncio.gather(*(run(i) for i in range(12)))
    for i, result in enumerate(results):
        assert uncached(result) == (uncached(alone[i]) if i % 3 else ("left" if i % 2 else "cancelled"))
    await wait_idle(tiny)


async def test_cancel_gives_a_cancelled_event(tiny: ChatModel) -> None:
    stream = tiny.generate(PROMPTS[0], options=GenerationOptions(max_tokens=900, min_tokens=900))
    events = []
    async for event in stream:
        events.append(event)
        if len(events) == 2:
            stream.cancel()
    check_final(events, "cancelled")
    assert events[-1].usage is not None and 2 <= events[-1].usage.completion_tokens < 900
    await wait_idle(tiny)
    stream.cancel()  # after the end: nothing happens
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


async def test_cancelling_queued_requests() -> None:
    registry = ModelRegistry(ModelConfig(max_batch_size=2))
    registry.add("tiny", TINY_MODEL)
    model: ChatModel = await registry.get("tiny")
    long = GenerationOptions(max_tokens=900, min_tokens=900)
    running = [model.generate(PROMPTS[0], options=long) for _ in range(2)]
    for stream in running:
        await stream.__anext__()
    queued = model.generate(PROMPTS[1], options=long)
    waiting = asyncio.create_task(queued.__anext__())
    abandoned = asyncio.create_task(model.generate(PROMPTS[2], options=long).collect())
    await wait_until(lambda: model.queued == 2)
    assert model.active == 2
    queued.cancel()  # stream.cancel() while queued: a final event, no tokens
    final = await waiting
    assert final.finish_reason == "cancelled" and final.token_id is None
    assert final.usage is not None and final.usage.completion_tokens == 0
    abandoned.cancel()  # the consuming task is cancelled while its request is queued
    with pytest.raises(asyncio.CancelledError):
        await abandoned
    await wait_until(lambda: model.queued == 0)
    assert model.active == 2
    for stream in running:
        await stream.aclose()
    await wait_idle(model)
    assert (
        await model.generate(PROMPTS[0], options=GREEDY).collect()
        == await model.generate(PROMPTS[0], options=GREEDY).collect()
    )
    await registry.close()


def test_a_consumer_whose_event_loop_is_gone_frees_its_row() -> None:
    """A stream left unfinished when its asyncio loop ends must not keep its row forever."""
    model = load_chat_model("tiny", TINY_MODEL, ModelConfig())

    async def take_one() -> None:
        stream = model.generate("hello", options=GenerationOptions(max_tokens=1000, min_tokens=1000))
        await stream.__anext__()  # then the loop ends without aclose()

    try:
        asyncio.run(take_one())
        deadline = time.monotonic() + 5
        while model.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert model.active == 0
    finally:
        asyncio.run(model.close())


# -- typed errors and chat --------------------------------------------------------------------


async def test_chat_messages_use_the_template(tiny: ChatModel) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = tiny.apply_chat_template(messages)
    assert (
        prompt
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<|im_start|>user" in tiny.apply_chat_template([{"role": "user", "content": "x"}])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = tiny.apply_chat_template(messages, tools=tools)
    assert "<tools>" in with_tools and "</tools>" in with_tools and '"name": "get_weather"' in with_tools
    assert "<tools>" not in prompt
    by_messages = await tiny.generate(messages=messages, options=GREEDY).collect()
    by_ids = await tiny.generate(tiny.encode(prompt, add_special_tokens=False), options=GREEDY).collect()
    assert by_messages == by_ids
    assert by_messages[3].prompt_tokens == len(tiny.encode(prompt, add_special_tokens=False))
    with_tools_out = await tiny.generate(messages=messages, tools=tools, options=GREEDY).collect()
    assert with_tools_out[3].prompt_tokens == len(tiny.encode(with_tools, add_special_tokens=False))


@pytest.mark.parametrize(
    ("options", "param"),
    [
        (GenerationOptions(temperature=-1), "temperature"),
        (GenerationOptions(temperature=3), "temperature"),
        (GenerationOptions(temperature=math.nan), "temperature"),
        (GenerationOptions(top_p=0), "top_p"),
        (GenerationOptions(top_p=math.nan), "top_p"),
        (GenerationOptions(top_k=-1), "top_k"),
        (GenerationOptions(max_tokens=0), "max_tokens"),
        (GenerationOptions(max_tokens=3, min_tokens=4), "min_tokens"),
        (GenerationOptions(repetition_penalty=0), "repetition_penalty"),
        (GenerationOptions(stop=("",)), "stop"),
        (GenerationOptions(seed=-1), "seed"),
    ],
)
async def test_nonsense_options_are_refused(tiny: ChatModel, options: GenerationOptions, param: str) -> None:
    steps = tiny.engine.steps
    with pytest.raises(InvalidRequestError) as info:
        tiny.generate("hello", options=options)
    assert info.value.param == param
    assert tiny.engine.steps == steps and tiny.queued == 0


async def test_bad_prompts_are_refused_before_the_engine(tiny: ChatModel) -> None:
    steps = tiny.engine.steps
    for prompt in ("", []):
        with pytest.raises(InvalidRequestError, match="empty") as empty:
            tiny.generate(prompt)
        assert empty.value.param == "prompt"
    for bad in ([1, 2, tiny.vocab_size], [-1]):
        with pytest.raises(InvalidRequestError, match="vocabulary") as vocab:
            tiny.generate(bad)
        assert vocab.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="either"):
        tiny.generate("x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(InvalidRequestError, match="either"):
        tiny.generate()
    with pytest.raises(InvalidRequestError) as no_messages:
        tiny.generate(messages=[])
    assert no_messages.value.param == "messages"
    assert tiny.max_sequence_length == tiny.context_length == 1024  # the model's own limit
    with pytest.raises(ContextLengthError) as too_long:
        tiny.generate([5] * 1024)
    assert too_long.value.param == "prompt" and "1024" in str(too_long.value)
    with pytest.raises(ContextLengthError):
        tiny.generate("word " * 1100)
    with pytest.raises(ContextLengthError) as chat_too_long:
        tiny.generate(messages=[{"role": "user", "content": "word " * 1100}])
    assert chat_too_long.value.param == "messages"
    with pytest.raises(ContextLengthError) as too_many:
        tiny.generate([5] * 1000, options=GenerationOptions(max_tokens=100))
    assert too_many.value.param == "max_tokens"
    tiny.generate([5] * 1000, options=GenerationOptions(max_tokens=24))  # exactly fits: accepted
    assert tiny.engine.steps == steps


async def test_max_sequence_length_config_caps_the_context() -> None:
    registry = ModelRegistry(ModelConfig(max_sequence_length=64))
    registry.add("tiny", TINY_MODEL)
    model: ChatModel = await registry.get("tiny")
    with pytest.raises(ContextLengthError, match="64"):
        model.generate("word " * 70)
    with pytest.raises(ContextLengthError, match="64") as info:
        model.generate("hello", options=GenerationOptions(max_tokens=64))
    assert info.value.param == "max_tokens"
    room = 64 - len(model.encode("hello"))
    options = GenerationOptions(temperature=0, min_tokens=room)  # no max_tokens: whatever fits
    _, tokens, reason, _ = await model.generate("hello", options=options).collect()
    assert reason == "length" and len(tokens) == room
    await registry.close()


async def test_a_closed_model_refuses_work() -> None:
    registry = ModelRegistry(ModelConfig(max_batch_size=1))
    registry.add("tiny", TINY_MODEL)
    model: ChatModel = await registry.get("tiny")
    pending = model.generate("hello", options=GenerationOptions(max_tokens=900, min_tokens=900))
    await pending.__anext__()
    queued = asyncio.create_task(model.generate("queued", options=GREEDY).collect())
    await wait_until(lambda: model.queued == 1)
    not_started = model.generate("hello")  # created before the close, consumed after it
    await registry.unload("tiny")
    with pytest.raises(EngineClosedError):
        async for _ in pending:
            pass
    with pytest.raises(EngineClosedError):
        await queued
    with pytest.raises(EngineClosedError):
        await not_started.collect()
    with pytest.raises(EngineClosedError):
        model.generate("hello")


async def test_grammar_constrains_the_output(tiny: ChatModel) -> None:
    regex = GenerationOptions(max_tokens=50, temperature=1.0, seed=4, grammar=Grammar("regex", r"[a-c]{2}\d{2,3}"))
    text, _, reason, _ = await tiny.generate("pick", options=regex).collect()
    assert reason == "stop"
    assert re.fullmatch(r"[a-c]{2}\d{2,3}", text)
    with pytest.raises(InvalidRequestError) as info:
        tiny.generate("x", options=GenerationOptions(grammar=Grammar("regex", "(unclosed")))
    assert info.value.param == "grammar"
    with pytest.raises(InvalidRequestError, match="schema"):
        tiny.generate("x", options=GenerationOptions(grammar=Grammar("json_schema", {"type": 5})))


async def chunked(chunk: int, max_batch_size: int = 8) -> tuple[ModelRegistry, ChatModel]:
    registry = ModelRegistry(ModelConfig(prefill_chunk_tokens=chunk, max_batch_size=max_batch_size))
    registry.add("tiny", TINY_MODEL)
    return registry, await registry.get("tiny")


async def test_chunked_prefill_gives_the_same_tokens(tiny: ChatModel) -> None:
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


async def test_cancel_before_the_first_read(tiny: ChatModel) -> None:
    steps = tiny.engine.steps
    stream = tiny.generate(PROMPTS[0], options=GenerationOptions(max_tokens=50))
    stream.cancel()
    events = [event async for event in stream]
    assert [(e.finish_reason, e.token_id) for e in events] == [("cancelled", None)]
    assert tiny.engine.steps == steps and tiny.active == 0  # it never reached the engine


async def test_background_requests_wait_behind_interactive_ones_and_give_their_rows_up() -> None:
    """A batch's lines (``background``) queue after interactive requests, and on ort-cpu one
    gives its row up as soon as an interactive request waits with every row taken."""
    registry = ModelRegistry(ModelConfig(max_batch_size=2))
    registry.add("tiny", TINY_MODEL)
    model: ChatModel = await registry.get("tiny")
    alone = await model.generate(PROMPTS[2], options=GREEDY).collect()
    long = GenerationOptions(max_tokens=900, min_tokens=900, background=True)
    rows = [model.generate(PROMPTS[0], options=long) for _ in range(2)]
    for stream in rows:
        await stream.__anext__()
    # The tiny model decodes 900 tokens in well under a second: the engine's lock holds its
    # thread between two steps while both rows run, and the two requests arrive together.
    with model.engine._cond:  # type: ignore[attr-defined]
        assert model.active == 2
        queued_line = asyncio.create_task(model.generate(PROMPTS[1], options=long).collect())
        interactive = asyncio.create_task(model.generate(PROMPTS[2], options=GREEDY).collect())
        await wait_until(lambda: model.queued == 2)
    assert await interactive == alone
    outcomes = []
    for stream in rows:
        try:
            outcomes.append((await stream.collect())[2])
        except PreemptedError as exc:
            assert "interactive" in str(exc)
            outcomes.append("preempted")
    assert sorted(outcomes) == ["length", "preempted"], outcomes
    assert (await queued_line)[2] == "length"  # it waited behind the interactive one, then ran
    await registry.close()


async def test_a_background_prompt_going_in_makes_way_for_an_interactive_one() -> None:
    """An interactive request that arrives while a background prompt is being prefilled goes
    in after that prompt's current chunk; the background one is parked (what it prefilled
    kept in the prefix cache) and resumed, and both give the tokens they give alone."""
    registry = ModelRegistry(ModelConfig(max_batch_size=3))
    registry.add("tiny", TINY_MODEL)
    model: ChatModel = await registry.get("tiny")
    long_prompt = " ".join(PROMPTS) * 8  # several 32-token chunks
    background = GenerationOptions(max_tokens=12, temperature=0, background=True)
    alone = await model.generate(PROMPTS[3], options=GREEDY).collect()
    line_alone = await model.generate(long_prompt, options=background).collect()
    await registry.unload("tiny")
    model = await registry.get("tiny")  # an empty prefix cache
    engine = model.engine  # type: ignore[attr-defined]
    # The one interleaving that matters, made certain: the engine holds on after the first
    # chunk of the background prompt until the interactive request is queued.
    first_chunk, queued = threading.Event(), threading.Event()
    prefill_chunk = engine._prefill_chunk

    def held_prefill_chunk(request: Any, chunk: int | None = None) -> Any:
        logits = prefill_chunk(request, chunk)
        if request.options.background and not first_chunk.is_set():
            first_chunk.set()
            queued.wait(10)
        return logits

    engine._prefill_chunk = held_prefill_chunk
    line = asyncio.create_task(model.generate(long_prompt, options=background).collect())
    await wait_until(first_chunk.is_set)
    interactive = asyncio.create_task(model.generate(PROMPTS[3], options=GREEDY).collect())
    await wait_until(lambda: model.queued == 1)
    queued.set()
    assert await interactive == alone
    assert engine.background_yields == 1
    assert (await line)[:3] == line_alone[:3]
    await registry.close()
