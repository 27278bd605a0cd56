"""``AsyncClient.files`` and ``.batches`` against the real server (uvicorn on a loopback
port): a batch made with :func:`batch_file`, its results read back as Structs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from ortserve_client import AsyncClient, BadRequestError, NotFoundError, PayloadTooLargeError, batch_file
from ortserve_client import batch_protocol as bp

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    pytest.importorskip("ortserve_server", reason="the contract test needs the server installed")
    from ortserve_server import ServerConfig, create_app
    from serving import TINY_MODEL, running

    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}))) as url:
        yield url


async def test_a_batch_round_trip(server_url: str) -> None:
    body = {"model": "tiny", "max_tokens": 3, "temperature": 0}
    lines: list[bp.BatchInputLine | dict[str, object]] = [
        {"custom_id": f"q{i}", "url": "/v1/completions", "body": {**body, "prompt": f"text {i}"}} for i in range(3)
    ]
    chat = {**body, "messages": [{"role": "user", "content": "hi"}]}
    lines.append(bp.BatchInputLine(custom_id="c", method="POST", url="/v1/chat/completions", body=chat))
    async with AsyncClient(f"{server_url}/v1") as client:
        uploaded = await client.files.create(file=batch_file(lines[:3]))
        assert uploaded.purpose == "batch" and (await client.files.retrieve(uploaded.id)).bytes == uploaded.bytes
        batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions")
        while (batch := await client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
            await asyncio.sleep(0.05)
        assert batch.request_counts == bp.BatchRequestCounts(total=3, completed=3, failed=0)
        assert batch.output_file_id is not None
        results = await client.files.results(batch.output_file_id)
        assert [r.custom_id for r in results] == ["q0", "q1", "q2"]
        direct = await client.completions.create(model="tiny", prompt="text 1", max_tokens=3, temperature=0)
        assert results[1].response is not None and results[1].response.status_code == 200
        assert results[1].response.body["choices"][0]["text"] == direct.choices[0].text
        assert (await client.batches.list(limit=1)).data[0].id == batch.id
        mixed = await client.files.create(file=("mixed.jsonl", batch_file(lines)))
        with pytest.raises(BadRequestError, match="request 4 of the file has url '/v1/chat/completions'"):
            await client.batches.create(input_file_id=mixed.id, endpoint="/v1/completions")
        assert (await client.files.delete(mixed.id)).deleted
        with pytest.raises(NotFoundError):
            await client.files.content(mixed.id)


async def test_files_and_batches_are_bounded_in_bytes() -> None:
    pytest.importorskip("ortserve_server", reason="the contract test needs the server installed")
    from ortserve_server import ServerConfig, create_app
    from serving import TINY_MODEL, running

    line = {"custom_id": "a", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x" * 300}}
    content = batch_file([line])
    config = ServerConfig(models={"tiny": TINY_MODEL}, files_max_bytes=len(content) * 3 // 2)
    with running(create_app(config)) as url:
        async with AsyncClient(f"{url}/v1") as client:
            first = await client.files.create(file=content)
            with pytest.raises(PayloadTooLargeError, match="room for files"):
                await client.files.create(file=content)  # a second file does not fit
            with pytest.raises(PayloadTooLargeError, match="room for files and batches"):
                await client.batches.create(input_file_id=first.id, endpoint="/v1/completions")  # nor its lines
            await client.files.delete(first.id)
            await client.files.create(file=content)  # room again


async def test_each_key_has_its_share_of_the_files_room() -> None:
    """Fifth probe of issue 45: one key's uploads could fill the room every key shares, and
    the others' uploads were then 413s for up to 30 days. Each of the server's keys holds at
    most an equal share; what one key holds leaves the others theirs."""
    pytest.importorskip("ortserve_server", reason="the contract test needs the server installed")
    from ortserve_server import ServerConfig, create_app
    from serving import TINY_MODEL, running

    line = {"custom_id": "a", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x" * 300}}
    content = batch_file([line])
    config = ServerConfig(
        models={"tiny": TINY_MODEL}, api_key=("key-a", "key-b"), files_max_bytes=len(content) * 5
    )  # a share: two and a half files
    with running(create_app(config)) as url:
        async with AsyncClient(f"{url}/v1", api_key="key-a") as alice, AsyncClient(f"{url}/v1", api_key="key-b") as bob:
            held = [await alice.files.create(file=content) for _ in range(2)]
            with pytest.raises(PayloadTooLargeError, match=r"this API key's share .* is full"):
                await alice.files.create(file=content)
            with pytest.raises(PayloadTooLargeError, match="this API key's share"):
                await alice.batches.create(input_file_id=held[0].id, endpoint="/v1/completions")
            for _ in range(2):
                await bob.files.create(file=content)  # Bob's share is untouched
            await alice.files.delete(held[1].id)
            await alice.files.create(file=content)  # room in her share again


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"batch_concurrency": 0}, "batch_concurrency"),
        ({"max_file_size": 0}, "max_file_size"),
        ({"state_url": "postgresql://nobody@127.0.0.1:1/x", "state_dir": "/tmp/x"}, "give one"),
    ],
)
def test_settings_that_cannot_work_are_refused(settings: dict[str, object], says: str) -> None:
    pytest.importorskip("ortserve_server", reason="needs the server installed")
    from ortserve_server import OrtServe, ServerConfig
    from serving import TINY_MODEL

    with pytest.raises(ValueError, match=says):
        OrtServe(ServerConfig(models={"tiny": TINY_MODEL}, **settings))  # type: ignore[arg-type]
