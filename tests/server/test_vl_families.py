"""Qwen2.5-VL and Qwen3-VL with images through a real server and the openai SDK, against
onnxruntime-genai's own processor and generator on the same prompt (tiny random models:
see ``build_qwen_vl`` in tests/fixtures/build_fixtures.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime_genai as og
import openai
import pytest
from images import image_bytes, image_part
from ortserve_server import ServerConfig, create_app
from serving import running
from tokenizers import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
FAMILIES = {"qwen2.5-vl": FIXTURES / "tiny-qwen2.5-vl", "qwen3-vl": FIXTURES / "tiny-qwen3-vl"}
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
RED, BLUE = image_bytes(64, 48, (220, 20, 20)), image_bytes(40, 72, (20, 20, 220))


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with (
        running(create_app(ServerConfig(models=FAMILIES))) as base,
        openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client,
    ):
        yield client


def og_reply(folder: Path, text: str, images: list[bytes], n: int) -> tuple[str, int]:
    """og's greedy reply to ``text`` with ``images`` (its own processor and generator loop),
    decoded as the server decodes, and the prompt's length in tokens."""
    model = og.Model(str(folder))
    processor = model.create_multimodal_processor()
    inputs = processor(text, images=og.Images.open_bytes(*images) if images else None)
    prompt = inputs["input_ids"].as_numpy().size
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=prompt + n, do_sample=False)
    generator = og.Generator(model, params)
    generator.set_inputs(inputs)
    out: list[int] = []
    while not generator.is_done() and len(out) < n:
        generator.generate_next_token()
        out.append(int(generator.get_next_tokens()[0]))
    ends = np.isin(out, [1019, 1021])  # <|endoftext|>, <|im_end|>: the server does not send them
    if ends.any():
        out = out[: int(np.argmax(ends))]
    return Tokenizer.from_file(str(folder / "tokenizer.json")).decode(out), prompt


def chat(client: openai.OpenAI, family: str, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=family,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=kwargs.pop("max_tokens", 10),
        temperature=0,
        **kwargs,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_images_anywhere_in_the_conversation_give_og_s_reply(client: openai.OpenAI, family: str) -> None:
    """Two images in the first turn (before and between text), one in a later turn."""
    messages = [
        {
            "role": "user",
            "content": [
                image_part(RED),
                {"type": "text", "text": "and"},
                image_part(BLUE),
                {"type": "text", "text": "Compare them."},
            ],
        },
        {"role": "assistant", "content": "They differ."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, image_part(RED)]},
    ]
    reply = chat(client, family, messages)
    text = (
        f"{SYSTEM}<|im_start|>user\n{VISION}and{VISION}Compare them.<|im_end|>\n"
        f"<|im_start|>assistantThey differ.<|im_end|>\n"  # the fixtures' template drops that newline
        f"<|im_start|>user\nAnd this one?{VISION}<|im_end|>\n<|im_start|>assistant\n"
    )
    expected, prompt_tokens = og_reply(FAMILIES[family], text, [RED, BLUE, RED], 10)
    assert reply.choices[0].message.content == expected
    assert reply.usage is not None and reply.usage.prompt_tokens == prompt_tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_sees_the_images_and_their_order(client: openai.OpenAI, family: str) -> None:
    def ask(*images: bytes) -> str | None:
        parts = [*(image_part(image) for image in images), {"type": "text", "text": "What is this?"}]
        return chat(client, family, [{"role": "user", "content": parts}]).choices[0].message.content

    red, blue = ask(RED), ask(BLUE)
    assert red != blue and ask(RED) == red
    assert ask(RED, BLUE) != ask(BLUE, RED)
    text_only = chat(client, family, [{"role": "user", "content": "What is this?"}])
    expected, _ = og_reply(
        FAMILIES[family], f"{SYSTEM}<|im_start|>user\nWhat is this?<|im_end|>\n<|im_start|>assistant\n", [], 10
    )
    assert text_only.choices[0].message.content == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_and_responses_api_answers_match(client: openai.OpenAI, family: str) -> None:
    parts = [image_part(BLUE), {"type": "text", "text": "Describe it."}]
    whole = chat(client, family, [{"role": "user", "content": parts}]).choices[0].message.content
    stream = chat(client, family, [{"role": "user", "content": parts}], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    response = client.responses.create(
        model=family,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": parts[0]["image_url"]["url"], "detail": "auto"},  # type: ignore[index]
                    {"type": "input_text", "text": "Describe it."},
                ],
            }
        ],
        max_output_tokens=10,
        temperature=0,
    )
    assert response.output_text == whole


def test_models_list_the_families_as_image_models(client: openai.OpenAI) -> None:
    models = {m.id: m for m in client.models.list()}
    for family in FAMILIES:
        extra = models[family].model_extra or {}
        assert extra.get("engine") == "og-generator" and extra.get("input_modalities") == ["text", "image"], extra
