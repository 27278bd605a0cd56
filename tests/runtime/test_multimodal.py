"""The multimodal model (tiny random Phi-3-vision with the real Phi-3-vision tokenizer)."""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime_genai as og
import pytest
from images import TINY_PHI3V, image_bytes
from ortserve_runtime import (
    AudioInput,
    ChatModel,
    EngineClosedError,
    EngineError,
    GenerationOptions,
    Grammar,
    ImageInput,
    InvalidRequestError,
    ModelConfig,
    ModelLoadError,
    ModelRegistry,
    detect_model_kind,
)

pytestmark = pytest.mark.anyio
GREEDY = GenerationOptions(max_tokens=8, temperature=0)


@pytest.fixture
async def vision() -> AsyncIterator[ChatModel]:
    registry = ModelRegistry(ModelConfig(multimodal_concurrency=2, max_images=2))
    registry.add("vision", TINY_PHI3V)
    model: ChatModel = await registry.get("vision")
    yield model
    await registry.close()


def ask(*parts: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, "What is in the picture?"]}]


async def test_loaded_as_a_multimodal_generative_model(vision: ChatModel) -> None:
    assert detect_model_kind(TINY_PHI3V) == "generative"
    assert isinstance(vision, ChatModel) and vision.modalities == frozenset({"image"})
    assert vision.engine.name == "og-generator" and vision.engine.capabilities.media
    text = vision.apply_chat_template(ask(ImageInput(b"not decoded here"), ImageInput(b"nor here")))
    assert text == "<|user|>\n<|image_1|>\n<|image_2|>\nWhat is in the picture?<|end|>\n<|assistant|>\n"


async def test_same_tokens_as_onnxruntime_genai(vision: ChatModel) -> None:
    """Host-side greedy sampling gives what og's own generator gives for the same prompt."""
    png = image_bytes(colour=(10, 200, 90))
    prompt = await vision.aprepare_chat(ask(ImageInput(png)))
    _, tokens, reason, usage = await vision.generate(prompt, options=GREEDY).collect()
    assert reason == "length" and usage.prompt_tokens == len(prompt) > 300

    def reference() -> list[int]:
        model = og.Model(str(TINY_PHI3V))
        processor = model.create_multimodal_processor()
        text = vision.apply_chat_template(ask(ImageInput(png)))
        inputs = processor(text, images=og.Images.open_bytes(png))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + 8, do_sample=False)
        generator = og.Generator(model, params)
        generator.set_inputs(inputs)
        out = []
        for _ in range(8):
            generator.generate_next_token()
            out.append(int(generator.get_next_tokens()[0]))
        return out

    assert tokens == await asyncio.to_thread(reference)


async def test_a_finished_requests_media_are_dropped_without_a_collection(vision: ChatModel) -> None:
    """Twenty-fifth probe, issue 45: an ended request and its stream held each other, so the
    og process kept every ended request's processed images until a full garbage collection
    (+73.5 MiB a request of eight 6-megapixel images, to 1,989 MiB). With the collector
    off, none is left once the request and its prompt are done with."""
    import gc

    from ortserve_runtime._og_process import RemoteMedia

    gc.collect()
    gc.disable()
    try:
        for colour in ((10, 20, 30), (200, 100, 0)):
            prompt = await vision.aprepare_chat(ask(ImageInput(image_bytes(colour=colour))))
            await vision.generate(prompt, options=GREEDY).collect()
            stream = vision.generate(prompt, options=GREEDY)
            await anext(stream)
            await stream.aclose()  # a client that leaves
            del prompt, stream
        assert not [o for o in gc.get_objects() if isinstance(o, RemoteMedia)]
    finally:
        gc.enable()


async def test_stops_and_grammar_behave_as_for_text_models(vision: ChatModel) -> None:
    prompt = await vision.aprepare_chat(ask(ImageInput(image_bytes())))
    text, _, _, _ = await vision.generate(prompt, options=GenerationOptions(max_tokens=12, temperature=0)).collect()
    stop = text[3:6]
    cut, _, reason, _ = await vision.generate(
        prompt, options=GenerationOptions(max_tokens=12, temperature=0, stop=(stop,))
    ).collect()
    assert reason == "stop" and cut == text[: text.index(stop)]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    schema["x-guidance"] = {"whitespace_flexible": False}
    options = GenerationOptions(max_tokens=40, temperature=0, grammar=Grammar("json_schema", schema))
    answer, _, reason, _ = await vision.generate(prompt, options=options).collect()
    assert reason == "stop" and isinstance(json.loads(answer)["n"], int)


