"""Agent frameworks through their documented custom-base-URL paths against a real server:
openai-agents, pydantic-ai, langchain-openai, langchain-anthropic, LiteLLM and DSPy, on the
tiny (random) model. Its words are gibberish, so these check structure: every request the
framework sends is accepted, forced and structured turns come back well-formed, and the
frameworks' own parsers take them. (instructor and LlamaIndex's OpenAILike cannot be
installed beside openai-agents: they pin openai below 3, openai-agents needs 3.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Iterator

import pytest
from ortserve_server import ServerConfig, create_app
from ortserve_server._demo import minilm_folder
from pydantic import BaseModel, Field
from serving import TINY_MODEL, running

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # no trace upload to OpenAI


class Answer(BaseModel):
    answer: str = Field(max_length=8)


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    minilm = minilm_folder(tmp_path_factory.mktemp("m") / "minilm")  # the demo's embedding model
    assert minilm is not None
    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL, "minilm": minilm}))) as url:
        yield f"{url}/v1"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def test_openai_agents_forced_tool_then_structured_output(base_url: str) -> None:
    """openai-agents sends ``tool_choice: required`` with the output type's response format
    (once a 400 here); it then runs the tool and resets tool_choice for the next turn."""
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
    )
    from openai import AsyncOpenAI

    calls: list[tuple[int, int]] = []

    @function_tool
    def add_numbers(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    async def run() -> object:
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        agent = Agent(
            name="adder",
            instructions="Add the numbers.",
            model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
            tools=[add_numbers],
            output_type=Answer,
            model_settings=ModelSettings(tool_choice="required", max_tokens=120, temperature=0),
        )
        try:
            result = await Runner.run(agent, "What is 2 + 3?", max_turns=4)
            return result.final_output
        except MaxTurnsExceeded:
            return None  # a random model may keep calling the tool; each turn was well-formed
        finally:
            await client.close()

    final = asyncio.run(run())
    assert calls and all(isinstance(a, int) and isinstance(b, int) for a, b in calls)
    assert final is None or isinstance(final, Answer)


def test_pydantic_ai_tools_and_structured_output(base_url: str) -> None:
    """pydantic-ai asks for its output through a forced ``final_result`` tool beside the
    agent's own tools; whichever the model calls parses."""
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    async def run() -> object:
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        model = OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=client))
        settings = ModelSettings(temperature=0, max_tokens=120)
        agent = Agent(model, output_type=Answer, tools=[add], model_settings=settings)
        try:
            return (await agent.run("What is 2 + 3?", usage_limits=UsageLimits(request_limit=4))).output
        except UsageLimitExceeded:
            return None  # the random model kept calling add: every call parsed, or pydantic-ai would have raised
        finally:
            await client.close()

    output = asyncio.run(run())
    assert output is None or isinstance(output, Answer)


def test_langchain_bind_tools_and_structured_output(base_url: str) -> None:
    import httpx
    from langchain_openai import ChatOpenAI

    with httpx.Client() as http:
        llm = ChatOpenAI(
            model="tiny",
            base_url=base_url,
            api_key="x",
            temperature=0,
            max_tokens=120,
            http_client=http,  # type: ignore[arg-type]
        )
        check_langchain(llm)


