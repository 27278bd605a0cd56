"""A server with the tiny model, shared by the API test modules that need nothing else."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running


@pytest.fixture(scope="module")
def tiny_url() -> Iterator[str]:
    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}))) as base:
        yield base


@pytest.fixture
def tiny_client(tiny_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{tiny_url}/v1", api_key="x", max_retries=0) as client:
        yield client


@pytest.fixture
def client(url: str) -> Iterator[openai.OpenAI]:
    """The openai SDK on the server of the test module's own ``url`` fixture."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as c:
        yield c
