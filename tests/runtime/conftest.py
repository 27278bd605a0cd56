"""Fixtures for the runtime tests: the tiny generative model, loaded fresh per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from ortserve_runtime import ChatModel, ModelRegistry
from serving import TINY_MODEL


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def tiny() -> AsyncIterator[ChatModel]:
    """The tiny model with the default config (its context, 1024 tokens, is the limit)."""
    registry = ModelRegistry()
    registry.add("tiny", TINY_MODEL)
    model: ChatModel = await registry.get("tiny")
    yield model
    await registry.close()
