"""Reasoning models through the openai SDK on a real server: thinking as
``reasoning_content``/``reasoning`` (whole and streamed), ``chat_template_kwargs`` and
grammars that hold for the answer only. The fixture's template opens ``<think>`` in the
generation prompt, so the random model's output is reasoning until it closes the block
(it never does by itself): thinking off is how a test gets an answer."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

THINK_MODEL = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-qwen3-think"
HELLO = [{"role": "user", "content": "Tell me about the iterable in sorted order"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    config = ServerConfig(
        models={"think": THINK_MODEL, "tiny": TINY_MODEL},
        model_config=ModelConfig(max_batch_size=4, max_sequence_length=512),
    )
    with running(create_app(config)) as url, openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c:
        yield c


def test_thinking_is_reasoning_not_content(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="think", messages=HELLO, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    message = reply.choices[0].message
    extra = message.model_extra or {}
    assert extra["reasoning_content"] and extra["reasoning"] == extra["reasoning_content"]
    assert message.content == ""
    assert reply.choices[0].finish_reason == "length"


def test_streamed_reasoning_equals_whole(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="think", messages=HELLO, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    thought, content, both = "", "", True
    for chunk in client.chat.completions.create(
        model="think",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        stream=True,
    ):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if "reasoning_content" in extra:
                thought += extra["reasoning_content"]
                both = both and extra.get("reasoning") == extra["reasoning_content"]
            content += choice.delta.content or ""
    assert both and thought == (whole.choices[0].message.model_extra or {})["reasoning_content"]
    assert content == ""


def test_thinking_off_through_chat_template_kwargs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="think",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        extra_body=OFF,
    )
    message = reply.choices[0].message
    assert message.content and "reasoning_content" not in (message.model_extra or {})
    usage_on = client.chat.completions.create(model="think", messages=HELLO, max_tokens=1).usage  # type: ignore[arg-type]
    assert reply.usage is not None and usage_on is not None
    # The template rendered the empty "<think>\n\n</think>\n\n" block instead of "<think>\n".
    assert reply.usage.prompt_tokens > usage_on.prompt_tokens


def test_regex_holds_for_the_answer_when_thinking_is_off(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="think",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=20,
        extra_body={**OFF, "guided_regex": "[0-9]{3}"},
    )
    assert re.fullmatch("[0-9]{3}", reply.choices[0].message.content or "")


def test_regex_leaves_the_reasoning_free(client: openai.OpenAI) -> None:
    # Thinking on: the block is open, so the constraint waits for "</think>"; the random
    # model never writes it, so its (unconstrained) text stays reasoning to max_tokens.
    reply = client.chat.completions.create(
        model="think",
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        extra_body={"guided_regex": "[0-9]{3}"},
    )
    free = client.chat.completions.create(model="think", messages=HELLO, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    thought = (reply.choices[0].message.model_extra or {})["reasoning_content"]
    assert thought == (free.choices[0].message.model_extra or {})["reasoning_content"]
    assert not re.fullmatch("[0-9]*", thought)


def test_reasoning_effort_and_earlier_reasoning_are_accepted(client: openai.OpenAI) -> None:
    history = [
        *HELLO,
        {"role": "assistant", "content": "yes", "reasoning_content": "thought"},
        {"role": "user", "content": "more"},
    ]
    reply = client.chat.completions.create(
        model="think",
        messages=history,  # type: ignore[arg-type]
        max_tokens=3,
        reasoning_effort="low",
    )
    assert reply.choices[0].finish_reason == "length"


def test_a_model_without_thinking_markup_has_no_reasoning_fields(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=4)  # type: ignore[arg-type]
    assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})
