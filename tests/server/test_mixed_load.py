"""Text, image and speech requests at once through one server, some abandoned by their
clients midway: every other request completes, slots come back, the server stays healthy."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from audio import TINY_WHISPER, tone_wav
from images import TINY_PHI3V, image_bytes, image_part
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

pytestmark = pytest.mark.timing  # wall-clock bounds: run apart (see the README's test command)

ROUNDS = 6


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    models = {"tiny": TINY_MODEL, "vision": TINY_PHI3V, "whisper": TINY_WHISPER}
    with running(create_app(ServerConfig(models=models))) as base:
        yield base


def test_mixed_load_with_abandoned_requests(url: str) -> None:
    async def run() -> list[object]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120) as client:

            async def text(i: int) -> object:
                messages = [{"role": "user", "content": f"hello {i}"}]
                if i % 2:
                    stream = await client.chat.completions.create(
                        model="tiny",
                        messages=messages,  # type: ignore[arg-type]
                        max_tokens=16,
                        stream=True,
                    )
                    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=16)  # type: ignore[arg-type]
                return reply.choices[0].message.content

            async def vision(i: int) -> object:
                part = image_part(image_bytes(colour=(40 * i % 256, 90, 160)))
                reply = await client.chat.completions.create(
                    model="vision",
                    messages=[{"role": "user", "content": [part, {"type": "text", "text": "what?"}]}],  # type: ignore[list-item]
                    max_tokens=12,
                )
                assert reply.usage is not None and reply.usage.prompt_tokens > 300
                return reply.choices[0].message.content

            async def speech(i: int) -> object:
                audio = ("a.wav", tone_wav(1.0 + i % 3, hertz=200.0 + 40 * i))
                format_ = "srt" if i % 2 else "json"
                return await client.audio.transcriptions.create(model="whisper", file=audio, response_format=format_)

            async def abandoned(i: int) -> object:
                request = client.chat.completions.create(
                    model="vision",
                    messages=[{"role": "user", "content": [image_part(), {"type": "text", "text": "x"}]}],  # type: ignore[list-item]
                    max_tokens=1000,
                )
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(request, 0.3 + 0.1 * i)
                return "abandoned"

            jobs = [make(i) for i in range(ROUNDS) for make in (text, vision, speech, abandoned)]
            return list(await asyncio.gather(*jobs))

    results = asyncio.run(run())
    assert len(results) == 4 * ROUNDS and all(r is not None for r in results)
    # The abandoned requests gave their slots back: nothing is running or waiting now.
    for _ in range(100):
        metrics = httpx.get(f"{url}/metrics").text
        busy = re.findall(r'ortserve_(?:active_requests|queue_depth)\{model="vision"\} (\S+)', metrics)
        if busy and all(float(value) == 0 for value in busy):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"vision still busy: {busy}")
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def _vision_busy(url: str) -> bool:
    metrics = httpx.get(f"{url}/metrics").text
    values = re.findall(r'ortserve_(?:active_requests|queue_depth)\{model="vision"\} (\S+)', metrics)
    return not values or any(float(value) for value in values)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_gives_up_frees_its_slot(url: str, stream: bool) -> None:
    # About two seconds of generation; the client gives up after half a second.
    body = {
        "model": "vision",
        "messages": [{"role": "user", "content": [image_part(), {"type": "text", "text": "x"}]}],
        "max_tokens": 1500,
        "min_tokens": 1500,
        "stream": stream,
    }
    if stream:  # read the first events, then hang up
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=5) as response:
            next(response.iter_bytes())
    else:  # wait half a second for the whole answer, then give up
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=0.5)
    gave_up = time.monotonic()
    while _vision_busy(url):
        assert time.monotonic() - gave_up < 0.5, "the abandoned generation kept running"
        time.sleep(0.02)