def test_langchain_embeddings(base_url: str) -> None:
    """``OpenAIEmbeddings`` with the served embedding model (its token-length check off: it
    would fetch OpenAI's tokenizer tables, and the server checks lengths itself)."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model="minilm", base_url=base_url, api_key="x", check_embedding_ctx_length=False)  # type: ignore[arg-type]
    vectors = embeddings.embed_documents(["hello", "world"])
    assert len(vectors) == 2 and len(vectors[0]) == 384
    assert embeddings.embed_query("hello") == pytest.approx(vectors[0], abs=1e-6)


def check_langchain(llm: object) -> None:
    message = llm.bind_tools([add], tool_choice="required").invoke("What is 2 + 3?")  # type: ignore[attr-defined]
    assert [call["name"] for call in message.tool_calls] == ["add"]  # type: ignore[attr-defined]
    assert set(message.tool_calls[0]["args"]) <= {"a", "b"}  # type: ignore[attr-defined]
    structured = llm.with_structured_output(Answer, method="json_schema").invoke("Answer briefly.")  # type: ignore[attr-defined]
    assert isinstance(structured, Answer)
    streamed = "".join(str(chunk.content) for chunk in llm.stream("Say hi."))  # type: ignore[attr-defined]
    assert streamed == llm.invoke("Say hi.").content  # type: ignore[attr-defined]


def test_langchain_anthropic_tools_and_structured_output(base_url: str) -> None:
    """langchain-anthropic through the Messages API (its base URL is the server's root)."""
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(
        model="tiny",  # type: ignore[call-arg]
        base_url=base_url.removesuffix("/v1"),
        api_key="x",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=120,  # type: ignore[call-arg]
    )
    message = llm.bind_tools([add], tool_choice="add").invoke("What is 2 + 3?")
    assert [call["name"] for call in message.tool_calls] == ["add"]  # type: ignore[attr-defined]
    assert set(message.tool_calls[0]["args"]) <= {"a", "b"}  # type: ignore[attr-defined]
    structured = llm.with_structured_output(Answer).invoke("Answer briefly.")
    assert isinstance(structured, Answer)


def test_litellm_tools_streaming_structured_output_and_embeddings(base_url: str) -> None:
    """LiteLLM's OpenAI-compatible path (``openai/MODEL`` with ``api_base``): a forced tool
    call its parser takes, streaming, a json_schema answer, and embeddings."""
    import litellm

    common = {"api_base": base_url, "api_key": "x", "max_tokens": 120, "temperature": 0}
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    called = litellm.completion(model="openai/tiny", messages=messages, tools=[tool], tool_choice="required", **common)
    calls = called.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "add"
    assert set(json.loads(calls[0].function.arguments)) <= {"a", "b"}  # undeclared keys closed
    plain = litellm.completion(model="openai/tiny", messages=messages, **common)
    streamed = litellm.completion(model="openai/tiny", messages=messages, stream=True, **common)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == plain.choices[0].message.content
    structured = litellm.completion(model="openai/tiny", messages=messages, response_format=Answer, **common)
    Answer.model_validate_json(structured.choices[0].message.content)
    vectors = litellm.embedding(model="openai/minilm", input=["hello"], api_base=base_url, api_key="x")
    assert len(vectors.data[0]["embedding"]) > 0


def test_dspy_reaches_the_model_through_litellm(base_url: str) -> None:
    """DSPy's documented path for an OpenAI-compatible server (``dspy.LM("openai/MODEL",
    api_base=...)``): its prompt reaches the model and the model's text comes back to DSPy's
    parser unchanged (the random model's text does not follow DSPy's field format, so the
    parse itself is not checked here)."""
    import dspy
    import openai

    lm = dspy.LM("openai/tiny", api_base=base_url, api_key="x", temperature=0, max_tokens=40, cache=False)
    with dspy.context(lm=lm), contextlib.suppress(dspy.utils.exceptions.AdapterParseError):
        dspy.Predict("question -> answer: str")(question="What is 2 + 3?")
    assert lm.history
    sent = lm.history[-1]
    with openai.OpenAI(base_url=base_url, api_key="x") as client:
        direct = client.chat.completions.create(model="tiny", messages=sent["messages"], temperature=0, max_tokens=40)
    assert sent["outputs"][0] == direct.choices[0].message.content


SMOLLM2 = os.environ.get("ORTSERVE_SMOLLM2")
CHATML_TOOLS = TINY_MODEL / "chat_template.jinja"  # Qwen2.5's tool wording, ChatML


@pytest.mark.skipif(SMOLLM2 is None, reason="ORTSERVE_SMOLLM2 (a SmolLM2-135M genai folder) not set")
def test_smollm2_agent_loops() -> None:
    """Real weights (SmolLM2-135M int4, its folder untouched): given a ChatML tool template,
    LangChain's forced call and structured output, and openai-agents' loop (forced call,
    tool run, structured answer) give Paris's weather; with its own template (tools in
    the system prompt) the forced call is still well-formed."""
    from pathlib import Path

    import httpx
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
    from langchain_openai import ChatOpenAI
    from openai import AsyncOpenAI
    from ortserve_runtime import ModelConfig

    class Weather(BaseModel):
        city: str = Field(max_length=40)
        temperature_c: int

    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        return json.dumps({"city": city, "temperature_c": 21})

    folder = Path(str(SMOLLM2))
    config = ServerConfig(
        models={"smol": folder, "own": folder},
        model_configs={"smol": ModelConfig(chat_template=CHATML_TOOLS)},
    )
    with running(create_app(config)) as url, httpx.Client() as http:
        for name in ("smol", "own"):
            llm = ChatOpenAI(
                model=name, base_url=f"{url}/v1", api_key="x", temperature=0, max_tokens=150, http_client=http
            )  # type: ignore[arg-type]
            call = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
            assert call.tool_calls == [
                {"name": "get_weather", "args": {"city": "Paris"}, "id": call.tool_calls[0]["id"], "type": "tool_call"}
            ]  # type: ignore[attr-defined]
            weather = llm.with_structured_output(Weather, method="json_schema").invoke(
                "Paris: 21 degrees. City, temperature?"
            )
            assert weather == Weather(city="Paris", temperature_c=21), (name, weather)

        async def loop() -> object:
            client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x")
            agent = Agent(
                name="weather",
                instructions="Answer with the tool's data.",
                model=OpenAIChatCompletionsModel(model="smol", openai_client=client),
                tools=[function_tool(get_weather)],
                output_type=Weather,
                model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=150),
            )
            try:
                return (await Runner.run(agent, "What is the weather in Paris?", max_turns=5)).final_output
            finally:
                await client.close()

        assert asyncio.run(loop()) == Weather(city="Paris", temperature_c=21)

        import litellm

        tool = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather of a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
        }
        called = litellm.completion(
            model="openai/smol",
            api_base=f"{url}/v1",
            api_key="x",
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[tool],
            tool_choice="required",
            temperature=0,
            max_tokens=150,
        )
        call = called.choices[0].message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})
