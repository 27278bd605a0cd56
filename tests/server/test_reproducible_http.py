"""Same request, same answer over HTTP: through the official OpenAI SDK, a chat sent again,
its next turn and the same chat beside others get the logprobs a model without the prefix
cache gives (both served by one real server on a loopback port). Set ``ORTSERVE_SMOLLM2``
to a real-weights folder to run it on SmolLM2-135M too."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, closing, running

SYSTEM = " ".join(f"Rule {i}: answer briefly, in order, and with an example each time." for i in range(12))


def answer(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], **options: Any) -> tuple[Any, ...]:
    result = client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, logprobs=True, top_logprobs=5, **options
    )
    choice = result.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    steps = tuple(
        (s.token, s.logprob, tuple((t.token, t.logprob) for t in s.top_logprobs)) for s in choice.logprobs.content
    )
    return choice.message.content, steps


MODELS = [
    pytest.param(TINY_MODEL, id="tiny-qwen2"),
    pytest.param(
        Path(os.environ.get("ORTSERVE_SMOLLM2", "/nonexistent")),
        id="smollm2",
        marks=pytest.mark.skipif("ORTSERVE_SMOLLM2" not in os.environ, reason="ORTSERVE_SMOLLM2 not set"),
    ),
]


@pytest.mark.parametrize("folder", MODELS)
def test_repeats_next_turns_and_neighbours_match_a_server_without_the_cache(folder: Path) -> None:
    config = ServerConfig(
        models={"cached": folder, "cold": folder},
        model_config=ModelConfig(prefix_cache_min_tokens=8, reproducible=True),
        model_configs={"cold": ModelConfig(prefix_cache_tokens=0, reproducible=True)},
    )
    with running(create_app(config)) as base:
        client = closing(openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0))
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Sort 3, 1, 2."}]
        for options in ({"temperature": 0}, {"temperature": 0.8, "seed": 99}):
            want = answer(client, "cold", first, **options)
            assert answer(client, "cached", first, **options) == want
            assert answer(client, "cached", first, **options) == want  # all but two tokens from the cache
        text, _ = answer(client, "cached", first, temperature=0)
        second = [*first, {"role": "assistant", "content": text}, {"role": "user", "content": "And backwards?"}]
        want = answer(client, "cold", second, temperature=0)
        assert answer(client, "cached", second, temperature=0) == want
        others = [[{"role": "user", "content": f"Question {i}: what comes after {i}?"}] for i in range(7)]
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda m: answer(client, "cached", m, temperature=0), [second, *others]))
        assert together[0] == want
        assert together[1:] == [answer(client, "cold", m, temperature=0) for m in others]
