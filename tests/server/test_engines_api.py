"""The API behaviours that matter, on every engine: one server serves the tiny model three
times (ort-cpu, og-engine, og-generator, chosen per model) and the openai SDK checks each."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

pytestmark = pytest.mark.anyio

ENGINES = ["ort-cpu", "og-engine", "og-generator"]
ASK = [{"role": "user", "content": "Tell me about the iterable in sorted order"}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Any]]:
    config = ServerConfig(
        models={engine: TINY_MODEL for engine in ENGINES},
        model_configs={engine: ModelConfig(engine=engine) for engine in ENGINES},  # type: ignore[arg-type]
    )
    app = create_app(config)
    with running(app) as url:
        yield url, app.state.ortserve


@pytest.fixture
def client(served: tuple[str, Any]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served[0]}/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest) -> str:
    """The model name, which is also the engine it runs on."""
    return str(request.param)


def test_models_say_which_engine(client: openai.OpenAI, engine: str) -> None:
    card = client.models.retrieve(engine)
    assert (card.engine, card.provider) == (engine, "cpu")  # type: ignore[attr-defined]


def test_greedy_text_is_the_same_on_every_engine(client: openai.OpenAI, engine: str) -> None:
    result = client.chat.completions.create(model=engine, messages=ASK, max_tokens=12, temperature=0)
    reference = client.chat.completions.create(model="ort-cpu", messages=ASK, max_tokens=12, temperature=0)
    assert result.choices[0].message.content == reference.choices[0].message.content
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None and result.usage.completion_tokens == 12
    assert result.usage.prompt_tokens == reference.usage.prompt_tokens  # type: ignore[union-attr]


def test_stream_equals_non_stream_and_n(client: openai.OpenAI, engine: str) -> None:
    whole = client.chat.completions.create(model=engine, messages=ASK, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=engine,
            messages=ASK,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    three = client.chat.completions.create(model=engine, messages=ASK, max_tokens=6, temperature=0, n=3)
    assert len({c.message.content for c in three.choices}) == 1 and len(three.choices) == 3


def test_stop_strings_are_exact(client: openai.OpenAI, engine: str) -> None:
    full = client.completions.create(model=engine, prompt="hello", max_tokens=20, temperature=0).choices[0].text
    stop = full[8:11]
    assert stop.strip(), full
    cut = client.completions.create(model=engine, prompt="hello", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[: full.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_structured_output_and_forced_tool_calls(client: openai.OpenAI, engine: str) -> None:
    result = client.chat.completions.create(
        model=engine,
        messages=ASK,
        max_tokens=200,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(result.choices[0].message.content or ""), SCHEMA)
    called = client.chat.completions.create(
        model=engine,
        messages=ASK,
        max_tokens=200,
        temperature=0,
        tools=[ADD],
        tool_choice="required",  # type: ignore[list-item]
    )
    assert called.choices[0].finish_reason == "tool_calls"
    calls = called.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "add"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(calls[0].function.arguments), ADD["function"]["parameters"])  # type: ignore[union-attr, index]


def test_seeds_reproduce_or_are_refused_naming_seed(client: openai.OpenAI, engine: str) -> None:
    kwargs: dict[str, Any] = {"model": engine, "messages": ASK, "max_tokens": 10, "temperature": 1.0, "seed": 3}
    if engine == "og-engine":  # og.Engine's static batches on the CPU cannot reseed per request
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**kwargs)
        assert info.value.body["param"] == "seed"  # type: ignore[index]
        return
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


def test_context_errors_are_400(client: openai.OpenAI, engine: str) -> None:
    with pytest.raises(openai.BadRequestError, match="limit of 1024 tokens"):
        client.completions.create(model=engine, prompt="hello " * 1100, max_tokens=4)


async def test_a_disconnect_mid_stream_frees_the_engine(served: tuple[str, Any], engine: str) -> None:
    url, state = served
    model = state.registry.loaded(engine)
    async with httpx.AsyncClient(timeout=30) as http:
        body = {"model": engine, "messages": ASK, "max_tokens": 400, "stream": True}
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    break
        deadline = time.monotonic() + 5
        while model.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert model.active == 0
        after = await http.post(f"{url}/v1/chat/completions", json={"model": engine, "messages": ASK, "max_tokens": 3})
        assert after.status_code == 200


async def test_concurrent_streams_each_get_their_own_text(served: tuple[str, Any], engine: str) -> None:
    async with openai.AsyncOpenAI(base_url=f"{served[0]}/v1", api_key="x", max_retries=0) as aclient:
        prompts = [[{"role": "user", "content": f"question {i} about lists"}] for i in range(8)]

        async def one(messages: list[dict[str, str]]) -> str:
            result = await aclient.chat.completions.create(
                model=engine,
                messages=messages,
                max_tokens=8,
                temperature=0,  # type: ignore[arg-type]
            )
            return result.choices[0].message.content or ""

        alone = [await one(m) for m in prompts]
        assert list(await asyncio.gather(*(one(m) for m in prompts))) == alone


def test_logprobs_on_the_host_sampling_engines_and_a_400_on_og_engine(client: openai.OpenAI, engine: str) -> None:
    kwargs: dict[str, Any] = {"messages": ASK, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    if engine == "og-engine":  # og samples inside onnxruntime-genai: no logits come back
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=engine, **kwargs)
        assert info.value.body["param"] == "logprobs"  # type: ignore[index]
        return
    result = client.chat.completions.create(model=engine, **kwargs)
    reference = client.chat.completions.create(model="ort-cpu", **kwargs)
    tokens = result.choices[0].logprobs.content
    assert [t.token for t in tokens] == [t.token for t in reference.choices[0].logprobs.content]
    assert all(t.top_logprobs[0].token == t.token for t in tokens)
