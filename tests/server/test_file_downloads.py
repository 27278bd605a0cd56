"""Downloads of stored files (``GET /v1/files/{id}/content``) through a real server, on both
state databases: read a piece at a time, several at once within issue 45's bounds."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from ortserve_server import ServerConfig, create_app
from postgres import postgres_server
from serving import TINY_MODEL, running, watched

pytestmark = pytest.mark.timing  # /health bounds: run apart

DOWNLOADS = 4


def _batch_file(mib: int) -> bytes:
    """A batch input file of about ``mib`` MiB: one chat line per MiB."""
    text = "abcdefghij" * (2**20 // 10)
    return b"".join(
        json.dumps(
            {
                "custom_id": str(i),
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "tiny", "messages": [{"role": "user", "content": f"{i} {text}"}]},
            }
        ).encode()
        + b"\n"
        for i in range(mib)
    )


@contextlib.contextmanager
def _server(database: str, folder: Path) -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        where = {"state_dir": folder} if database == "sqlite" else {"state_url": stack.enter_context(postgres_server())}
        config = ServerConfig(
            models={"tiny": TINY_MODEL},
            api_key=("alice", "bob"),
            max_body_size=64 << 20,
            max_file_size=64 << 20,
            **where,
        )
        yield stack.enter_context(running(create_app(config)))


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_downloads_are_read_a_piece_at_a_time(database: str, tmp_path: Path) -> None:
    """Issue 45: the content was read whole (and copied) for each download, so four downloads
    of a 48 MiB file at once grew the server ~230 MiB (95 MiB: +467 MiB, /health 350 ms)."""
    content = _batch_file(48)
    with _server(database, tmp_path) as url:
        alice, bob = ({"Authorization": f"Bearer {key}"} for key in ("alice", "bob"))
        uploaded = httpx.post(
            f"{url}/v1/files",
            headers=alice,
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", content)},
            timeout=60,
        )
        assert uploaded.status_code == 200, uploaded.text
        where = f"{url}/v1/files/{uploaded.json()['id']}/content"
        assert httpx.get(where, headers=bob).status_code == 404
        got: list[tuple[int, str | None, str]] = []

        def download() -> None:
            digest = hashlib.sha256()
            with httpx.stream("GET", where, headers=alice, timeout=60) as response:
                for chunk in response.iter_raw():
                    digest.update(chunk)
            got.append((response.status_code, response.headers.get("content-length"), digest.hexdigest()))

        with watched(url) as seen:
            downloads = [threading.Thread(target=download) for _ in range(DOWNLOADS)]
            for each in downloads:
                each.start()
            for each in downloads:
                each.join()
        seen.assert_within(grown=64 << 20)
        assert got == [(200, str(len(content)), hashlib.sha256(content).hexdigest())] * DOWNLOADS
