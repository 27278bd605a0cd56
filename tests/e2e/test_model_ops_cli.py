"""Model operations from the outside: a lazy LocalServer sidecar, its load/unload/status,
AsyncClient's model methods, and `ortserve ps`, all as real processes and sockets."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ortserve_client import AsyncClient, LocalServer, NotFoundError, PermissionDeniedError, ServiceUnavailableError

pytestmark = pytest.mark.anyio
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
MODELS = {"a": str(FIXTURES / "tiny-qwen2"), "b": str(FIXTURES / "tiny-qwen3-think")}


async def ps(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ortserve_server", "ps", *args]
    return await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True, timeout=60)


def rows(listing: str) -> dict[str, list[str]]:
    """``ortserve ps`` output by model name: its columns (split on runs of 2+ spaces)."""
    import re

    lines = listing.strip().splitlines()
    assert lines[0].split()[:3] == ["NAME", "KIND", "STATUS"]
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in lines[1:])}


async def test_lazy_sidecar_loads_unloads_and_ps_shows_it() -> None:
    serve_args = ["--max-loaded-models", "1", "--admin-key", "adm"]
    async with LocalServer(MODELS, port=0, lazy=True, api_key="key", serve_args=serve_args) as server:
        assert {m.id: m.status for m in await server.status()} == {"a": "unloaded", "b": "unloaded"}
        listed = await ps("--url", server.base_url, "--api-key", "key")
        assert listed.returncode == 0, listed.stderr
        table = rows(listed.stdout)
        assert table["a"][:3] == ["a", "generative", "unloaded"] and table["a"][4] == "-"

        with pytest.raises(PermissionDeniedError):  # the control routes want the admin key
            await server.load("a")
        async with AsyncClient(server.base_url, api_key="adm", max_retries=0) as admin:
            loaded = await admin.models.load("a", keep_alive="10m")
            assert loaded.status == "ready" and loaded.engine == "ort-cpu"
            assert loaded.expires_at is not None and 590 < loaded.expires_at - time.time() <= 600
            assert loaded.resident_bytes and loaded.kv_cache_bytes
            table = rows((await ps("--url", server.base_url, "--api-key", "key")).stdout)
            assert table["a"][2] == "ready" and table["a"][4].endswith("MiB") and table["a"][8].startswith("in ")

            async with server.client() as client:  # the API key serves requests; b's load evicts a
                await client.chat.completions.create(
                    model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                assert (await client.models.retrieve("a")).status == "unloaded"
                assert (await client.models.retrieve("b")).status == "ready"

            assert (await admin.models.unload("b")).status == "unloaded"
            with pytest.raises(NotFoundError):
                await admin.models.load("c")
    failed = await ps("--url", server.base_url)
    assert failed.returncode == 1 and "ortserve:" in failed.stderr and "Traceback" not in failed.stderr


async def test_the_client_retries_a_capacity_503_then_raises_it() -> None:
    async with LocalServer(MODELS, port=0, lazy=True, serve_args=["--memory-budget", "1K"]) as server:
        async with server.client(max_retries=1) as client:
            with pytest.raises(ServiceUnavailableError) as info:
                await client.models.load("a")
            assert "memory budget" in str(info.value)
        assert {m.id: m.status for m in await server.status()} == {"a": "unloaded", "b": "unloaded"}


async def test_a_sidecar_started_with_allow_runtime_adapters_serves_an_adapter_added_by_the_client() -> None:
    lora = FIXTURES / "tiny-qwen2-lora"
    serve_args = ["--allow-runtime-adapters"]
    async with LocalServer({"lora": str(lora)}, port=0, serve_args=serve_args) as server, server.client() as client:
        base = await client.completions.create(model="lora", prompt="hello there", max_tokens=8, temperature=0)
        card = await client.models.load_adapter("beta", str(lora / "adapters" / "beta.onnx_adapter"))
        assert (card.id, card.parent) == ("lora:beta", "lora")
        adapted = await client.completions.create(model="lora:beta", prompt="hello there", max_tokens=8, temperature=0)
        assert adapted.choices[0].text != base.choices[0].text  # the adapter changes the output
        assert (await client.models.unload_adapter("lora:beta")).deleted
        with pytest.raises(NotFoundError, match="no LoRA adapter 'beta'"):
            await client.completions.create(model="lora:beta", prompt="hello there", max_tokens=2)
