"""``echo`` on ``/v1/completions`` through the openai SDK: the prompt's text before the
completion's and, with ``logprobs``, its tokens scored first (the first one ``null``), as
lm-evaluation-harness's ``local-completions`` asks (``echo=True, max_tokens=0,
logprobs=1``); streamed with the prompt in the first chunk; refused by name where the
engine cannot score a prompt (og-generator)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from og_reference import og_greedy, prompt_logprobs
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

PROMPT = "Tell me about the iterable in sorted order, and"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = ServerConfig(
        models={"tiny": TINY_MODEL, "og": TINY_MODEL}, model_configs={"og": ModelConfig(engine="og-generator")}
    )
    with running(create_app(config)) as base:
        yield base


def _ids(url: str, text: str) -> list[int]:
    ids: list[int] = httpx.post(f"{url}/v1/tokenize", json={"model": "tiny", "prompt": text}).json()["tokens"]
    return ids


def _check_shape(lp: Any, text: str, count: int) -> None:
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == count
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    rest = zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], lp.text_offset[1:], strict=True)
    previous = lp.tokens[0]
    for token, logprob, top, offset in rest:
        assert -9999.0 <= logprob <= 0 and top[token] == logprob  # the chosen token is always among its top
        if not (token.startswith("bytes:") or previous.startswith("bytes:")):  # not one of split characters
            assert text[offset:].startswith(token)
        previous = token


def test_echo_scores_the_prompt_alone_as_the_whole_graph_does(client: openai.OpenAI, url: str) -> None:
    """lm-evaluation-harness's loglikelihood request: the prompt back, its tokens scored."""
    result = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    choice = result.choices[0]
    ids = _ids(url, PROMPT)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(ids), 0)
    lp = choice.logprobs
    _check_shape(lp, PROMPT, len(ids))
    assert "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[1:] == pytest.approx(prompt_logprobs(ids), abs=1e-4)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])  # the best one, and the token's own
    zero = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, logprobs=0)
    assert [list(top) if top else None for top in zero.choices[0].logprobs.top_logprobs] == [None] + [
        [t] for t in lp.tokens[1:]
    ]
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs  # the same request but for its top


def test_echoed_logprobs_of_generated_tokens_are_their_logprobs(client: openai.OpenAI, url: str) -> None:
    """Greedy tokens generated after a token-id prompt, then that prompt and those tokens
    (their ids as onnxruntime-genai's greedy search makes them, the same tokens) echoed:
    each generated token scores the same in the prompt as it did when generated."""
    ids = _ids(url, PROMPT)
    generated = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0, logprobs=0)
    choice = generated.choices[0]
    count = generated.usage.completion_tokens
    assert count == 8
    extended = ids + og_greedy(ids, count)
    echoed = client.completions.create(model="tiny", prompt=extended, echo=True, max_tokens=0, logprobs=0)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == PROMPT + choice.text  # token ids decoded
    assert lp.tokens[-count:] == choice.logprobs.tokens
    assert lp.token_logprobs[-count:] == pytest.approx(choice.logprobs.token_logprobs, abs=1e-4)


def test_echo_with_generation_whole_and_streamed(client: openai.OpenAI, url: str) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    plain = client.completions.create(**kwargs).choices[0]
    whole = client.completions.create(echo=True, **kwargs)
    choice = whole.choices[0]
    assert choice.text == PROMPT + plain.text and choice.finish_reason == plain.finish_reason
    prompt_count = len(_ids(url, PROMPT))
    lp = choice.logprobs
    _check_shape(lp, choice.text, prompt_count + len(plain.logprobs.tokens))
    assert lp.tokens[prompt_count:] == plain.logprobs.tokens
    assert lp.token_logprobs[prompt_count:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert lp.text_offset[prompt_count:] == [len(PROMPT) + offset for offset in plain.logprobs.text_offset]
    assert whole.usage is not None and whole.usage.completion_tokens == len(plain.logprobs.tokens)

    chunks = list(client.completions.create(echo=True, stream=True, **kwargs))
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.finish_reason is None  # the prompt first, as vLLM sends it
    assert first.logprobs.tokens == lp.tokens[:prompt_count] and first.logprobs.token_logprobs[0] is None
    streamed = [c for chunk in chunks for c in chunk.choices]
    assert "".join(c.text for c in streamed) == choice.text
    assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert [t for c in streamed if c.logprobs for t in c.logprobs.text_offset] == lp.text_offset
    assert streamed[-1].finish_reason == choice.finish_reason


def test_echo_without_logprobs_and_of_several_token_id_prompts(client: openai.OpenAI, url: str) -> None:
    alone = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0)
    assert alone.choices[0].text == PROMPT and alone.choices[0].logprobs is None
    assert alone.choices[0].finish_reason == "length" and alone.usage.completion_tokens == 0
    texts = ["The iterable", "sorted order of things"]
    batch = client.completions.create(
        model="tiny", prompt=[_ids(url, t) for t in texts], echo=True, max_tokens=0, logprobs=1
    )
    assert [c.text for c in batch.choices] == texts
    for choice, text in zip(batch.choices, texts, strict=True):
        _check_shape(choice.logprobs, text, len(_ids(url, text)))
    # Streamed alone: the prompt, then the end; usage counts no completion token.
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, echo=True, max_tokens=0, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed = [c for chunk in chunks for c in chunk.choices]
    assert "".join(c.text for c in streamed) == PROMPT and streamed[-1].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 0


def test_og_generator_echoes_text_and_refuses_to_score_by_name(client: openai.OpenAI) -> None:
    """og-generator hands back the last position's logits only: echo alone works there,
    echo with logprobs is a 400 naming ``echo``."""
    text = client.completions.create(model="og", prompt=PROMPT, echo=True, max_tokens=0).choices[0]
    assert text.text == PROMPT and text.finish_reason == "length"
    generated = client.completions.create(model="og", prompt=PROMPT, echo=True, max_tokens=3, temperature=0)
    assert generated.choices[0].text.startswith(PROMPT) and generated.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="og", prompt=PROMPT, echo=True, max_tokens=0, logprobs=1)
    assert info.value.body["param"] == "echo", info.value.body  # type: ignore[index]
    assert "og-generator" in info.value.body["message"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": True, "logprobs": 6}, "logprobs"),
        ({"echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
    ],
)
def test_bad_echo_requests_are_a_400_naming_the_field(client: openai.OpenAI, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Hi", extra_body={"max_tokens": 2, **extra})
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]
