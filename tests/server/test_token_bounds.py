"""Seventeenth probe, issue 45 (F4): text far past the context is refused without building
all its tokens. A byte-level BPE spells U+E0041 as 4 tokens, so the bound in characters
(the context in the longest tokens) let 240,000 of them through on the tiny Gemma 4 (4,096
tokens): 960,000 tokens were built, and the prompt paths held the GIL meanwhile, before the
context check refused them (or /v1/tokenize sent them all, and a ``prediction`` was taken).
Now the text is counted a window at a time, and counting stops past the context."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, closing, rss_growth, running

GEMMA4 = TINY_MODEL.parent / "tiny-gemma4"  # 4,096 tokens; byte-level: U+E0041 is 4 tokens
RARE = "\U000e0041" * 240_000  # 960,000 tokens, under the bound in characters (245,760)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running(create_app(ServerConfig(models={"gemma": GEMMA4}))) as base:
        yield base


def _chat(content: str, **more: Any) -> dict[str, Any]:
    return {"model": "gemma", "max_tokens": 1, "messages": [{"role": "user", "content": content}], **more}


CASES = [
    ("/v1/completions", {"model": "gemma", "max_tokens": 1, "prompt": RARE}, "prompt"),
    ("/v1/tokenize", {"model": "gemma", "prompt": RARE}, "prompt"),
    ("/v1/tokenize", {"model": "gemma", "messages": [{"role": "user", "content": RARE}]}, "messages"),
    ("/v1/chat/completions", _chat(RARE), "messages"),
    ("/v1/chat/completions", _chat("hi", prediction={"type": "content", "content": RARE}), "prediction"),
]


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_text_of_many_tokens_a_character_is_refused_counting_a_window_at_a_time(
    url: str, path: str, body: dict[str, Any], param: str
) -> None:
    with rss_growth() as grown:  # the server runs in this process
        refused = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param, error
    assert "more than this model's limit of 4096 tokens" in error["message"], error
    print(f"{path} {param}: +{grown[0] >> 20} MiB")
    assert grown[0] < 96 << 20, grown[0] >> 20  # 960,000 tokens built whole: +150 MiB and more


def test_the_bound_refuses_nothing_that_fits(url: str) -> None:
    """Text that fits is taken however it is spelt, through the SDKs: just under the
    context in rare characters, and a long prediction of plain words within it."""
    client = closing(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))
    fits = "\U000e0041" * 1000  # 4,000 tokens
    counted = httpx.post(f"{url}/v1/tokenize", json={"model": "gemma", "prompt": fits}, timeout=60).json()
    assert 4000 <= counted["count"] <= 4096, counted.get("count")
    document = httpx.post(f"{url}/v1/tokenize", json={"model": "gemma", "prompt": "word " * 6000}, timeout=60).json()
    assert document["count"] >= 12_000  # past the context: a document to count or cut into windows
    rare = httpx.post(f"{url}/v1/tokenize", json={"model": "gemma", "prompt": "\U000e0041" * 50_000}, timeout=60)
    assert rare.status_code == 400 and "more than the limit of 131072 tokens" in rare.text, rare.text[:300]
    words = "word " * 1500  # 3,000 tokens
    completion = client.completions.create(model="gemma", prompt=words, max_tokens=1)
    assert completion.usage is not None and completion.usage.prompt_tokens >= 3000
    chat = client.chat.completions.create(
        model="gemma",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=1,
        prediction={"type": "content", "content": words},
    )
    assert chat.choices[0].finish_reason == "length"
    too_long = "word " * 2500  # 5,000 tokens of prediction: more than the context holds
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="gemma",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            prediction={"type": "content", "content": too_long},
        )
    assert refused.value.body["param"] == "prediction"  # type: ignore[index]


def test_anthropic_messages_past_the_context_are_refused(url: str) -> None:
    client = closing(anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0))
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="gemma", max_tokens=1, messages=[{"role": "user", "content": RARE}])
    assert "4096 tokens" in str(refused.value)