async def test_concurrency_is_bounded_and_cancel_frees_the_slot(vision: ChatModel) -> None:
    prompt = await vision.aprepare_chat(ask(ImageInput(image_bytes())))
    streams = [vision.generate(prompt, options=GenerationOptions(max_tokens=1500, temperature=0)) for _ in range(3)]
    firsts = await asyncio.gather(*(anext(s) for s in streams[:2]))
    assert all(e.token_id is not None for e in firsts)
    waiting = asyncio.ensure_future(anext(streams[2]))
    await asyncio.sleep(0.2)
    assert vision.active == 2 and vision.queued == 1 and not waiting.done()
    streams[0].cancel()
    async for event in streams[0]:
        if event.finish_reason is not None:
            assert event.finish_reason == "cancelled"
    assert (await waiting).token_id is not None  # the freed slot went to the waiting request
    for stream in streams[1:]:
        await stream.aclose()
    _, tokens, _, _ = await vision.generate(prompt, options=GREEDY).collect()
    assert len(tokens) == 8


@pytest.mark.parametrize(
    ("parts", "param", "words"),
    [
        ([ImageInput(b"\x89PNG\r\n\x1a\n broken")], "messages[0].content[0]", "could not be decoded"),
        ([ImageInput(image_bytes(fmt="BMP")[:40])], "messages[0].content[0]", "could not be decoded"),
        ([ImageInput(b"")], "messages[0].content[0]", "empty"),
        ([ImageInput(image_bytes())] * 3, "messages", "at most 2"),
        (["hi ", AudioInput(b"RIFF")], "messages[0].content[1]", "does not take audio"),
    ],
)
async def test_bad_media(vision: ChatModel, parts: list[Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        await vision.aprepare_chat(ask(*parts))
    assert info.value.param == param and words in str(info.value)


async def test_decompression_bombs_are_refused_before_decoding(vision: ChatModel) -> None:
    from PIL import Image

    huge = Image.new("1", (6000, 6000))  # 36 Mpixels, a few kB as PNG
    buffer = io.BytesIO()
    huge.save(buffer, format="PNG")
    with pytest.raises(InvalidRequestError, match="6000x6000 pixels"):
        await vision.aprepare_chat(ask(ImageInput(buffer.getvalue())))


async def test_text_prompts_and_token_ids_work_too(vision: ChatModel) -> None:
    text, _, _, usage = await vision.generate("Hello", options=GREEDY).collect()
    assert text and usage.completion_tokens == 8
    ids = vision.encode("Hello")
    _, tokens, _, _ = await vision.generate(ids, options=GREEDY).collect()
    assert len(tokens) == 8 and np.all(np.asarray(tokens) >= 0)


async def test_an_unknown_multimodal_type_is_refused_at_load(tmp_path: Path) -> None:
    folder = tmp_path / "llava"
    shutil.copytree(TINY_PHI3V, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["type"] = "llava"
    (folder / "genai_config.json").write_text(json.dumps(config))
    registry = ModelRegistry()
    registry.add("llava", folder)
    with pytest.raises(ModelLoadError, match="multimodal or encoder-decoder model \\(llava\\)"):
        await registry.get("llava")
    assert registry.status()[0].state == "error"


async def test_an_onnxruntime_failure_fails_that_request_only(
    vision: ChatModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: object) -> None:
        raise RuntimeError("onnxruntime said no")

    monkeypatch.setattr(vision.engine, "_step", broken)
    with pytest.raises(EngineError, match="onnxruntime said no") as info:
        await vision.generate("Hello", options=GREEDY).collect()
    assert not isinstance(info.value, EngineClosedError)  # a 500, not "shutting down"
    monkeypatch.undo()
    assert len((await vision.generate("Hello", options=GREEDY).collect())[1]) == 8


def test_what_reaches_onnxruntime_genai() -> None:
    """PNGs Pillow reads whole pass as they are; everything else becomes a PNG (never JPEG:
    onnxruntime-genai's JPEG decoder exits the process on errors)."""
    from ortserve_runtime._images import png_for_og

    png = image_bytes()
    assert png_for_og(png, max_pixels=10_000, param="p") == png
    for fmt in ("JPEG", "BMP", "WEBP"):
        converted = png_for_og(image_bytes(fmt=fmt), max_pixels=10_000, param="p")
        assert converted.startswith(b"\x89PNG\r\n\x1a\n"), fmt
    with pytest.raises(InvalidRequestError, match="could not be decoded"):
        png_for_og(png[: len(png) // 2], max_pixels=10_000, param="p")


def _hold_prefills(vision: ChatModel, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Prefills wait on the prefill thread until the returned event is set."""
    gate = threading.Event()
    prefill = vision.engine._prefill

    def held_prefill(request: Any) -> Any:
        gate.wait(30)
        return prefill(request)

    monkeypatch.setattr(vision.engine, "_prefill", held_prefill)
    return gate


async def test_streams_keep_flowing_while_an_image_prompt_goes_in(
    vision: ChatModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the prefill on the owner thread, the running stream would make no progress
    # while the new prompt goes in, and the wait below would time out.
    running = vision.generate("Hello", options=GenerationOptions(max_tokens=1500, temperature=0))
    await anext(running)
    gate = _hold_prefills(vision, monkeypatch)
    prompt = await vision.aprepare_chat(ask(ImageInput(image_bytes())))
    waiting = asyncio.ensure_future(anext(vision.generate(prompt, options=GREEDY)))

    async def progress_while_prefilling() -> None:
        while vision.active < 2:  # the new request is on the prefill thread
            await anext(running)
        for _ in range(5):
            await anext(running)

    await asyncio.wait_for(progress_while_prefilling(), timeout=10)
    gate.set()
    assert (await waiting).token_id is not None
    running.cancel()


async def test_cancelled_during_its_prefill(vision: ChatModel, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = _hold_prefills(vision, monkeypatch)
    prompt = await vision.aprepare_chat(ask(ImageInput(image_bytes())))
    stream = vision.generate(prompt, options=GREEDY)
    waiting = asyncio.ensure_future(anext(stream))
    while vision.active < 1:
        await asyncio.sleep(0.01)
    stream.cancel()
    gate.set()
    assert (await waiting).finish_reason == "cancelled"
    assert vision.active == 0
    assert len((await vision.generate(prompt, options=GREEDY).collect())[1]) == 8


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda f: (f / "vision.onnx").write_bytes(b"not onnx"), "could not be loaded by onnxruntime-genai"),
        (lambda f: (f / "processor_config.json").unlink(), "could not be loaded by onnxruntime-genai"),
        (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json does not exist"),
    ],
)
async def test_a_broken_folder_is_a_load_error_naming_it(tmp_path: Path, damage: Any, words: str) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(TINY_PHI3V, folder)
    damage(folder)
    registry = ModelRegistry()
    registry.add("broken", folder)
    with pytest.raises(ModelLoadError, match=words) as info:
        await registry.get("broken")
    assert str(folder) in str(info.value)


async def test_processed_images_wait_for_room_while_the_engine_is_busy(vision: ChatModel) -> None:
    """Issue 45: the og process kept every queued request's processed images (twelve
    25-megapixel ones: +720 MiB while they waited for the engine's two slots). It keeps
    those of prompts alive up to the engine's concurrency plus the two being decoded; the
    next waits until a prompt is gone. Text alone takes no room."""
    first = [await vision.aprepare_chat(ask(ImageInput(image_bytes(colour=(i, 0, 0))))) for i in range(4)]
    text_only = await asyncio.wait_for(vision.aprepare_chat([{"role": "user", "content": "hi"}]), 30)
    assert len(text_only) > 0
    waiting = asyncio.ensure_future(vision.aprepare_chat(ask(ImageInput(image_bytes(colour=(9, 9, 9))))))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    _, tokens, _, _ = await vision.generate(first.pop(), options=GREEDY).collect()  # then the prompt is gone
    assert len(tokens) == 8
    fifth = await asyncio.wait_for(waiting, 30)
    _, tokens, _, _ = await vision.generate(fifth, options=GREEDY).collect()
    assert len(tokens) == 8
