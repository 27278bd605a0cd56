"""A host program that runs ortserve as a managed sidecar and talks to it.

LocalServer attaches to an ortserve server already on the port, or starts one (and
stops it again at the end of the block). Events show what happens.

    uv run python examples/sidecar.py
"""

from __future__ import annotations

import asyncio
import os

from _common import MODEL_DIR
from ortserve_client import DownloadProgress, LocalServer, LogLine, ServerEvent


def show(event: ServerEvent) -> None:
    if isinstance(event, DownloadProgress):
        print(f"downloading {event.filename}: {event.bytes_done}/{event.bytes_total} bytes")
    elif not isinstance(event, LogLine):
        print(event)


async def main() -> None:
    port = int(os.environ.get("PORT", "8000"))
    async with LocalServer({"tiny": MODEL_DIR}, port=port, on_event=show) as server, server.client() as client:
        reply = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=16
        )
        print("reply:", reply.choices[0].message.content)
        print("streamed:", end=" ")
        async with await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=16, stream=True
        ) as stream:
            async for chunk in stream:
                for choice in chunk.choices:
                    print(choice.delta.content or "", end="", flush=True)
        print()


if __name__ == "__main__":
    asyncio.run(main())
