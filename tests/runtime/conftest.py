"""Fixtures for the runtime tests: the tiny generative model, loaded once per module."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from ortserve_runtime import GenerativeModel, ModelConfig, ModelRegistry
from serving import TINY_MODEL


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def tiny() -> AsyncIterator[GenerativeModel]:
    registry = ModelRegistry(ModelConfig(max_sequence_length=1024))
    registry.add("tiny", TINY_MODEL)
    model: GenerativeModel = await registry.get("tiny")
    yield model
    await registry.close()
