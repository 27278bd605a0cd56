"""Agent frameworks on a local model: LangChain, openai-agents and pydantic-ai, each through
its own documented custom-base-URL path, against an ortserve sidecar.

    uv run python examples/agent_frameworks.py

Serves `ORTSERVE_EXAMPLE_MODEL` (default: the tiny random test model, whose words are
gibberish but whose calls and JSON are well-formed); on SmolLM2-135M int4 (see docs/guides/agent-frameworks.md)
the tool calls and structured answers are sensible. `ORTSERVE_EXAMPLE_CHAT_TEMPLATE`
replaces the model's own chat template (`--chat-template`), as for a model whose template
has no tools; without it such a model gets its tools in the system prompt.
"""

from __future__ import annotations

import asyncio
import json
import os

from _common import MODEL_DIR, PORT
from ortserve_client import LocalServer
from pydantic import BaseModel, Field

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # openai-agents uploads traces to OpenAI otherwise


class Weather(BaseModel):
    city: str = Field(max_length=40)  # bounds in the schema bound the generated JSON too
    temperature_c: int


def get_weather(city: str) -> str:
    """Get the current weather of a city."""
    return json.dumps({"city": city, "temperature_c": 21})


def with_langchain(base_url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="local", base_url=base_url, api_key="unused", temperature=0, max_tokens=150)
    call = llm.bind_tools([get_weather], tool_choice="required").invoke("What is the weather in Paris?")
    print("langchain tool call:", call.tool_calls)
    weather = llm.with_structured_output(Weather, method="json_schema").invoke("Paris: 21 degrees. City, temperature?")
    print("langchain structured:", weather)


async def with_openai_agents(base_url: str) -> None:
    from agents import Agent, MaxTurnsExceeded, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    agent = Agent(
        name="weather",
        instructions="Answer with the tool's data.",
        model=OpenAIChatCompletionsModel(model="local", openai_client=client),
        tools=[function_tool(get_weather)],
        output_type=Weather,  # with tool_choice required: the first turn calls, the last one answers
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=150),
    )
    try:
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=5)
        print("openai-agents:", result.final_output)
    except MaxTurnsExceeded:
        print("openai-agents: the model kept calling the tool")
    finally:
        await client.close()


async def with_pydantic_ai(base_url: str) -> None:
    from openai import AsyncOpenAI
    from pydantic_ai import Agent, ModelHTTPError, UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings
    from pydantic_ai.usage import UsageLimits

    client = AsyncOpenAI(base_url=base_url, api_key="unused")
    agent = Agent(
        OpenAIChatModel("local", provider=OpenAIProvider(openai_client=client)),
        output_type=Weather,
        tools=[get_weather],
        model_settings=ModelSettings(temperature=0, max_tokens=150),
    )
    try:
        result = await agent.run("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=5))
        print("pydantic-ai:", result.output)
    except UsageLimitExceeded:
        print("pydantic-ai: the model kept calling the tool")
    except ModelHTTPError as exc:  # a small context filled by the loop's turns: the server's 400
        print(f"pydantic-ai: the server refused a turn: {exc.body}")
    finally:
        await client.close()


async def main() -> None:
    template = os.environ.get("ORTSERVE_EXAMPLE_CHAT_TEMPLATE")
    serve_args = ["--chat-template", template] if template else []
    async with LocalServer({"local": MODEL_DIR}, port=PORT, serve_args=serve_args) as server:
        await asyncio.to_thread(with_langchain, server.base_url)
        await with_openai_agents(server.base_url)
        await with_pydantic_ai(server.base_url)


if __name__ == "__main__":
    asyncio.run(main())
